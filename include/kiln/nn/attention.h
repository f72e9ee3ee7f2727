// Attention, as PyTorch: nn::functional::scaled_dot_product_attention
// (torch.nn.functional.scaled_dot_product_attention) and nn::MultiheadAttention
// (torch.nn.MultiheadAttention, same parameter names and initialisation).
// Without active dropout, SDPA runs a fused, memory-efficient path: forward
// walks query rows in blocks and keeps only q, k, v, the output and the per-row
// log-sum-exp for backward (O(T) extra, no T x T matrix); backward recomputes
// the weights block by block. With dropout in training, or a floating
// attn_mask that requires grad, it runs the composite of kiln ops (matmul,
// softmax, masked_fill). Both are differentiable to any order: under
// create_graph the fused backward differentiates the composite instead.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <string>

#include "kiln/core/tensor.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"
#include "kiln/ops/attention.h"

namespace kiln::nn::functional {

/// softmax(q kᵀ / sqrt(E) + mask) v, with dropout on the attention weights.
/// q [..., L, E], k [..., S, E], v [..., S, Ev] -> [..., L, Ev]; leading dims broadcast.
/// attn_mask (broadcast to [..., L, S]): bool, where true means "may attend" (as torch's
/// SDPA), or floating, added to the scores. is_causal masks the upper triangle
/// (key j > query i, aligned top-left as torch) and excludes attn_mask. Dropout with
/// probability dropout_p is applied only when `training` (the default, as F.dropout).
/// Rows with every key masked give NaN, as the reference formula does.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask = {},
                                    double dropout_p = 0.0, bool is_causal = false, bool training = true,
                                    std::source_location loc = std::source_location::current());

namespace detail {
/// The composite form (matmul, softmax, masked_fill, dropout): T x T weights are kept for backward.
Tensor sdpa_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                      bool is_causal, bool training);
/// The fused form (no dropout): query rows in blocks of block_rows, only the per-row
/// log-sum-exp saved beyond q, k, v and the output. attn_mask must not require grad.
Tensor sdpa_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, bool is_causal,
                  int64_t block_rows = ops::kAttentionBlockRows);
}  // namespace detail

}  // namespace kiln::nn::functional

namespace kiln::nn {

struct MultiheadAttentionOptions {
  int64_t embed_dim = 0;
  int64_t num_heads = 1;
  double dropout = 0.0;  // on the attention weights, in training
  bool bias = true;
  bool batch_first = true;  // [N, L, E] when true, [L, N, E] when false; [L, E] unbatched either way
  std::optional<DType> dtype = std::nullopt;
};

/// torch.nn.MultiheadAttention (kdim = vdim = embed_dim, no bias_kv, no zero_attn).
/// Parameters: in_proj_weight [3E, E] (xavier_uniform_), in_proj_bias [3E] (zeros),
/// out_proj (a Linear, bias zeroed). forward returns the attention output only.
class MultiheadAttention : public Module {
 public:
  explicit MultiheadAttention(MultiheadAttentionOptions o);
  /// attn_mask as torch's MultiheadAttention: [L, S] or [N * num_heads, L, S];
  /// bool where TRUE MEANS MASKED OUT (the opposite of SDPA's), or floating, added.
  /// is_causal masks key j > query i (with no attn_mask).
  Tensor forward(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& attn_mask = {},
                 bool is_causal = false);
  /// Self-attention: forward(x, x, x).
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void reset_parameters();
  const MultiheadAttentionOptions options;
  Tensor& in_proj_weight;
  Tensor& in_proj_bias;  // undefined without bias
  std::shared_ptr<Linear> out_proj;
};

}  // namespace kiln::nn
