// mm, bmm, matmul, linear: values against PyTorch 1.13, oneDNN against
// OpenBLAS/float64, the float64/integer/float16 paths, the primitive cache,
// and error messages.
//
// Pinned inputs are seq(shape, a, b)[i] = (((i * a + b) % 11) - 5) * 0.25 in
// row-major order, built the same way in Python; the expected values below
// were printed by /usr/bin/python3 with torch 1.13 (torch.set_num_threads(1))
// from the torch expression named beside each case.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "kernels/cpu/dnnl_common.h"
#include "kernels/cpu/small_gemm.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/dnnl.h"
#include "dense_test_util.h"
#include "support/test_util.h"
#include "kiln/kiln.h"
#include "kiln/ops/linalg.h"
#include "support/oracle.h"

using namespace kiln;

namespace {

using test::expect_close;
using test::Expected;
using test::seq;
using test::to_doubles;


// Tolerances per dtype for these pinned cases (inputs are multiples of 1/4,
// so float32/float64 are exact; bfloat16 rounds the result to 8 bits).
double rtol_for(DType dt) { return dt == kBFloat16 ? 1.6e-2 : dt == kFloat16 ? 1e-3 : 1e-6; }
double atol_for(DType dt) { return dt == kBFloat16 ? 2e-2 : dt == kFloat16 ? 1e-3 : 1e-6; }

using test::error_message;

// clang-format off
// Mm: shape [3, 2]
const Expected kMm{{3, 2}, {1.9375, -0.875, -1.9375, -0.0625, -2.375, 0.0625}};
// MmT: shape [3, 2]
const Expected kMmT{{3, 2}, {0.6875, 2.125, 1.3125, -1.5, -0.125, -1}};
// Dot: shape []
const Expected kDot{{}, {1.375}};
// VecMat: shape [3]
const Expected kVecMat{{3}, {0.6875, 0.625, 0.5625}};
// MatVec: shape [3]
const Expected kMatVec{{3}, {0.4375, -0.5, -0.75}};
// Bcast4d: shape [2, 5, 3, 2]
const Expected kBcast4d{{2, 5, 3, 2},
    {1.9375, -0.875, -1.9375, -0.0625, -2.375, 0.0625, -0.625, -1.375, -0.6875, 1.1875, -0.0625, 0.3125, -1.125, -0.5,
     0.5625, -1, 0.1875, -0.125, 3.1875, -1, 0.4375, 0.25, 0.4375, 0.125, -0.75, 1.9375, -0.375, -1.9375, 0, -2.375,
     -2.8125, 0.1875, 0.1875, 0.3125, -0.25, 0.4375, 0.5625, -0.5625, -0.1875, 1.3125, 0.4375, 0.4375, -0.1875, 0.75,
     0.8125, -0.4375, 0.4375, 0.4375, 0.4375, 0, -3, 0.5625, -3, 0.4375, 0.375, -2.8125, 0.0625, 0.1875, 0.4375,
     -0.25}};
// VecBatch: shape [2, 3]
const Expected kVecBatch{{2, 3}, {0.6875, 0.625, 0.5625, 0.625, 0.5625, -0.1875}};
// BatchVec: shape [2, 3]
const Expected kBatchVec{{2, 3}, {0.4375, -0.5, -0.75, -1, 1.5, 1.25}};
// BatchMat: shape [2, 3, 2]
const Expected kBatchMat{{2, 3, 2},
    {1.9375, -0.875, -1.9375, -0.0625, -2.375, 0.0625, -2.8125, 0.1875, 0.1875, 0.3125, -0.25, 0.4375}};
// MatBatch: shape [2, 3, 2]
const Expected kMatBatch{{2, 3, 2},
    {1.9375, -0.875, -1.9375, -0.0625, -2.375, 0.0625, -0.625, -1.375, -0.6875, 1.1875, -0.0625, 0.3125}};
// Bmm: shape [2, 3, 2]
const Expected kBmm{{2, 3, 2},
    {1.9375, -0.875, -1.9375, -0.0625, -2.375, 0.0625, 0.5625, -0.5625, -0.1875, 1.3125, 0.4375, 0.4375}};
// BmmT: shape [2, 3, 2]
const Expected kBmmT{{2, 3, 2},
    {0.6875, 2.125, 1.3125, -1.5, -0.125, -1, -1.5625, -0.9375, 0.875, 1.375, 1.25, 0.25}};
// Linear3d: shape [2, 3, 5]
const Expected kLinear3d{{2, 3, 5},
    {-0.0625, 2.8125, -1.1875, -2.4375, 1.8125, -1, 3.4375, 1, 0.625, -0.4375, -1.25, 3.375, 1.125, 0.25, 0.0625,
     -1.5, 3.3125, 1.25, -0.125, 0.5625, 1, -0.1875, -0.6875, -1.1875, 1.75, 0.75, -0.25, -0.5625, -1.5625, 2.25}};
// LinearNoBias: shape [3, 5]
const Expected kLinearNoBias{{3, 5},
    {0.4375, 1.5625, -1.4375, -1.6875, 0.8125, -0.5, 2.1875, 0.75, 1.375, -1.4375, -0.75, 2.125, 0.875, 1, -0.9375}};
// LinearVec: shape [5]
const Expected kLinearVec{{5}, {-0.0625, 2.8125, -1.1875, -2.4375, 1.8125}};
// Linear2dBias: shape [3, 5]
const Expected kLinear2dBias{{3, 5},
    {-0.0625, 2.8125, -1.1875, -2.4375, 1.8125, -0.5, 1.1875, 1.5, 1.125, -2.6875, -0.25, 1.625, 2.125, 1.25,
     -1.6875}};
// IntMm: shape [3, 2]
const Expected kIntMm{{3, 2}, {31, -14, -31, -1, -38, 1}};
// clang-format on

const DType kFloatTypes[] = {kFloat32, kFloat64, kBFloat16, kFloat16};

}  // namespace

