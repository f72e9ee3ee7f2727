// `kiln quantize --method qat` (src/cli/quantize_qat.h).
#include "cli/quantize_qat.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>

#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/data/loader.h"
#include "kiln/nn/functional.h"
#include "kiln/optim/optimizer.h"
#include "kiln/quant/fuse.h"
#include "kiln/quant/ptq.h"
#include "kiln/quant/qat.h"

namespace kiln::cli {
namespace fs = std::filesystem;

void add_quantize_qat_options(CLI::App& q, QuantizeOptions& o) {
  q.add_option("--qat-steps", o.qat_steps, "qat: fine-tuning steps on the training split")->capture_default_str();
  q.add_option("--qat-lr", o.qat_lr, "qat: Adam's learning rate for the fine-tuning")->capture_default_str();
  q.add_option("--freeze-after", o.freeze_after, "qat: steps after which the observers stop moving")
      ->capture_default_str();
  q.add_option("--qat-observer", o.qat_observer, "qat: the activations' observer (an --observer name)")
      ->capture_default_str();
  q.add_flag("--qat-control", o.qat_control,
             "qat: the same fine-tuning with fake quantization off (the observers still watch), then the same "
             "convert: tells a gain of QAT from a gain of more training");
}

int quantize_qat_command(const QuantizeOptions& o) {
  // The observers must see at least one batch, or there is nothing to quantize with.
  if (o.qat_steps < 1) throw ConfigError("--qat-steps expects at least 1, got " + std::to_string(o.qat_steps));
  if (!(o.qat_lr >= 0)) throw ConfigError("--qat-lr expects a learning rate >= 0, got " + std::to_string(o.qat_lr));
  if (o.freeze_after < 1)
    throw ConfigError("--freeze-after expects at least 1 (the observers must see a batch), got " +
                      std::to_string(o.freeze_after));
  if (o.bench_batch < 1 || o.bench_iters < 1) throw ConfigError("--bench-batch and --bench-iters expect at least 1");
  const auto& names = quant::observer_names();
  if (std::find(names.begin(), names.end(), o.qat_observer) == names.end()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw ConfigError("--qat-observer " + o.qat_observer + ": expected one of " + list);
  }
  const fs::path ckpt = checkpoint_of(o.target, o.checkpoint);
  auto [config, task] = load_for_eval(ckpt);
  if (task.gpt)
    throw ConfigError(ckpt.string() +
                      ": kiln quantize covers image models (Conv2d and Linear layers); the language model's int8 "
                      "and int4 paths are not built yet");
  auto [config_f, task_f] = load_for_eval(ckpt);  // the float model, kept for the timing and the reload

  const EvalResult before = evaluate(task, config, "test", o.eval_batches);
  std::printf("float32: test accuracy %.2f%% (loss %.4f, %lld samples)\n", 100 * before.accuracy, before.loss,
              static_cast<long long>(before.samples));

  // BatchNorm is always folded first (the model is in eval mode here, as fuse_conv_bn needs):
  // fine-tuning then trains the one weight per convolution that int8 will hold.
  const std::vector<std::string> folded = quant::fuse_conv_bn(*task.model);
  auto prepared = quant::prepare_qat(*task.model, {.observer = o.qat_observer, .keep_float = o.keep_float});
  if (o.qat_control)
    for (auto& l : prepared->layers) {
      l.input_fq->disable_fake_quant();
      l.weight_fq->disable_fake_quant();
    }
  prepared->freeze_observers_after(o.freeze_after);

  optim::Adam opt(task.model->named_parameters(), {.lr = o.qat_lr});
  const int64_t batch_size = config.integer("data.batch_size");
  task.model->train();
  const auto t0 = std::chrono::steady_clock::now();
  double loss_sum = 0;
  int64_t step = 0, loss_n = 0;
  for (uint64_t epoch = 0; step < o.qat_steps; ++epoch) {
    data::DataLoader<> loader(task.train_set, {.batch_size = batch_size, .shuffle = true, .seed = epoch});
    int64_t batches = 0;
    for (auto& batch : loader) {
      if (step >= o.qat_steps) break;
      ++batches;
      Tensor loss = nn::functional::cross_entropy((*task.model)(batch.data), batch.target);
      opt.zero_grad();
      loss.backward();
      opt.step();
      prepared->step();
      ++step;
      loss_sum += loss.item<double>();
      ++loss_n;
      if (step % 100 == 0 || step == o.qat_steps) {
        std::printf("%s step %lld/%lld: mean training loss %.4f%s\n", o.qat_control ? "control" : "qat",
                    static_cast<long long>(step), static_cast<long long>(o.qat_steps), loss_sum / loss_n,
                    prepared->observers_frozen() ? " (observers frozen)" : "");
        std::fflush(stdout);
        loss_sum = 0;
        loss_n = 0;
      }
    }
    if (batches == 0) throw ValueError(ckpt.string() + ": the training split has no batch to fine-tune on");
  }
  const double train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  prepared->freeze_observers();  // the test split must not move the parameters
  const EvalResult tuned = evaluate(task, config, "test", o.eval_batches);
  std::printf("%s after %lld steps (lr %g, observers frozen after %lld, %.1f s): test accuracy %.2f%% (loss %.4f)\n",
              o.qat_control ? "float32 fine-tuned (control, fake quant off)" : "fake-quantized model",
              static_cast<long long>(step), o.qat_lr, static_cast<long long>(o.freeze_after), train_s,
              100 * tuned.accuracy, tuned.loss);

  const quant::ConvertReport report = quant::convert_qat(*task.model, *prepared);
  std::printf("\nint8 %s, observer %s%s:\n%s\n",
              o.qat_control ? "from float fine-tuning (control)" : "quantization-aware training",
              o.qat_observer.c_str(), folded.empty() ? "" : ", BatchNorm folded", report.table().c_str());

  const EvalResult after = evaluate(task, config, "test", o.eval_batches);
  std::printf("int8:    test accuracy %.2f%% (loss %.4f), %+.2f points from float32\n", 100 * after.accuracy,
              after.loss, 100 * (after.accuracy - before.accuracy));

  print_forward_timing(task_f, task, o, "int8");

  const fs::path out = o.out.empty() ? (fs::is_directory(o.target) ? o.target / "model.int8.safetensors"
                                                                   : ckpt.parent_path() / "model.int8.safetensors")
                                     : fs::path(o.out);
  quant::save_quantized(*task.model, out.string(),
                        {{"method", o.qat_control ? "qat-control" : "qat"},
                         {"observer", o.qat_observer},
                         {"qat_steps", std::to_string(step)},
                         {"source", ckpt.string()},
                         {"fuse_bn", folded.empty() ? "false" : "true"}});
  std::printf("wrote %s\n", out.string().c_str());

  // The file read back into a fresh float model (folded as this one was): the same accuracy and loss.
  if (!folded.empty()) quant::fuse_conv_bn(*task_f.model);
  quant::load_quantized(*task_f.model, out.string());
  const EvalResult reloaded = evaluate(task_f, config_f, "test", o.eval_batches);
  const bool same = reloaded.accuracy == after.accuracy && reloaded.loss == after.loss;
  std::printf("reloaded %s into a float model: test accuracy %.2f%% (loss %.4f)%s\n", out.filename().string().c_str(),
              100 * reloaded.accuracy, reloaded.loss, same ? ", as the int8 model" : ", DIFFERENT from the int8 model");
  if (!same) throw ValueError("kiln quantize: " + out.string() + " does not reload into the model that wrote it");
  return 0;
}

}  // namespace kiln::cli
