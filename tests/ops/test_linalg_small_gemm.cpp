// bfloat16 and float32 products of small batched matrices (Note [Small
// products] in src/kernels/cpu/small_gemm.h): every operand layout the kernel
// reads (rows contiguous in k, columns contiguous, neither; odd k; tails in m
// and n; a broadcast batch; two batch dims) against a float64 sum of the same
// values, the bits independent of the thread count, and the path actually
// taken where the CPU has AVX-512 (AVX512-BF16 for bf16).
//
// Tolerances. bf16: each product of two bf16 is exact in float32 and the sum
// over k runs in float32, then rounds once to bf16, so |got - ref| <= 2^-8
// |ref| (one bf16 ulp, allowing the float32 sum to cross a rounding boundary)
// plus k 2^-23 sum|a||b| for the float32 sum, bounded here by 1e-3. float32:
// k fused multiply-adds, each rounding once: (k + 1) 2^-23 sum|a||b|.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "kernels/cpu/small_gemm.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "ops/banded_matmul.h"

using namespace kiln;

namespace {

// One test case: c = a · b over outer x batch products, each operand a
// strided view into a buffer with the given strides (elements).
struct Layout {
  int64_t batch, row, col;
};
struct Case {
  int64_t outer, batch, m, n, k;
  Layout a = {}, b = {};
  int64_t a_outer = 0, b_outer = 0;
};

// Dense strides for a [rows, cols] matrix read row-major (or transposed).
Layout rows_contiguous(int64_t rows, int64_t cols) { return {rows * cols, cols, 1}; }
Layout cols_contiguous(int64_t rows, int64_t cols) { return {rows * cols, 1, rows}; }

int64_t extent(const Case& c, const Layout& l, int64_t outer_stride, int64_t rows, int64_t cols) {
  return (c.outer - 1) * outer_stride + (c.batch - 1) * l.batch + (rows - 1) * l.row + (cols - 1) * l.col + 1;
}

template <typename E>
std::vector<E> random_values(int64_t n, uint32_t seed) {
  Generator g(seed);
  const Tensor t = randn({n}, kFloat32, &g).to(dtype_of_v<E>);
  const auto* p = static_cast<const E*>(t.data_ptr());
  return std::vector<E>(p, p + n);
}

// The kernel's arguments for the case (no data yet).
template <typename E>
kernels::MatmulArgs args_of(const Case& cs) {
  kernels::MatmulArgs g;
  g.dtype = dtype_of_v<E>;
  g.outer = cs.outer;
  g.batch = cs.batch;
  g.m = cs.m;
  g.n = cs.n;
  g.k = cs.k;
  g.a = {nullptr, {cs.a.batch, cs.a.row, cs.a.col}, cs.a_outer};
  g.b = {nullptr, {cs.b.batch, cs.b.row, cs.b.col}, cs.b_outer};
  return g;
}

// Runs kernels::matmul on the case and returns c; ref gets the float64 sums
// and abs_ref the sums of |a||b|.
template <typename E>
std::vector<E> run(const Case& cs, const std::vector<E>& a, const std::vector<E>& b, std::vector<double>* ref,
                   std::vector<double>* abs_ref) {
  kernels::MatmulArgs g = args_of<E>(cs);
  g.a.data = a.data();
  g.b.data = b.data();
  std::vector<E> c(static_cast<size_t>(cs.outer * cs.batch * cs.m * cs.n), E(-7.0f));
  g.c = c.data();
  kernels::matmul(g);
  if (ref) {
    ref->assign(c.size(), 0.0);
    abs_ref->assign(c.size(), 0.0);
    for (int64_t o = 0; o < cs.outer; ++o)
      for (int64_t bi = 0; bi < cs.batch; ++bi)
        for (int64_t i = 0; i < cs.m; ++i)
          for (int64_t j = 0; j < cs.n; ++j) {
            double s = 0, sa = 0;
            for (int64_t p = 0; p < cs.k; ++p) {
              const double x =
                  static_cast<float>(a[o * cs.a_outer + bi * cs.a.batch + i * cs.a.row + p * cs.a.col]);
              const double y = static_cast<float>(b[o * cs.b_outer + bi * cs.b.batch + p * cs.b.row + j * cs.b.col]);
              s += x * y;
              sa += std::abs(x * y);
            }
            (*ref)[((o * cs.batch + bi) * cs.m + i) * cs.n + j] = s;
            (*abs_ref)[((o * cs.batch + bi) * cs.m + i) * cs.n + j] = sa;
          }
  }
  return c;
}

template <typename E>
void expect_matches(const Case& cs, const char* what) {
  SCOPED_TRACE(::testing::Message() << what << " " << dtype_name(dtype_of_v<E>) << ": outer " << cs.outer
                                    << " batch " << cs.batch << " m " << cs.m << " n " << cs.n << " k " << cs.k);
  const auto a = random_values<E>(extent(cs, cs.a, cs.a_outer, cs.m, cs.k), 1);
  const auto b = random_values<E>(extent(cs, cs.b, cs.b_outer, cs.k, cs.n), 2);
  std::vector<double> ref, abs_ref;
  const std::vector<E> c = run(cs, a, b, &ref, &abs_ref);
  int64_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    const double got = static_cast<float>(c[i]);
    const double allowed = std::is_same_v<E, BFloat16>
                               ? std::ldexp(std::abs(ref[i]), -8) + 1e-3
                               : static_cast<double>(cs.k + 1) * std::ldexp(abs_ref[i], -23) + 1e-30;
    const double err = std::abs(got - ref[i]);
    if (!(err <= allowed)) ++bad;
    worst = std::max(worst, err / allowed);
  }
  EXPECT_EQ(bad, 0) << "elements outside the bound; worst error / bound " << worst;
}

