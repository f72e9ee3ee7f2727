#pragma once
// Internal to src/dist: DDP's comparisons across ranks of the model (at wrap
// time) and of the communication hook (at the first synced backward).
#include <string>
#include <utility>
#include <vector>

#include "kiln/dist/ddp.h"
#include "kiln/dist/process_group.h"

namespace kiln::dist::detail {

/// Gathers every rank's (name, dtype, shape) of `params` then `buffers` and
/// throws DistributedError on every rank, naming the first tensor that differs
/// and the ranks that differ, when the ranks do not hold the same model.
void verify_same_model(ProcessGroup& group, const std::vector<std::pair<std::string, Tensor>>& params,
                       const std::vector<std::pair<std::string, Tensor>>& buffers);

/// Gathers every rank's communication hook (and PowerSGD's rank and start)
/// and throws DistributedError on every rank, naming each rank's, when they
/// differ: ranks that exchange buckets differently pair unrelated bytes.
void verify_same_hook(ProcessGroup& group, CommHook hook, const PowerSGDOptions& powersgd);

}  // namespace kiln::dist::detail
