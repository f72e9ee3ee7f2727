#pragma once
// `kiln eval`, `kiln export`, `kiln sample` and `kiln inspect`: the commands
// that read a run directory or a checkpoint without training.
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>

#include "config.h"
#include "task.h"

namespace kiln::cli {

/// Why a checkpoint file cannot be used ("" when it can): unreadable,
/// truncated, not safetensors, or not a kiln training checkpoint. Reads the whole file.
std::string checkpoint_problem(const std::filesystem::path& path);

/// The checkpoint a target names: a file as given, a run directory's newest
/// usable one, or with `which`, a run directory's "best", "latest" or step N.
std::filesystem::path checkpoint_of(const std::filesystem::path& target, const std::string& which = "");

/// The model (in eval mode, by construction) and data of a checkpoint, with its weights loaded.
std::pair<Config, Task> load_for_eval(const std::filesystem::path& ckpt);
/// A run directory's best checkpoint (train.keep_best), beside ckpt-<step> and latest.
inline constexpr const char* kBestCheckpoint = "best.safetensors";

/// Loss and accuracy (or bits/char) of the latest checkpoint of a run
/// directory (or the one `which` names: "latest", "best" or a step), or of one
/// checkpoint file, on `split` ("test" or "train").
int evaluate_command(const std::filesystem::path& target, const std::string& split, int64_t max_batches,
                     const std::string& which = "");

struct ExportOptions {
  std::string format = "onnx";  // onnx or pytorch
  /// empty: RUN/model.onnx or RUN/model.safetensors (for a checkpoint file:
  /// <checkpoint>.onnx or <checkpoint>.pytorch.safetensors)
  std::filesystem::path out;
  std::string checkpoint;  // latest (empty), best, or a step
  std::string dtype;       // float32 (empty), bfloat16 or float16 (pytorch only)
  /// onnx: the input axes left free, comma-separated names among batch and seq
  /// (seq: the language model only), or "none"; empty: batch (and seq for a GPT).
  std::string dynamic;
  int64_t opset = 17;  // onnx: 13 to 17
  /// onnx: run the file in ONNX Runtime beside kiln and compare every node's
  /// output (cli/export_check.h); exit 1 naming the first node that diverges.
  bool check = false;
  /// onnx: the standard passes (exporter::optimize_standard: BatchNorm folds,
  /// Identity/Dropout removal); the file stays standard ONNX.
  bool optimize = false;
  /// onnx: every initializer of 1 KiB or more in "<out>.data" beside the model
  /// (ONNX external data); without it only a model past 2 GiB does that.
  bool external_data = false;
};

/// `kiln export`: a checkpoint's model as an ONNX file (exporter::to_onnx: the
/// inference graph with the weights as initializers, for ONNX Runtime, OpenCV
/// DNN and other runtimes), or with format "pytorch" as a safetensors state
/// dict with PyTorch's names (nn::save_pytorch_weights), which torch's twin of
/// the architecture loads with load_state_dict(strict=True).
int export_command(const std::filesystem::path& target, const ExportOptions& options);

struct SampleOptions {
  std::string prompt;  // empty: start from a newline
  int64_t tokens = 200;
  double temperature = 0.8;  // 0: always the most likely byte
  int64_t top_k = 0;         // 0: all bytes
  uint64_t seed = 0;
  bool kv_cache = true;  // false: recompute the window for every byte (the same bytes, slower)
  bool timing = false;   // print tokens/s to stderr
};

/// Text from a run's (or checkpoint's) character-level GPT: the prompt, then `tokens` sampled bytes.
int sample_command(const std::filesystem::path& target, const SampleOptions& options);

/// A safetensors file or checkpoint (tensors with dtype, shape, bytes and
/// statistics, then metadata) or a run directory (its summary and checkpoints).
int inspect_command(const std::filesystem::path& target);

}  // namespace kiln::cli
