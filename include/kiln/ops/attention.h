// Scaled dot-product attention as one op, so that attention over long
// sequences costs O(T) memory instead of keeping T x T weight matrices for
// backward, and so that every caller (nn::functional::scaled_dot_product_attention,
// nn::MultiheadAttention, a user's own attention) shares one implementation and
// one choice between the fused and the composite form.
#pragma once

#include <cstdint>
#include <source_location>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// softmax(q kᵀ / sqrt(E) + mask) v, torch.nn.functional.scaled_dot_product_attention.
/// q [..., L, E], k [..., S, E], v [..., S, Ev] -> [..., L, Ev]; leading dims broadcast.
/// attn_mask (broadcast to [..., L, S]): bool, true = may attend, or floating,
/// added to the scores. is_causal hides key j > query i (aligned top-left) and
/// excludes attn_mask. Dropout with probability dropout_p on the weights only
/// when `training`. Without active dropout and without a mask that requires
/// grad this is attention_fused; active dropout is fused too where the heads
/// kernel takes it (float32 or bf16 heads [B, H, L, E], no mask, dropout_p < 1,
/// drawing the composite's mask bits: Note [Dropout inside the heads]);
/// otherwise attention_composite. Differentiable to any order either way.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask = {},
                                    double dropout_p = 0.0, bool is_causal = false, bool training = true,
                                    std::source_location loc = std::source_location::current());

/// attention_fused's query rows per block unless told otherwise
/// (scaled_dot_product_attention picks its own: Note [Query blocks for bf16
/// training] in src/ops/attention.cpp).
inline constexpr int64_t kAttentionBlockRows = 64;

/// The fused, memory-efficient form (no dropout): query rows in blocks of
/// block_rows; only q, k, v, the output and the per-row log-sum-exp are kept
/// for backward (a FusedSdpaBackward node, which recomputes the weights block
/// by block; under create_graph it differentiates the composite). attn_mask
/// must not require grad. Without anything to differentiate no node is
/// recorded and no log-sum-exp computed.
Tensor attention_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask = {},
                       bool is_causal = false, int64_t block_rows = kAttentionBlockRows,
                       std::source_location loc = std::source_location::current());

/// The composite form (matmul, softmax, masked_fill, dropout as kiln ops):
/// autograd records each op, and the [..., L, S] weights are kept for backward.
Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                           bool is_causal, bool training);

}  // namespace kiln::ops
