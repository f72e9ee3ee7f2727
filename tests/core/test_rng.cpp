// Philox4x32-10 and the random factories: known-answer vectors, exact
// reproducibility (seed, state save/restore, thread count), distribution
// sanity with statistical bounds, ranges and permutations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

struct Moments {
  double mean = 0, var = 0, min = INFINITY, max = -INFINITY;
};

Moments moments(const Tensor& t) {
  const auto v = test::to_doubles(t);
  Moments m;
  for (double x : v) {
    m.mean += x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean /= static_cast<double>(v.size());
  for (double x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= static_cast<double>(v.size() - 1);
  return m;
}

class ThreadCount {
 public:
  explicit ThreadCount(int n) : prev_(get_num_threads()) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(prev_); }

 private:
  int prev_;
};

}  // namespace

TEST(Philox, Random123KnownAnswers) {
  // Random123 kat_vectors, philox4x32 10: (counter words c0..c3, key words k0 k1) -> output.
  EXPECT_EQ(philox4x32(0, 0, 0), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32(~0ULL, ~0ULL, ~0ULL),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  // counter 243f6a88 85a308d3 13198a2e 03707344, key a4093822 299f31d0 (the digits of pi).
  EXPECT_EQ(philox4x32(0x299f31d0a4093822ULL, 0x0370734413198a2eULL, 0x85a308d3243f6a88ULL),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// Note [Philox sixteen at a time]: the vectorised fill gives each value the
// scalar loop's bits, a + span * u01_24(word) with one rounding, across 64-value
// steps, their tails, and counters whose low 32 bits wrap.
TEST(Philox, UniformFloatsHaveTheScalarBits) {
  const uint64_t keys[] = {0, 67280421310721ULL, 0xFFFFFFFFFFFFFFFFULL};
  const uint64_t firsts[] = {0, 12345, 0xFFFFFFFFULL - 5, 0xFFFFFFFFFFFFFFF0ULL};
  const int64_t sizes[] = {0, 1, 3, 63, 64, 65, 130, 1000};
  const std::pair<float, float> ranges[] = {{0.f, 1.f}, {-2.f, 4.f}, {0.5f, 1e-3f}};
  for (uint64_t key : keys)
    for (uint64_t first : firsts)
      for (int64_t n : sizes)
        for (const auto& [a, span] : ranges) {
          std::vector<float> got(static_cast<size_t>(n) + 1, -7.f);
          detail::philox_uniform_floats(got.data(), n, key, first, a, span);
          int64_t bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            const auto w = philox4x32(key, 0, first + static_cast<uint64_t>(i / 4));
            const float u = static_cast<float>(w[static_cast<size_t>(i % 4)] >> 8) * (1.0f / 16777216.0f);
            const float want = std::fma(span, u, a);
            bad += std::memcmp(&want, &got[static_cast<size_t>(i)], sizeof want) != 0;
          }
          EXPECT_EQ(bad, 0) << "key " << key << " first " << first << " n " << n << " a " << a << " span " << span;
          EXPECT_EQ(got[static_cast<size_t>(n)], -7.f) << "wrote past n";
        }
}

TEST(Generator, SameSeedSameTensors) {
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    Generator a(42), b(42);
    EXPECT_TRUE(test::bitwise_equal(rand({7, 5}, dt, &a), rand({7, 5}, dt, &b))) << dtype_name(dt);
    EXPECT_TRUE(test::bitwise_equal(randn({13}, dt, &a), randn({13}, dt, &b))) << dtype_name(dt);
  }
  Generator a(7), b(7), c(8);
  EXPECT_TRUE(test::bitwise_equal(randint(-3, 9, {100}, {}, &a), randint(-3, 9, {100}, {}, &b)));
  EXPECT_TRUE(test::bitwise_equal(randperm(50, &a), randperm(50, &b)));
  EXPECT_FALSE(test::bitwise_equal(rand({100}, kFloat32, &a), rand({100}, kFloat32, &c)));
  manual_seed(5);
  const Tensor x = randn({10});
  manual_seed(5);
  EXPECT_TRUE(test::bitwise_equal(x, randn({10})));
}

TEST(Generator, StateResumesExactly) {
  Generator g(123);
  rand({17}, kFloat32, &g);
  const GeneratorState s = g.get_state();
  const Tensor next1 = randn({33}, kFloat64, &g);
  const Tensor next2 = randint(0, 1000, {9}, {}, &g);
  g.set_state(s);
  EXPECT_TRUE(test::bitwise_equal(randn({33}, kFloat64, &g), next1));
  EXPECT_TRUE(test::bitwise_equal(randint(0, 1000, {9}, {}, &g), next2));
  // A copy continues the same stream independently.
  Generator copy = g;
  EXPECT_EQ(copy.get_state(), g.get_state());
  EXPECT_TRUE(test::bitwise_equal(rand({4}, kFloat32, &copy), rand({4}, kFloat32, &g)));
  EXPECT_EQ(g.initial_seed(), 123u);
}

TEST(Generator, OffsetAdvancesByBlocks) {
  Generator g(1);
  rand({10}, kFloat32, &g);  // 4 floats per 128-bit block -> 3 blocks
  EXPECT_EQ(g.get_state().offset, 3u);
  rand({10}, kFloat64, &g);  // 2 doubles per block -> 5 blocks
  EXPECT_EQ(g.get_state().offset, 8u);
  rand({0}, kFloat32, &g);
  EXPECT_EQ(g.get_state().offset, 8u);
  EXPECT_EQ(g.reserve(5), 8u);
  EXPECT_EQ(g.get_state().offset, 13u);
}

TEST(Generator, IndependentOfThreadCount) {
  Tensor one, two;
  {
    ThreadCount t(1);
    Generator g(99);
    one = randn({300000}, kFloat32, &g);
  }
  {
    ThreadCount t(2);
    Generator g(99);
    two = randn({300000}, kFloat32, &g);
  }
  EXPECT_TRUE(test::bitwise_equal(one, two));
  {
    ThreadCount t(1);
    Generator g(3);
    one = rand({200001}, kFloat64, &g);
  }
  {
    ThreadCount t(2);
    Generator g(3);
    two = rand({200001}, kFloat64, &g);
  }
  EXPECT_TRUE(test::bitwise_equal(one, two));
}

TEST(RandomFactories, UniformMoments) {
  constexpr int64_t n = 1'000'000;
  Generator g(2);
  for (DType dt : {kFloat32, kFloat64}) {
    const Moments m = moments(rand({n}, dt, &g));
    EXPECT_GE(m.min, 0.0);
    EXPECT_LT(m.max, 1.0);
    // Uniform(0,1): mean 1/2, variance 1/12; 6 standard errors.
    EXPECT_NEAR(m.mean, 0.5, 6 * std::sqrt(1.0 / 12 / n)) << dtype_name(dt);
    EXPECT_NEAR(m.var, 1.0 / 12, 6 * std::sqrt(1.0 / 180 / n)) << dtype_name(dt);
  }
  Tensor t = empty({n}, kFloat64);
  uniform_(t, -2.0, 3.0, &g);
  const Moments m = moments(t);
  EXPECT_GE(m.min, -2.0);
  EXPECT_LT(m.max, 3.0);
  EXPECT_NEAR(m.mean, 0.5, 6 * std::sqrt(25.0 / 12 / n));
}

TEST(RandomFactories, NormalMoments) {
  constexpr int64_t n = 1'000'000;
  Generator g(3);
  for (DType dt : {kFloat32, kFloat64}) {
    const Tensor x = randn({n}, dt, &g);
    const Moments m = moments(x);
    EXPECT_NEAR(m.mean, 0.0, 6 / std::sqrt(static_cast<double>(n))) << dtype_name(dt);
    EXPECT_NEAR(m.var, 1.0, 6 * std::sqrt(2.0 / n)) << dtype_name(dt);
    // Shape: the fraction within one standard deviation is 0.6827.
    const auto v = test::to_doubles(x);
    const double within = static_cast<double>(std::count_if(v.begin(), v.end(), [](double a) { return std::fabs(a) < 1; })) / n;
    EXPECT_NEAR(within, 0.682689, 6 * std::sqrt(0.6827 * 0.3173 / n)) << dtype_name(dt);
  }
  Tensor t = empty({n}, kFloat32);
  normal_(t, 3.0, 0.5, &g);
  const Moments m = moments(t);
  EXPECT_NEAR(m.mean, 3.0, 6 * 0.5 / std::sqrt(static_cast<double>(n)));
  EXPECT_NEAR(std::sqrt(m.var), 0.5, 0.005);
  // 16-bit outputs are rounded draws, still normal.
  const Moments mb = moments(randn({100000}, kBFloat16, &g));
  EXPECT_NEAR(mb.mean, 0.0, 0.03);
  EXPECT_NEAR(mb.var, 1.0, 0.03);
}

TEST(RandomFactories, NonContiguousTargets) {
  Generator g(4);
  Tensor base = zeros({6, 8}, kFloat32);
  Tensor view = base.t();
  uniform_(view, 5.0, 6.0, &g);
  const Moments m = moments(base);
  EXPECT_GE(m.min, 5.0);
  EXPECT_LT(m.max, 6.0);
}

TEST(RandomFactories, RandintRange) {
  Generator g(5);
  const Tensor r = randint(-3, 4, {10000}, {}, &g);
  EXPECT_EQ(r.dtype(), kInt64);
  const auto v = test::to_doubles(r);
  std::vector<int> counts(7, 0);
  for (double x : v) {
    ASSERT_GE(x, -3);
    ASSERT_LT(x, 4);
    ++counts[static_cast<int>(x) + 3];
  }
  for (int c : counts) EXPECT_NEAR(c, 10000.0 / 7, 6 * std::sqrt(10000.0 / 7));
  EXPECT_EQ(randint(0, 5, {3}, kInt32, &g).dtype(), kInt32);
  EXPECT_EQ(randint(0, 2, {3}, kBool, &g).dtype(), kBool);
  // The full int64 range: no signed overflow, values spread over both signs.
  const auto wide = test::to_doubles(randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                                             {1000}, {}, &g));
  EXPECT_TRUE(std::any_of(wide.begin(), wide.end(), [](double x) { return x < -1e18; }));
  EXPECT_TRUE(std::any_of(wide.begin(), wide.end(), [](double x) { return x > 1e18; }));
}

