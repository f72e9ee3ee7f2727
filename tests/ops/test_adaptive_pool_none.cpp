// adaptive_avg_pool2d with None output sizes (OptionalSize2d: std::nullopt keeps
// the input's size in that dim, as F.adaptive_avg_pool2d(x, (None, 7))): values
// in float32 and float64 and float64 gradients against torch 1.13, gradcheck,
// and that braced integer lists keep meaning what they meant (no ambiguity).
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "dense_grad_util.h"
#include "kiln/kiln.h"
#include "kiln/ops/conv.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

struct NoneCase {
  const char* label;
  std::vector<int64_t> shape;
  OptionalSize2d size;
  const char* torch_size;
};

const NoneCase kNoneCases[] = {
    {"(None, 2)", {2, 3, 6, 5}, {std::nullopt, 2}, "(None, 2)"},
    {"(4, None)", {1, 2, 7, 5}, {4, std::nullopt}, "(4, None)"},
    {"(None, None)", {2, 2, 5, 4}, {std::nullopt, std::nullopt}, "(None, None)"},
    {"(None, 7), larger than the input", {1, 2, 3, 5}, {std::nullopt, 7}, "(None, 7)"},
    {"unbatched (3, None)", {3, 7, 6}, {3, std::nullopt}, "(3, None)"},
    {"no None", {2, 3, 6, 5}, {3, 2}, "(3, 2)"},
};

void expect_near(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes().vec(), want.sizes().vec()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  const auto a = test::values(got), b = test::values(want);
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::abs(a[i] - b[i]), tol * (1 + std::abs(b[i]))) << what << ": element " << i;
}

}  // namespace

TEST(AdaptiveAvgPoolNone, MatchesTorch) {
  test::OracleBatch batch;
  struct Pending {
    size_t index;
    const NoneCase* c;
    Tensor x, gy;
  };
  std::vector<Pending> pending;
  uint64_t seed = 1;
  for (const NoneCase& c : kNoneCases) {
    const std::string expr = std::string("F.adaptive_avg_pool2d(x0, ") + c.torch_size + ")";
    for (DType dt : {kFloat32, kFloat64}) {
      Generator g(seed);
      const Tensor x = randn(c.shape, kFloat64, &g).to(dt);
      pending.push_back({batch.add(std::string(c.label) + " " + std::string(dtype_name(dt)), expr, {x}), &c, x, {}});
    }
    Generator g(seed), gg(seed + 50);
    const Tensor x = randn(c.shape, kFloat64, &g);
    const Tensor gy = randn(adaptive_avg_pool2d(x, c.size).sizes(), kFloat64, &gg);
    pending.push_back({batch.add_grad(std::string(c.label) + " grad", expr, {x}, {0}, {gy}), &c, x, gy});
    ++seed;
  }
  batch.run();
  for (const Pending& p : pending) {
    const test::OracleOutcome& r = batch.outcome(p.index);
    const std::string what = std::string(p.c->label) + " " + std::string(dtype_name(p.x.dtype())) +
                             (p.gy.defined() ? " grad" : "");
    ASSERT_TRUE(r.ok) << what << ": torch raised " << r.error;
    if (!p.gy.defined()) {
      expect_near(adaptive_avg_pool2d(p.x, p.c->size), r.outputs[0], p.x.dtype() == kFloat32 ? 1e-6 : 1e-12, what);
      continue;
    }
    const Tensor leaf = p.x.detach().requires_grad_();
    const TensorList g = autograd::grad({adaptive_avg_pool2d(leaf, p.c->size)}, {leaf}, {p.gy});
    expect_near(g[0], r.outputs[0], 1e-12, what);
  }
}

TEST(AdaptiveAvgPoolNone, Gradcheck) {
  test::expect_gradcheck([](const TensorList& t) { return adaptive_avg_pool2d(t[0], {std::nullopt, 3}); },
                         {test::leaf({1, 2, 4, 5}, 11)}, "(None, 3)");
  test::expect_gradcheck([](const TensorList& t) { return adaptive_avg_pool2d(t[0], OptionalSize2d{3, std::nullopt}); },
                         {test::leaf({2, 5, 4}, 12)}, "unbatched (3, None)");
}

// Braced integer lists, single ints and vectors still pick the integer overloads and mean what they meant.
TEST(AdaptiveAvgPoolNone, IntegerSizesStillWork) {
  Generator g(3);
  const Tensor x = randn({2, 3, 6, 5}, kFloat32, &g);
  const std::vector<int64_t> v23{2, 3};
  const Tensor want = adaptive_avg_pool2d(x, IntArrayRef(v23));
  EXPECT_TRUE(adaptive_avg_pool2d(x, {2, 3}).equal(want));
  EXPECT_TRUE(adaptive_avg_pool2d(x, v23).equal(want));
  EXPECT_TRUE(adaptive_avg_pool2d(x, OptionalSize2d{2, 3}).equal(want));
  const int h = 2, w = 3;  // int variables, not int64_t constants
  EXPECT_TRUE(adaptive_avg_pool2d(x, {h, w}).equal(want));
  EXPECT_EQ(adaptive_avg_pool2d(x, 1).sizes().vec(), (std::vector<int64_t>{2, 3, 1, 1}));
  EXPECT_EQ(adaptive_avg_pool2d(x, {4}).sizes().vec(), (std::vector<int64_t>{2, 3, 4, 4}));
  const std::optional<int64_t> none, seven = 7;  // optional variables pick OptionalSize2d
  EXPECT_EQ(adaptive_avg_pool2d(x, {none, seven}).sizes().vec(), (std::vector<int64_t>{2, 3, 6, 7}));
  EXPECT_EQ(adaptive_avg_pool2d(x, {std::nullopt, std::nullopt}).sizes().vec(), x.sizes().vec());
  // The integer form's errors are unchanged, and a None size is checked as the size it stands for.
  EXPECT_NE(test::error_message<ValueError>([&] { adaptive_avg_pool2d(x, {1, 2, 3}); }).find("a single int or 2 ints"),
            std::string::npos);
  EXPECT_NE(test::error_message<ValueError>([&] { adaptive_avg_pool2d(x, {std::nullopt, -1}); })
                .find("output_size must be non-negative, got 6 x -1"),
            std::string::npos);
  EXPECT_NE(test::error_message<ShapeError>([&] { adaptive_avg_pool2d(zeros({4, 4}), {std::nullopt, 2}); }),
            "<no error>");
}
