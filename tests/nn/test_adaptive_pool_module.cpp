// nn::AdaptiveAvgPool2d with None sizes (OptionalSize2d), as torch's
// nn.AdaptiveAvgPool2d((None, 7)): forward and gradient against torch 1.13,
// and its printed form, which is torch's (the strings below are what torch
// 1.13 prints for the same modules).
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "kiln/kiln.h"
#include "support/oracle.h"

using namespace kiln;

TEST(AdaptiveAvgPool2dModule, NoneSizesMatchTorch) {
  Generator g(5), gg(6);
  const Tensor x = randn({2, 3, 6, 5}, kFloat64, &g);
  nn::AdaptiveAvgPool2d pool(OptionalSize2d{std::nullopt, 2});
  const Tensor leaf = x.detach().requires_grad_();
  const Tensor y = pool.forward(leaf);
  ASSERT_EQ(y.sizes().vec(), (std::vector<int64_t>{2, 3, 6, 2}));
  const Tensor gy = randn(y.sizes(), kFloat64, &gg);
  const Tensor gx = autograd::grad({y}, {leaf}, {gy})[0];
  test::OracleBatch batch;
  const size_t fwd = batch.add("module (None, 2)", "torch.nn.AdaptiveAvgPool2d((None, 2))(x0)", {x});
  const size_t bwd = batch.add_grad("module (None, 2) grad", "torch.nn.AdaptiveAvgPool2d((None, 2))(x0)", {x}, {0}, {gy});
  batch.run();
  for (auto [i, got] : {std::pair{fwd, y}, std::pair{bwd, gx}}) {
    const test::OracleOutcome& r = batch.outcome(i);
    ASSERT_TRUE(r.ok) << r.error;
    ASSERT_EQ(got.sizes().vec(), r.outputs[0].sizes().vec());
    EXPECT_TRUE(got.detach().allclose(r.outputs[0], 1e-12, 1e-12)) << "case " << i;
  }
}

TEST(AdaptiveAvgPool2dModule, PrintsLikeTorch) {
  EXPECT_EQ(nn::AdaptiveAvgPool2d(OptionalSize2d{std::nullopt, 7}).to_string(), "AdaptiveAvgPool2d(output_size=(None, 7))");
  EXPECT_EQ(nn::AdaptiveAvgPool2d(OptionalSize2d{3, std::nullopt}).to_string(), "AdaptiveAvgPool2d(output_size=(3, None))");
  EXPECT_EQ(nn::AdaptiveAvgPool2d(OptionalSize2d{std::nullopt, std::nullopt}).to_string(),
            "AdaptiveAvgPool2d(output_size=(None, None))");
  EXPECT_EQ(nn::AdaptiveAvgPool2d({3, 2}).to_string(), "AdaptiveAvgPool2d(output_size=(3, 2))");
  EXPECT_EQ(nn::AdaptiveAvgPool2d(std::vector<int64_t>{1, 1}).to_string(), "AdaptiveAvgPool2d(output_size=(1, 1))");
  EXPECT_EQ(nn::AdaptiveAvgPool2d({1}).to_string(), "AdaptiveAvgPool2d(output_size=1)");
  // The integer forms keep both sizes, as before.
  nn::AdaptiveAvgPool2d one({4});
  EXPECT_EQ(one.output_size[0], 4);
  EXPECT_EQ(one.output_size[1], 4);
  EXPECT_EQ(one.forward(zeros({1, 2, 8, 8})).sizes().vec(), (std::vector<int64_t>{1, 2, 4, 4}));
}
