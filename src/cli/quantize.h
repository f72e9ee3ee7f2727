// `kiln quantize RUN_DIR`: int8 post-training quantization of a run's image
// model (quant::prepare / convert), with test accuracy and 1-thread inference
// time before and after, and the int8 model written beside the run.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

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
  int64_t group_size = 128;  // --method int4
  bool gptq = false;         // --method int4: GPTQ instead of round-to-nearest
};

/// Registers the subcommand and its options on `app`.
CLI::App* add_quantize_command(CLI::App& app, QuantizeOptions& o);
int quantize_command(const QuantizeOptions& o);

}  // namespace kiln::cli
