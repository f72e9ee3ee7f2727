#pragma once
// The global gradient norm over gradients that are sharded across the ranks of
// a group (ZeRO-1/2's pieces, FSDP's flat shards), and clipping by it: one
// algorithm for both, so that their norms are the same as one process's
// optim::clip_grad_norm_ over the full gradients to the last float32 bit
// wherever the partial sums allow (docs/distributed.md).
#include <cstddef>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"

namespace kiln::dist::detail {

/// This rank's part of one parameter's gradient: a contiguous 1-D float32
/// tensor (undefined: this rank has no gradient for that piece).
struct GradPiece {
  size_t param = 0;  // index among the `num_params` parameters, the same on every rank
  Tensor grad;
};

/// A collective: each rank reduces its pieces per parameter (sum of squares or
/// max |g|, in double), the partial results are all-gathered and combined in
/// rank order, so every rank gets the same per-parameter norms; these are
/// rounded to float32 and combined as optim::clip_grad_norm_ does. Scales every
/// piece by min(1, max_norm / (total + 1e-6)). `who` prefixes errors. Returns
/// the total norm (0 when no rank has a gradient).
double clip_sharded_grad_norm(ProcessGroup& group, size_t num_params, const std::vector<GradPiece>& pieces,
                              double max_norm, double norm_type, const std::string& who);

}  // namespace kiln::dist::detail