TEST(Linalg, MatchesTorchOnPinnedCases) {
  for (DType dt : kFloatTypes) {
    const std::string d(dtype_name(dt));
    const double rt = rtol_for(dt), at = atol_for(dt);
    auto s = [&](IntArrayRef shape, int a, int b) { return seq(shape, a, b, dt); };
    // torch: seq([3,4],3,1) @ seq([4,2],5,2) and the transposed views of the same math.
    expect_close(mm(s({3, 4}, 3, 1), s({4, 2}, 5, 2)), kMm, rt, at, "mm " + d);
    expect_close(s({4, 3}, 3, 1).t().mm(s({2, 4}, 5, 2).t()), kMmT, rt, at, "mm transposed " + d);
    expect_close(matmul(s({5}, 3, 1), s({5}, 5, 2)), kDot, rt, at, "dot " + d);
    expect_close(matmul(s({4}, 3, 1), s({4, 3}, 5, 2)), kVecMat, rt, at, "vec-mat " + d);
    expect_close(matmul(s({3, 4}, 3, 1), s({4}, 5, 2)), kMatVec, rt, at, "mat-vec " + d);
    expect_close(matmul(s({2, 1, 3, 4}, 3, 1), s({5, 4, 2}, 5, 2)), kBcast4d, rt, at, "4-D broadcast " + d);
    expect_close(matmul(s({4}, 3, 1), s({2, 4, 3}, 5, 2)), kVecBatch, rt, at, "vec-batch " + d);
    expect_close(matmul(s({2, 3, 4}, 3, 1), s({4}, 5, 2)), kBatchVec, rt, at, "batch-vec " + d);
    expect_close(matmul(s({2, 3, 4}, 3, 1), s({4, 2}, 5, 2)), kBatchMat, rt, at, "batch-mat " + d);
    expect_close(s({3, 4}, 3, 1).matmul(s({2, 4, 2}, 5, 2)), kMatBatch, rt, at, "mat-batch " + d);
    expect_close(bmm(s({2, 3, 4}, 3, 1), s({2, 4, 2}, 5, 2)), kBmm, rt, at, "bmm " + d);
    expect_close(s({2, 4, 3}, 3, 1).transpose(1, 2).bmm(s({2, 2, 4}, 5, 2).transpose(1, 2)), kBmmT, rt, at,
                 "bmm transposed " + d);
    expect_close(linear(s({2, 3, 4}, 3, 1), s({5, 4}, 5, 2), s({5}, 7, 3)), kLinear3d, rt, at, "linear 3-D " + d);
    expect_close(linear(s({3, 4}, 3, 1), s({5, 4}, 5, 2)), kLinearNoBias, rt, at, "linear no bias " + d);
    expect_close(linear(s({4}, 3, 1), s({5, 4}, 5, 2), s({5}, 7, 3)), kLinearVec, rt, at, "linear 1-D " + d);
    expect_close(linear(s({3, 4}, 3, 1), s({5, 4}, 5, 2), s({3, 5}, 7, 3)), kLinear2dBias, rt, at,
                 "linear 2-D bias " + d);
  }
}