TEST(RandomFactories, RandpermIsAPermutation) {
  Generator g(6);
  for (int64_t n : {0, 1, 2, 17, 1000}) {
    const Tensor p = randperm(n, &g);
    EXPECT_EQ(p.dtype(), kInt64);
    ASSERT_EQ(p.numel(), n);
    std::vector<int64_t> v(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + n);
    std::sort(v.begin(), v.end());
    std::vector<int64_t> iota(static_cast<size_t>(n));
    std::iota(iota.begin(), iota.end(), 0);
    EXPECT_EQ(v, iota) << "n=" << n;
  }
  const Tensor p = randperm(1000, &g);
  int fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += p.data_ptr<int64_t>()[i] == i;
  EXPECT_LT(fixed, 10) << "a random permutation has about one fixed point";
}

TEST(RandomFactories, Errors) {
  Tensor i = zeros({3}, kInt64);
  EXPECT_THROW(uniform_(i), DTypeError);
  EXPECT_THROW(normal_(i), DTypeError);
  Tensor f = zeros({3});
  EXPECT_THROW(uniform_(f, 2.0, 1.0), ValueError);
  EXPECT_THROW(normal_(f, 0.0, -1.0), ValueError);
  EXPECT_THROW(randint(3, 3, {2}), ValueError);
  EXPECT_THROW(randperm(-1), ValueError);
  EXPECT_THROW(rand({2}, kInt32), DTypeError);
  EXPECT_TRUE(rand({2}, TensorOptions(kFloat32).requires_grad(true)).requires_grad());
}
