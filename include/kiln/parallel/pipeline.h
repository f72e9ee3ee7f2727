// Pipeline parallelism (issue 20, docs/pipeline.md): a model cut into stages,
// one per rank of a pipeline, each batch cut into M micro-batches that flow
// through the stages: activations forward, their gradients backward, with
// point-to-point send/recv between neighbouring stages.
//
//   auto groups = parallel::make_pipeline_groups({{0, 1, 2, 3}});     // every process calls it
//   auto stage = parallel::make_gpt_stage(gpt_options, groups.stage, groups.num_stages);
//   parallel::Pipeline pipe(stage, groups, {.micro_batches = 8, .schedule = parallel::Schedule::OneFOneB},
//                           parallel::gpt_loss(gpt_options), stage->tied_parameters());
//   optim::AdamW opt(*stage, {...});
//   auto r = pipe.step(idx, targets);   // forward + backward of the whole batch; r.loss on every stage
//   opt.step(); opt.zero_grad();
//
// Two schedules (Note [Pipeline schedules] in src/parallel/pipeline_schedule.cpp):
// GPipe (all M forwards, then all M backwards: M micro-batches' activations
// held at once) and 1F1B (stage s runs p-1-s forwards, then alternates one
// forward and one backward, then drains: at most p-s held). Both have the
// same bubble, (p-1)/(M+p-1) of the step when a forward and a backward cost
// one slot each; step() measures it in slots (deterministic) and in wall time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/module.h"

namespace kiln::parallel {

/// The groups one pipeline talks over. Point-to-point traffic runs on one
/// two-rank group per (link, direction), so that activations going forward
/// and gradients coming back never queue behind each other on a group's
/// single communication thread (docs/distributed.md: send and recv run one at
/// a time in issue order); each of these groups carries micro-batches in
/// order 0 .. M-1 on both of its ranks, so no order of calls can deadlock.
struct PipelineGroups {
  int stage = 0;                          // this process's stage (its position in its pipeline's list)
  int num_stages = 1;                     // p
  std::vector<int> ranks;                 // world rank of each stage, in stage order
  dist::ProcessGroupPtr all;              // every stage (stats, the loss); group ranks sorted by world rank
  dist::ProcessGroupPtr fwd_in, fwd_out;  // activations: from stage-1, to stage+1 (null at the ends)
  dist::ProcessGroupPtr bwd_in, bwd_out;  // gradients: from stage+1, to stage-1 (null at the ends)
  dist::ProcessGroupPtr ends;             // the first and the last stage (tied weights); null when p = 1
};

/// Builds the groups of every pipeline. A collective on the world (it calls
/// dist::new_group): every process calls it with the same `pipelines`, each a
/// list of world ranks in stage order (for a dp x pp mesh: its pp lists).
/// The returned groups are those of the pipeline this process is in; a
/// process in none gets num_stages = 0 and no groups.
PipelineGroups make_pipeline_groups(const std::vector<std::vector<int>>& pipelines);

enum class Schedule { GPipe, OneFOneB };
const char* schedule_name(Schedule s);

/// One unit of a stage's work: the forward or the backward of a micro-batch.
struct PipelineOp {
  bool forward = true;
  int64_t micro_batch = 0;
  bool operator==(const PipelineOp&) const = default;
};
/// The order in which stage `stage` of `num_stages` runs the forwards and
/// backwards of `micro_batches` micro-batches under `schedule`.
std::vector<PipelineOp> schedule_ops(Schedule schedule, int stage, int num_stages, int64_t micro_batches);
/// The bubble of the model, (p-1)/(M+p-1).
double model_bubble(int num_stages, int64_t micro_batches);

struct PipelineOptions {
  int64_t micro_batches = 4;  // M; the batch (dim 0) must divide evenly
  Schedule schedule = Schedule::OneFOneB;
};

/// One stage's figures for one step.
struct StageStats {
  int stage = 0;
  double compute_s = 0;        // forwards, backwards and the loss
  double wait_s = 0;           // blocked on a neighbour: receives, and sends not yet taken at the end
  double total_s = 0;          // the whole step on this stage
  int64_t peak_in_flight = 0;  // micro-batches forwarded and not yet backwarded (activations held)
  /// The most activation bytes (MemoryCategory::Activation, above what was
  /// live when the step began) held between this stage's ops: what the
  /// schedule bounds (transients inside one forward or backward not included).
  int64_t peak_held_activation_bytes = 0;
  int64_t busy_slots = 0;  // 2M: one per forward and per backward
  int64_t last_slot = 0;   // the slot at which this stage's last op ended
};

struct PipelineStepResult {
  /// The batch's loss: the sum of the micro-batches' losses each scaled by
  /// 1/M, the mean one process computes on the whole batch (when every
  /// micro-batch counts the same number of terms). On every stage.
  double loss = 0;
  std::vector<StageStats> stages;  // every stage's, in stage order
  double model_bubble = 0;         // (p-1)/(M+p-1)
  /// Measured in slots: each op starts once this stage finished its previous
  /// op and its input was produced (a slot count the message carries), and
  /// takes one slot; the bubble is 1 - 2M / (the last op's end slot over all
  /// stages). Deterministic: it depends on the schedule only.
  double slot_bubble = 0;
  int64_t slots = 0;  // the step's length in slots
  /// Measured in wall time: 1 - (sum of stages' compute) / (p x the longest stage's step).
  double wall_bubble = 0;
  std::string describe() const;  // a few lines: per-stage figures and the bubbles
};

/// Runs one stage of a pipeline. `stage` is this rank's part of the model:
/// the first stage's forward takes the micro-batch of the input, every other
/// stage's takes the previous stage's output; the last stage's output and the
/// micro-batch of the target go to `loss_fn`, which returns the micro-batch's
/// mean loss (only the last stage needs it). `tied` are parameters that the
/// first and the last stage both hold, as copies of one weight (the GPT's token
/// embedding and LM head): their gradients are summed between those two
/// stages after each step, in the same order on both, so the copies take the
/// same update and stay equal.
class Pipeline {
 public:
  using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;
  Pipeline(nn::ModulePtr stage, PipelineGroups groups, PipelineOptions options, LossFn loss_fn = {},
           std::vector<Tensor> tied = {});

