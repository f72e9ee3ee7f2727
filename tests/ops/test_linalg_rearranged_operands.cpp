// Products that rearrange an operand before oneDNN reads it, on two threads:
// a transposed first operand copied row-major (Note [Transposed first
// operands] in src/kernels/cpu/dnnl_matmul.cpp) and b packed into oneDNN's
// layout first (Note [Packing b first on two threads]).
//
// The turned copy moves every element's bits (both element sizes, edges that
// fill no 16 x 16 block, a row stride wider than the row, 1 and 2 threads), and
// a weight-gradient-shaped product that takes the copy gives what the same
// product with a stored row by row gives, bit for bit (without the copy the
// strided float32 case differs in its last bits, so the test sees the path).
// Products that pack b first (b plain or transposed, with a bias, a GELU
// epilogue, an addend) agree with a float64 sum, and with the same product
// on one thread, which does not pack.
//
// Shares of a product on one thread each (Note [Shares of a product on one
// thread each]): row-split products (plain and strided a, a c wider than its
// rows, bias, GELU, addend, a row count that is no multiple of 16) and
// depth-split bf16 weight gradients (a depth that is no multiple of 32, a
// strided a) agree with a float64 sum, on two and three threads; the row
// split gives what one thread gives, bit for bit (each row of c is summed by
// the same kernel), and the depth split gives the same bits on every call.
//
// Tolerances: float32, k fused multiply-adds each rounding once, so
// |got - ref| <= (k + 1) 2^-23 sum_p |a_ip||b_pj|; bf16, products exact in
// float32 and summed in float32, then rounded once: one bf16 ulp of |ref|
// (2^-8) plus the float32 sum's (k + 1) 2^-23 sum_p |a_ip||b_pj|. Against one
// thread (the epilogue and addend cases): twice those bounds, for two results
// each within one of them, taken over float64 sums of |a||b|.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/transpose_copy.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"

using namespace kiln;

namespace {

struct ThreadCount {
  int before = get_num_threads();
  explicit ThreadCount(int n) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(before); }
};

template <typename W>
void check_turn(int64_t rows, int64_t cols, int64_t ld, int threads) {
  const ThreadCount tc(threads);
  std::vector<W> src(static_cast<size_t>(rows * ld)), dst(static_cast<size_t>(rows * cols), W{0});
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (W& w : src) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w = static_cast<W>(x);
  }
  const DType dt = sizeof(W) == 4 ? kFloat32 : kBFloat16;
  kernels::detail::transpose_copy(dt, src.data(), ld, rows, cols, dst.data());
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_EQ(dst[c * rows + r], src[r * ld + c])
          << "element (" << r << ", " << c << ") of a [" << rows << ", " << cols << "] source, ld " << ld << ", "
          << threads << " threads";
}

TEST(TransposeCopy, MovesEveryElementsBits) {
  const int64_t shapes[][3] = {{37, 45, 50}, {64, 32, 32}, {33, 17, 17}, {2048, 256, 256}, {96, 80, 128}, {5, 3, 3}};
  for (int threads : {1, 2}) {
    for (const auto& s : shapes) {
      check_turn<uint32_t>(s[0], s[1], s[2], threads);
      check_turn<uint16_t>(s[0], s[1], s[2], threads);
    }
  }
}

