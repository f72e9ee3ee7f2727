// Helpers the graph passes (optimize.cpp, fuse.cpp) share: who produces and
// who reads each value, initializer lookup, and compaction after nodes are
// marked removed. Private to src/export.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kiln/export/graph.h"

namespace kiln::exporter::detail {

/// A snapshot of the graph's wiring; rebuild it after an edit.
struct GraphIndex {
  explicit GraphIndex(const Graph& g);
  std::map<std::string, size_t> producer;              // value -> node index
  std::map<std::string, std::vector<size_t>> readers;  // value -> reading node indices (once per input slot)
  std::set<std::string> graph_outputs;
  std::map<std::string, const Tensor*> initializers;

  const Tensor* init(const std::string& name) const;
  /// The node that is `value`'s only reader (read through one input slot),
  /// when `value` is not a graph output either.
  std::optional<size_t> sole_reader(const std::string& value) const;
  /// The node producing `value`, if a node does.
  std::optional<size_t> producer_of(const std::string& value) const;
};

/// The scalar value of a one-element float32 initializer.
std::optional<float> scalar_value(const GraphIndex& ix, const std::string& name);

/// Removes the nodes at `removed`, the values nothing defines any more, the
/// module outputs that named them and the initializers no node reads; then
/// validates the graph.
void compact(Graph& g, const std::set<size_t>& removed);

/// A new float32 initializer (fresh name derived from `name`); returns its name.
std::string add_initializer(Graph& g, const std::string& name, const Tensor& t);

}  // namespace kiln::exporter::detail
