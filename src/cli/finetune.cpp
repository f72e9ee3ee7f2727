// Fine-tuning in `kiln train` (src/cli/finetune.h).
#include "cli/finetune.h"

#include <cstdio>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/io/peft_adapter.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/lora.h"
#include "kiln/nn/pytorch_weights.h"
#include "kiln/quant/nf4.h"
#include "kiln/train/checkpoint.h"

namespace kiln::cli {
namespace fs = std::filesystem;

namespace {

std::vector<std::string> split_targets(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s + ",") {
    if (ch == ',') {
      const size_t b = cur.find_first_not_of(" \t"), e = cur.find_last_not_of(" \t");
      if (b != std::string::npos) out.push_back(cur.substr(b, e - b + 1));
      cur.clear();
    } else {
      cur += ch;
    }
  }
  return out;
}

// The file init_from names: a run directory's newest usable checkpoint, or the file itself.
fs::path init_file(const Config& c) {
  const fs::path target = c.string("init_from");
  const std::string where = c.origin("init_from") + ": init_from = \"" + target.string() + "\"";
  if (fs::is_regular_file(target)) return target;
  if (!fs::is_directory(target))
    throw ConfigError(where +
                      ": no such file or run directory (expected a run directory, a kiln checkpoint or a "
                      "safetensors state dict)");
  const fs::path dir = target / "checkpoints";
  if (!fs::is_directory(dir)) throw ConfigError(where + ": no checkpoints/ under it (has that run saved one?)");
  const auto files = train::CheckpointManager(dir).list();
  std::string skipped;
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    const std::string why = checkpoint_problem(*it);
    if (why.empty()) return *it;
    skipped += "\n  " + it->string() + ": " + why;
  }
  throw ConfigError(where + ": no usable checkpoint under " + dir.string() + (skipped.empty() ? "" : ":" + skipped));
}

std::string load_init(const Config& c, nn::Module& model) {
  const fs::path file = init_file(c);
  const std::string where = c.origin("init_from") + ": init_from " + file.string();
  io::SafetensorsFile f;
  try {
    f = io::load_safetensors(file.string());
  } catch (const Error& e) {
    throw ConfigError(where + ": " + e.what());
  }
  // A kiln checkpoint keeps the model under "model."; anything else is a state
  // dict with PyTorch's names (nn::load_pytorch_state_dict's key mapping).
  const bool checkpoint = f.metadata.count("kiln.checkpoint") != 0;
  io::NamedTensors weights;
  if (checkpoint) {
    for (auto& [name, t] : f.tensors)
      if (name.rfind("model.", 0) == 0) weights.emplace_back(name.substr(6), t);
  } else {
    weights = std::move(f.tensors);
  }
  const bool strict = c.boolean("init_strict");
  nn::PyTorchLoadResult r;
  try {
    r = nn::load_pytorch_state_dict(model, weights, {.strict = strict});
  } catch (const Error& e) {
    throw ConfigError(where + " does not fit the model" + (strict ? " (init_strict = true)" : "") + ": " + e.what());
  }
  std::ostringstream os;
  os << "init_from " << file.string() << ": " << weights.size() << " tensors";
  auto list = [&](const char* what, const std::vector<std::string>& keys) {
    if (keys.empty()) return;
    os << "; " << keys.size() << " " << what << ":";
    for (const auto& k : keys) os << " " << k;
  };
  list("missing (left as initialised)", r.missing_keys);
  list("unexpected (ignored)", r.unexpected_keys);
  return os.str();
}

}  // namespace

std::string finetune_note(const FinetuneSummary& s) {
  std::string note = s.init;
  if (s.lora) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "lora: %lld of %lld parameters train (%.2f%%)", static_cast<long long>(s.trainable),
                  static_cast<long long>(s.total),
                  s.total > 0 ? 100.0 * static_cast<double>(s.trainable) / static_cast<double>(s.total) : 0.0);
    if (!note.empty()) note += '\n';
    note += buf;
  }
  return note;
}