// a [k, m] stored row by row, read as aᵀ [m, k]; b [k, n]. Returns the worst
// |got - ref| / bound over c = aᵀ b.
double worst_against_float64(const Tensor& at, const Tensor& b, const Tensor& c, bool bf16) {
  const Tensor a64 = at.to(kFloat64).contiguous(), b64 = b.to(kFloat64).contiguous();
  const Tensor c64 = c.to(kFloat64).contiguous();
  const int64_t m = at.size(0), k = at.size(1), n = b.size(1);
  const double* pa = a64.data_ptr<double>();
  const double* pb = b64.data_ptr<double>();
  const double* pc = c64.data_ptr<double>();
  double worst = 0;
  std::vector<double> ref(static_cast<size_t>(n)), mag(static_cast<size_t>(n));
  for (int64_t i = 0; i < m; ++i) {
    std::fill(ref.begin(), ref.end(), 0.0);
    std::fill(mag.begin(), mag.end(), 0.0);
    for (int64_t p = 0; p < k; ++p) {
      const double av = pa[i * k + p];
      for (int64_t j = 0; j < n; ++j) {
        ref[j] += av * pb[p * n + j];
        mag[j] += std::fabs(av * pb[p * n + j]);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const double bound = (bf16 ? std::ldexp(std::fabs(ref[j]), -8) : 0.0) + (k + 1) * std::ldexp(mag[j], -23);
      worst = std::max(worst, std::fabs(pc[i * n + j] - ref[j]) / bound);
    }
  }
  return worst;
}

TEST(TransposedFirstOperand, AWeightGradientShapedProductMatchesTheRowMajorOneAndFloat64) {
  // k = 1024 tokens, m = 24 outputs, n = 1024 inputs: deep and wide enough for
  // the copy on two threads; a also as a view narrower than its rows (ld 40).
  const ThreadCount tc(2);
  Generator g(11);
  for (DType dt : {kFloat32, kBFloat16}) {
    const Tensor wide = randn({1024, 40}, kFloat32, &g).to(dt);
    const Tensor b = randn({1024, 1024}, kFloat32, &g).to(dt);
    for (const Tensor& a : {wide.narrow(1, 0, 24).contiguous(), wide.narrow(1, 8, 24)}) {
      const Tensor c = mm(a.t(), b);
      const Tensor rows = mm(a.t().contiguous(), b);
      ASSERT_EQ(c.dtype(), dt);
      ASSERT_EQ(std::memcmp(c.data_ptr(), rows.data_ptr(), static_cast<size_t>(c.numel() * element_size(dt))), 0)
          << "dtype " << dtype_name(dt) << ", a's row stride " << a.stride(0);
      EXPECT_LE(worst_against_float64(a.t(), b, c, dt == kBFloat16), 1.0) << "dtype " << dtype_name(dt);
    }
  }
}


TEST(PackedBFirst, WideProductsOnTwoThreadsAgreeWithFloat64AndOneThread) {
  // m = 1024 rows, n = 768 columns: many rows and wide, so two threads pack b.
  const int64_t m = 1024, n = 768, k = 96;
  Generator g(12);
  for (DType dt : {kFloat32, kBFloat16}) {
    const bool bf16 = dt == kBFloat16;
    const Tensor a = randn({m, k}, kFloat32, &g).to(dt);
    const Tensor w = randn({n, k}, kFloat32, &g).to(dt);  // b = wᵀ, as a linear's weight
    const Tensor bp = randn({k, n}, kFloat32, &g).to(dt);  // b as given, as an input gradient's W
    const Tensor bias = randn({n}, kFloat32, &g).to(dt);
    const Tensor addend = randn({m, n}, kFloat32, &g).to(dt);
    for (int variant = 0; variant < 5; ++variant) {
      // 0 b plain; 1 b transposed; 2 with a bias; 3 bias and GELU; 4 bias and an addend.
      const Tensor b = variant == 0 ? bp : w.t();
      auto run = [&](int threads) {
        const ThreadCount tc(threads);
        Tensor c = empty({m, n}, dt);
        kernels::MatmulArgs args;
        args.dtype = dt;
        args.m = m;
        args.n = n;
        args.k = k;
        args.a = {a.data_ptr(), {0, k, 1}, 0};
        args.b = {b.data_ptr(), {0, b.stride(0), b.stride(1)}, 0};
        args.c = c.data_ptr();
        if (variant >= 2) args.bias = bias.data_ptr();
        if (variant == 3) args.epilogue = kernels::MatmulEpilogue::GeluTanh;
        if (variant == 4) args.addend = addend.data_ptr();
        kernels::matmul(args);
        return c;
      };
      const Tensor two = run(2), one = run(1);
      const std::string what = std::string(dtype_name(dt)) + ", variant " + std::to_string(variant);
      // The float64 sum of a·b (+ bias): the whole result where there is no
      // epilogue or addend, and the bound's scale everywhere.
      const Tensor a64 = a.to(kFloat64), b64 = b.to(kFloat64);
      Tensor ref = mm(a64, b64), mag = mm(a64.abs(), b64.abs());
      if (variant >= 2) ref = ref + bias.to(kFloat64);
      const Tensor bound = (bf16 ? ref.abs() * std::ldexp(1.0, -8) : zeros_like(ref)) + mag * ((k + 1) * std::ldexp(1.0, -23));
      if (variant <= 2) {
        const double worst = ((two.to(kFloat64) - ref).abs() / bound).max().item<double>();
        EXPECT_LE(worst, 1.0) << what;
      }
      // GELU's slope is below 1.2 and the addend is added once more, rounded
      // once: the two results stay within twice the bound plus that rounding.
      const Tensor out = one.to(kFloat64).abs();
      const Tensor slack = bound * 2.4 + out * (bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -22));
      const double apart = ((two.to(kFloat64) - one.to(kFloat64)).abs() / slack).max().item<double>();
      EXPECT_LE(apart, 1.0) << what << ": two threads against one";
    }
  }
}

// c = a b through kernels::matmul, a [m, k] (row stride lda), b [k, n] as
// given, c [m, n] in a buffer with row stride ldc (the columns past n stay
// as they were).
Tensor run_product(const Tensor& a, int64_t m, int64_t k, const Tensor& b, int64_t n, int64_t ldc, int threads,
                   const void* bias = nullptr, const void* addend = nullptr,
                   kernels::MatmulEpilogue epilogue = kernels::MatmulEpilogue::None) {
  const ThreadCount tc(threads);
  Tensor c = full({m, ldc}, 7.0, a.dtype());
  kernels::MatmulArgs args;
  args.dtype = a.dtype();
  args.m = m;
  args.n = n;
  args.k = k;
  args.a = {a.data_ptr(), {0, a.stride(0), a.stride(1)}, 0};
  args.b = {b.data_ptr(), {0, b.stride(0), b.stride(1)}, 0};
  args.c = c.data_ptr();
  args.c_stride[1] = ldc;
  args.bias = bias;
  args.addend = addend;
  args.epilogue = epilogue;
  kernels::matmul(args);
  return c;
}

