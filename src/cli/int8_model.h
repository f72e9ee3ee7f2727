#pragma once
// `kiln eval RUN --int8 [FILE]` and `kiln export RUN --int8 [FILE]`: a run's
// int8 model (the file `kiln quantize` writes, RUN/model.int8.safetensors by
// default) evaluated, or exported to ONNX in QDQ form (docs/quantization.md,
// "QDQ export and int8 inference").
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>

#include "commands.h"
#include "config.h"
#include "task.h"

namespace kiln::cli {

/// The int8 file of `target`: `file` when given, else RUN/model.int8.safetensors
/// (for a checkpoint file: model.int8.safetensors beside it).
std::filesystem::path int8_file_of(const std::filesystem::path& target, const std::string& file);

/// The run's float model (its checkpoint's config and data) turned into the
/// int8 model of `int8_file` (quant::load_quantized; BatchNorms folded first
/// when the file says it was written from a folded model). A missing file is
/// a ConfigError that says how to make it.
std::pair<Config, Task> load_int8_model(const std::filesystem::path& target, const std::filesystem::path& int8_file,
                                        const std::string& which = "");

/// `kiln eval --int8`: loss and accuracy of the int8 model on `split`.
int evaluate_int8_command(const std::filesystem::path& target, const std::string& int8_file, const std::string& split,
                          int64_t max_batches, const std::string& which = "");

/// `kiln export --int8`: the int8 model as ONNX in QDQ form (default
/// RUN/model.int8.onnx), checked on a test batch: kiln's runtime (the QDQ
/// patterns fused into int8 kernels) against the eager int8 model.
int export_int8_command(const std::filesystem::path& target, const std::string& int8_file, const ExportOptions& o);

}  // namespace kiln::cli
