// Every layer's forward against PyTorch's functional form given the same
// weights (one oracle run), gradient flow through each layer (gradcheck in
// float64), BatchNorm running statistics against torch, Dropout statistics.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>

#include "kiln/ops/gradcheck.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

struct Case {
  std::string id;
  std::shared_ptr<nn::Module> m;
  Tensor input;
  std::string expr;  // over x0 = input, then the module's parameters (and buffers) in order
  bool with_buffers = false;
};

std::vector<Case> layer_cases() {
  manual_seed(7);
  std::vector<Case> c;
  auto img = randn({2, 3, 7, 6});
  auto lin = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 5, .out_features = 4});
  c.push_back({"linear", lin, randn({3, 2, 5}), "F.linear(x0, x1, x2)"});
  c.push_back({"linear_nobias",
               std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 5, .out_features = 2, .bias = false}),
               randn({3, 5}), "F.linear(x0, x1)"});
  c.push_back({"conv2d",
               std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
                   .in_channels = 3, .out_channels = 4, .kernel_size = {3, 2}, .stride = {2}, .padding = {1}}),
               img, "F.conv2d(x0, x1, x2, stride=2, padding=1)"});
  c.push_back({"conv2d_groups",
               std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 4,
                                                              .out_channels = 2,
                                                              .kernel_size = {3},
                                                              .dilation = {2},
                                                              .groups = 2,
                                                              .bias = false}),
               randn({1, 4, 8, 8}), "F.conv2d(x0, x1, None, dilation=2, groups=2)"});
  c.push_back({"embedding",
               std::make_shared<nn::Embedding>(nn::EmbeddingOptions{.num_embeddings = 6, .embedding_dim = 3}),
               tensor<int64_t>({0, 5, 2, 2, 1, 4}, {2, 3}), "F.embedding(x0, x1)"});
  c.push_back({"embedding_padding",
               std::make_shared<nn::Embedding>(
                   nn::EmbeddingOptions{.num_embeddings = 6, .embedding_dim = 3, .padding_idx = -4}),
               tensor<int64_t>({0, 5, 2, 2, 1, 4}, {2, 3}), "F.embedding(x0, x1, padding_idx=2)"});
  c.push_back({"maxpool", std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{.kernel_size = {3}, .stride = {2}, .padding = {1}}),
               img, "F.max_pool2d(x0, 3, 2, 1)"});
  c.push_back({"avgpool", std::make_shared<nn::AvgPool2d>(nn::Pool2dOptions{.kernel_size = {2}}), img,
               "F.avg_pool2d(x0, 2)"});
  c.push_back({"adaptive_avgpool", std::make_shared<nn::AdaptiveAvgPool2d>(std::vector<int64_t>{3, 2}), img,
               "F.adaptive_avg_pool2d(x0, (3, 2))"});
  c.push_back({"flatten", std::make_shared<nn::Flatten>(), img, "torch.flatten(x0, 1)"});
  c.push_back({"identity", std::make_shared<nn::Identity>(), img, "x0"});
  c.push_back({"relu", std::make_shared<nn::ReLU>(), img, "F.relu(x0)"});
  c.push_back({"gelu", std::make_shared<nn::GELU>(), img, "F.gelu(x0)"});
  c.push_back({"gelu_tanh", std::make_shared<nn::GELU>("tanh"), img, "F.gelu(x0, approximate='tanh')"});
  c.push_back({"silu", std::make_shared<nn::SiLU>(), img, "F.silu(x0)"});
  c.push_back({"tanh", std::make_shared<nn::Tanh>(), img, "torch.tanh(x0)"});
  c.push_back({"sigmoid", std::make_shared<nn::Sigmoid>(), img, "torch.sigmoid(x0)"});
  c.push_back({"softmax", std::make_shared<nn::Softmax>(1), img, "F.softmax(x0, 1)"});
  auto seq = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 5, .out_features = 6}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 6, .out_features = 2})});
  c.push_back({"sequential", seq, randn({4, 5}), "F.linear(F.relu(F.linear(x0, x1, x2)), x3, x4)"});
  // Norms: perturb the affine parameters so they matter.
  auto perturb = [](const std::shared_ptr<nn::Module>& m) {
    NoGradGuard g;
    for (auto& p : m->parameters()) p.add_(randn(p.sizes()).mul(0.3));
    return m;
  };
  c.push_back({"layernorm", perturb(std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {7, 6}})),
               img, "F.layer_norm(x0, (7, 6), x1, x2)"});
  c.push_back({"groupnorm",
               perturb(std::make_shared<nn::GroupNorm>(nn::GroupNormOptions{.num_groups = 2, .num_channels = 4})),
               randn({3, 4, 5}), "F.group_norm(x0, 2, x1, x2)"});
  c.push_back({"rmsnorm", perturb(std::make_shared<nn::RMSNorm>(nn::RMSNormOptions{.normalized_shape = {6}})), img,
               "x0 * torch.rsqrt(x0.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps) * x1"});
  auto bn2 = perturb(std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = 3}));
  c.push_back({"batchnorm2d_train", bn2, img, "F.batch_norm(x0, x3.clone(), x4.clone(), x1, x2, True, 0.1, 1e-5)",
               true});
  c.push_back({"layernorm_plain",
               std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {6}, .elementwise_affine = false}),
               img, "F.layer_norm(x0, (6,))"});
  c.push_back({"groupnorm_plain",
               std::make_shared<nn::GroupNorm>(nn::GroupNormOptions{.num_groups = 3, .num_channels = 3, .affine = false}),
               img, "F.group_norm(x0, 3)"});
  c.push_back({"batchnorm1d_nostats",
               std::make_shared<nn::BatchNorm1d>(
                   nn::BatchNormOptions{.num_features = 5, .affine = false, .track_running_stats = false}),
               randn({6, 5}), "F.batch_norm(x0, None, None, training=True)"});
  return c;
}

}  // namespace

