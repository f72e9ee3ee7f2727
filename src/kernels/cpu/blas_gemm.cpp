// gemm on OpenBLAS (float32, float64) and a plain loop (integers), and the
// BLAS side of kernels::matmul.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kiln/core/capture.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

namespace {

// Integer gemm, i-p-j order so the innermost loop runs along a row of b and c
// (vectorises when b is row-major). Arithmetic wraps modulo 2^bits, as
// torch's integer mm does, done in unsigned types to stay defined behaviour.
template <typename T>
void int_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
              bool accumulate, T* c, int64_t ldc) {
  using U = std::make_unsigned_t<T>;
  parallel_for(m, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, n * k)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      U* crow = reinterpret_cast<U*>(c + i * ldc);
      if (!accumulate) std::fill(crow, crow + n, U{0});
      for (int64_t p = 0; p < k; ++p) {
        const U aip = static_cast<U>(ta ? a[p * lda + i] : a[i * lda + p]);
        if (aip == 0) continue;
        if (!tb) {
          const U* brow = reinterpret_cast<const U*>(b + p * ldb);
          for (int64_t j = 0; j < n; ++j) crow[j] = static_cast<U>(crow[j] + aip * brow[j]);
        } else {
          for (int64_t j = 0; j < n; ++j) crow[j] = static_cast<U>(crow[j] + aip * static_cast<U>(b[j * ldb + p]));
        }
      }
    }
  });
}

// OpenBLAS runs float32 and float64; int_gemm the integers.
constexpr DTypeSet kGemmTypes{kFloat32, kFloat64, kInt64, kInt32, kUInt8};

}  // namespace

void gemm(DType dtype, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b,
          int64_t ldb, bool accumulate, void* c, int64_t ldc) {
  KILN_CAPTURE_KERNEL("gemm", gemm(dtype, ta, tb, m, n, k, a, lda, b, ldb, accumulate, c, ldc));
  if (m <= 0 || n <= 0) return;
  const auto cta = ta ? CblasTrans : CblasNoTrans;
  const auto ctb = tb ? CblasTrans : CblasNoTrans;
  const bool done = visit_dtype<kGemmTypes>(dtype, "gemm", [&]<typename T>() {
    if constexpr (std::is_same_v<T, float>) {
      if (k == 0) return false;
      cblas_sgemm(CblasRowMajor, cta, ctb, static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k),
                  1.0f, static_cast<const float*>(a), static_cast<blasint>(lda), static_cast<const float*>(b),
                  static_cast<blasint>(ldb), accumulate ? 1.0f : 0.0f, static_cast<float*>(c),
                  static_cast<blasint>(ldc));
    } else if constexpr (std::is_same_v<T, double>) {
      if (k == 0) return false;
      cblas_dgemm(CblasRowMajor, cta, ctb, static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k),
                  1.0, static_cast<const double*>(a), static_cast<blasint>(lda), static_cast<const double*>(b),
                  static_cast<blasint>(ldb), accumulate ? 1.0 : 0.0, static_cast<double*>(c),
                  static_cast<blasint>(ldc));
    } else {
      int_gemm(ta, tb, m, n, k, static_cast<const T*>(a), lda, static_cast<const T*>(b), ldb, accumulate,
               static_cast<T*>(c), ldc);
    }
    return true;
  });
  if (done) return;
  // k == 0 on the BLAS types: BLAS may skip touching c at all; make the result explicit.
  if (!accumulate) {
    const int64_t es = element_size(dtype);
    for (int64_t i = 0; i < m; ++i) std::memset(static_cast<char*>(c) + i * ldc * es, 0, static_cast<size_t>(n * es));
  }
}

void blas_matmul(const MatmulArgs& g) {
  KILN_CAPTURE_KERNEL("blas_matmul", blas_matmul(g));
  const int64_t es = element_size(g.dtype);
  const BlasLayout la = blas_layout(g.m, g.k, g.a.stride[1], g.a.stride[2]);
  const BlasLayout lb = blas_layout(g.k, g.n, g.b.stride[1], g.b.stride[2]);
  KILN_ASSERT(la.ok && lb.ok, "blas_matmul: operands need a unit stride (the ops layer copies them)");
  const int64_t mn = g.m * g.n, ldc = g.c_row_stride();
  auto one = [&](int64_t bi) {
    const char* a = static_cast<const char*>(g.a.data) + bi * g.a.stride[0] * es;
    const char* b = static_cast<const char*>(g.b.data) + bi * g.b.stride[0] * es;
    char* c = static_cast<char*>(g.c) + bi * g.c_batch_stride() * es;
    if (g.bias) {
      for (int64_t i = 0; i < g.m; ++i) std::memcpy(c + i * ldc * es, g.bias, static_cast<size_t>(g.n * es));
    }
    gemm(g.dtype, la.trans, lb.trans, g.m, g.n, g.k, a, la.ld, b, lb.ld, g.bias != nullptr, c, ldc);
  };
  // Many small matrices: one per thread (BLAS runs single-threaded inside an
  // OpenMP region). Few large ones: one after another, each threaded by BLAS.
  const int64_t flops = std::max<int64_t>(1, mn * std::max<int64_t>(g.k, 1));
  if (g.batch > 1 && flops < (int64_t{1} << 18)) {
    parallel_for(g.batch, std::max<int64_t>(1, (int64_t{1} << 18) / flops), [&](int64_t b0, int64_t b1) {
      for (int64_t bi = b0; bi < b1; ++bi) one(bi);
    });
  } else {
    for (int64_t bi = 0; bi < g.batch; ++bi) one(bi);
  }
}

bool blas_uses_openmp() { return openblas_get_parallel() == 2; }

}  // namespace kiln::kernels
