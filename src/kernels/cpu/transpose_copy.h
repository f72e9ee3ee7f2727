// A transposing copy of a row-major matrix, for kernels that want an operand
// in the other order than the one they were given (dnnl_matmul.cpp: a
// product's transposed first operand, Note [Transposed first operands]).
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln::kernels::detail {

/// dst [cols, rows] (contiguous) = the transpose of src [rows, cols] (row
/// stride ld >= cols), for 4-byte and 2-byte dtypes; split across threads by
/// rows of dst, so each thread writes whole lines of its own.
void transpose_copy(DType dt, const void* src, int64_t ld, int64_t rows, int64_t cols, void* dst);

}  // namespace kiln::kernels::detail