template <typename V>
void check_every_layout() {
  // gpt's attention products: heads as views of a [B, T, 3C] projection (row
  // stride 3C = 768), 64-row blocks, 64 or 128 keys, both batch dims.
  const int64_t T = 128, C3 = 768, E = 64;
  for (int64_t keys : {64, 128}) {
    Case qk{.outer = 2, .batch = 4, .m = 64, .n = keys, .k = E};
    qk.a = {E, C3, 1};  // q rows: contiguous in k
    qk.b = {E, 1, C3};  // kᵀ: columns contiguous
    qk.a_outer = qk.b_outer = T * C3;
    expect_matches<V>(qk, "q kT of head views");
    Case pv{.outer = 2, .batch = 4, .m = 64, .n = E, .k = keys};
    pv.a = rows_contiguous(64, keys);
    pv.a_outer = 4 * 64 * keys;
    pv.b = {E, C3, 1};  // v rows
    pv.b_outer = T * C3;
    expect_matches<V>(pv, "P v");
    Case ptdo{.outer = 1, .batch = 8, .m = keys, .n = E, .k = 64};
    ptdo.a = cols_contiguous(keys, 64);  // Pᵀ: a transposed view
    ptdo.b = rows_contiguous(64, E);
    expect_matches<V>(ptdo, "PT dO");
  }
  // Tails: m not a multiple of the 6-row tile, n of 16 or 64, odd k, k = 1.
  for (int64_t m : {1, 5, 7, 13})
    for (int64_t n : {1, 15, 17, 65, 130})
      for (int64_t k : {1, 3, 64, 65}) {
        Case c{.outer = 1, .batch = 2, .m = m, .n = n, .k = k};
        c.a = rows_contiguous(m, k);
        c.b = rows_contiguous(k, n);
        expect_matches<V>(c, "contiguous");
        c.a = cols_contiguous(m, k);
        c.b = cols_contiguous(k, n);
        expect_matches<V>(c, "both transposed");
      }
  // Neither dim contiguous (every other element), and a broadcast b.
  // Only the small kernel takes such operands: oneDNN needs a unit stride,
  // and the ops layer makes one before any other kernel (a build for a CPU
  // without AVX512-BF16 has no small kernel).
  Case strided{.outer = 1, .batch = 3, .m = 9, .n = 33, .k = 20};
  strided.a = {2 * 9 * 20 * 2, 2 * 20 * 2, 2};
  strided.b = {0, 2 * 33 * 2, 2};
  if (kernels::detail::small_matmul_applies(args_of<V>(strided)))
    expect_matches<V>(strided, "strided a, broadcast strided b");
  // The largest sizes the kernel takes, and one past them (oneDNN).
  Case big{.outer = 1, .batch = 2, .m = 512, .n = 512, .k = 512};
  big.a = rows_contiguous(512, 512);
  big.b = cols_contiguous(512, 512);
  expect_matches<V>(big, "512 cubed");
  Case past{.outer = 1, .batch = 2, .m = 8, .n = 8, .k = 513};
  past.a = rows_contiguous(8, 513);
  past.b = rows_contiguous(513, 8);
  expect_matches<V>(past, "k 513");
}

}  // namespace

TEST(SmallProducts, MatchFloat64OnEveryLayout) {
  check_every_layout<BFloat16>();
  check_every_layout<float>();
}

