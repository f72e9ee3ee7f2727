// Layer normalisation as one op (torch.nn.functional.layer_norm), so that a
// transformer's many LayerNorms cost one pass over the activation forward and
// one backward instead of the eight-odd passes of the composite of
// elementwise ops and reductions. nn::LayerNorm calls it; it is the op to use
// for a layer norm outside a module.
#pragma once

#include <cstdint>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// y = (x - mean) / sqrt(var + eps) * weight + bias, mean and var (biased)
/// taken over the trailing dims given by normalized_shape, which x must end
/// in. weight and bias are undefined (no affine step) or of normalized_shape;
/// either may be given alone. Differentiable to any order in x, weight and
/// bias: float32/float64 with both weight and bias run the fused kernels
/// (a FusedLayerNormBackward node; under create_graph its backward
/// differentiates the composite), everything else the composite of kiln ops.
Tensor layer_norm(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight = {}, const Tensor& bias = {},
                  double eps = 1e-5);

namespace detail {
/// The composite of kiln ops that layer_norm takes for every case the fused
/// kernels do not, over the last n_dims dims; exposed for the tests that
/// check both paths against each other and to second order.
Tensor layer_norm_composite(const Tensor& x, int64_t n_dims, const Tensor& weight, const Tensor& bias, double eps);
}  // namespace detail

}  // namespace kiln::ops
