#pragma once
// ZeRO stages 1 and 2: an optimizer whose state is sharded across the ranks
// of a process group, as torch.distributed.optim.ZeroRedundancyOptimizer
// (stage 1) and FSDP's SHARD_GRAD_OP (stage 2). See docs/distributed.md,
// "ZeRO stages 1 and 2".
//
// The trainable parameters, in the order given (registration order for
// model.named_parameters()), are laid end to end as one flat float32 range of
// T elements; it is cut into N = group->size() contiguous shards of
// S = ceil(T / N) elements (the last ones shorter, possibly empty). Rank r
// owns elements [r*S, min((r+1)*S, T)). Each rank builds the user's optimizer
// over its shard only: one piece per parameter that overlaps the shard, a view
// of that parameter's elements named like the parameter, in the parameter's
// param group. So optimizer state exists for ~T/N elements per rank. After
// each rank has stepped its pieces, the shards are all-gathered back into every
// rank's parameters (allgather_into_tensor).
//
//   stage 1: gradients are averaged by DDP (wrap the model in
//            DistributedDataParallel); each rank steps its range of them.
//   stage 2: do NOT wrap the model in DDP. After backward each rank's full
//            gradients are divided by N and reduce-scattered
//            (reduce_scatter_tensor) into a shard-sized gradient buffer; the
//            parameters' .grad are then freed, so that between steps each
//            rank holds only ~T/N gradient elements.
//
//   auto net = ...;
//   dist::DistributedDataParallel ddp(net, pg);              // stage 1 only
//   dist::ZeroRedundancyOptimizer opt(net->named_parameters(), pg,
//       dist::optimizer_factory<optim::AdamW>(optim::AdamWOptions{.lr = 1e-3}), {.stage = 1});
//   opt.zero_grad(); loss.backward(); opt.clip_grad_norm_(1.0); opt.step();
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"
#include "kiln/optim/optimizer.h"

namespace kiln::dist {

/// Builds the local optimizer over this rank's pieces, one group per param
/// group given to ZeroRedundancyOptimizer (same order; a group may be empty on
/// some ranks).
using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

/// optimizer_factory<optim::AdamW>(optim::AdamWOptions{...}): the usual factory.
template <class Opt, class Options>
OptimizerFactory optimizer_factory(Options options) {
  return [options](std::vector<optim::ParamGroup> groups) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<Opt>(std::move(groups), options);
  };
}

struct ZeroOptions {
  /// 1: optimizer state sharded (gradients averaged by DDP). 2: gradients too.
  int stage = 1;
  /// Broadcast the parameters from group rank 0 at construction (as DDP does).
  bool broadcast_parameters = true;
};

/// A parameter's part of one rank's shard.
struct ZeroPiece {
  size_t param = 0;    // index into the flat order
  int64_t begin = 0;   // first element of the parameter in this shard (element offset within the parameter)
  int64_t length = 0;  // elements
  int64_t flat = 0;    // element offset of the piece in the flat range
};

class ZeroRedundancyOptimizer {
 public:
  ZeroRedundancyOptimizer(optim::NamedParams params, ProcessGroupPtr group, OptimizerFactory make_optimizer,
                          ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, ProcessGroupPtr group, OptimizerFactory make_optimizer,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  /// Stage 2: reduce-scatters the gradients accumulated since the last
  /// reduction (every parameter's .grad, undefined ones counting as zero) into
  /// this rank's gradient shard, adding to what it holds unless zero_grad()
  /// cleared it, and frees the parameters' .grad. Nothing to do when no .grad
  /// is defined. step() and clip_grad_norm_() call it; every rank must reach it
  /// alike. Stage 1: nothing (DDP has averaged the .grad already).
  void reduce_gradients();

  /// Steps this rank's pieces with the local optimizer, then all-gathers every
  /// rank's shard into the parameters. A collective.
  void step();

  /// Stage 1: clears the parameters' .grad (as Optimizer::zero_grad). Stage 2:
  /// also clears the gradient shard (set_to_none: the next reduction writes it
  /// afresh; otherwise it is zeroed).
  void zero_grad(bool set_to_none = true);

  /// clip_grad_norm_ by the global norm over every shard (norm_type 2 or inf):
  /// each rank computes, per parameter, the sum of squares (or max) of its
  /// pieces' gradients in double; the partial sums are all-gathered and added
  /// in rank order, so every rank gets the same per-parameter norms, rounded to
  /// float32 and combined exactly as optim::clip_grad_norm_ does. Scales this
  /// rank's pieces' gradients (stage 1: the parameters' .grad within this
  /// rank's range only). Returns the total norm. A collective.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// This rank's optimizer state (pieces' state tensors, keyed by parameter
  /// name); load_state_dict takes what the same rank of the same layout saved.
  optim::OptimizerStateDict state_dict() const;
  void load_state_dict(const optim::OptimizerStateDict& sd);
  /// The unsharded state, as the unsharded optimizer's state_dict() would
  /// give it, assembled on group rank `to` (other ranks get an empty one). A
  /// collective. Every parameter's state tensors must exist (after a step in
  /// which every parameter had a gradient).
  optim::OptimizerStateDict consolidate_state_dict(int to = 0);

  /// The local optimizer over this rank's pieces; null when the shard is empty
  /// (more ranks than elements). LR schedulers can be built over it.
  optim::Optimizer* optimizer() { return local_.get(); }
  const ProcessGroupPtr& process_group() const { return group_; }
  int stage() const { return options_.stage; }
  int64_t numel() const { return total_; }
  /// Elements per shard (the padded size; the last shards may hold fewer).
  int64_t shard_size() const { return shard_; }
  /// [begin, end) of rank r's shard in the flat range.
  std::pair<int64_t, int64_t> shard_range(int r) const;
  const std::vector<ZeroPiece>& pieces() const { return pieces_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  /// Stage 2: this rank's gradient shard (shard_size() elements; undefined after zero_grad(true)).
  const Tensor& gradient_shard() const { return grad_shard_; }

 private:
  void prepare_gradients();
  void gather_parameters();

  ProcessGroupPtr group_;
  ZeroOptions options_;
  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::vector<size_t> group_of_;  // param -> param group
  std::vector<int64_t> offset_;   // param -> flat offset
  int64_t total_ = 0, shard_ = 0;
  std::vector<ZeroPiece> pieces_;
  std::vector<Tensor> piece_tensors_;  // views of the parameters, what the local optimizer steps
  Tensor grad_shard_;                  // stage 2
  std::unique_ptr<optim::Optimizer> local_;
};

}  // namespace kiln::dist