template <typename E>
void check_own_kernel_and_threads() {
  SCOPED_TRACE(dtype_name(dtype_of_v<E>));
  Case c{.outer = 1, .batch = 16, .m = 64, .n = 128, .k = 64};
  c.a = rows_contiguous(64, 64);
  c.b = cols_contiguous(64, 128);
  const auto a = random_values<E>(extent(c, c.a, 0, c.m, c.k), 3);
  const auto b = random_values<E>(extent(c, c.b, 0, c.k, c.n), 4);
  const int threads = get_num_threads();
  set_num_threads(1);
  const int64_t before = kernels::dnnl_primitives_created();
  const auto one = run(c, a, b, nullptr, nullptr);
  const bool own = kernels::detail::small_matmul_applies(args_of<E>(c));
#if defined(__AVX512BF16__)
  EXPECT_TRUE(own) << "a build for AVX-512 with BF16 must take kiln's kernel";
#endif
  if (own) {
    EXPECT_EQ(kernels::dnnl_primitives_created(), before) << "the product must not build a oneDNN primitive";
  }
  set_num_threads(2);
  const auto two = run(c, a, b, nullptr, nullptr);
  set_num_threads(threads);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(E)), 0) << "1 and 2 threads must give the same bits";
}

TEST(SmallProducts, RunOnTheirOwnKernelWithBitsIndependentOfThreads) {
  check_own_kernel_and_threads<BFloat16>();
  check_own_kernel_and_threads<float>();
}

// Note [Prefetching inside the tiles]: the tiles of a product handed cache
// lines ask for them as they go, as many as their depth steps allow, and the
// product's bits are those of the product without them.
template <typename E>
void check_prefetch_lines() {
  SCOPED_TRACE(dtype_name(dtype_of_v<E>));
  Case c{.outer = 1, .batch = 1, .m = 64, .n = 128, .k = 64};
  c.a = {0, 768, 1};  // gpt's head views: q kᵀ
  c.b = {0, 1, 768};
  const auto a = random_values<E>(extent(c, c.a, 0, c.m, c.k), 5);
  const auto b = random_values<E>(extent(c, c.b, 0, c.k, c.n), 6);
  kernels::MatmulArgs g = args_of<E>(c);
  g.a.data = a.data();
  g.b.data = b.data();
  if (!kernels::detail::small_matmul_fits(g)) {
#if defined(__AVX512BF16__)
    ADD_FAILURE() << "a build for AVX-512 with BF16 must take kiln's kernel";
#endif
    return;
  }
  std::vector<E> plain(static_cast<size_t>(c.m * c.n)), asked(plain.size());
  g.c = plain.data();
  kernels::detail::small_matmul_here(g);
  const std::vector<char> target(1 << 20);
  std::vector<const char*> lines;
  for (size_t off = 0; off < target.size(); off += 64) lines.push_back(target.data() + off);
  kernels::detail::PrefetchLines many{lines.data(), static_cast<int64_t>(lines.size()), 0};
  g.c = asked.data();
  kernels::detail::small_matmul_here(g, &many);
  EXPECT_EQ(std::memcmp(plain.data(), asked.data(), plain.size() * sizeof(E)), 0);
  // 11 row tiles x 2 column tiles, each over 64 depth steps (32 bf16 pairs),
  // one line every 2 steps.
  const int64_t steps = std::is_same_v<E, float> ? 64 : 32;
  EXPECT_EQ(many.next, 11 * 2 * ((steps + 1) / 2));
  kernels::detail::PrefetchLines few{lines.data(), 10, 0};
  kernels::detail::small_matmul_here(g, &few);
  EXPECT_EQ(few.next, 10) << "every line asked for when the tiles have steps to spare";
  EXPECT_EQ(std::memcmp(plain.data(), asked.data(), plain.size() * sizeof(E)), 0);
}

TEST(SmallProducts, PrefetchLinesAreAskedForAsTheTilesGoAndChangeNoBit) {
  check_prefetch_lines<BFloat16>();
  check_prefetch_lines<float>();
}

