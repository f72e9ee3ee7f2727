// A pre-LayerNorm GPT block with nanoGPT's module and parameter names, so
// nanoGPT checkpoints load by name:
//   x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
// attn is causal multi-head self-attention (c_attn: Linear(d, 3d) producing
// q, k, v; c_proj: Linear(d, d)); mlp is c_fc: Linear(d, d_ff), GELU(tanh),
// c_proj: Linear(d_ff, d). Dropout (on the attention weights, and after each
// c_proj) only in training. Linear layers keep torch's default
// initialisation; GPT-specific init belongs to the model that owns the blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"

namespace kiln::nn {

struct TransformerBlockOptions {
  int64_t d_model = 0;
  int64_t n_head = 1;
  int64_t d_ff = 0;  // 0: 4 * d_model, as GPT
  double dropout = 0.0;
  std::optional<DType> dtype = std::nullopt;
  bool causal = true;  // false: every position attends to every other (an encoder block, as ViT's)
};

/// nanoGPT's CausalSelfAttention: input [B, T, d_model] -> [B, T, d_model].
/// With options.causal = false the same module attends without a mask.
class CausalSelfAttention : public Module {
 public:
  explicit CausalSelfAttention(const TransformerBlockOptions& o);
  Tensor forward(const Tensor& x) override;
  /// residual + forward(x), with the add inside c_proj's product when nothing
  /// is differentiated (kiln::linear_add); call it only while resid_dropout is
  /// the identity and no hook is on this module or its c_proj, resid_dropout.
  Tensor forward_add(const Tensor& x, const Tensor& residual);
  const int64_t d_model, n_head;
  const double dropout;
  const bool causal;
  std::shared_ptr<Linear> c_attn, c_proj;
  std::shared_ptr<Dropout> resid_dropout;

 private:
  Tensor attend(const Tensor& x);
};

/// nanoGPT's MLP: c_fc, GELU(approximate='tanh'), c_proj, dropout.
class TransformerMLP : public Module {
 public:
  explicit TransformerMLP(const TransformerBlockOptions& o);
  Tensor forward(const Tensor& x) override;
  /// residual + forward(x), as CausalSelfAttention::forward_add (dropout the
  /// identity, no hook on this module or its c_proj, dropout).
  Tensor forward_add(const Tensor& x, const Tensor& residual);
  std::shared_ptr<Linear> c_fc;
  std::shared_ptr<GELU> gelu;
  std::shared_ptr<Linear> c_proj;
  std::shared_ptr<Dropout> dropout;

 private:
  Tensor hidden(const Tensor& x);
};

/// nanoGPT's Block: children ln_1, attn, ln_2, mlp.
class TransformerBlock : public Module {
 public:
  explicit TransformerBlock(TransformerBlockOptions o);
  Tensor forward(const Tensor& x) override;
  const TransformerBlockOptions options;  // d_ff resolved
  std::shared_ptr<LayerNorm> ln_1;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<LayerNorm> ln_2;
  std::shared_ptr<TransformerMLP> mlp;
};

}  // namespace kiln::nn