TEST(Linalg, IntegerMatmul) {
  // torch: (seq*4).long() @ (seq*4).long()
  for (DType dt : {kInt64, kInt32}) {
    const Tensor a = seq({3, 4}, 3, 1, dt, 1.0), b = seq({4, 2}, 5, 2, dt, 1.0);
    const Tensor c = mm(a, b);
    EXPECT_EQ(c.dtype(), dt);
    expect_close(c, kIntMm, 0, 0, std::string("int mm ") + std::string(dtype_name(dt)));
  }
}

// Random operands: oneDNN float32 against float64 (OpenBLAS dgemm) and
// OpenBLAS float32, over layouts that take different kernel paths.
TEST(Linalg, OneDnnMatchesBlasOnRandomOperands) {
  Generator g(7);
  const Tensor a = randn({2, 65, 130}, kFloat32, &g), b = randn({2, 130, 47}, kFloat32, &g);
  const Tensor a64 = a.to(kFloat64), b64 = b.to(kFloat64);
  // float32 with k = 130: summation order differs between libraries.
  const double rt = 1e-4, at = 1e-4;
  expect_close(bmm(a, b), bmm(a64, b64), rt, at, "bmm f32 vs f64");
  expect_close(mm(a[0], b[1]), mm(a64[0], b64[1]), rt, at, "mm f32 vs f64");
  // The same product read through transposed views (no copies).
  const Tensor at_ = a.transpose(1, 2).contiguous().transpose(1, 2);
  const Tensor bt_ = b.transpose(1, 2).contiguous().transpose(1, 2);
  EXPECT_FALSE(at_.is_contiguous());
  expect_close(bmm(at_, bt_), bmm(a64, b64), rt, at, "bmm transposed f32");
  expect_close(bmm(at_.to(kFloat64), bt_.to(kFloat64)), bmm(a64, b64), 1e-12, 1e-12, "bmm transposed f64");
  // Broadcast batch through oneDNN (batch of 1 on one side).
  const Tensor w = randn({130, 47}, kFloat32, &g);
  expect_close(matmul(a, w), matmul(a64, w.to(kFloat64)), rt, at, "batch x matrix");
  expect_close(matmul(w.t(), a.transpose(1, 2)), matmul(w.t().to(kFloat64), a64.transpose(1, 2)), rt, at,
               "matrix x batch");
  // OpenBLAS float32 as an independent reference for oneDNN float32.
  Tensor ref = empty({65, 47}, kFloat32);
  const Tensor a0 = a[0].contiguous(), b1 = b[1].contiguous();
  kernels::gemm(kFloat32, false, false, 65, 47, 130, a0.data_ptr(), 130, b1.data_ptr(), 47, false, ref.data_ptr(), 47);
  expect_close(mm(a0, b1), ref, rt, at, "oneDNN vs OpenBLAS f32");
  // bfloat16 against float32 on the same (bf16-rounded) inputs.
  const Tensor ab = a.to(kBFloat16), bb = b.to(kBFloat16);
  expect_close(bmm(ab, bb), bmm(ab.to(kFloat32), bb.to(kFloat32)), 1.6e-2, 5e-2, "bmm bf16 vs f32");
}

