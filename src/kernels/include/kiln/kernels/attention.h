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

// Note [Attention by head]
// Above, each step of a block runs over all B x H heads before the next one
// starts: the scores of every head are written, then read by the row kernel,
// then by the next product, and q, k, v and dO are read again by every
// product. Inside a training step those come from memory, not cache (the
// activations of the whole forward lie between forward and backward): gpt's
// bf16 attention took 17.8 ms per step where the same calls on warm data took
// 12.9. attention_heads_forward / _backward run the same sequence (the same
// products on the small-product kernel, the same row kernels, in the same
// order) one head at a time, heads across threads: a head's scores stay in
// L1/L2 and its q, k, v, dO rows are read from memory about once. Every
// value is computed as in the sequence over all heads, so the bits are the
// same.

/// Element (b, h, i, e) of a head operand at data + b * outer + h * head + i * row + e (elements).
struct HeadOperand {
  void* data = nullptr;
  int64_t outer = 0, head = 0, row = 0;
};

/// One attention over heads: q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev]
/// as head operands; lse and D contiguous [B, H, L]; query rows in blocks of
/// block_rows, causal blocks seeing keys up to their last row and skipping
/// the hidden triangle (Note [Causal products] in kiln/kernels/dnnl.h).
struct AttentionHeads {
  DType dtype = DType::Float32;  // every operand's
  int64_t B = 0, H = 0, L = 0, S = 0, E = 0, Ev = 0;
  double scale = 1.0;
  bool causal = false;
  int64_t block_rows = 64;
  HeadOperand q, k, v;
  HeadOperand out;      // forward's output, backward's input is dout
  void* lse = nullptr;  // forward: written when not null; backward: read
  /// The attention weights of every block (Note [Kept weights]): forward
  /// writes them here when not null, and backward reads them instead of
  /// recomputing them from lse. attention_heads_weights_size elements, block
  /// by block, each block [B, H, rows, keys it sees] contiguous.
  void* weights = nullptr;
  HeadOperand dout;         // backward
  const void* D = nullptr;  // backward: the rows' Σ dO ∘ out
  HeadOperand dq, dk, dv;   // backward's outputs (written whole)
  /// Dropout on the weights (Note [Dropout inside the heads]): when not
  /// null, [B, H, L, S] bytes. Forward writes keep = u < keep_below for the
  /// keys each row sees (0 for the others), u being the uniform that
  /// philox_uniform_floats gives element ((b H + h) L + i) S + j of the
  /// stream (seed, first_block), rounded to bf16 for bf16 heads, and
  /// multiplies the weights by keep · dropout_scale before the product with
  /// v; backward reads keep.
  uint8_t* keep = nullptr;
  float keep_below = 1.0f, dropout_scale = 1.0f;
  uint64_t seed = 0, first_block = 0;
};

// Note [Dropout inside the heads]
// Dropout on the attention weights made every training step with dropout take
// the composite path (matmul, scale, masked_fill, softmax, dropout, matmul,
// each over all [B, H, L, S] weights, four of them kept for backward):
// configs/gpt_mobydick.toml spent about 75 ms of a 270 ms step there. The heads
// kernel now drops a block's weights while they are in cache: forward keeps
// P (the weights the backward needs) and multiplies a copy by the mask factor
// for the product with v; backward forms that copy again for dV = (P Z)ᵀ dO,
// multiplies dO vᵀ by Z, and goes on as without dropout (D = Σ dO ∘ out is
// still Σ P ∘ dP). The mask bytes are drawn from the Philox elements that
// dropout_train would draw over the whole [B, H, L, S] weights, compared as
// the composite compares them (rand's values and 1 - p in the heads' dtype),
// and the generator advances as much, so a seed keeps the masks the
// composite drew, in float32 and in bf16.
// The keys a causal row does not see are not drawn (their weight is 0 either
// way).

/// Backward's per-row D = Σ_e dO[r, e] · out[r, e] for heads [B, H, L, Ev]
/// (a 3-D batch is B = 1; rows contiguous in e), into D contiguous [B, H, L]:
/// each product and the sum in float, 16 lanes folded in a fixed order, D
/// rounded to the dtype once (float32 or bfloat16; a separate mul and sum
/// would round every bf16 product).
void attention_output_dots(DType dtype, int64_t B, int64_t H, int64_t L, int64_t Ev, const HeadOperand& dout,
                           const HeadOperand& out, void* D);

// Note [Kept weights]
// Backward needs each block's weights P. Recomputing them (flash attention's
// way) costs one of backward's five products, its pack of k transposed, and
// an exp per score; keeping them costs memory: one weight per score the
// causal blocks compute, against the T x E of each of q, k, v and out. At
// gpt's shape (T 128, E 64, blocks of 64) the weights are 37 % of those four;
// at T 1024 they are 2.1 times them and grow as T^2. So the weights are kept
// when they take no more than q, k, v and out together
// (attention_keeps_weights), and recomputed beyond: memory stays O(T) for
// long sequences. The kept weights are the forward's own, so backward uses
// the P that made the output (as torch's math path does), not exp(S - lse)
// rounded again; the two differ by roundings. Measured in gpt's step
// (1 thread, 2026-12-05): see docs/decisions.md (Ops).

/// The weights one head's blocks compute: sum over blocks of rows x keys seen.
int64_t attention_weights_per_head(int64_t L, int64_t S, bool causal, int64_t block_rows);
/// Whether Note [Kept weights] keeps them: per head, at most L E + S E + S Ev + L Ev.
bool attention_keeps_weights(int64_t L, int64_t S, int64_t E, int64_t Ev, bool causal, int64_t block_rows);
/// Elements of AttentionHeads::weights: B H attention_weights_per_head.
int64_t attention_heads_weights_size(const AttentionHeads& a);

/// Whether this build and these sizes can run attention_heads_* (float32 or
/// bfloat16 on the small-product kernel; a causal attention with L >= S, so
/// that the last block sees every key).
bool attention_heads_apply(const AttentionHeads& a);
/// out and, when a.lse is not null, the log-sum-exp.
void attention_heads_forward(const AttentionHeads& a);
/// dq, dk, dv from dout, out's D, the saved lse and q, k, v.
void attention_heads_backward(const AttentionHeads& a);

}  // namespace kiln::kernels
