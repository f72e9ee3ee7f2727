// The per-module check of an exported graph: kiln's own forward and a runtime
// (ONNX Runtime, through `kiln export --check`) on the same input, compared at
// every module's output, so that a graph that disagrees with the model is
// traced to the first module whose nodes go wrong.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kiln/export/graph.h"
#include "kiln/nn/module.h"

namespace kiln::exporter {

/// Each module's output as kiln computes it on `input` (eval mode, no grad),
/// keyed by the graph value that stands for it (graph.module_outputs). Forward
/// hooks on those modules read the outputs; they are removed afterwards.
std::map<std::string, Tensor> module_values(nn::Module& module, const Graph& graph, const Tensor& input);

/// `graph` with every module output added as a graph output (under its value
/// name), for a runtime to return alongside "output".
Graph with_module_outputs(const Graph& graph);

/// One module's output compared.
struct ModuleDiff {
  std::string module;       // path, "<root>" for the model itself
  std::string module_type;  // "LayerNorm"
  std::string node;         // the graph node that computes it
  std::string op_type;      // that node's ONNX operator
  double max_abs = 0;       // max |runtime - kiln|
  double scaled = 0;        // max_abs / max |kiln|
  bool diverges = false;    // scaled > tolerance (or shapes differ, or NaN on one side only)
  std::string note;         // why, when it is not a plain difference
};

struct CheckReport {
  std::vector<ModuleDiff> rows;  // in graph.module_outputs order
  std::optional<size_t> first_divergent;
  double tolerance = 0;
  /// The table, one module a line, and the verdict naming the first divergent module.
  std::string str() const;
};

/// Compares `runtime` (value name -> tensor, as a runtime returned them) with
/// `kiln` (module_values) at each module output, divergence past `tolerance`
/// relative to the kiln output's scale.
CheckReport compare_module_outputs(const Graph& graph, const std::map<std::string, Tensor>& kiln,
                                   const std::map<std::string, Tensor>& runtime, double tolerance = 1e-4);

}  // namespace kiln::exporter
