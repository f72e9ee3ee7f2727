// The zoo GPT (models::GPT) built tensor-parallel over a tp group (Megatron's
// layout, docs/parallel.md):
//   transformer.wte        VocabParallelEmbedding (vocabulary split)
//   transformer.wpe        nn::Embedding, whole on every rank
//   transformer.h.N.attn   ParallelSelfAttention: c_attn column-parallel with q, k, v as
//                          3 blocks (each rank holds n_head / tp heads), c_proj row-parallel
//   transformer.h.N.mlp    ParallelMLP: c_fc column-parallel, c_proj row-parallel
//   ln_1, ln_2, ln_f       nn::LayerNorm, whole on every rank
//   lm_head                tied to wte: each rank computes its vocabulary slice of the
//                          logits, and loss() is vocab_parallel_cross_entropy over them
// Parameter names are models::GPT's, so load_from_full(gpt.state_dict())
// splits a single-process model (or checkpoint) into this rank's shards and
// full_state_dict() merges them back into one that models::GPT loads strictly
// ("lm_head.weight" included, as GPT's state_dict lists the tied weight twice).
// Per rank the block weights and the token embedding are 1/tp; LayerNorms,
// positions and the row-parallel biases are replicated. The gradients of the
// replicated parameters are the same on every rank (the computation around
// them is), so a plain optimizer over parameters() steps every rank alike.
#pragma once

#include <cstdint>
#include <memory>

#include "kiln/models/gpt.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/parallel/tensor_parallel.h"

namespace kiln::parallel {

struct TensorParallelOptions {
  /// Megatron's sequence parallelism: outside the tp regions (LayerNorms,
  /// dropout, residual adds, positions) every rank works on its chunk of the
  /// sequence, [B, T / tp, d], so those activations are 1/tp per rank; the
  /// all-reduces become an all-gather before each column-parallel layer and a
  /// reduce-scatter after each row-parallel one (backward: the reverse). The
  /// replicated parameters used on chunks (LayerNorms, row-parallel biases,
  /// positions) go through f, so their gradients sum every chunk's and stay
  /// equal on every rank. T must divide by tp.
  bool sequence_parallel = false;
};

/// nanoGPT's causal self-attention with the heads split across the group:
/// [B, T, d] -> [B, T, d] (the output all-reduced once, in c_proj).
class ParallelSelfAttention : public nn::Module {
 public:
  ParallelSelfAttention(const nn::TransformerBlockOptions& o, dist::ProcessGroupPtr group, const std::string& name,
                        TensorParallelOptions tp = {});
  Tensor forward(const Tensor& x) override;
  const int64_t d_model, n_head, local_heads;
  const double dropout;
  std::shared_ptr<ColumnParallelLinear> c_attn;  // [3 d / tp, d]: this rank's q, k, v rows
  std::shared_ptr<RowParallelLinear> c_proj;     // [d, d / tp]
  std::shared_ptr<nn::Dropout> resid_dropout;
};

/// nanoGPT's MLP: c_fc (column-parallel), GELU(tanh), c_proj (row-parallel), dropout.
class ParallelMLP : public nn::Module {
 public:
  ParallelMLP(const nn::TransformerBlockOptions& o, dist::ProcessGroupPtr group, const std::string& name,
              TensorParallelOptions tp = {});
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<ColumnParallelLinear> c_fc;
  std::shared_ptr<RowParallelLinear> c_proj;
  std::shared_ptr<nn::Dropout> dropout;
};

/// nanoGPT's pre-LN block: x + attn(ln_1(x)), then h + mlp(ln_2(h)).
class ParallelTransformerBlock : public nn::Module {
 public:
  ParallelTransformerBlock(nn::TransformerBlockOptions o, dist::ProcessGroupPtr group, const std::string& name,
                           TensorParallelOptions tp = {});
  /// x: [B, T, d], or this rank's [B, T / tp, d] under sequence parallelism.
  Tensor forward(const Tensor& x) override;
  const dist::ProcessGroupPtr group;
  const TensorParallelOptions tp;
  const std::string name;
  std::shared_ptr<nn::LayerNorm> ln_1;
  std::shared_ptr<ParallelSelfAttention> attn;
  std::shared_ptr<nn::LayerNorm> ln_2;
  std::shared_ptr<ParallelMLP> mlp;
};

/// models::GPT split across `group` (see the header comment). Every rank of
/// the group builds it with the same options; vocab_size, n_head, n_embd and
/// d_ff must divide by the group's size. Initialisation has GPT's
/// distributions (N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer)),
/// biases 0), drawn whole on every rank and sharded: seeded alike, the ranks
/// agree, but the numbers are not a models::GPT's of the same seed (the draws
/// come in another order); to start from one, load_from_full(gpt.state_dict()).
/// Dropout > 0 runs (replicated regions draw the same masks on every rank when
/// seeded alike) but does not reproduce a single-process run's masks.
class TensorParallelGPT : public nn::Module {
 public:
  TensorParallelGPT(models::GPTOptions o, dist::ProcessGroupPtr group, TensorParallelOptions tp = {});
  /// idx [B, T] int64 -> this rank's logits [B, T, vocab_size / tp] (classes [vocab_start(), +vocab_size / tp)).
  Tensor forward(const Tensor& idx) override;
  /// The full logits [B, T, vocab_size] on every rank (an all-gather; for sampling and evaluation).
  Tensor full_logits(const Tensor& idx);
  /// Mean next-token cross-entropy, equal to models::GPT::loss (targets [B, T], -100 ignored),
  /// through vocab_parallel_cross_entropy: no rank forms the full logits.
  Tensor loss(const Tensor& idx, const Tensor& targets);
  /// Splits a single-process models::GPT state dict into this rank's shards (collective).
  void load_from_full(const nn::NamedTensors& state_dict);
  /// models::GPT's state dict, merged from every rank's shards (collective; every rank gets it).
  nn::NamedTensors full_state_dict();
  int64_t vocab_start() const { return wte->vocab_start; }

  const models::GPTOptions options;
  const dist::ProcessGroupPtr group;
  const TensorParallelOptions tp;
  std::shared_ptr<nn::ModuleDict> transformer;
  std::shared_ptr<VocabParallelEmbedding> wte;
  std::shared_ptr<nn::Embedding> wpe;
  std::shared_ptr<nn::Dropout> drop;
  std::shared_ptr<nn::ModuleList> h;  // of ParallelTransformerBlock
  std::shared_ptr<nn::LayerNorm> ln_f;
};

}  // namespace kiln::parallel
