// Copy with dtype conversion and fill, over strided operands (kernels layer).
#pragma once

#include "kiln/core/dtype.h"
#include "kiln/core/scalar.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

/// Operand 0 (dtype `out`) = operand 1 (dtype `in`) converted as static_cast
/// (floats to ints truncate toward zero; anything nonzero to bool is true).
void copy_cast(const LoopSpec& s, DType out, DType in);
/// Operand 0 (dtype `dt`) = value.
void fill(const LoopSpec& s, DType dt, const Scalar& value);

}  // namespace kiln::kernels