TEST(SmallProducts, NaNAndInfinityPropagateToTheirRowsOnly) {
  Case c{.outer = 1, .batch = 2, .m = 8, .n = 20, .k = 10};
  c.a = rows_contiguous(8, 10);
  c.b = rows_contiguous(10, 20);
  auto a = random_values<BFloat16>(extent(c, c.a, 0, c.m, c.k), 5);
  const auto b = random_values<BFloat16>(extent(c, c.b, 0, c.k, c.n), 6);
  a[3 * 10 + 4] = BFloat16(std::nanf(""));                              // batch 0, row 3
  a[8 * 10 + 5 * 10 + 1] = BFloat16(std::numeric_limits<float>::infinity());  // batch 1, row 5
  const auto out = run(c, a, b, nullptr, nullptr);
  for (int64_t bi = 0; bi < 2; ++bi)
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 20; ++j) {
        const float v = static_cast<float>(out[(bi * 8 + i) * 20 + j]);
        const bool poisoned = (bi == 0 && i == 3) || (bi == 1 && i == 5);
        if (bi == 0 && i == 3)
          EXPECT_TRUE(std::isnan(v)) << "row with a NaN, column " << j;
        else if (poisoned)
          EXPECT_TRUE(std::isinf(v) || std::isnan(v)) << "row with an infinity, column " << j;
        else
          EXPECT_TRUE(std::isfinite(v)) << "batch " << bi << " row " << i << " column " << j;
      }
}

// Note [Causal products]: a product under a band equals the whole product on
// the entries the band keeps, bit for bit (the skipped terms are zeros of a),
// and a Columns band writes exact zeros over the hidden entries, on the small
// kernel and on the paths that compute whole and zero after (k > 512,
// float64).
template <typename E>
void check_bands() {
  using Band = kernels::MatmulBand;
  const int64_t T = 128, C3 = 768, E_ = 64;
  struct Shape {
    Case c;
    const char* what;
  };
  std::vector<Shape> shapes;
  // gpt's blocks: q kᵀ and P v on head views, Pᵀ dO with a transposed a.
  Case qk{.outer = 2, .batch = 2, .m = 64, .n = 128, .k = E_};
  qk.a = {E_, C3, 1};
  qk.b = {E_, 1, C3};
  qk.a_outer = qk.b_outer = T * C3;
  shapes.push_back({qk, "q kT heads"});
  Case pv{.outer = 2, .batch = 2, .m = 64, .n = E_, .k = 128};
  pv.a = rows_contiguous(64, 128);
  pv.a_outer = 2 * 64 * 128;
  pv.b = {E_, C3, 1};
  pv.b_outer = T * C3;
  shapes.push_back({pv, "P v heads"});
  Case pt{.outer = 1, .batch = 3, .m = 128, .n = E_, .k = 64};
  pt.a = cols_contiguous(128, 64);
  pt.b = rows_contiguous(64, E_);
  shapes.push_back({pt, "PT dO"});
  // Tails in every dim, odd k (bf16 pairs straddling the band's edge).
  Case odd{.outer = 1, .batch = 2, .m = 13, .n = 37, .k = 29};
  odd.a = rows_contiguous(13, 29);
  odd.b = rows_contiguous(29, 37);
  shapes.push_back({odd, "odd sizes"});
  Case odd_t = odd;
  odd_t.a = cols_contiguous(13, 29);
  shapes.push_back({odd_t, "odd sizes, a transposed"});
  Case past{.outer = 1, .batch = 2, .m = 9, .n = 11, .k = 513};  // oneDNN: whole, then zeros
  past.a = rows_contiguous(9, 513);
  past.b = rows_contiguous(513, 11);
  shapes.push_back({past, "k 513"});
  for (const Shape& sh : shapes)
    for (const Band::Kind kind : {Band::Kind::Columns, Band::Kind::DepthUpTo, Band::Kind::DepthFrom})
      for (const int64_t offset : {int64_t{0}, int64_t{5}, int64_t{64}, int64_t{-3}}) {
        const Case& cs = sh.c;
        const Band band{kind, offset};
        SCOPED_TRACE(::testing::Message() << sh.what << " " << dtype_name(dtype_of_v<E>) << " band "
                                          << static_cast<int>(kind) << " offset " << offset);
        auto a = random_values<E>(extent(cs, cs.a, cs.a_outer, cs.m, cs.k), 7);
        const auto b = random_values<E>(extent(cs, cs.b, cs.b_outer, cs.k, cs.n), 8);
        // The depth bands' contract: a is 0 at the terms they leave out.
        auto hidden_term = [&](int64_t i, int64_t p) {
          return (kind == Band::Kind::DepthUpTo && p > i + offset) || (kind == Band::Kind::DepthFrom && p < i - offset);
        };
        for (int64_t o = 0; o < cs.outer; ++o)
          for (int64_t bi = 0; bi < cs.batch; ++bi)
            for (int64_t i = 0; i < cs.m; ++i)
              for (int64_t p = 0; p < cs.k; ++p)
                if (hidden_term(i, p)) a[o * cs.a_outer + bi * cs.a.batch + i * cs.a.row + p * cs.a.col] = E(0.0f);
        const std::vector<E> whole = run(cs, a, b, nullptr, nullptr);
        kernels::MatmulArgs g = args_of<E>(cs);
        g.a.data = a.data();
        g.b.data = b.data();
        g.band = band;
        std::vector<E> got(whole.size(), E(-7.0f));
        g.c = got.data();
        kernels::matmul(g);
        int64_t wrong = 0;
        for (int64_t r = 0; r < cs.outer * cs.batch; ++r)
          for (int64_t i = 0; i < cs.m; ++i)
            for (int64_t j = 0; j < cs.n; ++j) {
              const size_t at = static_cast<size_t>((r * cs.m + i) * cs.n + j);
              const bool zero = kind == Band::Kind::Columns && j > i + offset;
              const E want = zero ? E(0.0f) : whole[at];
              if (std::memcmp(&got[at], &want, sizeof(E)) != 0) ++wrong;
            }
        EXPECT_EQ(wrong, 0) << "entries that differ from the whole product (or from 0 where hidden)";
      }
}

