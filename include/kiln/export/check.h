// The check of an exported graph against kiln: a consumer runtime (ONNX
// Runtime, through `kiln export --check`) beside kiln on the same input,
// compared at every graph node (compare_nodes) and, as a summary, at every
// module's output (compare_module_outputs), so that a graph that disagrees
// with the model, or a runtime that disagrees with the graph, is traced to the
// first node that goes wrong and the kiln module that emitted it.
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

/// `graph` with every node output added as a graph output (under its value
/// name, once each, "output" staying first), so that a runtime returns every
/// value the graph computes. Omitted optional outputs ("") are not added.
Graph with_node_outputs(const Graph& graph);

/// Two runtimes' values of the same node outputs compared (the worst output).
struct ValueDiff {
  double max_abs = 0;     // max |consumer - kiln| over the finite elements
  double scaled = 0;      // max_abs / max |kiln| (over each output's finite elements)
  bool diverges = false;  // scaled > tolerance, or shape/dtype differs, NaN or inf on one side only, value missing
  std::string note;       // why, when it is not a plain difference
};

/// One graph node checked. Two comparisons, both against the consumer (ONNX
/// Runtime), so that together they say whose fault a divergence is:
/// - `runtime`, at every node: the consumer's outputs against kiln's own
///   runtime (run_all_values) of the same graph. Both evaluate the same ONNX
///   nodes from the same graph input, so this catches the first node that a
///   consumer and kiln read differently (an op's semantics, an attribute
///   default), however deep inside a module.
/// - `eager`, where an output of the node is a module's output: the consumer's
///   value against kiln's eager forward of that module (module_values). This
///   catches a graph that is wrong for the model (an exporter bug, such as a
///   wrong LayerNorm epsilon: consumer and kiln's runtime agree on the wrong
///   graph, the module does not), at module granularity: a module's inner
///   nodes have no eager counterpart, so the error shows at its output node.
/// Hence `runtime` diverging alone: kiln's runtime and the consumer disagree;
/// `eager` alone: the exported graph differs from the kiln module; both: the
/// consumer differs from both kiln sides.
struct NodeDiff {
  std::string node;
  std::string op_type;
  std::string module;       // the kiln module that emitted the node, "<root>" for the model
  std::string module_type;  // its type ("LayerNorm"): kiln's call site, at module granularity
  std::vector<std::string> outputs;
  ValueDiff runtime;
  std::optional<ValueDiff> eager;  // absent at nodes whose outputs are no module's output
  std::string eager_module;        // the innermost module whose output this node computes
  bool diverges = false;           // runtime.diverges or eager->diverges
  /// "ok", "runtime" (consumer vs kiln's runtime), "module" (the graph vs kiln's
  /// module) or "both".
  std::string verdict() const;
};

struct NodeCheckReport {
  std::vector<NodeDiff> rows;  // in graph node order
  std::optional<size_t> first_divergent;
  double tolerance = 0;
  CheckReport modules;  // the per-module summary (consumer vs kiln's eager forward)
  /// The node table, the module summary, and the verdict naming the first
  /// divergent node, its op and its kiln module.
  std::string str() const;
  /// The same as JSON: {"tolerance", "first_divergent" (node name or null),
  /// "nodes": [{node, op_type, module, module_type, outputs, runtime: {max_abs,
  /// scaled, diverges, note}, eager: {...} or null, eager_module, verdict}],
  /// "modules": [{module, module_type, node, op_type, max_abs, scaled, diverges, note}]}.
  std::string json() const;
};

/// Compares every node of `graph`: `consumer` (every node output by value
/// name, as a runtime ran with_node_outputs(graph)) against `kiln_runtime`
/// (run_all_values of the same graph and input) at every node, and against
/// `kiln_eager` (module_values) where a node output is a module's output;
/// divergence past `tolerance` relative to the kiln side's scale.
NodeCheckReport compare_nodes(const Graph& graph, const std::map<std::string, Tensor>& consumer,
                              const std::map<std::string, Tensor>& kiln_runtime,
                              const std::map<std::string, Tensor>& kiln_eager, double tolerance = 1e-4);

}  // namespace kiln::exporter
