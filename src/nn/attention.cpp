// scaled_dot_product_attention and MultiheadAttention. The attention itself is
// the op of kiln/ops/attention.h (the fused, memory-efficient form, with
// dropout where its heads kernel takes it; the composite of kiln ops
// otherwise); this file adds autocast and
// the module's projections and head split around it.
#include "kiln/nn/attention.h"

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/init.h"
#include "kiln/ops/attention.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/linalg.h"
#include "nn_util.h"

namespace kiln::nn {
using util::dtype_or_default;
using util::num;
using util::py_bool;

namespace functional {

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    double dropout_p, bool is_causal, bool training, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::scaled_dot_product_attention,
        [&](const Tensor& q2, const Tensor& k2, const Tensor& v2, const Tensor& m2) {
          return scaled_dot_product_attention(q2, k2, v2, m2, dropout_p, is_causal, training, loc);
        },
        q, k, v, attn_mask);
  return ops::scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, training, loc);
}

namespace detail {

Tensor sdpa_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                      bool is_causal, bool training) {
  return ops::attention_composite(q, k, v, attn_mask, dropout_p, is_causal, training);
}

Tensor sdpa_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, bool is_causal,
                  int64_t block_rows) {
  return ops::attention_fused(q, k, v, attn_mask, is_causal, block_rows);
}

}  // namespace detail
}  // namespace functional

// ---- MultiheadAttention ----
MultiheadAttention::MultiheadAttention(MultiheadAttentionOptions o)
    : Module("MultiheadAttention"),
      options(o),
      in_proj_weight(
          register_parameter("in_proj_weight", empty({3 * o.embed_dim, o.embed_dim}, dtype_or_default(o.dtype)))),
      in_proj_bias(
          register_parameter("in_proj_bias", o.bias ? empty({3 * o.embed_dim}, dtype_or_default(o.dtype)) : Tensor())) {
  KILN_CHECK(o.embed_dim > 0 && o.num_heads > 0 && o.embed_dim % o.num_heads == 0, ValueError,
             "MultiheadAttention: expected embed_dim > 0 divisible by num_heads > 0, got embed_dim ", o.embed_dim,
             " and num_heads ", o.num_heads);
  KILN_CHECK(o.dropout >= 0.0 && o.dropout <= 1.0, ValueError, "MultiheadAttention: expected dropout in [0, 1], got ",
             o.dropout);
  out_proj = register_module(
      "out_proj", std::make_shared<Linear>(LinearOptions{
                      .in_features = o.embed_dim, .out_features = o.embed_dim, .bias = o.bias, .dtype = o.dtype}));
  reset_parameters();
}

void MultiheadAttention::reset_parameters() {
  // torch's _reset_parameters: xavier_uniform_ on in_proj_weight, zero biases;
  // out_proj.weight keeps Linear's initialisation.
  init::xavier_uniform_(in_proj_weight);
  if (in_proj_bias.defined()) init::zeros_(in_proj_bias);
  if (out_proj->bias.defined()) init::zeros_(out_proj->bias);
}

Tensor MultiheadAttention::forward(const Tensor& x) { return forward(x, x, x); }

Tensor MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& attn_mask,
                                   bool is_causal) {
  const int64_t E = options.embed_dim, H = options.num_heads, Dh = E / H;
  KILN_CHECK(query.dim() == key.dim() && key.dim() == value.dim() && (query.dim() == 2 || query.dim() == 3), ShapeError,
             "MultiheadAttention: expected query, key, value all 3-D (batched) or all 2-D, got ", query.shape_string(),
             ", ", key.shape_string(), ", ", value.shape_string());
  KILN_CHECK(query.size(-1) == E && key.size(-1) == E && value.size(-1) == E, ShapeError,
             "MultiheadAttention: expected embed dim ", E, " as the last dim, got ", query.shape_string(), ", ",
             key.shape_string(), ", ", value.shape_string());
  const bool batched = query.dim() == 3;
  // To batch-first [N, L, E].
  auto to_nle = [&](const Tensor& t) {
    if (!batched) return t.unsqueeze(0);
    return options.batch_first ? t : t.transpose(0, 1);
  };
  Tensor qi = to_nle(query), ki = to_nle(key), vi = to_nle(value);
  const int64_t N = qi.size(0), L = qi.size(1), S = ki.size(1);
  KILN_CHECK(ki.size(0) == N && vi.size(0) == N && vi.size(1) == S, ShapeError,
             "MultiheadAttention: expected matching batch and key/value lengths, got query ", query.shape_string(),
             ", key ", key.shape_string(), ", value ", value.shape_string());

  auto proj = [&](const Tensor& t, int64_t i) {
    Tensor b = in_proj_bias.defined() ? in_proj_bias.narrow(0, i * E, E) : Tensor();
    Tensor y = linear(t, in_proj_weight.narrow(0, i * E, E), b);  // [N, T, E]
    return y.view({N, t.size(1), H, Dh}).transpose(1, 2);         // [N, H, T, Dh]
  };
  Tensor q = proj(qi, 0), k = proj(ki, 1), v = proj(vi, 2);

  Tensor mask;
  if (attn_mask.defined()) {
    KILN_CHECK(!is_causal, ValueError, "MultiheadAttention: expected either attn_mask or is_causal, got both");
    if (attn_mask.dim() == 2) {
      KILN_CHECK(attn_mask.size(0) == L && attn_mask.size(1) == S, ShapeError,
                 "MultiheadAttention: expected a 2-D attn_mask [", L, ", ", S, "], got ", attn_mask.shape_string());
      mask = attn_mask;
    } else {
      KILN_CHECK(attn_mask.dim() == 3 && attn_mask.size(0) == N * H && attn_mask.size(1) == L && attn_mask.size(2) == S,
                 ShapeError, "MultiheadAttention: expected a 3-D attn_mask [", N * H, ", ", L, ", ", S, "], got ",
                 attn_mask.shape_string());
      mask = attn_mask.reshape({N, H, L, S});
    }
    // torch's MultiheadAttention: true = masked out; SDPA: true = kept.
    if (mask.dtype() == kBool) mask = mask.logical_not();
  }
  Tensor o = functional::scaled_dot_product_attention(q, k, v, mask, options.dropout, is_causal, is_training());
  o = o.transpose(1, 2).reshape({N, L, E});
  o = (*out_proj)(o);
  if (!batched) return o.squeeze(0);
  return options.batch_first ? o : o.transpose(0, 1);
}

std::string MultiheadAttention::extra_repr() const {
  return "embed_dim=" + std::to_string(options.embed_dim) + ", num_heads=" + std::to_string(options.num_heads) +
         ", dropout=" + num(options.dropout) + ", bias=" + py_bool(options.bias) +
         ", batch_first=" + py_bool(options.batch_first);
}

}  // namespace kiln::nn
