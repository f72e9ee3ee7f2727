// Training-mode batch normalisation as one op (torch's native_batch_norm with
// training=True): per-channel statistics over every dim but 1, normalise,
// scale and shift, with a backward node of two passes. nn::BatchNorm1d/2d use
// it in training mode for float32 and float64, and for channels-last bf16
// (a conv's output under autocast) with float32 parameters and statistics,
// as PyTorch's CPU kernel; other dtypes keep the composite of elementwise ops
// and reductions.
#pragma once

#include <source_location>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// What batch_norm_train returns: the output, and the batch's per-channel
/// mean and biased variance (no gradient; for the running statistics).
struct BatchNormResult {
  Tensor output, mean, var;
};

/// Whether batch_norm_train takes these operands: x float32 or float64 with
/// at least 2 dims, or bf16 4-dim channels-last; weight and bias undefined or
/// [C] of stat_dtype(x).
bool batch_norm_train_supported(const Tensor& x, const Tensor& weight, const Tensor& bias);

/// The dtype of the statistics (mean, var), weight, bias and their
/// gradients: x's own, or float32 for bf16 x, whose output and input gradient
/// stay bf16 while every sum runs in float32 or wider.
DType stat_dtype(const Tensor& x);

/// y = (x - mean) / sqrt(var + eps) * weight + bias over channel dim 1, mean
/// and var (biased) taken over the other dims. Differentiable in x, weight and
/// bias (NativeBatchNormBackward0); double backward goes through the
/// composite formula, so gradients of any order follow.
BatchNormResult batch_norm_train(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                 std::source_location loc = std::source_location::current());

/// relu(batch_norm_train(x, ...).output) with the same values and gradients
/// (mean and var as batch_norm_train's). For a channels-last x (a conv's
/// output) the ReLU runs inside the batch norm's passes, forward and backward
/// (one node, NativeBatchNormReluBackward0); other layouts run the two ops.
BatchNormResult batch_norm_relu_train(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                      std::source_location loc = std::source_location::current());

/// The running statistics' update of a training step, in place and outside
/// the graph: running_mean = (1 - momentum) * running_mean + momentum * mean
/// and running_var likewise with var * n / (n - 1) (torch's unbiased
/// estimate; n values per channel), the arithmetic of `mul_(1 - momentum)
/// .add_(x, momentum)` (equal to its last bit or two). One pass over the [C]
/// vectors instead of seven ops per layer.
void batch_norm_update_running_stats(Tensor& running_mean, Tensor& running_var, const Tensor& mean, const Tensor& var,
                                     double momentum, int64_t n);

/// relu(batch_norm_train(x, ...).output + residual), a residual block's end,
/// the same values and gradients (residual's gradient too). Fused into the
/// batch norm's passes (NativeBatchNormAddReluBackward0) when x and residual
/// are channels-last of one shape and dtype; otherwise the three ops.
BatchNormResult batch_norm_add_relu_train(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                          const Tensor& residual, double eps,
                                          std::source_location loc = std::source_location::current());

}  // namespace kiln::ops
