// Layer normalisation as one op (torch.nn.functional.layer_norm), so that a
// transformer's many LayerNorms cost one pass over the activation forward and
// one backward instead of the eight-odd passes of the composite of
// elementwise ops and reductions. nn::LayerNorm calls it; it is the op to use
// for a layer norm outside a module.
#pragma once

#include <cstdint>
#include <source_location>

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
                  double eps = 1e-5, std::source_location loc = std::source_location::current());

/// layer_norm(x, ...).to(dtype) in one op: the same bits forward and backward
/// (the kernel rounds each float32 output as the cast would, and widens a
/// bf16 gradient exactly), without the cast's extra pass over the activation
/// and its gradient. Fused for float32 x into bfloat16; other pairs run
/// layer_norm and then the cast. Autocast's callers use it where a norm's
/// output only feeds a lower-precision product (Note [Layer norm into a product]).
Tensor layer_norm_to(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight, const Tensor& bias,
                     double eps, DType dtype, std::source_location loc = std::source_location::current());

namespace detail {
/// The composite of kiln ops that layer_norm takes for every case the fused
/// kernels do not, over the last n_dims dims; exposed for the tests that
/// check both paths against each other and to second order.
Tensor layer_norm_composite(const Tensor& x, int64_t n_dims, const Tensor& weight, const Tensor& bias, double eps);
}  // namespace detail

}  // namespace kiln::ops
