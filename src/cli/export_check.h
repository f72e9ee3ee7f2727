#pragma once
// `kiln export --check`: the exported graph in ONNX Runtime beside kiln's own
// forward on the same input, compared at every module's output
// (exporter::compare_module_outputs). ONNX Runtime is the npm package
// onnxruntime-node that scripts/setup.sh installs, run by `node`.
#include <filesystem>
#include <map>
#include <string>

#include "kiln/export/check.h"
#include "kiln/export/graph.h"
#include "kiln/nn/module.h"

namespace kiln::cli {

/// Where scripts/setup.sh installs onnxruntime-node.
inline constexpr const char* kOnnxRuntimeModules = "/usr/local/share/kiln/npm/node_modules";

/// Every output of the ONNX model at `model` run by ONNX Runtime on `input`
/// (fed as "input"), by output name. Throws ConfigError saying what to install
/// when node or onnxruntime-node is missing, Error with ONNX Runtime's message
/// when it fails. Scratch files go under `workdir`.
std::map<std::string, Tensor> run_onnxruntime(const std::filesystem::path& model, const Tensor& input,
                                              const std::filesystem::path& workdir);

/// Writes `graph` with every module output as a graph output, runs it in ONNX
/// Runtime on `input` and compares each module output with kiln's forward of
/// `module` (the module the graph was captured from).
exporter::CheckReport check_export(nn::Module& module, const exporter::Graph& graph, const Tensor& input, int64_t opset,
                                   double tolerance = 1e-4);

}  // namespace kiln::cli
