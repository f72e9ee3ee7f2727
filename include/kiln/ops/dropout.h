// Dropout in training as one op (torch.nn.functional.dropout with training
// on; torch's native_dropout): nn::Dropout and scaled_dot_product_attention's
// attention dropout call it.
#pragma once

#include <source_location>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// x * keep / (1 - p), keep drawn as rand(x.sizes()) < 1 - p from the default
/// generator: the values, gradients and generator advance of the composite
/// `x * rand(...).lt(1 - p).to(x.dtype()).mul(1 / (1 - p))`, bit for bit.
/// Requires 0 < p < 1 (nn::functional::dropout handles 0, 1 and eval mode).
/// A contiguous float32 x runs one pass (a NativeDropoutBackward0 node keeping
/// a byte per element); other dtypes and layouts run the composite.
Tensor dropout_train(const Tensor& x, double p, std::source_location loc = std::source_location::current());

}  // namespace kiln::ops
