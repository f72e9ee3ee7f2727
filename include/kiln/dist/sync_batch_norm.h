#pragma once
// SyncBatchNorm: batch normalisation whose training-mode statistics are those
// of the whole batch spread over a process group, as torch.nn.SyncBatchNorm
// (docs/distributed.md, "SyncBatchNorm").
//
// Forward (training): each rank takes its per-channel count, mean and sum of
// squared deviations (M2) over its own share of the batch; the ranks exchange
// them (one allgather of [C] float64 vectors) and every rank combines them in
// group-rank order with the pairwise formula of Chan et al. (no E[x^2] - E[x]^2
// cancellation), so per-rank batches may differ in size. The running
// statistics are updated with the global mean and the unbiased variance of the
// global count. Backward: sum(dy) and sum(dy * (x - mean)) per channel are
// exchanged the same way, so the input gradient is that of one process on the
// global batch; weight and bias gradients stay local (the sum over this rank's
// share), as torch's, for DDP to reduce with every other gradient.
// Eval mode (with running statistics), and a group of one rank, run the plain
// BatchNorm and communicate nothing.
//
// The layer lives in dist, not nn (DESIGN.md §1: nn is below dist). It is an
// nn::BatchNorm2d (BatchNorm1d for SyncBatchNorm1d), so a model that holds its
// norms as std::shared_ptr<nn::BatchNorm2d> (the zoo's ResNet) can hold one, and
// its state_dict keys are BatchNorm2d's. It prints as the BatchNorm it derives
// from plus ", process_group=..." (Module::type_name is fixed by nn).
#include <memory>
#include <string>

#include "kiln/dist/process_group.h"
#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"

namespace kiln::dist {

/// Input [N, C, H, W]. `group` null: dist::world(), looked up at each forward.
class SyncBatchNorm : public nn::BatchNorm2d {
 public:
  explicit SyncBatchNorm(nn::BatchNormOptions o, ProcessGroupPtr group = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const ProcessGroupPtr& process_group() const { return group_; }

 private:
  ProcessGroupPtr group_;
};

/// Input [N, C] or [N, C, L]; otherwise as SyncBatchNorm.
class SyncBatchNorm1d : public nn::BatchNorm1d {
 public:
  explicit SyncBatchNorm1d(nn::BatchNormOptions o, ProcessGroupPtr group = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const ProcessGroupPtr& process_group() const { return group_; }

 private:
  ProcessGroupPtr group_;
};

/// As torch.nn.SyncBatchNorm.convert_sync_batchnorm: returns `module` with
/// every BatchNorm2d (and BatchNorm1d) in it, recursively, replaced by a
/// SyncBatchNorm (SyncBatchNorm1d) on `group` (null: the world) that shares
/// its parameters and buffers (the same tensors, so an optimizer built before
/// keeps working) and its training mode; `module` itself when it is a
/// BatchNorm is replaced by the returned one. Children are replaced in their
/// parent's registry; the zoo's ResNet and BasicBlock, which also keep typed
/// pointers to their norms, get those pointers updated. Any other parent that
/// keeps such a pointer would still call the old module: each replaced norm
/// is therefore left with a forward pre-hook that throws a ValueError naming
/// it, so a missed replacement fails loudly instead of silently not syncing.
std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module, ProcessGroupPtr group = nullptr);

}  // namespace kiln::dist
