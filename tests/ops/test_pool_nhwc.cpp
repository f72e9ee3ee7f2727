// Channels-last max pooling on kiln's own kernel (Note [Channels-last max
// pooling] in src/kernels/cpu/pool_max_nhwc.cpp) against kiln's torch-exact
// NCHW loop in float64 (pinned to torch in test_conv_pool*.cpp): the same
// maxima, NaN included, and the same gradients, bit for bit. Inputs rounded to
// halves (many ties), with NaN and -inf planted; gradients small integers, so
// that overlapping windows' sums are exact in any order. Windows disjoint
// (2x2 stride 2, with gaps, with padding, ceil_mode) and overlapping (3x3
// stride 2 padding 1, stride 1), channels a multiple of 16 and not (the
// kernel's tail), float32 and bfloat16, 1 and 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/memory_format.h"

using namespace kiln;

namespace {

struct Case {
  int64_t k, s, p;
  bool ceil;
};

// Element-wise equality that takes NaN as equal to NaN.
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  const Tensor a = got.to(kFloat64).contiguous(), b = want.to(kFloat64).contiguous();
  ASSERT_EQ(a.sizes().vec(), b.sizes().vec()) << what;
  const double *pa = a.data_ptr<double>(), *pb = b.data_ptr<double>();
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const bool same = (std::isnan(pa[i]) && std::isnan(pb[i])) || pa[i] == pb[i];
    if (!same && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.numel() << " differ, first at " << first << ": "
                    << pa[first < 0 ? 0 : first] << " vs " << pb[first < 0 ? 0 : first];
}

Tensor planted_input(int64_t c, uint64_t seed) {
  Generator g(seed);
  Tensor x = randn({2, c, 9, 11}, kFloat64, &g);
  double* v = x.data_ptr<double>();
  for (int64_t i = 0; i < x.numel(); ++i) v[i] = std::round(v[i] * 2) / 2;
  v[5] = std::numeric_limits<double>::quiet_NaN();
  v[x.numel() / 2 + 3] = std::numeric_limits<double>::quiet_NaN();
  v[17] = -std::numeric_limits<double>::infinity();
  v[18] = -std::numeric_limits<double>::infinity();
  return x;
}

}  // namespace

TEST(PoolNhwc, MaxPoolMatchesTheTorchExactLoopBitwise) {
  const int saved = get_num_threads();
  const Case cases[] = {{2, 2, 0, false}, {2, 2, 0, true}, {2, 3, 1, true}, {3, 3, 1, false},
                        {3, 2, 1, false}, {3, 2, 1, true}, {3, 1, 1, false}, {1, 1, 0, false}};
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (int64_t c : {20, 32}) {
      const Tensor x64 = planted_input(c, 40 + static_cast<uint64_t>(c));
      for (const Case& k : cases) {
        const auto pool = [&](const Tensor& t) { return max_pool2d(t, k.k, k.s, k.p, 1, k.ceil); };
        const Tensor want_leaf = x64.detach().requires_grad_();
        const Tensor want = pool(want_leaf);
        std::vector<double> gv(static_cast<size_t>(want.numel()));
        for (size_t i = 0; i < gv.size(); ++i) gv[i] = static_cast<double>(i % 7 + 1);
        const Tensor g = tensor<double>(gv).reshape(want.sizes());
        const Tensor want_grad = autograd::grad({want}, {want_leaf}, {g})[0];
        for (DType dt : {kFloat32, kBFloat16}) {
          const bool overlapping = k.s < k.k;
          if (dt == kBFloat16 && overlapping) continue;  // oneDNN's (test_conv_pool_grad.cpp)
          const std::string what = std::string(dtype_name(dt)) + " c=" + std::to_string(c) + " k=" +
                                   std::to_string(k.k) + " s=" + std::to_string(k.s) + " p=" + std::to_string(k.p) +
                                   (k.ceil ? " ceil" : "") + ", threads " + std::to_string(threads);
          const Tensor x = contiguous(x64.to(dt), MemoryFormat::ChannelsLast).requires_grad_();
          const Tensor y = pool(x);
          EXPECT_EQ(suggest_memory_format(y), MemoryFormat::ChannelsLast) << what << ": a NaN no longer leaves NHWC";
          expect_same(y, want, what + ": output");
          const Tensor gx = autograd::grad({y}, {x}, {contiguous(g.to(dt), MemoryFormat::ChannelsLast)})[0];
          expect_same(gx, want_grad, what + ": input gradient");
          const NoGradGuard no_grad;  // inference writes no workspace
          expect_same(pool(x.detach()), want, what + ": output without grad");
        }
      }
    }
  }
  set_num_threads(saved);
}