TEST(SmallProducts, CausalBandsKeepEveryVisibleBitAndZeroTheHiddenColumns) {
  check_bands<BFloat16>();
  check_bands<float>();
  check_bands<double>();  // BLAS: whole, then the zeros
}

TEST(SmallProducts, BandMultiplyAddsCountTheVisibleTerms) {
  using Band = kernels::MatmulBand;
  EXPECT_EQ(kernels::band_multiply_adds(4, 5, 6, {}), 120.0);
  // Rows 0..3 keep 1, 2, 3, 4 of 5 columns (offset 0), times k = 6.
  EXPECT_EQ(kernels::band_multiply_adds(4, 5, 6, {Band::Kind::Columns, 0}), 60.0);
  // Row i sums p <= i + 2 of 6 terms: 3, 4, 5, 6; times n = 5.
  EXPECT_EQ(kernels::band_multiply_adds(4, 5, 6, {Band::Kind::DepthUpTo, 2}), 90.0);
  // Row i sums p >= i - 1: 6, 6, 5, 4.
  EXPECT_EQ(kernels::band_multiply_adds(4, 5, 6, {Band::Kind::DepthFrom, 1}), 105.0);
  // A band past every entry keeps none; one before them all keeps the whole product.
  EXPECT_EQ(kernels::band_multiply_adds(4, 5, 6, {Band::Kind::Columns, -10}), 0.0);
  EXPECT_EQ(kernels::band_multiply_adds(4, 5, 6, {Band::Kind::DepthFrom, 10}), 120.0);
}

// The ops' banded products (src/ops/banded_matmul.h) on every path the ops
// layer takes: heads with two strided batch dims (float32, bf16), dense 3-D
// batches, and float16, which computes through float32 and writes a Columns
// band's zeros itself. Against matmul with the hidden entries zeroed.
TEST(SmallProducts, BandedMatmulOpsZeroTheHiddenColumnsOnEveryPath) {
  using Band = kernels::MatmulBand;
  manual_seed(43);
  const int64_t B = 2, T = 24, H = 3, E = 8;
  const Tensor rows = arange(T).unsqueeze(1), cols = arange(T).unsqueeze(0);
  for (const DType dt : {kFloat32, kBFloat16, kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = randn({B, T, 2 * H * E}).to(dt);
    auto heads = [&](int64_t i) { return x.narrow(2, i * H * E, H * E).view({B, T, H, E}).transpose(1, 2); };
    const Tensor q = heads(0), k = heads(1);
    for (const bool dense : {false, true}) {
      const Tensor a = dense ? q.contiguous().view({B * H, T, E}) : q;
      const Tensor bt = (dense ? k.contiguous().view({B * H, T, E}) : k).transpose(-2, -1);
      const Tensor want = a.matmul(bt).masked_fill(cols.gt(rows.add(5)), 0.0);
      const Tensor got = ops::banded_matmul(a, bt, Band{Band::Kind::Columns, 5});
      EXPECT_TRUE(got.equal(want)) << (dense ? "dense batch" : "heads");
      Tensor into = full(want.sizes(), 7.0, TensorOptions(dt));
      ops::banded_matmul_into(a, bt, into, Band{Band::Kind::Columns, 5});
      EXPECT_TRUE(into.equal(want)) << (dense ? "dense batch, into" : "heads, into");
    }
  }
}