TEST(Linalg, LinearMatchesMatmulWithBias) {
  Generator g(11);
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    const Tensor x = randn({4, 3, 33}, kFloat32, &g).to(dt), w = randn({17, 33}, kFloat32, &g).to(dt);
    const Tensor bias = randn({17}, kFloat32, &g).to(dt);
    const Tensor y = linear(x, w, bias);
    ASSERT_EQ(y.sizes().vec(), (std::vector<int64_t>{4, 3, 17}));
    ASSERT_EQ(y.dtype(), dt);
    // Reference in float64: x · wᵀ, then + bias row by row.
    const auto ref = to_doubles(matmul(x.to(kFloat64), w.to(kFloat64).t()));
    const auto bv = to_doubles(bias);
    std::vector<double> want(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) want[i] = ref[i] + bv[i % 17];
    const double tol = dt == kBFloat16 ? 5e-2 : dt == kFloat32 ? 1e-4 : 1e-12;
    expect_close(y, {4, 3, 17}, want, tol, tol, "linear " + std::string(dtype_name(dt)));
    // A non-contiguous input (every other row) and a transposed-storage weight.
    const Tensor xs = x.slice(0, 0, std::nullopt, 2);
    const Tensor wt = w.t().contiguous().t();
    expect_close(linear(xs, wt, bias), linear(xs.contiguous(), w, bias), 1e-6, 1e-6,
                 "linear strided " + std::string(dtype_name(dt)));
  }
}

TEST(Linalg, OperandsWithoutUnitStrideAreCopied) {
  Generator g(3);
  const Tensor big = randn({12, 18}, kFloat32, &g);
  const Tensor a = big.slice(0, 0, std::nullopt, 2).slice(1, 0, std::nullopt, 3);  // [6, 6], strides (36, 3)
  const Tensor b = big.slice(1, 1, 7).t();                                          // [6, 12] transposed view
  expect_close(mm(a, b.slice(1, 0, 5)), mm(a.contiguous(), b.slice(1, 0, 5).contiguous()), 1e-6, 1e-6,
               "strided mm");
  // An expanded (stride 0) operand.
  const Tensor row = randn({1, 6}, kFloat32, &g).expand({4, 6});
  expect_close(mm(row, a), mm(row.contiguous(), a.contiguous()), 1e-6, 1e-6, "expanded mm");
}

