// Threshold kernels (kernels layer): ReLU's backward as one pass, instead of
// a compare into a bool tensor followed by a general where (which read and
// wrote three tensors and a mask, ~50x slower than the forward).
#pragma once

#include "kiln/core/dtype.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

/// Operand 0 = (operand 2 <= threshold) ? 0 : operand 1, all of dtype `dt`
/// (torch's threshold_backward: operand 1 the incoming gradient, operand 2 the
/// saved input or output). `threshold` points at a value of dtype `dt`. A NaN
/// in operand 2 passes the gradient, as in torch. Any dtype but bool.
void threshold_backward(const LoopSpec& s, DType dt, const void* threshold);

}  // namespace kiln::kernels
