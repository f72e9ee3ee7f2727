// Graph-level inference optimisation of a captured export::Graph. Each pass
// keeps the graph's inputs, outputs and values within float rounding of the
// unoptimised graph. Two sets (docs/export.md, "Inference optimisation"):
//  - standard passes (fold_batch_norm, remove_identities; optimize_standard
//    runs both): the graph stays standard ONNX, so `kiln export --optimize`
//    writes it for any runtime;
//  - kiln's fusion pass (fuse_for_kiln): Conv/Gemm/MatMul chains become
//    "kiln.FusedConv" / "kiln.FusedGemm" nodes, which only kiln's own runtime
//    runs (infer::optimize, include/kiln/export/infer.h).
#pragma once

#include <cstdint>

#include "kiln/export/graph.h"

namespace kiln::exporter {

/// What fold_batch_norm did.
struct FoldReport {
  int64_t folded = 0;        // BatchNormalization nodes folded away
  int64_t into_linear = 0;   // of them, folded into a Gemm/MatMul (the rest into a Conv)
  int64_t nodes_before = 0;  // node counts
  int64_t nodes_after = 0;
};

/// Folds every BatchNormalization that reads a Conv's output (and is that
/// output's only reader) into the Conv, and every one over a 2-D [N, C]
/// output of a Gemm (transB = 1, Linear's form) or of MatMul by a weight
/// initializer, with or without an Add of a bias initializer after it (a
/// Linear followed by BatchNorm1d), into that product: W' = W * s, b' = (b - mean) * s + beta
/// with s = gamma / sqrt(var + eps) per output channel, computed in float64.
/// The Conv then writes the BatchNormalization's output value; its new weight
/// and bias are initializers named "<BN module>.folded_weight" / ".folded_bias",
/// and initializers no node reads any more are dropped. A folded Conv's own
/// module output disappears from graph.module_outputs (it no longer exists).
FoldReport fold_batch_norm(Graph& graph);

/// Removes Identity and Dropout nodes (Dropout is the identity in inference;
/// its optional mask output must be unread): their readers read the input
/// instead. Returns the number removed. An Identity from a graph input straight
/// to a graph output stays (a graph needs a node to name its output).
int64_t remove_identities(Graph& graph);

/// What fuse_for_kiln did.
struct FuseReport {
  int64_t fused_conv = 0;  // kiln.FusedConv nodes written
  int64_t fused_gemm = 0;  // kiln.FusedGemm nodes written
  int64_t attention = 0;   // kiln.Attention nodes written
  int64_t absorbed = 0;  // nodes (bias Add, residual Add, Relu, GELU's nodes, attention's, weight Transposes) folded in
};

/// Rewrites for kiln's runtime: each Conv, with an Add of a residual of its
/// output's shape after it and/or a Relu, becomes one "kiln.FusedConv" node;
/// each Gemm (transB = 1) or MatMul by a (transposed) weight initializer,
/// with an Add of its bias, an Add of a residual and/or a Relu or GELU
/// subgraph (erf or tanh, as capture writes GELU) after it, becomes one
/// "kiln.FusedGemm". Fused nodes compute act(op(x) + bias + residual):
///   kiln.FusedConv  inputs [x, W (OIHW), B or "", residual (when residual=1)];
///                   Conv's attributes plus "activation" and "residual";
///   kiln.FusedGemm  inputs [x, W ([out, in]), B or "", residual (when residual=1)];
///                   attributes "activation" ("none", "relu", "gelu",
///                   "gelu_tanh") and "residual" (0/1).
/// And attention as capture writes it (Split of the qkv projection, head
/// Reshape/Transposes, MatMul, scale, the causal mask's Add, Softmax, MatMul,
/// merge Transpose/Reshape: about 15 nodes) becomes one "kiln.Attention":
///   kiln.Attention  inputs [qkv [B, T, 3 d]]; attributes "n_head" and "causal"
///                   (0/1); output [B, T, d], softmax(q kᵀ / sqrt(d / n_head) + mask) v
///                   with the heads merged.
/// A chain is fused only where each intermediate value has that one reader
/// and is not a graph output. The graph is no longer standard ONNX.
FuseReport fuse_for_kiln(Graph& graph);

/// Drops nodes none of whose outputs is read (a weight's Transpose once its
/// product is fused) and initializers no node reads. Returns the nodes dropped.
int64_t remove_dead(Graph& graph);

/// The standard passes in order, with the node counts around them: what
/// `kiln export --optimize` applies before writing the file.
struct StandardReport {
  FoldReport fold;
  int64_t identities_removed = 0;
  int64_t nodes_before = 0;
  int64_t nodes_after = 0;
};
StandardReport optimize_standard(Graph& graph);

}  // namespace kiln::exporter