bool same_bits(const Tensor& x, const Tensor& y) {
  return x.sizes() == y.sizes() && x.dtype() == y.dtype() &&
         std::memcmp(x.contiguous().data_ptr(), y.contiguous().data_ptr(),
                     static_cast<size_t>(x.numel() * element_size(x.dtype()))) == 0;
}

TEST(SharesOnEachThread, RowSplitProductsMatchFloat64AndOneThreadBitForBit) {
  // 1637 rows (two or three shares of at least 512, no multiple of 16), n = 200 < 768.
  const int64_t m = 1637, n = 200, k = 136, ldc = 232;
  const bool avx512_core = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  Generator g(13);
  for (DType dt : {kFloat32, kBFloat16}) {
    const bool bf16 = dt == kBFloat16;
    const Tensor wide = randn({m, k + 24}, kFloat32, &g).to(dt);
    const Tensor w = randn({n, k}, kFloat32, &g).to(dt);
    const Tensor bias = randn({n}, kFloat32, &g).to(dt);
    const Tensor addend = randn({m, n}, kFloat32, &g).to(dt);
    for (int variant = 0; variant < 5; ++variant) {
      // 0 a contiguous; 1 a strided (row stride k + 24); 2 with a bias; 3 bias and GELU; 4 bias and an addend.
      const Tensor a = variant == 1 ? wide.narrow(1, 8, k) : wide.narrow(1, 0, k).contiguous();
      const Tensor b = w.t();
      const void* bp = variant >= 2 ? bias.data_ptr() : nullptr;
      const void* ap = variant == 4 ? addend.data_ptr() : nullptr;
      const auto ep = variant == 3 ? kernels::MatmulEpilogue::GeluTanh : kernels::MatmulEpilogue::None;
      const Tensor two = run_product(a, m, k, b, n, ldc, 2, bp, ap, ep);
      const Tensor three = run_product(a, m, k, b, n, ldc, 3, bp, ap, ep);
      const Tensor one = run_product(a, m, k, b, n, ldc, 1, bp, ap, ep);
      const std::string what = std::string(dtype_name(dt)) + ", variant " + std::to_string(variant);
      // The shares' bits are the whole product's on oneDNN's AVX-512 kernels
      // (the rule's premise); its AVX2 float32 kernel sums a share's rows in
      // another order than the whole's (seen on an AVX2-only EPYC, 2026-12-06),
      // where float64 alone judges.
      if (avx512_core) {
        EXPECT_TRUE(same_bits(two, one)) << what << ": two threads against one";
        EXPECT_TRUE(same_bits(three, one)) << what << ": three threads against one";
      }
      EXPECT_TRUE(same_bits(two.narrow(1, n, ldc - n), full({m, ldc - n}, 7.0, dt)))
          << what << ": the columns of c past n were written";
      if (variant <= 2) {
        const Tensor a64 = a.to(kFloat64), b64 = b.to(kFloat64);
        Tensor ref = mm(a64, b64);
        if (variant == 2) ref = ref + bias.to(kFloat64);
        const Tensor mag = mm(a64.abs(), b64.abs());
        const Tensor bound =
            (bf16 ? ref.abs() * std::ldexp(1.0, -8) : zeros_like(ref)) + mag * ((k + 1) * std::ldexp(1.0, -23));
        const double worst = ((two.narrow(1, 0, n).to(kFloat64) - ref).abs() / bound).max().item<double>();
        EXPECT_LE(worst, 1.0) << what;
      }
    }
  }
}

TEST(SharesOnEachThread, DepthSplitBf16WeightGradientsMatchFloat64AndRepeatTheirBits) {
  // dW = dYᵀ X over 3109 tokens (two or three shares of at least 1024, no
  // multiple of 32), m n = 264 x 256 >= 65536; dY also as a view narrower
  // than its rows.
  const int64_t k = 3109, m = 264, n = 256, ldc = 280;
  Generator g(14);
  const Tensor dy_wide = randn({k, m + 16}, kFloat32, &g).to(kBFloat16);
  const Tensor x = randn({k, n}, kFloat32, &g).to(kBFloat16);
  for (int threads : {2, 3}) {
    for (const Tensor& dy : {dy_wide.narrow(1, 0, m).contiguous(), dy_wide.narrow(1, 16, m)}) {
      const std::string what = std::to_string(threads) + " threads, dY's row stride " + std::to_string(dy.stride(0));
      const Tensor at = dy.t();  // [m, k], a transposed
      const Tensor c = run_product(at, m, k, x, n, ldc, threads);
      const Tensor again = run_product(at, m, k, x, n, ldc, threads);
      EXPECT_TRUE(same_bits(c, again)) << what;
      EXPECT_TRUE(same_bits(c.narrow(1, n, ldc - n), full({m, ldc - n}, 7.0, kBFloat16)))
          << what << ": the columns of c past n were written";
      EXPECT_LE(worst_against_float64(at, x, c.narrow(1, 0, n).contiguous(), true), 1.0) << what;
    }
  }
}

}  // namespace
