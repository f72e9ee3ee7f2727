#pragma once
// FullyShardedDataParallel: ZeRO stage 3, as torch.distributed.fsdp's
// FullyShardedDataParallel with use_orig_params=True (docs/distributed.md,
// "FSDP (ZeRO-3)").
//
// The model is cut into units: each submodule named in FSDPOptions::units,
// and the root unit holding every parameter outside them. A unit's parameters
// are laid end to end as one flat float32 range of T elements, cut into
// N = group->size() shards of S = ceil(T / N) elements; rank r keeps only
// elements [r*S, (r+1)*S) (its flat shard, the float32 master copy).
//
// Between steps each parameter is a 1-D view of its piece of this rank's shard
// (possibly empty), so an optimizer built over fsdp.parameters() steps only
// this rank's ~1/N of the parameters and keeps state for those alone. Just
// before a unit's forward its shard is all-gathered from every rank and its
// parameters become views of the full flat buffer; after the forward the
// buffer is freed (reshard_after_forward). When the gradient of the unit's
// output arrives in backward the unit is gathered again, and once each of its
// parameters has its gradient the full gradients are divided by N and
// reduce-scattered into this rank's gradient shard, while backward goes on.
// The next unit's all-gather is issued while the current one computes
// (prefetch), in forward and in backward. When backward ends every
// parameter's .grad is a view of its piece of the gradient shard.
//
//   auto fsdp = std::make_shared<dist::FullyShardedDataParallel>(
//       model, dist::world(), dist::FSDPOptions{.units = dist::modules_of_type(*model, "Block")});
//   optim::AdamW opt(fsdp->named_parameters(), {.lr = 1e-3});
//   loss_fn((*fsdp)(x), y).backward(); fsdp->clip_grad_norm_(1.0); opt.step(); opt.zero_grad();
//
// Outside forward and backward, do not read the parameters through the
// wrapped module expecting their full shapes: use full_state_dict().
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"
#include "kiln/dist/sharded_checkpoint.h"
#include "kiln/nn/module.h"
#include "kiln/optim/optimizer.h"

namespace kiln::dist {

struct FSDPOptions {
  /// Dotted names (as named_modules() gives them) of the submodules that are
  /// each one unit: typically every transformer block or ResNet stage. Units
  /// may not nest. A parameter shared by two units (tied weights) goes to the
  /// root unit, which holds everything outside the units and stays gathered
  /// from the start of forward to the end of backward.
  std::vector<std::string> units;
  /// Free a unit's gathered parameters after its forward and gather them again
  /// for backward (ZeRO-3). Off: keep them until backward ends (less
  /// communication, more memory: torch's SHARD_GRAD_OP).
  bool reshard_after_forward = true;
  /// Issue the next unit's all-gather before computing the current one (the
  /// forward order is the one recorded in the previous iteration; backward
  /// runs it in reverse).
  bool prefetch = true;
  /// Broadcast the parameters and buffers from group rank 0 at construction.
  bool broadcast_parameters = true;
  /// Parameters that get no gradient in a backward pass are taken as having a
  /// zero one; off, they are an error naming them (as DDP). On, every unit's
  /// reduce-scatter waits for the end of backward.
  bool find_unused_parameters = false;
};

/// The dotted names of every submodule of `model` whose type_name() is
/// `type_name` (torch's transformer_auto_wrap_policy): the usual units.
std::vector<std::string> modules_of_type(nn::Module& model, const std::string& type_name);

/// One unit's layout, the same on every rank.
struct FSDPUnitInfo {
  std::string name;                 // the submodule's dotted name; "(root)" for the root unit
  std::vector<std::string> params;  // the parameters' names in the wrapped module, in flat order
  std::vector<int64_t> offsets;     // each parameter's first element in the unit's flat range
  int64_t numel = 0;                // T
  int64_t shard_size = 0;           // S
};

/// What the last forward and backward did, for figures and tests.
struct FSDPStats {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t prefetched = 0;           // all-gathers issued ahead of their unit
  double exposed_comm_seconds = 0;  // time spent waiting on all-gathers and reduce-scatters
  int64_t max_gathered_units = 0;   // most units holding full parameters at once
};

class FullyShardedDataParallel : public nn::Module {
 public:
  /// Collective over `group`. Every rank must wrap the same units (checked:
  /// a mismatch is a DistributedError on every rank naming the group, the
  /// first differing unit and the ranks). Parameters must be float32 and
  /// contiguous.
  FullyShardedDataParallel(std::shared_ptr<nn::Module> module, ProcessGroupPtr group, FSDPOptions options = {});
  ~FullyShardedDataParallel() override;

  Tensor forward(const Tensor& input) override;
  Tensor forward(const Tensor& input, const Tensor& other) override;

