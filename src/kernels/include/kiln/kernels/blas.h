// General matrix multiply on the BLAS side of the kernels layer: OpenBLAS
// (the OpenMP build, so it shares kiln's thread pool) for float32/float64,
// and a plain cache-friendly loop for the integer types torch multiplies on
// CPU. kernels::matmul routes float64 and integers here; tests use the
// float32 path as an independent reference for oneDNN.
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels {

/// How BLAS (and oneDNN's fast matmul paths) can read a strided [rows, cols]
/// matrix: row-major with leading dim `ld` (trans = false), column-major with
/// leading dim `ld` (trans = true), or not at all (ok = false: no unit stride,
/// or rows overlap), in which case the caller copies it to contiguous.
/// Strides of size-1 dims do not matter and are ignored.
struct BlasLayout {
  bool ok = false;
  bool trans = false;
  int64_t ld = 0;
};

inline BlasLayout blas_layout(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  const int64_t r = rows > 1 ? rows : 1, c = cols > 1 ? cols : 1;
  if ((cols <= 1 || col_stride == 1) && (rows <= 1 || row_stride >= c)) {
    return {true, false, rows <= 1 ? c : row_stride};
  }
  if ((rows <= 1 || row_stride == 1) && (cols <= 1 || col_stride >= r)) {
    return {true, true, cols <= 1 ? r : col_stride};
  }
  return {};
}

/// Row-major c[m, n] = op(a)[m, k] · op(b)[k, n] (+ c when accumulate), where
/// op transposes when asked. a, b, c have leading dims lda, ldb, ldc (in
/// elements), as cblas_?gemm with CblasRowMajor. dtype: float32, float64,
/// int64, int32, uint8.
void gemm(DType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
          const void* b, int64_t ldb, bool accumulate, void* c, int64_t ldc);

/// kernels::matmul on the BLAS side (float32, float64, integers).
void blas_matmul(const MatmulArgs& args);

/// True when the linked OpenBLAS is the OpenMP build (it then shares kiln's
/// OpenMP runtime and follows kiln::set_num_threads; DESIGN.md §4).
bool blas_uses_openmp();

}  // namespace kiln::kernels
