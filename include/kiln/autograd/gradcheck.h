// gradcheck / gradgradcheck, as torch.autograd: compares the gradients
// autograd computes with float64 central differences.
//
// Tolerances (defaults, as PyTorch's): eps = 1e-6 for the finite
// difference, and |analytical - numerical| <= atol + rtol * |numerical|
// with atol = 1e-5, rtol = 1e-3, element by element of the Jacobian.
#pragma once

#include <functional>
#include <string>

#include "kiln/core/tensor.h"

namespace kiln::autograd {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
  /// Throw a ValueError describing the worst mismatch (true) or return false.
  bool raise = true;
};

using DifferentiableFn = std::function<TensorList(const TensorList&)>;

/// Checks d(fn)/d(inputs) for every input that requires grad (those must be float64).
bool gradcheck(const DifferentiableFn& fn, const TensorList& inputs, const GradcheckOptions& opts = {});

/// Checks second derivatives: gradcheck of (inputs, v) -> grad(fn(inputs), inputs, v, create_graph).
bool gradgradcheck(const DifferentiableFn& fn, const TensorList& inputs, const GradcheckOptions& opts = {},
                   uint64_t seed = 0);

}  // namespace kiln::autograd
