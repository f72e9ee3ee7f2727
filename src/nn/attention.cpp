// scaled_dot_product_attention and MultiheadAttention as compositions of kiln
// ops: autograd records matmul, softmax and masked_fill, so gradients of any
// order follow without a hand-written backward.
//
// Memory: this composite form materialises the [..., L, S] score and weight
// matrices and keeps them for backward (O(T^2) per head). It runs only for
// dropout in training or a floating mask that requires grad; otherwise
// scaled_dot_product_attention dispatches to detail::sdpa_fused
// (attention_fused.cpp), which keeps O(T) and recomputes the weights blockwise.
#include "kiln/nn/attention.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/guards.h"
#include "kiln/nn/init.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/linalg.h"

namespace kiln::nn {
namespace {

TensorOptions dtype_or_default(const std::optional<DType>& d) { return TensorOptions(d ? *d : default_dtype()); }

// [L, S] bool, true where key j lies after query i (the positions causal attention hides).
Tensor causal_hidden(int64_t L, int64_t S) {
  Tensor rows = arange(L).unsqueeze(1);
  Tensor cols = arange(S).unsqueeze(0);
  return cols.gt(rows);
}

}  // namespace

namespace functional {

void check_sdpa_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                     bool is_causal);

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    double dropout_p, bool is_causal, bool training, std::source_location loc) {
  if (autocast_enabled()) return ops::autocast_call(AutocastOp::scaled_dot_product_attention, [&](const Tensor& q2, const Tensor& k2, const Tensor& v2, const Tensor& m2) { return scaled_dot_product_attention(q2, k2, v2, m2, dropout_p, is_causal, training, loc); }, q, k, v, attn_mask);
  check_sdpa_args(q, k, v, attn_mask, dropout_p, is_causal);
  const bool dropout_active = training && dropout_p > 0.0;
  const bool mask_needs_grad = attn_mask.defined() && attn_mask.requires_grad() && grad_mode_enabled();
  if (!dropout_active && !mask_needs_grad) return detail::sdpa_fused(q, k, v, attn_mask, is_causal);
  return detail::sdpa_composite(q, k, v, attn_mask, dropout_p, is_causal, training);
}

void check_sdpa_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                     bool is_causal) {
  KILN_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, ShapeError,
             "scaled_dot_product_attention: expected q [..., L, E], k [..., S, E], v [..., S, Ev] with at least "
             "2 dims, got q ",
             q.shape_string(), ", k ", k.shape_string(), ", v ", v.shape_string());
  KILN_CHECK(q.is_floating_point() && k.is_floating_point() && v.is_floating_point(), DTypeError,
             "scaled_dot_product_attention: expected floating-point q, k, v, got ", dtype_name(q.dtype()), ", ",
             dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  KILN_CHECK(q.size(-1) == k.size(-1), ShapeError,
             "scaled_dot_product_attention: expected q and k to share the last dim E, got q ", q.shape_string(),
             " and k ", k.shape_string());
  KILN_CHECK(k.size(-2) == v.size(-2), ShapeError,
             "scaled_dot_product_attention: expected k and v to share the sequence dim S, got k ", k.shape_string(),
             " and v ", v.shape_string());
  KILN_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, ValueError,
             "scaled_dot_product_attention: expected dropout_p in [0, 1], got ", dropout_p);
  KILN_CHECK(!(is_causal && attn_mask.defined()), ValueError,
             "scaled_dot_product_attention: expected either attn_mask or is_causal, got both");
  if (attn_mask.defined()) {
    const int64_t L = q.size(-2), S = k.size(-2);
    KILN_CHECK(attn_mask.dim() >= 1 && attn_mask.size(-1) == S && (attn_mask.dim() < 2 || attn_mask.size(-2) == L ||
                                                                   attn_mask.size(-2) == 1),
               ShapeError, "scaled_dot_product_attention: expected attn_mask broadcastable to [..., ", L, ", ", S,
               "], got ", attn_mask.shape_string());
    KILN_CHECK(attn_mask.dtype() == kBool || attn_mask.is_floating_point(), DTypeError,
               "scaled_dot_product_attention: expected a bool or floating attn_mask, got ",
               dtype_name(attn_mask.dtype()));
  }
}

