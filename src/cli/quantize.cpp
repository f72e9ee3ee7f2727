// `kiln quantize` (src/cli/quantize.h).
#include "cli/quantize.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string_view>

#include "cli/commands.h"
#include "cli/quantize_int4.h"
#include "cli/quantize_qat.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/data/loader.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/int8.h"
#include "kiln/quant/fuse.h"
#include "kiln/quant/ptq.h"

namespace kiln::cli {
namespace fs = std::filesystem;

CLI::App* add_quantize_command(CLI::App& app, QuantizeOptions& o) {
  auto* q = app.add_subcommand("quantize",
                               "Quantize a run's image model to int8 after training (Conv2d and Linear layers); "
                               "prints test accuracy and 1-thread inference time before and after");
  q->add_option("target", o.target, "Run directory or checkpoint file")->required();
  q->add_option("--checkpoint", o.checkpoint, "Of a run directory: latest (default), best or a step");
  q->add_option("--method", o.method,
                "ptq (post-training int8), qat (quantization-aware fine-tuning), int4 (GPT weight-only) or "
                "int8-dynamic (GPT)")
      ->capture_default_str();
  q->add_option("--observer", o.observer, "minmax, moving_average, histogram (L2), percentile or entropy (KL)")
      ->capture_default_str();
  q->add_option("--calib-batches", o.calib_batches, "Training batches the observers see")->capture_default_str();
  q->add_option("--keep-float", o.keep_float, "Layers to keep in float (module path patterns), repeatable");
  q->add_flag("--fuse-bn", o.fuse_bn, "Fold BatchNorm into the convolution before it first (ResNet)");
  q->add_option("--out", o.out, "Where the int8 model goes (default: RUN_DIR/model.int8.safetensors)");
  q->add_option("--eval-batches", o.eval_batches, "Test batches to evaluate (0: all)")->capture_default_str();
  q->add_option("--bench-batch", o.bench_batch, "Batch size of the timed inference")->capture_default_str();
  q->add_option("--bench-iters", o.bench_iters, "Timed forward passes (the median is printed)")->capture_default_str();
  add_quantize_qat_options(*q, o);
  q->add_option("--group-size", o.group_size, "int4: weights per scale and zero point (64 or 128)")
      ->capture_default_str();
  q->add_flag("--gptq", o.gptq, "int4: GPTQ over --calib-batches training batches instead of round-to-nearest");
  return q;
}

// One forward of each model on `x` at 1 thread after warm-up, the two
// alternated so that load on the machine falls on both alike: the median
// (carries the load) and the best (what an idle machine gives) of each.
std::pair<ForwardTiming, ForwardTiming> time_forward(nn::Module& a, nn::Module& b, const Tensor& x, int64_t iters) {
  const int saved = get_num_threads();
  set_num_threads(1);
  const InferenceModeGuard inference;
  for (int i = 0; i < 3; ++i) a(x), b(x);
  std::vector<double> ms[2];
  for (int64_t i = 0; i < iters; ++i)
    for (int k = 0; k < 2; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      (k == 0 ? a : b)(x);
      ms[k].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  set_num_threads(saved);
  ForwardTiming t[2];
  for (int k = 0; k < 2; ++k) {
    std::sort(ms[k].begin(), ms[k].end());
    t[k] = {ms[k][ms[k].size() / 2], ms[k].front()};
  }
  return {t[0], t[1]};
}

void print_forward_timing(Task& float_task, Task& quant_task, const QuantizeOptions& o, const char* label) {
  data::DataLoader<> loader(quant_task.eval_set, {.batch_size = o.bench_batch, .seed = 0});
  const Tensor x = (*loader.begin()).data.contiguous();
  float_task.model->eval();
  quant_task.model->eval();
  const auto [f, q] = time_forward(*float_task.model, *quant_task.model, x, o.bench_iters);
  const bool tokens = quant_task.gpt != nullptr;
  const std::string shape =
      tokens ? std::to_string(x.size(0)) + " x " + std::to_string(x.size(1)) + " tokens" : std::to_string(x.size(0));
  std::printf(
      "%s at 1 thread, batch %s, %lld runs: median float32 %.3f ms, %s %.3f ms, %.2fx; "
      "best float32 %.3f ms, %s %.3f ms, %.2fx\n",
      tokens ? "forward" : "inference", shape.c_str(), static_cast<long long>(o.bench_iters), f.median_ms, label,
      q.median_ms, f.median_ms / q.median_ms, f.best_ms, label, q.best_ms, f.best_ms / q.best_ms);
  // int8 layers that sum in float32 are slower than float32 ones: say why, rather than leave a
  // "0.6x" to puzzle over.
  if (std::string_view(label) == "int8" && !ops::int8_products_native())
    std::printf(
        "int8 products sum in float32 on this CPU (exactly, the kernel column's \"no VNNI\"): oneDNN has no "
        "VNNI (AVX512_VNNI or AVX-VNNI) to use here, so int8 saves weight memory, not time\n");
}

int quantize_command(const QuantizeOptions& o) {
  if (o.method == "qat") return quantize_qat_command(o);
  if (o.method == "int4") return quantize_int4_command(o);
  if (o.method == "int8-dynamic") return quantize_gpt_int8_command(o);
  if (o.method != "ptq")
    throw ConfigError("--method " + o.method +
                      ": expected ptq (post-training quantization), qat (quantization-aware training), int4 "
                      "(GPT weight-only) or int8-dynamic (GPT)");
  if (o.calib_batches < 1) throw ConfigError("--calib-batches expects at least 1");
  if (o.bench_batch < 1 || o.bench_iters < 1) throw ConfigError("--bench-batch and --bench-iters expect at least 1");
  const fs::path ckpt = checkpoint_of(o.target, o.checkpoint);
  auto [config, task] = load_for_eval(ckpt);
  if (task.gpt)
    throw ConfigError(ckpt.string() +
                      ": --method ptq covers image models (Conv2d and Linear layers); for the language model use "
                      "--method int4 (int8 for GPT is not built yet)");
  auto [config_f, task_f] = load_for_eval(ckpt);  // the float model, kept for the timing

  const EvalResult before = evaluate(task, config, "test", o.eval_batches);
  std::printf("float32: test accuracy %.2f%% (loss %.4f, %lld samples)\n", 100 * before.accuracy, before.loss,
              static_cast<long long>(before.samples));

  auto prepared =
      quant::prepare(*task.model, {.observer = o.observer, .keep_float = o.keep_float, .fuse_bn = o.fuse_bn});
  {
    data::DataLoader<> loader(task.train_set,
                              {.batch_size = config.integer("data.batch_size"), .shuffle = true, .seed = 0});
    const NoGradGuard no_grad;
    int64_t n = 0;
    for (auto& batch : loader) {
      if (n++ >= o.calib_batches) break;
      (*task.model)(batch.data);
    }
  }
  const quant::ConvertReport report = quant::convert(*task.model, *prepared);
  std::printf("\nint8 post-training quantization, observer %s, %lld calibration batches of %lld:\n%s\n",
              o.observer.c_str(), static_cast<long long>(o.calib_batches),
              static_cast<long long>(config.integer("data.batch_size")), report.table().c_str());

  const EvalResult after = evaluate(task, config, "test", o.eval_batches);
  std::printf("int8:    test accuracy %.2f%% (loss %.4f), %+.2f points\n", 100 * after.accuracy, after.loss,
              100 * (after.accuracy - before.accuracy));

  print_forward_timing(task_f, task, o, "int8");

  const fs::path out = o.out.empty() ? (fs::is_directory(o.target) ? o.target / "model.int8.safetensors"
                                                                   : ckpt.parent_path() / "model.int8.safetensors")
                                     : fs::path(o.out);
  quant::save_quantized(
      *task.model, out.string(),
      {{"observer", o.observer}, {"source", ckpt.string()}, {"fuse_bn", o.fuse_bn ? "true" : "false"}});
  std::printf("wrote %s\n", out.string().c_str());

  // The file read back into the float model, as a user would: the same accuracy and loss, or the file is wrong.
  // A file written from a folded model loads into a model folded the same way.
  if (o.fuse_bn) quant::fuse_conv_bn(*task_f.model);
  quant::load_quantized(*task_f.model, out.string());
  const EvalResult reloaded = evaluate(task_f, config_f, "test", o.eval_batches);
  std::printf("reloaded %s into a float model: test accuracy %.2f%% (loss %.4f)%s\n", out.filename().string().c_str(),
              100 * reloaded.accuracy, reloaded.loss,
              reloaded.accuracy == after.accuracy && reloaded.loss == after.loss ? ", as the int8 model"
                                                                                 : ", DIFFERENT from the int8 model");
  if (reloaded.accuracy != after.accuracy || reloaded.loss != after.loss)
    throw ValueError("kiln quantize: " + out.string() + " does not reload into the model that wrote it");
  return 0;
}

}  // namespace kiln::cli
