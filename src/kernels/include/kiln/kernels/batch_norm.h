// BatchNorm's training-mode kernels (kernels layer): the forward in two
// passes over x (per-channel statistics, then normalise), the backward in two
// passes (per-channel sums of dy and dy * (x - mean), then dx), instead of
// the composite's dozen full-size elementwise and reduction passes.
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln::kernels {

/// x viewed as [n, c, inner]: dim 0, the channel dim 1, and the rest.
struct BatchNormShape {
  int64_t n = 0, c = 0, inner = 0;
  /// The arrays are [n, inner, c] in memory (channels-last) instead of [n, c, inner].
  bool channels_last = false;
  /// A ReLU fused after the affine step (channels-last only): the forward
  /// writes relu(y); the backward takes dy of that ReLU's output and masks it
  /// by recomputing y > 0 from x (the same rounding as the forward), so the
  /// ReLU costs no pass of its own either way.
  bool relu = false;
};

/// Float32 and float64 (dtype `dt`); every array contiguous, all of dtype `dt`.
/// bf16 (channels-last only) is mixed, as PyTorch's CPU batch norm: the
/// activations (x, y, residual; dy, dx, dresidual) are bf16, while weight, bias,
/// mean, invstd, var, dweight and dbias are float32, and all arithmetic is
/// float32 (sums in double), each activation rounded once when stored.
/// In: x [n, c, inner]; weight, bias [c] or null (1 and 0). Out: y [n, c, inner];
/// mean, invstd = 1 / sqrt(var + eps) and the biased variance var, each [c].
/// Sums accumulate in double; y = (x - mean) * (invstd * weight) + bias.
/// With s.relu, `residual` (null, or [n, c, inner] in x's layout) is added
/// before the ReLU: y = relu(batch_norm(x) + residual), a residual block's end.
void batch_norm_train_forward(DType dt, BatchNormShape s, const void* x, const void* weight, const void* bias,
                              double eps, void* y, void* mean, void* invstd, void* var, const void* residual = nullptr);

/// In: dy and x [n, c, inner]; mean, invstd (the forward's) and weight [c]
/// (null: 1); bias [c] (null: 0), read only with s.relu. Out, each optional
/// (null: not wanted): dx [n, c, inner], dweight = sum(dy * xhat) and
/// dbias = sum(dy), each [c].
/// With a residual (s.relu), dresidual (optional) receives the gradient that
/// reaches it: dy where the forward's relu input was positive, else 0.
void batch_norm_train_backward(DType dt, BatchNormShape s, const void* dy, const void* x, const void* mean,
                               const void* invstd, const void* weight, void* dx, void* dweight, void* dbias,
                               const void* bias = nullptr, const void* residual = nullptr, void* dresidual = nullptr);

}  // namespace kiln::kernels
