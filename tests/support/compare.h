// Comparing a kiln result with a reference (usually the PyTorch oracle's):
// same shape, same dtype, values within tolerance, NaNs in the same places,
// integers and bools exact. On mismatch the message names the worst element.
#pragma once

#include <string>

#include "kiln/core/tensor.h"

namespace kiln::test {

struct Comparison {
  bool ok = true;
  std::string message;  // empty when ok
};

/// |got - want| <= atol + rtol * |want| elementwise; infinities must match
/// exactly, NaN only NaN. Integers and bools compare exactly whatever the
/// tolerance. With check_dtype false, only values are compared (a Python
/// number against a 0-dim tensor), and shapes need only agree in numel.
Comparison compare_tensors(const Tensor& got, const Tensor& want, double rtol, double atol, bool check_dtype = true);

}  // namespace kiln::test
