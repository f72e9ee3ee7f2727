// The zoo GPT trained over a dp x tp x pp device mesh (issue 20,
// docs/parallel.md "Composing dp, tp and pp"): each pipeline stage holds a
// range of layers, each tensor-parallel, and each data-parallel replica of the
// whole arrangement reads its own share of the batches.
//
//   dist::DeviceMesh mesh({{"dp", 2}, {"tp", 2}, {"pp", 2}});   // 8 ranks
//   models::GPT full(options);                                  // same seed on every rank
//   parallel::MeshGPT gpt(full, mesh, {.micro_batches = 4});    // `full` may be dropped now
//   optim::AdamW opt(gpt.module().named_parameters(), {...});
//   auto r = gpt.forward_backward(idx, targets);   // this replica's batch: pipeline over tp stages
//   gpt.allreduce_gradients();                      // mean over dp
//   gpt.clip_grad_norm_(1.0);                       // the global norm, each weight counted once
//   opt.step(); opt.zero_grad();
//   nn::NamedTensors sd = gpt.full_state_dict();    // models::GPT's state dict, on every rank
//
// Parameter names are models::GPT's throughout, so a single-process
// checkpoint loads into any layout and any layout's merged state dict loads
// into models::GPT strictly; the optimizer state merges and splits the same
// way (optimizer state is keyed by parameter name).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/dist/device_mesh.h"
#include "kiln/models/gpt.h"
#include "kiln/optim/optimizer.h"
#include "kiln/parallel/pipeline.h"
#include "kiln/parallel/tensor_parallel_gpt.h"

namespace kiln::parallel {

/// Stage `stage` of a TensorParallelGPT: blocks [begin, end) of transformer.h
/// (tensor-parallel over the GPT's tp group), with the vocabulary-parallel
/// token embedding and the positions on the first stage and ln_f and the
/// vocabulary-parallel head on the last. The last stage of several holds its
/// own copy of the embedding's shard as lm_head.weight (Note [Tied weights
/// across stages] in pipeline_gpt.cpp; the copies pair up tp rank by tp rank,
/// each pipeline being one tp coordinate). Under sequence parallelism the
/// activations passed between stages are each rank's [b, T / tp, d] chunk.
class TensorParallelGPTStage : public nn::Module {
 public:
  /// Takes stage `stage`'s modules out of `full` (which may then be dropped).
  /// A collective over full.group when a head copy is made (its layout check).
  TensorParallelGPTStage(TensorParallelGPT& full, int stage, int num_stages, std::pair<int64_t, int64_t> layers);
  /// First stage: idx [b, T] -> hidden; middle: hidden -> hidden; last: hidden
  /// -> this rank's logits [b, T, V / tp]; one stage: idx -> logits.
  Tensor forward(const Tensor& x) override;
  /// The first stage's wte.weight or the last stage's lm_head.weight (none for
  /// middle stages and for a single stage).
  std::vector<Tensor> tied_parameters() const;
  /// Mean next-token cross-entropy over the last stage's vocabulary-parallel
  /// logits (targets -100 ignored); no rank forms the full logits.
  Pipeline::LossFn loss_fn() const;
  /// Whether `name` is the last stage's copy of the tied embedding (counted
  /// once, on the first stage, by norms and merges).
  bool is_tied_copy(const std::string& name) const;

  const models::GPTOptions options;
  const dist::ProcessGroupPtr group;  // tp
  const TensorParallelOptions tp;
  const int stage, num_stages;
  const std::pair<int64_t, int64_t> layers;
  std::shared_ptr<VocabParallelEmbedding> wte;      // first stage (and a single stage's head)
  std::shared_ptr<nn::Embedding> wpe;               // first stage
  std::shared_ptr<nn::Dropout> drop;                // first stage
  std::shared_ptr<nn::ModuleDict> h;                // ParallelTransformerBlocks by their GPT index
  std::shared_ptr<nn::LayerNorm> ln_f;              // last stage
  std::shared_ptr<VocabParallelEmbedding> lm_head;  // last stage of several: the tied copy
};

struct MeshGPTOptions {
  int64_t micro_batches = 1;  // M: each replica's batch is cut into M micro-batches (must divide it)
  Schedule schedule = Schedule::OneFOneB;
  bool sequence_parallel = false;  // Megatron's SP inside each tp group (T must divide by tp)
};

/// One rank's part of a GPT laid out over a mesh with dimensions named "dp",
/// "tp" and "pp" (in any order; any may have size 1): layers split evenly into
/// pp stages, each stage tensor-parallel over its tp group, the whole repeated
/// over dp replicas.
class MeshGPT {
 public:
  /// `full` is a models::GPT built alike on every rank (same options, same
  /// seed): each rank keeps its stage's tp shard of it. A collective over the
  /// world (it builds the pipelines' groups). The default generator's state
  /// is the same after construction as before.
  MeshGPT(const models::GPT& full, const dist::DeviceMesh& mesh, MeshGPTOptions options = {});