TEST(Layers, ForwardMatchesPyTorch) {
  auto cases = layer_cases();
  test::OracleBatch b;
  std::vector<Tensor> outs;
  for (auto& c : cases) {
    std::vector<Tensor> in = {c.input};
    for (auto& p : c.m->parameters()) in.push_back(p.detach());
    if (c.with_buffers)
      for (auto& t : c.m->buffers()) in.push_back(t.detach().clone());
    b.add(c.id, "(lambda F: " + c.expr + ")(torch.nn.functional)", in);
    outs.push_back(c.m->forward(c.input));
  }
  b.run();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << cases[i].id << ": " << r.error;
    ASSERT_EQ(r.outputs[0].sizes(), outs[i].sizes()) << cases[i].id;
    EXPECT_TRUE(outs[i].allclose(r.outputs[0], 1e-5, 1e-5)) << cases[i].id << "\nkiln:\n"
                                                            << outs[i] << "\ntorch:\n"
                                                            << r.outputs[0];
  }
}

TEST(Layers, GradientsFlowThroughEveryLayer) {
  for (auto& c : layer_cases()) {
    c.m->to(kFloat64);
    Tensor x = c.input.is_floating_point() ? c.input.to(kFloat64).requires_grad_() : c.input;
    TensorList inputs;
    if (x.requires_grad()) inputs.push_back(x);
    auto params = c.m->parameters();
    for (auto& p : params) inputs.push_back(p);
    if (inputs.empty()) continue;
    auto m = c.m;
    auto fn = [m, x](const TensorList&) { return TensorList{m->forward(x)}; };
    if (c.id == "batchnorm2d_train") m->eval();  // running stats must not drift between evaluations
    // The padding row is deliberately cut off from the gradient (as torch), so
    // finite differences disagree there; EmbeddingPaddingRowGetsNoGradient checks it.
    if (c.id != "embedding_padding") {
      EXPECT_TRUE(autograd::gradcheck(fn, inputs, {.fast_mode = true})) << c.id;
    }
    // Every parameter gets a gradient from backward.
    m->zero_grad();
    m->forward(x).sum().backward();
    for (auto& [n, p] : m->named_parameters()) EXPECT_TRUE(p.grad().defined()) << c.id << " " << n;
  }
}

