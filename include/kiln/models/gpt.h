// models::GPT: a nanoGPT-style decoder-only language model, the "gpt" workload
// of bench/WORKLOADS.md by default (vocab 256, context 128, 4 layers, 4 heads,
// d_model 256, MLP 1024 with GELU(tanh)).
//
// Modules and state_dict names are nanoGPT's (so its checkpoints load by name):
//   transformer.wte   Embedding(vocab_size, n_embd)       token embedding
//   transformer.wpe   Embedding(block_size, n_embd)       learned positions
//   transformer.drop  Dropout(dropout)
//   transformer.h.N   nn::TransformerBlock (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj)
//   transformer.ln_f  LayerNorm(n_embd)
//   lm_head           Linear(n_embd, vocab_size, bias = false), weight TIED to transformer.wte.weight
// The tied weight is one tensor: named_parameters()/parameters() list it once
// (as "transformer.wte.weight") and its gradient is the sum of both uses'. As
// torch, state_dict() lists it under both names ("transformer.wte.weight" and
// "lm_head.weight"), so state dicts exchange with torch's twin strictly in
// both directions. Initialisation is nanoGPT's: every Linear and Embedding
// weight N(0, 0.02), biases zero, LayerNorms ones/zeros, and the residual
// projections (attn.c_proj.weight, mlp.c_proj.weight) N(0, 0.02 / sqrt(2 n_layer)).
// The PyTorch twin is in tests/parity/models_twins_gpt.py.
#pragma once

#include <cstdint>
#include <memory>

#include "kiln/nn/checkpoint.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/transformer.h"

namespace kiln::models {

struct GPTOptions {
  int64_t vocab_size = 256;
  int64_t block_size = 128;  // the longest sequence (positions of wpe)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 256;
  int64_t d_ff = 0;  // 0: 4 * n_embd
  double dropout = 0.0;
  /// Which transformer.h blocks run under nn::checkpoint in training forwards
  /// (copied into GPT::checkpointing).
  nn::CheckpointPolicy activation_checkpointing;
};

/// nanoGPT's initialisation of a GPT-shaped `model`: every Linear and
/// Embedding weight N(0, 0.02), Linear biases zero, and then every parameter
/// named "*c_proj.weight" (the residual projections) N(0, 0.02 / sqrt(2 n_layer)),
/// in registration order. models::GPT uses it, and so do the GPT variants built
/// elsewhere from nn's pieces (parallel::MoEGPT), so that their weights match.
void init_gpt_weights(nn::Module& model, int64_t n_layer);

/// forward: idx [B, T] int64 token ids (T <= block_size) -> logits [B, T, vocab_size].
class GPT : public nn::Module {
 public:
  explicit GPT(GPTOptions o = {});
  Tensor forward(const Tensor& idx) override;
  /// Mean next-token cross-entropy: cross_entropy(logits [B*T, V], targets [B*T]),
  /// targets [B, T] int64 (entries -100 are ignored, as torch's default ignore_index).
  Tensor loss(const Tensor& idx, const Tensor& targets);
  const GPTOptions options;
  std::shared_ptr<nn::ModuleDict> transformer;
  std::shared_ptr<nn::Embedding> wte, wpe;  // also transformer.wte, transformer.wpe
  std::shared_ptr<nn::Dropout> drop;
  std::shared_ptr<nn::ModuleList> h;  // of nn::TransformerBlock
  std::shared_ptr<nn::LayerNorm> ln_f;
  std::shared_ptr<nn::Linear> lm_head;
  /// Activation checkpointing of the blocks (nn::CheckpointPolicy); may be changed between steps.
  nn::CheckpointPolicy checkpointing = options.activation_checkpointing;
};

}  // namespace kiln::models