namespace detail {

Tensor sdpa_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                      bool is_causal, bool training) {
  const int64_t L = q.size(-2), S = k.size(-2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const double neg_inf = -std::numeric_limits<double>::infinity();

  Tensor scores = q.matmul(k.transpose(-2, -1)).mul(scale);  // [..., L, S]
  if (is_causal) scores = scores.masked_fill(causal_hidden(L, S), neg_inf);
  if (attn_mask.defined()) {
    KILN_CHECK(attn_mask.dim() >= 1 && attn_mask.size(-1) == S && (attn_mask.dim() < 2 || attn_mask.size(-2) == L ||
                                                                   attn_mask.size(-2) == 1),
               ShapeError, "scaled_dot_product_attention: expected attn_mask broadcastable to [..., ", L, ", ", S,
               "], got ", attn_mask.shape_string());
    if (attn_mask.dtype() == kBool) {
      scores = scores.masked_fill(attn_mask.logical_not(), neg_inf);
    } else {
      KILN_CHECK(attn_mask.is_floating_point(), DTypeError,
                 "scaled_dot_product_attention: expected a bool or floating attn_mask, got ",
                 dtype_name(attn_mask.dtype()));
      scores = scores + attn_mask;
    }
  }
  Tensor weights = scores.softmax(-1);
  if (training && dropout_p > 0.0) {
    if (dropout_p == 1.0) {
      weights = weights * zeros_like(weights);
    } else {
      Tensor keep = rand(weights.sizes(), TensorOptions(weights.dtype())).lt(1.0 - dropout_p).to(weights.dtype());
      weights = weights * keep.mul(1.0 / (1.0 - dropout_p));
    }
  }
  return weights.matmul(v);
}

}  // namespace detail
}  // namespace functional

// ---- MultiheadAttention ----
MultiheadAttention::MultiheadAttention(MultiheadAttentionOptions o)
    : Module("MultiheadAttention"),
      options(o),
      in_proj_weight(register_parameter("in_proj_weight", empty({3 * o.embed_dim, o.embed_dim}, dtype_or_default(o.dtype)))),
      in_proj_bias(register_parameter("in_proj_bias",
                                      o.bias ? empty({3 * o.embed_dim}, dtype_or_default(o.dtype)) : Tensor())) {
  KILN_CHECK(o.embed_dim > 0 && o.num_heads > 0 && o.embed_dim % o.num_heads == 0, ValueError,
             "MultiheadAttention: expected embed_dim > 0 divisible by num_heads > 0, got embed_dim ", o.embed_dim,
             " and num_heads ", o.num_heads);
  KILN_CHECK(o.dropout >= 0.0 && o.dropout <= 1.0, ValueError, "MultiheadAttention: expected dropout in [0, 1], got ",
             o.dropout);
  out_proj = register_module(
      "out_proj", std::make_shared<Linear>(
                      LinearOptions{.in_features = o.embed_dim, .out_features = o.embed_dim, .bias = o.bias, .dtype = o.dtype}));
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
  KILN_CHECK(query.dim() == key.dim() && key.dim() == value.dim() && (query.dim() == 2 || query.dim() == 3),
             ShapeError, "MultiheadAttention: expected query, key, value all 3-D (batched) or all 2-D, got ",
             query.shape_string(), ", ", key.shape_string(), ", ", value.shape_string());
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
    return y.view({N, t.size(1), H, Dh}).transpose(1, 2);          // [N, H, T, Dh]
  };
  Tensor q = proj(qi, 0), k = proj(ki, 1), v = proj(vi, 2);

  Tensor mask;
  if (attn_mask.defined()) {
    KILN_CHECK(!is_causal, ValueError, "MultiheadAttention: expected either attn_mask or is_causal, got both");
    if (attn_mask.dim() == 2) {
      KILN_CHECK(attn_mask.size(0) == L && attn_mask.size(1) == S, ShapeError, "MultiheadAttention: expected a 2-D attn_mask [",
                 L, ", ", S, "], got ", attn_mask.shape_string());
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
  std::ostringstream s;
  s << "embed_dim=" << options.embed_dim << ", num_heads=" << options.num_heads << ", dropout=" << options.dropout
    << ", bias=" << (options.bias ? "True" : "False") << ", batch_first=" << (options.batch_first ? "True" : "False");
  return s.str();
}

}  // namespace kiln::nn
