// gradcheck / gradgradcheck, as torch.autograd: compares the gradients
// autograd computes with float64 central differences.
//
// Tolerances (defaults, as PyTorch's): eps = 1e-6 for the finite
// difference, and |analytical - numerical| <= atol + rtol * |numerical|
// with atol = 1e-5, rtol = 1e-3, element by element of the Jacobian.
//
// Fast mode (torch's fast_mode=True): instead of the whole Jacobian J of
// each (output, input) pair, compares the scalar u^T J v for random unit
// vectors u (per output) and v (per input): numerically from the directional
// derivative (f(x + eps v) - f(x - eps v)) / 2 eps dotted with u, analytically
// from one backward with grad_outputs u dotted with v. Cost: 2 forwards per
// input and 1 backward per output, whatever their sizes. The atol is scaled
// by sum(u) * sum(v), as torch does, since the scalar sums that many entries.
//
// It keeps torch's name (kiln::autograd::gradcheck) but lives in the ops
// layer: it draws random inputs and perturbs them with ops, which autograd,
// below ops, cannot call (docs/architecture.md).
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
  /// Compare u^T J v for random u, v instead of the full Jacobian (see above).
  bool fast_mode = false;
  /// Seed of fast mode's random u and v (and of gradgradcheck's v).
  uint64_t seed = 0;
};

using DifferentiableFn = std::function<TensorList(const TensorList&)>;

/// Checks d(fn)/d(inputs) for every input that requires grad (those must be float64).
bool gradcheck(const DifferentiableFn& fn, const TensorList& inputs, const GradcheckOptions& opts = {});

/// Checks second derivatives: gradcheck of (inputs, v) -> grad(fn(inputs), inputs, v, create_graph).
/// First checks that those create_graph gradients equal the plain backward's (within atol/rtol), and are
/// defined wherever the plain ones are: the gradcheck alone sees only their derivatives, so a
/// create_graph branch that drops an input's gradient at every point would pass it.
bool gradgradcheck(const DifferentiableFn& fn, const TensorList& inputs, const GradcheckOptions& opts = {},
                   uint64_t seed = 0);

}  // namespace kiln::autograd
