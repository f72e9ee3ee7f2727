// Knowledge distillation in `kiln train` (src/cli/distill.h).
#include "cli/distill.h"

#include <cstdio>

#include "cli/commands.h"
#include "cli/task.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/data/loader.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/distillation.h"

namespace kiln::cli {
namespace fs = std::filesystem;

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The teacher's checkpoint: its best one when the run kept one (train.keep_best), else its newest usable one.
fs::path teacher_checkpoint(const fs::path& dir, const std::string& where) {
  if (!fs::is_directory(dir))
    throw ConfigError(where + ": no such run directory (expected the directory of a finished `kiln train` run)");
  if (fs::is_regular_file(dir / "checkpoints" / kBestCheckpoint)) return dir / "checkpoints" / kBestCheckpoint;
  try {
    return checkpoint_of(dir, "");
  } catch (const ConfigError& e) {
    throw ConfigError(where + ": " + e.what());
  }
}

}  // namespace

std::shared_ptr<Distiller> make_distiller(const Config& c, const Task& t) {
  const std::string teacher_dir = c.string("distill.teacher");
  if (teacher_dir.empty()) return nullptr;
  const std::string where = c.origin("distill.teacher") + ": distill.teacher = \"" + teacher_dir + "\"";
  if (c.is_language_model())
    throw ConfigError(
        where + ": distillation needs a classifier student, got the language model (data.dataset = " + "\"text\")");
  if (c.string("dist.strategy") == "zero3")
    throw ConfigError(where + ": distillation does not work with dist.strategy = \"zero3\" yet (the student's " +
                      "forward goes through FSDP, past the loss's hook); use dist.strategy = \"ddp\", \"zero1\" or " +
                      "\"zero2\"");
  auto d = std::make_shared<Distiller>();
  d->checkpoint = teacher_checkpoint(teacher_dir, where);
  d->kind = c.string("distill.kind");
  d->temperature = c.number("distill.temperature");
  d->alpha = c.number("distill.alpha");

  const auto file = io::load_safetensors(d->checkpoint.string());
  const auto meta = file.metadata.find("config");
  if (meta == file.metadata.end() || meta->second.empty())
    throw ConfigError(where + ": " + d->checkpoint.string() + " is not a kiln training checkpoint (no config in it)");
  // The teacher's build seeds the default generator and may set a thread
  // count: both are put back, so the student's run goes on as without a teacher.
  const GeneratorState saved = default_generator().get_state();
  const int threads = get_num_threads();
  Config tc = Config::from_string(meta->second, d->checkpoint.string() + " (the teacher's config)");
  Task teacher = build_task(tc, Purpose::Evaluate);
  default_generator().set_state(saved);
  set_num_threads(threads);
  if (tc.is_language_model())
    throw ConfigError(where + ": the teacher is a language model (" + d->checkpoint.string() +
                      "); distillation needs a classifier teacher");
  if (teacher.num_classes != t.num_classes)
    throw ConfigError(where + ": the teacher predicts " + std::to_string(teacher.num_classes) + " classes (" +
                      tc.string("data.dataset") + "), the student " + std::to_string(t.num_classes) + " (" +
                      c.string("data.dataset") + "); both must have the same classes");
  if (teacher.sample_shape != t.sample_shape)
    throw ConfigError(where + ": the teacher takes inputs of shape " + shape_text(teacher.sample_shape) +
                      ", the student's data gives " + shape_text(t.sample_shape));
  io::NamedTensors weights;
  for (const auto& [name, w] : file.tensors)
    if (name.rfind("model.", 0) == 0) weights.emplace_back(name.substr(6), w);
  try {
    teacher.model->load_state_dict(weights);
  } catch (const std::exception& e) {
    throw ConfigError(where + ": " + d->checkpoint.string() + " does not load into the teacher's model: " + e.what());
  }
  teacher.model->eval();
  for (Tensor& p : teacher.model->parameters()) p.requires_grad_(false);
  d->teacher = teacher.model;
  d->teacher_model = tc.string("model.type");
  return d;
}

Tensor distillation_batch_loss(Distiller& d, const Tensor& student_logits, const data::Example& batch) {
  Tensor teacher_logits;
  {
    NoGradGuard no_grad;
    teacher_logits = (*d.teacher)(batch.data);
  }
  if (d.kind == "hard") return nn::functional::hard_distillation_loss(student_logits, teacher_logits, batch.target);
  return nn::functional::distillation_loss(student_logits, teacher_logits, batch.target, d.temperature, d.alpha);
}

std::string distill_note(Distiller& d, const Task& t, const Config& c) {
  NoGradGuard no_grad;
  data::DataLoader<> loader(t.eval_set, {.batch_size = c.integer("data.eval_batch_size"), .seed = 0});
  int64_t correct = 0, n = 0;
  for (auto& batch : loader) {
    correct += (*d.teacher)(batch.data).argmax(1).eq(batch.target).sum().item<int64_t>();
    n += batch.target.numel();
  }
  char acc[32];
  std::snprintf(acc, sizeof acc, "%.2f%%", n ? 100.0 * static_cast<double>(correct) / static_cast<double>(n) : 0.0);
  std::string settings = d.kind == "hard" ? std::string("hard (DeiT: half the labels, half the teacher's argmax)")
                                          : "soft, temperature " + c.value_text("distill.temperature") + ", alpha " +
                                                c.value_text("distill.alpha");
  return "distilling from " + d.teacher_model + " teacher " + d.checkpoint.string() + " (" + settings +
         "): teacher accuracy " + acc + " on this run's " + std::to_string(n) + " evaluation samples";
}

}  // namespace kiln::cli