  /// This rank's stage (its parameters carry models::GPT's names).
  nn::Module& module() { return *stage_; }
  std::shared_ptr<TensorParallelGPTStage> stage_module() const { return stage_; }
  Pipeline& pipeline() { return *pipe_; }

  /// Forward and backward of this replica's batch (idx and targets [B, T];
  /// every rank of the replica passes the same): the stage's parameters end
  /// with the gradient of the batch's mean loss added to their .grad, not yet
  /// averaged over dp. The loss is on every rank of the replica.
  PipelineStepResult forward_backward(const Tensor& idx, const Tensor& targets);
  /// The mean of every replica's gradients (one all-reduce over dp of all of
  /// them, flattened); nothing with dp = 1. A collective over dp.
  void allreduce_gradients();
  /// Scales the gradients so that their global 2-norm (over every stage and tp
  /// shard, replicated weights and the tied head copy counted once) is at most
  /// max_norm, as optim::clip_grad_norm_ does on one process; returns the norm
  /// before clipping. Call after allreduce_gradients. A collective over the world.
  double clip_grad_norm_(double max_norm);
  /// The mean loss of one batch, forward only (no gradients; the stage's
  /// train/eval mode is the caller's), on every rank. A collective over the
  /// replica (pp x tp).
  double evaluate(const Tensor& idx, const Tensor& targets);

  /// models::GPT's state dict (lm_head.weight listed beside
  /// transformer.wte.weight, as GPT's own), on every rank. A collective over the world.
  nn::NamedTensors full_state_dict();
  /// Loads this rank's shard of a models::GPT state dict (every rank passes
  /// the same; the tied head copies both take transformer.wte.weight's rows).
  /// A collective over the world.
  void load_full_state_dict(const nn::NamedTensors& state_dict);
  /// The optimizer state of the whole GPT, keyed by models::GPT's parameter
  /// names, from this rank's `local` state (keyed by the stage's names, as the
  /// stage's optimizer or ZeRO's consolidate_state_dict gives it). A
  /// collective over this rank's tp and pp groups: every rank of one dp
  /// coordinate calls it (all ranks get the result).
  std::map<std::string, optim::ParamState> full_optim_state(const std::map<std::string, optim::ParamState>& local);
  /// This rank's part of `full` (as full_optim_state returns it): each state
  /// tensor cut to the rank's shard of its parameter. Local.
  std::map<std::string, optim::ParamState> local_optim_state(const std::map<std::string, optim::ParamState>& full);

  /// Parameter elements this rank holds, and the whole GPT's.
  int64_t local_numel() const;
  int64_t full_numel() const { return full_numel_; }
  const dist::ProcessGroupPtr& dp_group() const { return dp_; }
  const dist::ProcessGroupPtr& tp_group() const { return tp_; }
  const dist::ProcessGroupPtr& pp_group() const { return pp_; }
  /// "stage 1 of 2 (layers 2-3), tp rank 0 of 2, dp replica 1 of 2"
  std::string describe() const;

 private:
  /// The GPT's parameter (or state dict entry) `full_name` is held by this stage.
  int owner_stage(const std::string& full_name) const;
  /// The name under which the owning stage holds `full_name` (itself, except a single stage's tied head).
  std::string local_name(const std::string& full_name) const;

  MeshGPTOptions options_;
  dist::ProcessGroupPtr dp_, tp_, pp_, world_;
  std::shared_ptr<TensorParallelGPTStage> stage_;
  std::unique_ptr<Pipeline> pipe_;
  std::vector<std::pair<int64_t, int64_t>> layers_;  // every stage's
  // The whole GPT's state dict entries (names and shapes, in its order) and its parameters' names.
  std::vector<std::pair<std::string, std::vector<int64_t>>> full_entries_;
  std::vector<std::string> full_params_;
  std::map<std::string, ShardSpec> specs_;  // the stage's, by local name
  int64_t full_numel_ = 0;
};

}  // namespace kiln::parallel