TEST(Layers, BatchNormRunningStatsMatchTorch) {
  manual_seed(3);
  nn::BatchNorm1d bn({.num_features = 4, .momentum = 0.2});
  std::vector<Tensor> batches;
  for (int i = 0; i < 3; ++i) batches.push_back(randn({5, 4, 3}).mul(2.0).add(1.0));
  for (auto& x : batches) bn(x);
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 3);
  test::OracleBatch b;
  b.add("bn_running",
        "(lambda m: ([m(x) for x in (x0, x1, x2)], (m.running_mean, m.running_var))[1])"
        "(torch.nn.BatchNorm1d(4, momentum=0.2))",
        batches);
  b.run();
  const auto& r = b.outcome(0);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_TRUE(bn.running_mean.allclose(r.outputs[0], 1e-5, 1e-6)) << bn.running_mean << r.outputs[0];
  EXPECT_TRUE(bn.running_var.allclose(r.outputs[1], 1e-5, 1e-6)) << bn.running_var << r.outputs[1];
  // Eval uses the running statistics.
  bn.eval();
  Tensor x = randn({2, 4, 3});
  Tensor expected = (x - bn.running_mean.view({1, 4, 1})) / (bn.running_var.view({1, 4, 1}) + 1e-5).sqrt();
  EXPECT_TRUE(bn(x).allclose(expected, 1e-5, 1e-6));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 3);
  EXPECT_EQ(bn.to_string(), "BatchNorm1d(4, eps=1e-05, momentum=0.2, affine=True, track_running_stats=True)");
  std::vector<std::string> keys;
  for (auto& [n, t] : bn.state_dict()) keys.push_back(n);
  EXPECT_EQ(keys, (std::vector<std::string>{"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}));
  EXPECT_THROW(bn(randn({2, 3})), ShapeError);
}

TEST(Layers, BatchNormCumulativeAverageWithoutMomentum) {
  manual_seed(4);
  nn::BatchNorm2d bn({.num_features = 2, .momentum = std::nullopt});
  std::vector<Tensor> batches;
  for (int i = 0; i < 3; ++i) batches.push_back(randn({3, 2, 2, 2}).add(static_cast<double>(i)));
  for (auto& x : batches) bn(x);
  test::OracleBatch b;
  b.add("bn_cumulative",
        "(lambda m: ([m(x) for x in (x0, x1, x2)], (m.running_mean, m.running_var))[1])"
        "(torch.nn.BatchNorm2d(2, momentum=None))",
        batches);
  b.run();
  const auto& r = b.outcome(0);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_TRUE(bn.running_mean.allclose(r.outputs[0], 1e-5, 1e-6)) << bn.running_mean << r.outputs[0];
  EXPECT_TRUE(bn.running_var.allclose(r.outputs[1], 1e-5, 1e-6)) << bn.running_var << r.outputs[1];
  EXPECT_NE(bn.to_string().find("momentum=None"), std::string::npos) << bn.to_string();
}

// Memory reports split a model into parameters and buffers (running statistics),
// not parameters and "activations".
TEST(Layers, BuffersAndParametersAreChargedToTheirCategories) {
  nn::BatchNorm2d bn({.num_features = 3});
  for (auto& [name, b] : bn.named_buffers())
    EXPECT_EQ(b.storage()->category(), MemoryCategory::Buffer) << name;
  for (auto& [name, p] : bn.named_parameters())
    EXPECT_EQ(p.storage()->category(), MemoryCategory::Parameter) << name;
}

TEST(Layers, DropoutTrainScalesAndEvalIsIdentity) {
  manual_seed(11);
  nn::Dropout d(0.25);
  Tensor x = ones({200000});
  Tensor y = d(x);
  auto v = test::to_doubles(y);
  int64_t kept = 0;
  for (double e : v) {
    if (e != 0.0) {
      ++kept;
      EXPECT_NEAR(e, 1.0 / 0.75, 1e-6);
    }
  }
  double frac = static_cast<double>(kept) / static_cast<double>(v.size());
  // Binomial std of the kept fraction is ~0.001; allow 5 sigma.
  EXPECT_NEAR(frac, 0.75, 0.005);
  EXPECT_NEAR(y.mean().item<double>(), 1.0, 0.01);
  // The mask is recorded by autograd: the gradient is the mask scaled.
  Tensor xg = ones({1000}).requires_grad_();
  Tensor yg = d(xg);
  yg.sum().backward();
  EXPECT_TRUE(xg.grad().equal(yg.detach()));
  d.eval();
  EXPECT_TRUE(d(x).is_same(x));
  EXPECT_THROW(nn::Dropout(1.5), ValueError);
}

// Issue 27: nn::functional has the activations and dropout under torch's names;
// F::dropout draws the same mask as nn::Dropout for the same generator state.
TEST(Layers, FunctionalActivationsAndDropout) {
  Tensor x = tensor<float>({-2.0f, -0.5f, 0.0f, 1.5f});
  EXPECT_TRUE(nn::F::relu(x).equal(x.relu()));
  EXPECT_TRUE(nn::F::gelu(x, "tanh").equal(x.gelu("tanh")));
  EXPECT_TRUE(nn::F::silu(x).equal(x.silu()));
  EXPECT_TRUE(nn::F::sigmoid(x).equal(x.sigmoid()));
  EXPECT_TRUE(nn::F::tanh(x).equal(x.tanh()));
  EXPECT_TRUE(nn::F::softmax(x, 0).equal(x.softmax(0)));
  EXPECT_TRUE(nn::F::log_softmax(x, 0).equal(x.log_softmax(0)));
  Tensor big = ones({64, 64});
  manual_seed(5);
  Tensor a = nn::F::dropout(big, 0.25);
  manual_seed(5);
  nn::Dropout d(0.25);
  EXPECT_TRUE(a.equal(d(big)));
  EXPECT_TRUE(nn::F::dropout(big, 0.25, /*training=*/false).equal(big));
  EXPECT_THROW(nn::F::dropout(big, 1.5), ValueError);
}

TEST(Layers, EmbeddingPaddingRowGetsNoGradient) {
  nn::Embedding emb({.num_embeddings = 4, .embedding_dim = 2, .padding_idx = 1});
  EXPECT_TRUE(emb.weight.select(0, 1).equal(zeros({2})));
  EXPECT_EQ(emb.to_string(), "Embedding(4, 2, padding_idx=1)");
  emb(tensor<int64_t>({1, 3, 1, 3, 0}, {5})).sum().backward();
  // Row counts as torch: padding row 0, row 3 twice, row 0 once, row 2 never.
  EXPECT_EQ(test::to_doubles(emb.weight.grad()), (std::vector<double>{1, 1, 0, 0, 0, 0, 2, 2}));
  EXPECT_THROW(nn::Embedding({.num_embeddings = 4, .embedding_dim = 2, .padding_idx = 4}), ValueError);
  EXPECT_THROW(emb(ones({2})), DTypeError);
}

TEST(Layers, ShapeErrorsSayWhatWasExpected) {
  nn::Linear lin({.in_features = 3, .out_features = 2});
  try {
    lin(ones({2, 4}));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("last dim 3"), std::string::npos) << e.what();
  }
  nn::LayerNorm ln({.normalized_shape = {4}});
  EXPECT_THROW(ln(ones({2, 3})), ShapeError);
  EXPECT_THROW(nn::GroupNorm({.num_groups = 3, .num_channels = 4}), ValueError);
  nn::ModuleDict dict({{"a", std::make_shared<nn::ReLU>()}});
  EXPECT_TRUE(dict.contains("a"));
  EXPECT_THROW(dict["b"], ValueError);
  nn::ModuleList list({std::make_shared<nn::ReLU>()});
  EXPECT_THROW(list(ones({1})), ValueError);
  EXPECT_THROW(list[1], IndexError);
}