  /// Forward and backward of one batch over M micro-batches: the stage's
  /// parameters end with the gradient of the batch's mean loss (added to what
  /// .grad held, as backward() does). `input` is read on the first stage,
  /// `target` on the last; other stages may pass undefined tensors.
  PipelineStepResult step(const Tensor& input, const Tensor& target);

  /// The mean loss of one batch, forward only and in one piece (no
  /// micro-batches, no gradients): for evaluation. The stage's train/eval mode
  /// is the caller's. The loss is on every stage.
  double evaluate(const Tensor& input, const Tensor& target);

  nn::Module& module() { return *stage_; }
  const PipelineGroups& groups() const { return groups_; }
  const PipelineOptions& options() const { return options_; }

 private:
  void sum_tied_gradients(std::vector<Tensor> before);
  PipelineStepResult gather_stats(const StageStats& mine, double loss_sum);

  nn::ModulePtr stage_;
  PipelineGroups groups_;
  PipelineOptions options_;
  LossFn loss_fn_;
  std::vector<Tensor> tied_;
};

/// The GPT's layers split as evenly as possible into `num_stages` ranges
/// [begin, end) (earlier stages take one more when it does not divide).
std::vector<std::pair<int64_t, int64_t>> balanced_layer_ranges(int64_t n_layer, int num_stages);

/// Stage i of a models::GPT: blocks [begin, end) of transformer.h, with the
/// embeddings (and dropout) on the first stage and ln_f and lm_head on the
/// last. Parameters keep the GPT's names (transformer.h.2.ln_1.weight), so a
/// full GPT's state dict loads into each stage by name (strict = false).
/// With more than one stage, the last stage's lm_head.weight is its own copy
/// of transformer.wte.weight, listed by tied_parameters() on both ends.
class GPTStage : public nn::Module {
 public:
  /// Takes stage `stage`'s modules out of `full` (which may then be dropped).
  GPTStage(models::GPT& full, int stage, int num_stages, std::pair<int64_t, int64_t> layers);
  /// First stage: idx [b, T] int64 -> hidden [b, T, C]; middle: hidden ->
  /// hidden; last: hidden -> logits [b, T, V]; a single stage: idx -> logits.
  Tensor forward(const Tensor& x) override;
  /// The first stage's wte.weight or the last stage's lm_head.weight (empty
  /// for middle stages and for a single stage, where they are one tensor).
  std::vector<Tensor> tied_parameters() const;

  const models::GPTOptions options;
  const int stage, num_stages;
  const std::pair<int64_t, int64_t> layers;
  std::shared_ptr<nn::Embedding> wte, wpe;  // first stage
  std::shared_ptr<nn::Dropout> drop;        // first stage
  std::shared_ptr<nn::ModuleDict> h;        // blocks by their GPT index
  std::shared_ptr<nn::LayerNorm> ln_f;      // last stage
  std::shared_ptr<nn::Linear> lm_head;      // last stage
};

/// Builds models::GPT(options) (so the same seed gives the same weights as
/// one process's GPT) and keeps stage `stage`'s part. Layers split by
/// balanced_layer_ranges unless `layers` is given.
std::shared_ptr<GPTStage> make_gpt_stage(const models::GPTOptions& options, int stage, int num_stages,
                                         std::vector<std::pair<int64_t, int64_t>> layers = {});

/// The GPT's loss on the last stage's logits: mean next-token cross-entropy,
/// as models::GPT::loss (targets -100 are ignored).
Pipeline::LossFn gpt_loss(const models::GPTOptions& options);

}  // namespace kiln::parallel
