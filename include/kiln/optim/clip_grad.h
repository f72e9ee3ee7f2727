// Gradient clipping (torch.nn.utils.clip_grad_norm_ / clip_grad_value_) over
// named parameters (what Module::named_parameters() returns) or plain tensors.
// Parameters without a gradient are skipped.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "kiln/optim/optimizer.h"

namespace kiln::optim {

inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

/// Scales every gradient by min(1, max_norm / (total_norm + 1e-6)) in place and
/// returns the total norm (the norm of the per-parameter norms; norm_type may be
/// kInfNorm, 0 counts nonzeros), computed and rounded in the gradients' dtype as
/// torch does. With error_if_nonfinite, a NaN/Inf total norm throws ValueError
/// naming the first parameter whose gradient norm is non-finite, and nothing is scaled.
double clip_grad_norm_(const NamedParams& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

namespace detail {
/// Σ x² in double, in the order clip_grad_norm_'s 2-norm sums it (sixteen
/// lanes, folded in a fixed order), for the sharded norms to sum alike.
double sum_of_squares(const float* x, int64_t n);
}  // namespace detail

/// Clamps every gradient to [-clip_value, clip_value] in place.
void clip_grad_value_(const NamedParams& params, double clip_value);
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

}  // namespace kiln::optim
