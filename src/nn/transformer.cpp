// The pre-LayerNorm GPT block (nanoGPT's Block) built from Linear, LayerNorm,
// GELU, Dropout and functional::scaled_dot_product_attention.
#include "kiln/nn/transformer.h"

#include "kiln/core/error.h"
#include "kiln/nn/attention.h"
#include "kiln/ops/linalg.h"

namespace kiln::nn {
namespace {

TransformerBlockOptions resolved(TransformerBlockOptions o) {
  KILN_CHECK(o.d_model > 0 && o.n_head > 0 && o.d_model % o.n_head == 0, ValueError,
             "TransformerBlock: expected d_model > 0 divisible by n_head > 0, got d_model ", o.d_model, " and n_head ",
             o.n_head);
  KILN_CHECK(o.d_ff >= 0, ValueError, "TransformerBlock: expected d_ff >= 0 (0 means 4 * d_model), got ", o.d_ff);
  KILN_CHECK(o.dropout >= 0.0 && o.dropout <= 1.0, ValueError, "TransformerBlock: expected dropout in [0, 1], got ",
             o.dropout);
  if (o.d_ff == 0) o.d_ff = 4 * o.d_model;
  return o;
}

std::shared_ptr<Linear> linear(int64_t in, int64_t out, const std::optional<DType>& dtype) {
  return std::make_shared<Linear>(LinearOptions{.in_features = in, .out_features = out, .dtype = dtype});
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(const TransformerBlockOptions& o)
    : Module("CausalSelfAttention"), d_model(o.d_model), n_head(o.n_head), dropout(o.dropout), causal(o.causal) {
  c_attn = register_module("c_attn", linear(o.d_model, 3 * o.d_model, o.dtype));
  c_proj = register_module("c_proj", linear(o.d_model, o.d_model, o.dtype));
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(o.dropout));
}

// The attention output before c_proj: [B, T, d_model].
Tensor CausalSelfAttention::attend(const Tensor& x) {
  KILN_CHECK(x.dim() == 3 && x.size(2) == d_model, ShapeError, "CausalSelfAttention: expected input [B, T, ", d_model,
             "], got ", x.shape_string());
  const int64_t B = x.size(0), T = x.size(1), hs = d_model / n_head;
  auto qkv = (*c_attn)(x).split(d_model, 2);
  auto heads = [&](const Tensor& t) { return t.view({B, T, n_head, hs}).transpose(1, 2); };  // [B, nh, T, hs]
  Tensor y = functional::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, dropout,
                                                      /*is_causal=*/causal, is_training());
  return y.transpose(1, 2).reshape({B, T, d_model});
}

Tensor CausalSelfAttention::forward(const Tensor& x) { return (*resid_dropout)((*c_proj)(attend(x))); }

Tensor CausalSelfAttention::forward_add(const Tensor& x, const Tensor& residual) {
  return c_proj->forward_add(attend(x), residual);
}

TransformerMLP::TransformerMLP(const TransformerBlockOptions& o) : Module("MLP") {
  c_fc = register_module("c_fc", linear(o.d_model, o.d_ff, o.dtype));
  gelu = register_module("gelu", std::make_shared<GELU>("tanh"));
  c_proj = register_module("c_proj", linear(o.d_ff, o.d_model, o.dtype));
  dropout = register_module("dropout", std::make_shared<Dropout>(o.dropout));
}

// GELU(c_fc(x)). linear_gelu runs GELU inside c_fc's product when nothing is
// differentiated (inference); hooks on either module need them called one by one.
Tensor TransformerMLP::hidden(const Tensor& x) {
  return c_fc->has_forward_hooks() || gelu->has_forward_hooks() ? (*gelu)((*c_fc)(x))
                                                                : c_fc->forward_gelu(x, gelu->approximate);
}

Tensor TransformerMLP::forward(const Tensor& x) { return (*dropout)((*c_proj)(hidden(x))); }

Tensor TransformerMLP::forward_add(const Tensor& x, const Tensor& residual) {
  return c_proj->forward_add(hidden(x), residual);
}

TransformerBlock::TransformerBlock(TransformerBlockOptions o) : Module("Block"), options(resolved(o)) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(
                                     LayerNormOptions{.normalized_shape = {options.d_model}, .dtype = options.dtype}));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(options));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(
                                     LayerNormOptions{.normalized_shape = {options.d_model}, .dtype = options.dtype}));
  mlp = register_module("mlp", std::make_shared<TransformerMLP>(options));
}

namespace {

bool identity_dropout(const Dropout& d) { return d.p == 0.0 || !d.is_training(); }

}  // namespace

Tensor TransformerBlock::forward(const Tensor& x) {
  // The residual adds go inside c_proj's products (forward_add) unless a hook
  // must see the modules' own outputs or a dropout sits between.
  const bool fuse_residuals = !attn->has_forward_hooks() && !attn->c_proj->has_forward_hooks() &&
                              !attn->resid_dropout->has_forward_hooks() && identity_dropout(*attn->resid_dropout) &&
                              !mlp->has_forward_hooks() && !mlp->c_proj->has_forward_hooks() &&
                              !mlp->dropout->has_forward_hooks() && identity_dropout(*mlp->dropout);
  // Each norm's output only feeds its sublayer's first linear: under bf16
  // autocast it comes out in bf16 directly (LayerNorm::forward_for_product),
  // unless a hook on the sublayer could look at it.
  const auto norm = [](LayerNorm& ln, const Module& sub, const Module& first_linear, const Tensor& t) {
    return sub.has_forward_hooks() || first_linear.has_forward_hooks() ? ln(t) : ln.forward_for_product(t);
  };
  if (!fuse_residuals) {
    Tensor h = x + (*attn)(norm(*ln_1, *attn, *attn->c_attn, x));
    return h + (*mlp)(norm(*ln_2, *mlp, *mlp->c_fc, h));
  }
  Tensor h = attn->forward_add(norm(*ln_1, *attn, *attn->c_attn, x), x);
  return mlp->forward_add(norm(*ln_2, *mlp, *mlp->c_fc, h), h);
}

}  // namespace kiln::nn
