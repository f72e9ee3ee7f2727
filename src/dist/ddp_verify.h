#pragma once
// Internal to src/dist: DDP's wrap-time comparison of the model across ranks.
#include <string>
#include <utility>
#include <vector>

#include "kiln/dist/process_group.h"

namespace kiln::dist::detail {

/// Gathers every rank's (name, dtype, shape) of `params` then `buffers` and
/// throws DistributedError on every rank, naming the first tensor that differs
/// and the ranks that differ, when the ranks do not hold the same model.
void verify_same_model(ProcessGroup& group, const std::vector<std::pair<std::string, Tensor>>& params,
                       const std::vector<std::pair<std::string, Tensor>>& buffers);

}  // namespace kiln::dist::detail
