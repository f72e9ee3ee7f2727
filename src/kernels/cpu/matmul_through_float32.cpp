// A bfloat16 product on a CPU where oneDNN has no bfloat16 kernel (AVX2-only
// x86: oneDNN 2.6 creates no bfloat16 primitive there, not even a reference
// one): the operands are widened to float32, the float32 product runs, and c
// is rounded to bfloat16 once (Note [Kernels without AVX-512] in
// docs/decisions.md).
//
// That is the arithmetic of oneDNN's bfloat16 kernels (float32 sums of exact
// bf16 x bf16 products, the bias, epilogue and addend applied in float32,
// one rounding at the store), so a result differs from theirs only by the
// order of the sums; torch's CPU fallback for bfloat16 does the same.

#include "dnnl_common.h"
#include "elementwise_math.h"
#include "kiln/core/half.h"
#include "kiln/core/parallel.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::dnnl_detail {

namespace {

constexpr int64_t kRowGrain = 64;  // rows of a widening or rounding pass per thread at least

// An operand's [outer, batch, rows, cols] elements widened into `out` in the
// order they lie: row-major, or column-major where the source's columns are
// contiguous (a transposed view, as a weight gradient's dYᵀ). Read across its
// rows, a transposed operand costs a cache line per element. A broadcast batch
// (stride 0) is copied out whole. Returns the float32 operand over `out`.
MatrixOperand widen_operand(const MatrixOperand& o, int64_t outer, int64_t batch, int64_t rows, int64_t cols,
                            float* out) {
  const bool by_columns = o.stride[2] != 1 && o.stride[1] == 1;
  const int64_t lines = by_columns ? cols : rows, len = by_columns ? rows : cols;
  const int64_t line_stride = by_columns ? o.stride[2] : o.stride[1], step = by_columns ? o.stride[1] : o.stride[2];
  const auto* base = static_cast<const BFloat16*>(o.data);
  parallel_for(outer * batch * lines, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t i = r % lines, bi = (r / lines) % batch, oi = r / (lines * batch);
      const BFloat16* src = base + oi * o.outer_stride + bi * o.stride[0] + i * line_stride;
      float* dst = out + r * len;
      if (step == 1) {
        vm::bf16_to_float_row(dst, src, len);
      } else {
        for (int64_t j = 0; j < len; ++j) dst[j] = static_cast<float>(src[j * step]);
      }
    }
  });
  const int64_t size = rows * cols;
  if (by_columns) return MatrixOperand{out, {size, 1, rows}, batch * size};
  return MatrixOperand{out, {size, cols, 1}, batch * size};
}

void widen_contiguous(const void* src, int64_t n, float* out) {
  const auto* s = static_cast<const BFloat16*>(src);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(s[i]);
}

}  // namespace

void matmul_through_float32(const MatmulArgs& g) {
  KILN_ASSERT(g.dtype == kBFloat16, "matmul_through_float32: expected a bfloat16 product");
  const int64_t products = g.outer * g.batch;
  const size_t a_n = static_cast<size_t>(products * g.m * g.k), b_n = static_cast<size_t>(products * g.k * g.n);
  const size_t c_n = g.float_c ? 0 : static_cast<size_t>(products * g.m * g.n);
  const size_t bias_n = g.bias ? static_cast<size_t>(g.n) : 0, add_n = g.addend ? static_cast<size_t>(g.m * g.n) : 0;
  ScratchBlock block(align64(a_n * 4) + align64(b_n * 4) + align64(c_n * 4) + align64(bias_n * 4) + align64(add_n * 4));
  char* p = block.data();
  auto carve = [&p](size_t n) {
    auto* f = reinterpret_cast<float*>(p);
    p += align64(n * 4);
    return f;
  };
  float* a = carve(a_n);
  float* b = carve(b_n);
  float* c = carve(c_n);
  float* bias = carve(bias_n);
  float* addend = carve(add_n);

  const MatrixOperand wide_a = widen_operand(g.a, g.outer, g.batch, g.m, g.k, a);
  const MatrixOperand wide_b = widen_operand(g.b, g.outer, g.batch, g.k, g.n, b);
  if (g.bias) widen_contiguous(g.bias, g.n, bias);
  if (g.addend) widen_contiguous(g.addend, g.m * g.n, addend);

  MatmulArgs h = g;
  h.dtype = kFloat32;
  h.float_c = false;
  h.a = wide_a;
  h.b = wide_b;
  h.bias = g.bias ? bias : nullptr;
  h.addend = g.addend ? addend : nullptr;
  if (g.float_c) {
    matmul(h);  // c is float32 already, with g's strides
    return;
  }
  h.c = c;
  h.c_stride[0] = h.c_stride[1] = 0;
  h.c_outer_stride = 0;
  matmul(h);

  auto* out = static_cast<BFloat16*>(g.c);
  parallel_for(products * g.m, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t i = r % g.m, bi = (r / g.m) % g.batch, oi = r / (g.m * g.batch);
      BFloat16* dst = out + oi * g.c_outer() + bi * g.c_batch_stride() + i * g.c_row_stride();
      vm::float_to_bf16_row(dst, c + r * g.n, g.n);
    }
  });
}

}  // namespace kiln::kernels::dnnl_detail
