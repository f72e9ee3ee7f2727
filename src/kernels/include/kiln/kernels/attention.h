// Row kernels of the fused scaled_dot_product_attention (src/ops/attention.cpp)
// over raw pointers (the kernels layer: no Tensor here).
//
// The fused attention computes its query rows in blocks: per block the raw
// scores S = q kᵀ come from one batched matmul, then one of these kernels
// turns S into the attention weights (forward) or the score gradient
// (backward) in a single sweep per row, with the scale, the causal triangle,
// the row max, exp, the row sum and the log-sum-exp all inside. That replaces
// a chain of elementwise ops (scale, masked_fill, softmax, logsumexp; sub,
// exp; sub, mul, mul) that each read and wrote the whole block.
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln::kernels {

/// `batch` contiguous score blocks of [rows, cols]: block b holds the scores of
/// query rows row0 .. row0 + rows - 1 against keys 0 .. cols - 1.
struct AttentionBlock {
  DType dtype = DType::Float32;  // scores, lse and D share it (floating)
  int64_t batch = 1, rows = 0, cols = 0;
  double scale = 1.0;  // applied to the raw scores
  /// Causal: query row r sees keys j <= r only (torch's is_causal, aligned at the
  /// top left); the hidden keys get weight exactly 0.
  bool causal = false;
  int64_t row0 = 0;
  /// Per-row values (log-sum-exp, D): element (b, i) at [b * row_batch_stride + i].
  int64_t row_batch_stride = 0;
};

/// Forward, in place: scores ← softmax(scores · scale) along each row, with
/// the causal triangle hidden. When `lse` is not null it receives each row's
/// log-sum-exp of the scaled visible scores (m + log Σ exp(x - m)).
void attention_weights(const AttentionBlock& a, void* scores, void* lse);

/// Backward, in place: scores ← exp(scores · scale - lse) (0 on hidden keys),
/// the forward's weights recomputed from its saved log-sum-exp.
void attention_recompute_weights(const AttentionBlock& a, void* scores, const void* lse);

/// Backward, in place: dp (= dO vᵀ for the block, same layout as the weights
/// p) ← p ∘ (dp - D) · scale, the gradient of the raw scores, where D is the
/// row's Σ dO ∘ out. With the scale folded in, dq = dS k and dk = dSᵀ q.
void attention_scores_grad(const AttentionBlock& a, void* dp, const void* p, const void* D);

}  // namespace kiln::kernels
