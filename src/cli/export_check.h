#pragma once
// `kiln export --check`: the exported graph in ONNX Runtime beside kiln on the
// same input, compared at every graph node against kiln's own runtime of the
// graph and, at module outputs, against kiln's eager forward
// (exporter::compare_nodes, with the per-module summary). ONNX Runtime is the
// npm package onnxruntime-node that scripts/setup.sh installs, run by `node`.
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

/// Writes `graph` with every node output as a graph output, runs it in ONNX
/// Runtime (graph optimisations off, so no node is fused away) on `input`,
/// runs the same graph in kiln's runtime (exporter::run_all_values) and kiln's
/// eager forward of `module` (the module the graph was captured from), and
/// compares them node by node (exporter::compare_nodes). When `json` is not
/// empty the report is also written there (NodeCheckReport::json).
exporter::NodeCheckReport check_export(nn::Module& module, const exporter::Graph& graph, const Tensor& input,
                                       int64_t opset, double tolerance = 1e-4, const std::filesystem::path& json = {});

}  // namespace kiln::cli
