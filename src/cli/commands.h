#pragma once
// `kiln eval`, `kiln sample` and `kiln inspect`: the commands that read a run
// directory or a checkpoint without training.
#include <cstdint>
#include <filesystem>
#include <string>

namespace kiln::cli {

/// Why a checkpoint file cannot be used ("" when it can): unreadable,
/// truncated, not safetensors, or not a kiln training checkpoint. Reads the whole file.
std::string checkpoint_problem(const std::filesystem::path& path);

/// Loss and accuracy (or bits/char) of the latest checkpoint of a run
/// directory, or of one checkpoint file, on `split` ("test" or "train").
int evaluate_command(const std::filesystem::path& target, const std::string& split, int64_t max_batches);

struct SampleOptions {
  std::string prompt;  // empty: start from a newline
  int64_t tokens = 200;
  double temperature = 0.8;  // 0: always the most likely byte
  int64_t top_k = 0;         // 0: all bytes
  uint64_t seed = 0;
};

/// Text from a run's (or checkpoint's) character-level GPT: the prompt, then `tokens` sampled bytes.
int sample_command(const std::filesystem::path& target, const SampleOptions& options);

/// A safetensors file or checkpoint (tensors with dtype, shape, bytes and
/// statistics, then metadata) or a run directory (its summary and checkpoints).
int inspect_command(const std::filesystem::path& target);

}  // namespace kiln::cli
