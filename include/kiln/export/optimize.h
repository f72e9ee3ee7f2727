// Graph-level inference optimisation of a captured export::Graph, applied
// before writing a file (`kiln export --optimize`). Each pass keeps the graph's
// inputs, outputs and values within float rounding of the unoptimised graph.
#pragma once

#include <cstdint>

#include "kiln/export/graph.h"

namespace kiln::exporter {

/// What fold_batch_norm did.
struct FoldReport {
  int64_t folded = 0;        // BatchNormalization nodes folded away
  int64_t nodes_before = 0;  // node counts
  int64_t nodes_after = 0;
};

/// Folds every BatchNormalization that reads a Conv's output (and is that
/// output's only reader) into the Conv: W' = W * s, b' = (b - mean) * s + beta
/// with s = gamma / sqrt(var + eps) per output channel, computed in float64.
/// The Conv then writes the BatchNormalization's output value; its new weight
/// and bias are initializers named "<BN module>.folded_weight" / ".folded_bias",
/// and initializers no node reads any more are dropped. A folded Conv's own
/// module output disappears from graph.module_outputs (it no longer exists).
FoldReport fold_batch_norm(Graph& graph);

}  // namespace kiln::exporter
