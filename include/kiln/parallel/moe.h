// A mixture-of-experts feed-forward layer with expert parallelism (issue 20,
// docs/moe.md): parallel::MoE replaces a transformer block's MLP by E experts
// of the GPT MLP's shape (d -> d_ff -> d, GELU(tanh)), a linear router and
// top-k gating; parallel::MoEGPT is the zoo GPT with MoE feed-forwards.
//
// Routing (Mixtral's convention): logits = router(x) [N, E]; each token picks
// its k largest logits (ties: the lower expert index) and its gates are the
// softmax over those k logits only, so they sum to 1 per token (for k = 1 the
// gate is 1, so the router learns only through the auxiliary loss; Switch and
// GShard instead scale by the full softmax's probability).
//
// Capacity: every expert takes at most C = ceil(capacity_factor * N * k / E)
// of the (token, choice) assignments of the N tokens a rank routes (GShard's
// per-group capacity: with expert parallelism an expert receives up to C from
// each rank). Assignments are admitted choice by choice (every token's first
// choice, in token order, before any second choice), and the rest are dropped:
// they contribute zero, so a token whose every choice is dropped leaves the
// layer as zero and only the residual connection around it carries it.
//
// Load-balancing loss (Switch Transformer's, extended to k choices as Mixtral
// and HF do): aux = E * sum_e f_e * P_e, f_e the fraction of the N * k
// assignments routed to expert e (before capacity), P_e the mean over tokens
// of the full softmax's probability of e. It is 1 under perfectly uniform
// routing. Only P_e carries a gradient. aux_loss() returns it after forward;
// the training loss adds coefficient * aux_loss().
//
// Expert parallelism: with a group of ep ranks (E divisible by ep) rank r
// holds experts [r E / ep, (r + 1) E / ep); every rank routes its own tokens,
// sends each assignment's row to the rank holding its expert with one
// all-to-all (split sizes per rank), runs its experts on what it received, and
// sends the results back with a second all-to-all; both are autograd Functions
// whose backward is the reverse all-to-all. The router is replicated: like any
// data-parallel parameter its gradient must be averaged across the ranks that
// saw different tokens (DDP or an all-reduce); the experts' gradients are
// already complete on their owner (they summed every rank's tokens).
//
// Parameter names are the single-process layer's: router.weight and
// experts.<global index>.c_fc/c_proj.{weight,bias}, so a rank's state_dict is
// the full one restricted to its experts (load_from_full copies them).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/transformer.h"

namespace kiln::parallel {

struct MoEOptions {
  int64_t d_model = 0;
  int64_t d_ff = 0;  // 0: 4 * d_model, as the GPT's MLP
  int64_t num_experts = 8;
  int64_t top_k = 2;
  /// C = ceil(capacity_factor * tokens * top_k / num_experts) assignments per expert per rank;
  /// <= 0: no capacity limit (nothing is dropped).
  double capacity_factor = 1.25;
  double dropout = 0.0;  // after each expert's c_proj, as the GPT's MLP
  /// Names the layer in collective labels ("MoE 'h.0.mlp': dispatch all-to-all").
  std::string name;
};

/// What the last forward routed (this rank's tokens; counts are assignments).
struct MoEStats {
  std::vector<int64_t> routed;  // [E] assignments per expert before capacity
  std::vector<int64_t> kept;    // [E] assignments per expert that fit in the capacity
  int64_t capacity = 0;         // C (per expert, per rank); 0: unlimited
  int64_t dropped = 0;          // assignments over capacity
  int64_t dropped_tokens = 0;   // tokens all of whose k assignments were dropped
  /// Bytes this rank sent to other ranks in forward (dispatch rows, combine rows, token counts);
  /// backward sends as many rows again.
  int64_t alltoall_bytes = 0;
};

/// The MoE feed-forward: [.., d] -> [.., d] (see the header comment).
class MoE : public nn::Module {
 public:
  /// `group`: the expert-parallel group (nullptr: one process holds every expert).
  explicit MoE(MoEOptions o, dist::ProcessGroupPtr group = nullptr);
  Tensor forward(const Tensor& x) override;
  /// The load-balancing loss of the last forward (a scalar with a gradient to the router).
  const Tensor& aux_loss() const { return aux_; }
  const MoEStats& stats() const { return stats_; }
  /// Copies router and this rank's experts from a single-process MoE's state dict.
  void load_from_full(const nn::NamedTensors& full);

  const MoEOptions options;  // d_ff resolved
  const dist::ProcessGroupPtr group;
  const int ep, ep_rank;
  const int64_t local_experts, first_expert;
  std::shared_ptr<nn::Linear> router;       // [E, d], no bias
  std::shared_ptr<nn::ModuleDict> experts;  // "<global index>" -> nn::TransformerMLP

 private:
  Tensor aux_;
  MoEStats stats_;
};

/// A pre-LN block whose feed-forward is an MoE: x + attn(ln_1(x)), then h + mlp(ln_2(h)).
class MoEBlock : public nn::Module {
 public:
  MoEBlock(const nn::TransformerBlockOptions& o, MoEOptions moe, dist::ProcessGroupPtr group);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::LayerNorm> ln_1;
  std::shared_ptr<nn::CausalSelfAttention> attn;
  std::shared_ptr<nn::LayerNorm> ln_2;
  std::shared_ptr<MoE> mlp;
};

struct MoEGPTOptions {
  models::GPTOptions gpt;
  int64_t num_experts = 4;
  int64_t top_k = 2;
  double capacity_factor = 1.25;
  /// Which blocks use an MoE (Switch/GShard use every other one); empty: all.
  std::vector<bool> moe_layers;
  /// The weight of the summed auxiliary losses in loss().
  double aux_loss_coef = 0.01;
};

/// models::GPT with MoE feed-forwards. models::GPT's MLP is a fixed
/// nn::TransformerMLP member of nn::TransformerBlock and cannot be swapped
/// from outside, so this model composes nn's pieces under GPT's names
/// (transformer.wte/wpe/h.N.ln_1/attn/ln_2/mlp, transformer.ln_f, lm_head tied
/// to wte) with transformer.h.N.mlp an MoE (router, experts.M.c_fc/c_proj) or,
/// where moe_layers says no, the dense nn::TransformerMLP. nanoGPT's init.
class MoEGPT : public nn::Module {
 public:
  explicit MoEGPT(MoEGPTOptions o, dist::ProcessGroupPtr group = nullptr);
  Tensor forward(const Tensor& idx) override;
  /// Cross-entropy of the next token plus aux_loss_coef * the sum of the MoE layers' aux losses.
  Tensor loss(const Tensor& idx, const Tensor& targets);
  /// The MoE layers, in block order.
  std::vector<std::shared_ptr<MoE>> moe_layers() const;
  const MoEGPTOptions options;
  std::shared_ptr<nn::ModuleDict> transformer;
  std::shared_ptr<nn::Embedding> wte, wpe;
  std::shared_ptr<nn::ModuleList> h;
  std::shared_ptr<nn::LayerNorm> ln_f;
  std::shared_ptr<nn::Linear> lm_head;
};

}  // namespace kiln::parallel
