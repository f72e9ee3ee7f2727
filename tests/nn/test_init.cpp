// nn::init and the layers' default initialisation: bounds, means and standard
// deviations within statistical tolerance of PyTorch's distributions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/nn/init.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "support/test_util.h"

using namespace kiln;

namespace {
struct Stats {
  double mean = 0, std = 0, min = 0, max = 0;
};
Stats stats(const Tensor& t) {
  auto v = test::to_doubles(t);
  Stats s;
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  for (double e : v) s.mean += e;
  s.mean /= static_cast<double>(v.size());
  for (double e : v) s.std += (e - s.mean) * (e - s.mean);
  s.std = std::sqrt(s.std / static_cast<double>(v.size() - 1));
  return s;
}
// Uniform(-b, b): inside the bounds, near both ends, std b/sqrt(3).
void expect_uniform(const Tensor& t, double b, const char* what) {
  Stats s = stats(t);
  const double n = static_cast<double>(t.numel());
  EXPECT_GE(s.min, -b) << what;
  EXPECT_LE(s.max, b) << what;
  EXPECT_LT(s.min, -0.95 * b) << what;
  EXPECT_GT(s.max, 0.95 * b) << what;
  EXPECT_NEAR(s.mean, 0.0, 5 * b / std::sqrt(3.0 * n)) << what;
  EXPECT_NEAR(s.std, b / std::sqrt(3.0), 0.03 * b) << what;
}
void expect_normal(const Tensor& t, double mean, double sd, const char* what) {
  Stats s = stats(t);
  EXPECT_NEAR(s.mean, mean, 5 * sd / std::sqrt(static_cast<double>(t.numel()))) << what;
  EXPECT_NEAR(s.std, sd, 0.03 * sd) << what;
}
}  // namespace

TEST(Init, LinearAndConvDefaultsAsPyTorch) {
  manual_seed(1);
  nn::Linear lin({.in_features = 400, .out_features = 300});
  // kaiming_uniform_(a=sqrt(5)): bound = sqrt(6 / ((1 + 5) * fan_in)) = 1/sqrt(fan_in).
  expect_uniform(lin.weight, 1.0 / std::sqrt(400.0), "linear weight");
  Stats b = stats(lin.bias);
  EXPECT_GE(b.min, -1.0 / 20);
  EXPECT_LE(b.max, 1.0 / 20);
  nn::Conv2d conv({.in_channels = 16, .out_channels = 64, .kernel_size = {3, 3}});
  expect_uniform(conv.weight, 1.0 / std::sqrt(16.0 * 9), "conv weight");
  EXPECT_LE(stats(conv.bias).max, 1.0 / 12);
  nn::Embedding emb({.num_embeddings = 1000, .embedding_dim = 64});
  expect_normal(emb.weight, 0.0, 1.0, "embedding");
  nn::LayerNorm ln({.normalized_shape = {8}});
  EXPECT_TRUE(ln.weight.equal(ones({8})));
  EXPECT_TRUE(ln.bias.equal(zeros({8})));
  nn::BatchNorm2d bn({.num_features = 3});
  EXPECT_TRUE(bn.running_var.equal(ones({3})));
  EXPECT_TRUE(bn.running_mean.equal(zeros({3})));
  // Default init runs under no-grad: parameters stay leaves.
  EXPECT_TRUE(lin.weight.is_leaf() && lin.weight.requires_grad());
}

TEST(Init, Initialisers) {
  manual_seed(2);
  Tensor w = empty({256, 512});
  nn::init::kaiming_uniform_(w, 0.0, "fan_in", "relu");
  expect_uniform(w, std::sqrt(2.0) * std::sqrt(3.0 / 512), "kaiming_uniform relu fan_in");
  nn::init::kaiming_normal_(w, 0.0, "fan_out", "relu");
  expect_normal(w, 0.0, std::sqrt(2.0 / 256), "kaiming_normal relu fan_out");
  nn::init::xavier_uniform_(w, 2.0);
  expect_uniform(w, 2.0 * std::sqrt(6.0 / (256 + 512)), "xavier_uniform");
  nn::init::xavier_normal_(w);
  expect_normal(w, 0.0, std::sqrt(2.0 / (256 + 512)), "xavier_normal");
  nn::init::normal_(w, 3.0, 0.5);
  expect_normal(w, 3.0, 0.5, "normal");
  nn::init::uniform_(w, -2.0, 2.0);
  expect_uniform(w, 2.0, "uniform");
  nn::init::trunc_normal_(w, 0.0, 1.0, -1.0, 1.0);
  Stats s = stats(w);
  EXPECT_GE(s.min, -1.0);
  EXPECT_LE(s.max, 1.0);
  // The std of N(0,1) truncated to [-1, 1] is 0.5379.
  EXPECT_NEAR(s.std, 0.5379, 0.01);
  EXPECT_NEAR(s.mean, 0.0, 0.01);
  nn::init::constant_(w, 0.25);
  EXPECT_TRUE(w.equal(full({256, 512}, 0.25f)));
  nn::init::ones_(w);
  EXPECT_TRUE(w.equal(ones({256, 512})));
  nn::init::zeros_(w);
  EXPECT_TRUE(w.equal(zeros({256, 512})));
  // On a parameter that requires grad: allowed (no-grad), stays a leaf.
  Tensor p = empty({4, 4}).requires_grad_();
  nn::init::kaiming_uniform_(p);
  EXPECT_TRUE(p.is_leaf());
  EXPECT_NEAR(nn::init::calculate_gain("leaky_relu", std::sqrt(5.0)), std::sqrt(1.0 / 3.0), 1e-12);
  EXPECT_NEAR(nn::init::calculate_gain("tanh"), 5.0 / 3.0, 1e-12);
  EXPECT_THROW(nn::init::calculate_gain("softsign"), ValueError);
  EXPECT_THROW(nn::init::kaiming_uniform_(p, 0.0, "fan_mid"), ValueError);
  Tensor v = empty({4});
  EXPECT_THROW(nn::init::xavier_uniform_(v), ShapeError);
  EXPECT_EQ(nn::init::calculate_fan_in_and_fan_out(empty({8, 3, 5, 5})), (std::pair<int64_t, int64_t>{75, 200}));
}
