// `kiln quantize RUN_DIR`: int8 post-training quantization of a run's image
// model (quant::prepare / convert), with test accuracy and 1-thread inference
// time before and after, and the int8 model written beside the run.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "kiln/nn/module.h"

namespace CLI {
class App;
}

namespace kiln::cli {

struct QuantizeOptions {
  std::filesystem::path target;
  std::string checkpoint;
  std::string method = "ptq";
  std::string observer = "histogram";
  int64_t calib_batches = 32;
  std::vector<std::string> keep_float;
  bool fuse_bn = false;      // fold BatchNorm into the convolutions first
  std::string out;           // default: RUN_DIR/model.int8.safetensors
  int64_t eval_batches = 0;  // 0: the whole test split
  int64_t bench_batch = 64;  // the timed batch size
  int64_t bench_iters = 30;
  // --method qat (src/cli/quantize_qat.h)
  int64_t qat_steps = 500;
  double qat_lr = 1e-4;
  int64_t freeze_after = 300;  // observers frozen after this many steps
  std::string qat_observer = "moving_average";
  bool qat_control = false;  // the same fine-tuning with fake quant off, then the same convert
  int64_t group_size = 128;  // --method int4
  bool gptq = false;         // --method int4: GPTQ instead of round-to-nearest
};

/// Milliseconds of one forward at 1 thread after warm-up: the median and the best of `iters`.
struct ForwardTiming {
  double median_ms = 0, best_ms = 0;
};

/// Registers the subcommand and its options on `app`.
CLI::App* add_quantize_command(CLI::App& app, QuantizeOptions& o);
int quantize_command(const QuantizeOptions& o);
/// Times `a` and `b` on `x`, alternated so that load falls on both alike.
std::pair<ForwardTiming, ForwardTiming> time_forward(nn::Module& a, nn::Module& b, const Tensor& x, int64_t iters);

struct Task;
/// Times one test batch of o.bench_batch through `float_task`'s model and `quant_task`'s, 1 thread,
/// o.bench_iters runs each, and prints both with the ratio, the quantized one named `label`:
/// "inference at 1 thread, batch B" for an image model, "forward at 1 thread, batch B x T tokens"
/// for a language model.
void print_forward_timing(Task& float_task, Task& quant_task, const QuantizeOptions& o, const char* label);

}  // namespace kiln::cli