TEST(Linalg, EmptyOperands) {
  const Tensor z = mm(zeros({2, 0}), zeros({0, 3}));
  expect_close(z, {2, 3}, std::vector<double>(6, 0.0), 0, 0, "k = 0");
  EXPECT_EQ(mm(zeros({0, 3}), zeros({3, 4})).sizes().vec(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(matmul(zeros({2, 0, 3}), zeros({3, 5})).sizes().vec(), (std::vector<int64_t>{2, 0, 5}));
  EXPECT_EQ(bmm(zeros({0, 2, 3}), zeros({0, 3, 4})).sizes().vec(), (std::vector<int64_t>{0, 2, 4}));
  // torch: F.linear(x[2, 0], w[3, 0], b) is b on every row.
  const Tensor b = seq({3}, 7, 3);
  expect_close(linear(zeros({2, 0}), zeros({3, 0}), b), {2, 3}, [&] {
    auto v = to_doubles(b);
    v.insert(v.end(), v.begin(), v.end());
    return v;
  }(), 0, 0, "linear k = 0");
  expect_close(matmul(zeros({0}), zeros({0})), {}, {0.0}, 0, 0, "empty dot");
}

TEST(Linalg, Float64UsesBlasAndIsExact) {
  // 1/3 is not representable in float32: only a true float64 path gets this to 1e-15.
  const Tensor a = full({2, 3}, 1.0 / 3.0, kFloat64), b = full({3, 2}, 3.0, kFloat64);
  expect_close(mm(a, b), {2, 2}, std::vector<double>(4, 3.0), 1e-15, 1e-15, "f64 mm");
  EXPECT_EQ(mm(a, b).dtype(), kFloat64);
  EXPECT_TRUE(kernels::blas_uses_openmp());
}

TEST(Linalg, PrimitiveCacheReusesPrimitives) {
  // 315,000 multiply-adds: above Note [Tiny products], so oneDNN runs it.
  const Tensor a = seq({70, 90}, 3, 1), b = seq({90, 50}, 5, 2), bias = seq({50}, 7, 3);
  const Tensor r1 = mm(a, b);
  const int64_t after_first = kernels::dnnl_primitives_created();
  const Tensor r2 = mm(a, b);
  const Tensor r3 = mm(seq({70, 90}, 4, 2), seq({90, 50}, 6, 1));  // same shapes, other data
  EXPECT_EQ(kernels::dnnl_primitives_created(), after_first) << "same shapes must reuse the cached primitive";
  expect_close(r2, r1, 0, 0, "cached result");
  (void)r3;
  (void)mm(a, seq({90, 60}, 5, 2));  // new shape
  EXPECT_EQ(kernels::dnnl_primitives_created(), after_first + 1);
  (void)linear(a, b.t(), bias);  // linear with bias is a different primitive
  const int64_t after_linear = kernels::dnnl_primitives_created();
  EXPECT_EQ(after_linear, after_first + 2);
  (void)linear(a, b.t(), bias);
  EXPECT_EQ(kernels::dnnl_primitives_created(), after_linear);
  // A tiny product (7 x 9 x 5) takes kiln's own tile and no primitive, with the
  // exact sums these quarter-integer inputs have in any order.
  const Tensor ta = seq({7, 9}, 3, 1), tb = seq({9, 5}, 5, 2);
  const Tensor tiny = mm(ta, tb), tiny_linear = linear(ta, tb.t(), seq({5}, 7, 3));
  kernels::MatmulArgs tiny_args;
  tiny_args.m = 7;
  tiny_args.n = 5;
  tiny_args.k = 9;
  const bool on_tile = kernels::detail::tiny_matmul_applies(tiny_args);
#if defined(__AVX512BF16__)
  EXPECT_TRUE(on_tile) << "a build for AVX-512 with BF16 must take kiln's tile";
#endif
  if (on_tile) EXPECT_EQ(kernels::dnnl_primitives_created(), after_linear) << "a tiny product needs no primitive";
  expect_close(tiny, mm(ta.to(kFloat64), tb.to(kFloat64)).to(kFloat32), 0, 0, "tiny product");
  expect_close(tiny_linear, (mm(ta.to(kFloat64), tb.to(kFloat64)) + seq({5}, 7, 3).to(kFloat64)).to(kFloat32), 0, 0,
               "tiny product with a bias");
  // The thread count is part of the key: oneDNN plans its work split at creation.
  // A product under 2^17 multiply-adds runs on one thread whatever the
  // setting (no OpenMP fork for microseconds of work), so its primitive is
  // shared; 600 rows keep this one off the tiny tile (at most 512 a side).
  const int threads = get_num_threads();
  const Tensor small_a = seq({600, 4}, 3, 1), small_b = seq({4, 3}, 5, 2);
  const Tensor big_a = seq({64, 64}, 3, 1), big_b = seq({64, 48}, 5, 2);  // 196608 multiply-adds
  set_num_threads(2);
  const Tensor r5 = mm(big_a, big_b);
  const Tensor s2 = mm(small_a, small_b);
  const int64_t at_two = kernels::dnnl_primitives_created();
  set_num_threads(1);
  const Tensor s1 = mm(small_a, small_b);
  EXPECT_EQ(kernels::dnnl_primitives_created(), at_two) << "a small product is serial at any thread count";
  const Tensor r6 = mm(big_a, big_b);
  EXPECT_EQ(kernels::dnnl_primitives_created(), at_two + 1) << "a larger one plans per thread count";
  set_num_threads(threads);
  expect_close(s1, s2, 0, 0, "one thread");
  expect_close(r6, r5, 1e-6, 1e-6, "one thread, larger");
  kernels::dnnl_clear_cache();
  const int64_t cleared = kernels::dnnl_primitives_created();
  (void)mm(a, b);
  EXPECT_EQ(kernels::dnnl_primitives_created(), cleared + 1);
}

// Note [Tiny products]: single float32 products under 2^17 multiply-adds run on
// kiln's own tile, which reads a in place whatever its strides and packs b
// when its rows are not contiguous. Every layout a view can give, with and
// without a bias, against float64; tolerance: k float32 roundings of terms
// bounded by |a| |b| (inputs in [-1, 1)), i.e. k * 2^-24 * k plus slack.
TEST(Linalg, TinyProductsMatchFloat64OnEveryLayout) {
  manual_seed(31);
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape sh : {Shape{1, 1, 1}, Shape{8, 64, 32}, Shape{7, 10, 64}, Shape{64, 33, 17}, Shape{5, 512, 16},
                         Shape{100, 3, 200}}) {
    const int64_t m = sh.m, n = sh.n, k = sh.k;
    const double tol = 4.0 * static_cast<double>(k) * static_cast<double>(k) * std::ldexp(1.0, -24) + 1e-6;
    // Each operand as a plain matrix, a transposed view, and a view with gaps (every other column).
    auto layouts = [](int64_t rows, int64_t cols) {
      const Tensor base = rand({rows, 2 * cols}) * 2 - 1;
      return std::vector<Tensor>{base.narrow(1, 0, cols).contiguous(),
                                 base.narrow(1, 0, cols).contiguous().t().contiguous().t(),
                                 base.slice(1, 0, 2 * cols, 2)};
    };
    const std::vector<Tensor> as = layouts(m, k), bs = layouts(k, n);
    const Tensor bias = rand({n}) * 2 - 1;
    for (size_t i = 0; i < as.size(); ++i) {
      for (size_t j = 0; j < bs.size(); ++j) {
        const std::string what = std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + " layout " +
                                 std::to_string(i) + "," + std::to_string(j);
        const Tensor want = mm(as[i].to(kFloat64), bs[j].to(kFloat64));
        expect_close(mm(as[i], bs[j]), want.to(kFloat32), 0, tol, what);
        // linear reads its weight transposed: W = bᵀ.
        expect_close(linear(as[i], bs[j].t(), bias), (want + bias.to(kFloat64)).to(kFloat32), 0, tol,
                     what + " linear");
      }
    }
  }
}

TEST(Linalg, Float16ComputesInFloat32) {
  const Tensor a = seq({3, 4}, 3, 1, kFloat16), b = seq({4, 2}, 5, 2, kFloat16);
  const Tensor c = mm(a, b);
  EXPECT_EQ(c.dtype(), kFloat16);
  expect_close(c, kMm, 1e-3, 1e-3, "f16 mm");
  // oneDNN 2.6 has bfloat16 kernels from AVX-512 (avx512_core) on.
  const char* off = std::getenv("KILN_ONEDNN_BF16");
  const bool avx512_core = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  EXPECT_EQ(kernels::dnnl_supports(kBFloat16), avx512_core && !(off != nullptr && std::string(off) == "0"));
  EXPECT_TRUE(kernels::dnnl_supports(kFloat32));
}

// Note [bf16 products where bf16 is slow] (src/kernels/cpu/bf16_products.cpp): bfloat16 products
// run on oneDNN's kernels only where the CPU's bf16 dot product pays. The rule, as this CPU reads it.
TEST(Linalg, Bfloat16ProductsRunNativelyOnlyWhereBf16Pays) {
  const char* env = std::getenv("KILN_ONEDNN_BF16");
  const std::string forced = env != nullptr ? env : "";
  // What oneDNN may use: the CPU's flag, capped by ONEDNN_MAX_CPU_ISA (AVX512_CORE stands in for a
  // CPU without AVX512_BF16, as Skylake-X to Ice Lake are), which the rule reads too.
  const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16") &&
                           kernels::dnnl_detail::isa_has(dnnl_cpu_isa_avx512_core_bf16);
  const double rate = kernels::bf16_dot_flop_rate_vs_fma();
  std::cout << "[ measured ] vdpbf16ps flops per second / vfmadd231ps's: " << rate << "\n";
  if (!avx512_bf16) {
    EXPECT_EQ(rate, 0);  // not measured: no such instruction
  } else {
    EXPECT_GT(rate, 0.1);
    EXPECT_LT(rate, 10.0);
  }
  const bool native = kernels::bf16_products_on_dnnl();
  EXPECT_EQ(native, kernels::bf16_products_on_dnnl());  // decided once per process
  if (!kernels::dnnl_supports(kBFloat16) || forced == "0") {
    EXPECT_FALSE(native);
  } else if (forced == "1") {
    EXPECT_TRUE(native);
  } else if (!avx512_bf16) {
    EXPECT_FALSE(native) << "oneDNN would emulate the bf16 dot product here";
  } else if (rate < 0.6 * kernels::kBf16NativeRate || rate > 1.4 * kernels::kBf16NativeRate) {
    // Far from the line the rule draws, a measurement now must agree with the one the process made.
    EXPECT_EQ(native, rate >= kernels::kBf16NativeRate) << "rate " << rate;
  }
  // Where the rule timed the instruction, a run reports that figure, the same on every call
  // (a fresh timing would differ in its last bits, and may fall on the other side of the line).
  if (kernels::dnnl_supports(kBFloat16) && forced.empty() && avx512_bf16 && !kernels::dnnl_has_amx()) {
    const double decided = kernels::bf16_products_decision_rate();
    EXPECT_EQ(decided, kernels::bf16_products_decision_rate());
    EXPECT_EQ(native, decided >= kernels::kBf16NativeRate) << "decided on " << decided;
  }
  // Either path sums exact products in float32 and rounds once. These inputs (multiples of 1/4)
  // sum exactly in float32 in any order, so each path gives the float64 product rounded to bf16.
  const Tensor a = seq({33, 70}, 7, 3, kBFloat16), b = seq({70, 19}, 5, 2, kBFloat16);
  const Tensor got = mm(a, b);
  EXPECT_EQ(got.dtype(), kBFloat16);
  expect_close(got, mm(a.to(kFloat64), b.to(kFloat64)).to(kBFloat16), 0, 0, "bf16 mm");
}

TEST(Linalg, ErrorsNameOpShapesAndDtypes) {
  const Tensor a = zeros({2, 3}), b = zeros({4, 5});
  EXPECT_THROW(mm(a, b), ShapeError);
  EXPECT_EQ(error_message([&] { mm(a, b); }), "mm: cannot multiply [2, 3] by [4, 5]: inner dims 3 and 4 differ");
  EXPECT_NE(error_message([&] { mm(zeros({2, 3, 4}), b); }).find("expected two 2-D tensors"), std::string::npos);
  EXPECT_THROW(bmm(zeros({2, 3, 4}), zeros({3, 4, 5})), ShapeError);
  EXPECT_NE(error_message([&] { bmm(zeros({2, 3, 4}), zeros({3, 4, 5})); }).find("batch sizes differ: [2, 3, 4] and [3, 4, 5]"),
            std::string::npos);
  EXPECT_NE(error_message([&] { bmm(zeros({2, 3, 4}), zeros({2, 5, 5})); }).find("inner dims 4 and 5 differ"),
            std::string::npos);
  EXPECT_THROW(matmul(zeros({}), zeros({3})), ShapeError);
  EXPECT_NE(error_message([&] { matmul(zeros({3}), zeros({5})); }).find("inner dims 3 and 5 differ"),
            std::string::npos);
  EXPECT_NE(error_message([&] { matmul(zeros({2, 2, 3, 4}), zeros({5, 4, 2})); }).find("do not broadcast: 2 vs 5"),
            std::string::npos);
  EXPECT_THROW(mm(zeros({2, 3}), zeros({3, 2}, kFloat64)), DTypeError);
  EXPECT_NE(error_message([&] { mm(zeros({2, 3}), zeros({3, 2}, kFloat64)); }).find("float32 and float64"),
            std::string::npos);
  EXPECT_THROW(mm(zeros({2, 3}, kBool), zeros({3, 2}, kBool)), DTypeError);
  EXPECT_THROW(linear(zeros({2, 3}), zeros({4, 5})), ShapeError);
  EXPECT_NE(error_message([&] { linear(zeros({2, 3}), zeros({4, 5})); }).find("[out_features, in_features]"),
            std::string::npos);
  EXPECT_THROW(linear(zeros({2, 3}), zeros({4, 3}), zeros({5})), ShapeError);
  EXPECT_THROW(linear(zeros({2, 3}), zeros({4, 3}), zeros({4}, kFloat64)), DTypeError);
  // A 1-D weight is [in_features] (torch's 1-D weight form, LinalgGrad.LinearWithVectorWeight*); its size must fit.
  EXPECT_THROW(linear(zeros({2, 3}), zeros({4})), ShapeError);
}

TEST(Linalg, TransposedBatchTimesMatrixReadsInPlace) {
  // [B, k, m] viewed as [B, m, k]: the batch does not fold into rows without a
  // copy, so the product runs batched with the matrix broadcast.
  Generator g(13);
  const Tensor a = randn({3, 6, 5}, kFloat32, &g).transpose(1, 2);
  const Tensor w = randn({6, 4}, kFloat32, &g);
  expect_close(matmul(a, w), matmul(a.contiguous(), w), 1e-6, 1e-6, "transposed batch x matrix");
  expect_close(matmul(a, w.t().contiguous().t()), matmul(a.contiguous(), w), 1e-6, 1e-6, "both transposed");
}

TEST(Linalg, AttentionHeadViewsMatchTorch) {
  // Heads viewed out of one [B, T, 3C] projection, as attention splits q, k, v:
  // [B, nh, T, hs] with strides [3TC, hs, 3C, 1], whose batch dims do not
  // merge. The product runs per leading index on the strided views (no copy);
  // values against torch for q·kᵀ and P·v, outputs contiguous.
  Generator g(29);
  const int64_t B = 2, T = 5, nh = 3, hs = 4, C = nh * hs;
  const Tensor qkv = randn({B, T, 3 * C}, kFloat32, &g);
  auto heads = [&](int64_t i) { return qkv.narrow(2, i * C, C).view({B, T, nh, hs}).transpose(1, 2); };
  const Tensor q = heads(0), k = heads(1), v = heads(2);
  const Tensor s = matmul(q, k.transpose(-2, -1));
  const Tensor p = randn({B, nh, T, T}, kFloat32, &g);
  const Tensor o = matmul(p, v);
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_TRUE(o.is_contiguous());
  const test::OracleOutcome want = test::torch_eval(
      "(lambda h: (torch.matmul(h(0), h(1).transpose(-2, -1)), torch.matmul(x1, h(2))))("
      "lambda i: x0.narrow(2, i * 12, 12).view(2, 5, 3, 4).transpose(1, 2))",
      {qkv, p});
  ASSERT_TRUE(want.ok) << want.error;
  expect_close(s, want.outputs[0], 1e-5, 1e-5, "q . k^T of head views");
  expect_close(o, want.outputs[1], 1e-5, 1e-5, "P . v of head views");
  // The same head views in bf16, float64 and int64 (oneDNN's 4-D product; a
  // loop over dim 0 for the types oneDNN lacks) against contiguous copies.
  for (DType dt : {kBFloat16, kFloat64, kInt64}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = (qkv * 4).to(dt);
    auto hd = [&](int64_t i) { return x.narrow(2, i * C, C).view({B, T, nh, hs}).transpose(1, 2); };
    const Tensor kt = hd(1).transpose(-2, -1);
    const double tol = dt == kBFloat16 ? 1.0 / 128 : 1e-12;
    expect_close(matmul(hd(0), kt).to(kFloat64), matmul(hd(0).contiguous(), kt.contiguous()).to(kFloat64), tol, tol,
                 "q . k^T of head views");
    const Tensor pd = (p * 4).to(dt);
    expect_close(matmul(pd, hd(2)).to(kFloat64), matmul(pd, hd(2).contiguous()).to(kFloat64), tol, tol,
                 "P . v of head views");
  }
  // A 5-D operand peels two leading dims before the rest merge.
  const Tensor a5 = randn({2, 3, 2, 4, 5}, kFloat32, &g).permute({1, 0, 2, 3, 4});
  const Tensor b5 = randn({3, 2, 2, 5, 3}, kFloat32, &g);
  expect_close(matmul(a5, b5), matmul(a5.contiguous(), b5), 1e-5, 1e-5, "5-D with a permuted batch");
}