void check_finetune_config(const Config& c, bool distributed) {
  const std::string strategy = c.string("dist.strategy");
  const bool lora = c.integer("lora.rank") > 0;
  if (c.string("lora.quantize") != "none" && !lora)
    throw ConfigError(c.origin("lora.quantize") + ": lora.quantize = \"" + c.string("lora.quantize") +
                      "\" freezes the targets' weights in 4 bits and trains adapters over them; it needs lora.rank > "
                      "0, got 0");
  if (c.string("lora.bias") != "none" && !lora)
    throw ConfigError(c.origin("lora.bias") + ": lora.bias = \"" + c.string("lora.bias") +
                      "\" trains biases beside LoRA adapters; it needs lora.rank > 0, got 0 (full fine-tuning "
                      "trains every bias already)");
  if (distributed && lora && strategy == "zero3")
    throw ConfigError(c.origin("lora.rank") +
                      ": lora does not work with dist.strategy = \"zero3\" yet (FSDP shards frozen and "
                      "trainable parameters together); use dist.strategy = \"ddp\"");
  if (distributed && c.integer("train.grad_accum_steps") > 1 && strategy == "zero2")
    throw ConfigError(c.origin("train.grad_accum_steps") +
                      ": train.grad_accum_steps > 1 does not work with dist.strategy = \"zero2\" yet (its gradient "
                      "reduce-scatter has no no_sync); use dist.strategy = \"zero1\" or \"ddp\"");
}

int64_t steps_for_epochs(const Config& c, int64_t batches) {
  const int64_t k = c.integer("train.grad_accum_steps");
  return std::max<int64_t>(1, c.integer("train.epochs") * batches / k);
}

FinetuneSummary prepare_model(const Config& c, nn::Module& model, bool load_init_weights) {
  FinetuneSummary s;
  if (load_init_weights && !c.string("init_from").empty()) s.init = load_init(c, model);
  const int64_t rank = c.integer("lora.rank");
  if (rank > 0) {
    const auto targets = split_targets(c.string("lora.targets"));
    try {
      if (c.string("lora.quantize") == "nf4") quant::quantize_linears_nf4(model, targets);
      nn::lora::apply(model, {.targets = targets,
                              .rank = rank,
                              .alpha = c.number("lora.alpha"),
                              .dropout = c.number("lora.dropout"),
                              .name = "default",
                              .bias = c.string("lora.bias")});
    } catch (const ValueError& e) {
      throw ConfigError(c.origin("lora.targets") + ": " + e.what());
    }
    s.lora = true;
  }
  for (auto& [n, p] : model.named_parameters()) {
    s.total += p.numel();
    if (p.requires_grad()) s.trainable += p.numel();
  }
  // NF4 weights are buffers (codes and scales): count the elements they stand for.
  for (auto& [path, m] : model.named_modules())
    if (auto* q = dynamic_cast<quant::NF4Linear*>(m)) s.total += q->weight_nf4().numel();
  return s;
}

Tensor micro_batch_backward(Task& t, const data::Example& batch, int64_t k) {
  Tensor loss = batch_loss(t, batch);
  const Tensor scaled = k > 1 ? loss.div(static_cast<double>(k)) : loss;
  if (t.scaler)
    t.scaler->scale(scaled).backward();
  else
    scaled.backward();
  return loss;
}

double accumulate_micro_batch(Task& t, const data::Example& batch, int64_t k) {
  Tensor loss;
  if (t.ddp) {
    auto no_sync = t.ddp->no_sync();
    loss = micro_batch_backward(t, batch, k);
  } else if (t.fsdp) {
    auto no_sync = t.fsdp->no_sync();
    loss = micro_batch_backward(t, batch, k);
  } else {
    loss = micro_batch_backward(t, batch, k);
  }
  return loss.item<double>();
}

void save_run_adapter(const Config& c, const nn::Module& model, const fs::path& dir) {
  if (c.integer("lora.rank") <= 0) return;
  io::PeftAdapter a;
  a.config.r = c.integer("lora.rank");
  a.config.lora_alpha = c.number("lora.alpha");
  a.config.lora_dropout = c.number("lora.dropout");
  a.config.base_model_name_or_path = c.string("init_from");
  a.config.bias = c.string("lora.bias");
  const std::string a_mid = ".lora_A.default.weight", b_mid = ".lora_B.default.weight";
  for (auto& [name, p] : model.named_parameters()) {
    for (const auto& [suffix, which] : {std::pair{a_mid, 'A'}, std::pair{b_mid, 'B'}}) {
      if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const std::string path = name.substr(0, name.size() - suffix.size());
      a.tensors.emplace_back(io::peft_lora_key(path, which), p.detach());
      if (which == 'A') a.config.target_modules.push_back(path);
    }
  }
  // The trained biases (lora.bias): the parameters outside the adapters that require grad.
  if (a.config.bias != "none")
    for (auto& [name, p] : model.named_parameters())
      if (p.requires_grad() && name.find(".lora_") == std::string::npos)
        a.tensors.emplace_back("base_model.model." + name, p.detach());
  io::save_peft_adapter(dir.string(), a);
}

}  // namespace kiln::cli