  const std::shared_ptr<nn::Module>& module() const { return module_; }
  const ProcessGroupPtr& process_group() const { return group_; }
  const FSDPOptions& options() const { return options_; }
  const std::vector<FSDPUnitInfo>& units() const { return info_; }
  const FSDPStats& stats() const { return stats_; }

  /// clip_grad_norm_ by the global norm over every rank's gradient shards
  /// (norm 2 or inf), computed as ZeroRedundancyOptimizer::clip_grad_norm_
  /// does. Call after backward; a collective. Returns the total norm.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// While a NoSync guard lives, backward keeps full (unsharded) gradients and
  /// does not reduce them; the first backward after it reduce-scatters
  /// everything accumulated. Costs one full copy of the gradients in memory.
  class NoSync {
   public:
    explicit NoSync(FullyShardedDataParallel& fsdp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
    bool prev_;
  };
  NoSync no_sync() { return NoSync(*this); }

  /// The wrapped module's state dict with full parameters, keyed as
  /// module()->state_dict() would be (torch's FULL_STATE_DICT). A collective:
  /// every unit is all-gathered in turn. Every rank gets it.
  nn::NamedTensors full_state_dict();
  /// Loads a full state dict (the same on every rank): each rank keeps its
  /// shard of each parameter and all of each buffer. Every key is checked
  /// (missing, unexpected, shape, dtype) before anything changes.
  void load_full_state_dict(const nn::NamedTensors& dict);

  /// The optimizer state of `opt` (built over this->named_parameters())
  /// assembled to full shapes and keyed by full_state_dict() names, as the
  /// unsharded optimizer's state_dict() would be. A collective; every rank gets it.
  optim::OptimizerStateDict full_optim_state_dict(const optim::Optimizer& opt);
  /// Loads a full optimizer state dict (as full_optim_state_dict gives, or an
  /// unsharded run's state_dict() with module-relative names) into `opt`,
  /// each rank taking its pieces.
  void load_full_optim_state_dict(optim::Optimizer& opt, const optim::OptimizerStateDict& full);

  /// Writes the model and `opt`'s state (null: the model only) as one
  /// sharded checkpoint (sharded_checkpoint.h): each rank writes its own
  /// pieces ("model.<name>", "optim.<name>.<key>"), rank 0 the buffers and the
  /// optimizer's per-parameter steps; `metadata` and the param groups'
  /// hyperparameters go in the index. Nothing is gathered: no rank ever holds
  /// more than its shard. A collective.
  void save_sharded_checkpoint(const std::filesystem::path& dir, const optim::Optimizer* opt,
                               ShardedMetadata metadata = {});
  /// Loads a checkpoint save_sharded_checkpoint wrote at any world size: each
  /// rank reads only the ranges of its own pieces. Every tensor is checked
  /// (present, full shape) before anything changes. Returns the metadata.
  /// Not a collective (each rank reads for itself).
  ShardedMetadata load_sharded_checkpoint(const std::filesystem::path& dir, optim::Optimizer* opt);

  struct Unit;

 private:
  friend class NoSync;
  Tensor run(const Tensor& input, const Tensor* other);
  void begin_iteration();
  void on_unit_pre_forward(size_t u);
  Tensor on_unit_post_forward(size_t u, const Tensor& out);
  void on_backward_start();
  void on_unit_backward(size_t u);
  void on_gradient_ready(size_t param);
  void launch_reduce(size_t u);
  void complete_reduce(size_t u);
  void finalize_backward();
  void abandon_backward();
  void gather(size_t u, bool prefetch);
  void wait_gathered(size_t u);
  void reshard(size_t u);
  void prefetch_after(size_t u, int direction);
  std::string param_label(size_t param) const;
  std::string unit_label(size_t u, const char* what) const;

  std::shared_ptr<nn::Module> module_;
  ProcessGroupPtr group_;
  FSDPOptions options_;
  std::vector<FSDPUnitInfo> info_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<Tensor> params_;             // every parameter, unit by unit in flat order
  std::vector<std::string> names_;         // their names in the wrapped module
  std::vector<size_t> unit_of_, slot_of_;  // param -> unit, index within the unit
  std::vector<HookHandle> module_hooks_;
  std::vector<HookHandle> grad_hooks_;
  std::vector<size_t> order_, last_order_;  // units in forward order: this iteration, the previous one
  std::vector<char> ready_;                 // param got its gradient in this backward
  std::deque<size_t> in_flight_;            // units whose reduce-scatter is not folded in yet
  bool sync_ = true;
  bool in_backward_ = false;
  bool backward_pending_ = false;  // a forward with grad ran and its backward has not started
  FSDPStats stats_;
};

}  // namespace kiln::dist
