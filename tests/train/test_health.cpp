// HealthMonitor (kiln/train/health.h): each number it records is checked on a
// model built to show it (a detached branch, dead ReLUs, a known SGD update).
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/kiln.h"
#include "kiln/train/health.h"

using namespace kiln;

namespace {

// in -> a -> relu -> b -> out, plus a side branch whose output is detached (it never gets a gradient)
// and a frozen layer.
class Net : public nn::Module {
 public:
  Net() : Module("Net") {
    a = register_module("a", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 16}));
    relu = register_module("relu", std::make_shared<nn::ReLU>());
    b = register_module("b", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 4}));
    side = register_module("side", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 4}));
    frozen = register_module("frozen",
                             std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 4}));
    frozen->weight.requires_grad_(false);
    frozen->bias.requires_grad_(false);
  }
  Tensor forward(const Tensor& x) override {
    return (*b)((*relu)((*a)(x))) + (*side)(x).detach() + (*frozen)(x);
  }
  std::shared_ptr<nn::Linear> a, b, side, frozen;
  std::shared_ptr<nn::ReLU> relu;
};

const train::ModuleHealth& module(const train::HealthRecord& r, const std::string& name) {
  for (const auto& m : r.modules)
    if (m.name == name) return m;
  ADD_FAILURE() << "no module " << name;
  return r.modules.front();
}

}  // namespace

TEST(HealthMonitor, RecordsOnlySampledSteps) {
  manual_seed(1);
  Net net;
  optim::SGD opt(net, {.lr = 0.1});
  train::HealthMonitor monitor(net, {.every = 3});
  int records = 0;
  for (int64_t step = 1; step <= 6; ++step) {
    monitor.begin_step(step);
    opt.zero_grad();
    net(randn({4, 8})).pow(2).mean().backward();
    opt.step();
    auto r = monitor.end_step();
    EXPECT_EQ(r.has_value(), step % 3 == 0) << step;
    if (r) {
      EXPECT_EQ(r->step, step);
      ++records;
    }
  }
  EXPECT_EQ(records, 2);
}

TEST(HealthMonitor, GradientNormsUpdateRatioNoGradAndFrozen) {
  manual_seed(2);
  Net net;
  optim::SGD opt(net, {.lr = 0.05});
  train::HealthMonitor monitor(net, {.every = 1});
  monitor.begin_step(1);
  opt.zero_grad();
  net(randn({32, 8})).pow(2).mean().backward();
  const Tensor ga = net.a->weight.grad().clone(), gab = net.a->bias.grad().clone();
  const double wa = std::sqrt(std::pow(train::l2_norm(net.a->weight), 2) + std::pow(train::l2_norm(net.a->bias), 2));
  opt.step();
  auto r = monitor.end_step();
  ASSERT_TRUE(r);
  const double gnorm = std::sqrt(std::pow(train::l2_norm(ga), 2) + std::pow(train::l2_norm(gab), 2));
  EXPECT_NEAR(module(*r, "a").grad_norm, gnorm, 1e-6 * gnorm);
  EXPECT_NEAR(module(*r, "a").weight_norm, wa, 1e-5 * wa);
  // Plain SGD: delta w = lr * g, so the ratio is lr * ||g|| / ||w||.
  EXPECT_NEAR(module(*r, "a").update_ratio, 0.05 * gnorm / wa, 1e-4 * 0.05 * gnorm / wa);
  // The detached side branch got no gradient, by name; the frozen layer is counted, not listed.
  EXPECT_EQ(r->no_grad, (std::vector<std::string>{"side.weight", "side.bias"}));
  EXPECT_EQ(r->frozen, 2);
  EXPECT_EQ(r->trainable, 6);
  EXPECT_EQ(module(*r, "side").grad_norm, 0.0);
  EXPECT_EQ(module(*r, "side").update_ratio, 0.0);
  // Blocks: the children with parameters, each with its output and gradient scale.
  ASSERT_EQ(r->blocks.size(), 4u);  // a, b, side, frozen: registration order, not forward order
  EXPECT_EQ(r->blocks[0].name, "a");
  EXPECT_GT(r->blocks[0].activation_rms, 0.0);
  EXPECT_GT(r->blocks[0].grad_rms, 0.0);
  EXPECT_EQ(r->blocks[2].name, "side");
  EXPECT_EQ(r->blocks[2].grad_rms, -1.0);  // detached: no gradient reached its output
  // The input's statistics (randn: mean ~0, std ~1 over 256 values).
  EXPECT_NEAR(r->input_mean, 0.0, 0.2);
  EXPECT_NEAR(r->input_std, 1.0, 0.2);
}

TEST(HealthMonitor, UpdateRatioOfALargeParameterIsEstimatedClosely) {
  // 65536 weights: the monitor keeps every 16th; the estimate must be within 5% of the exact ratio.
  manual_seed(4);
  nn::Sequential model(
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 256, .out_features = 256, .bias = false}));
  optim::Adam opt(model, {.lr = 1e-3});
  train::HealthMonitor monitor(model, {.every = 1});
  const Tensor weight = model.named_parameters()[0].second;
  const Tensor before = weight.detach().clone();
  monitor.begin_step(1);
  opt.zero_grad();
  model(randn({32, 256})).pow(2).mean().backward();
  opt.step();
  auto r = monitor.end_step();
  ASSERT_TRUE(r);
  ASSERT_EQ(r->modules.size(), 1u);
  const double exact = train::l2_norm(weight.detach() - before) / train::l2_norm(before);
  EXPECT_NEAR(r->modules[0].weight_norm, train::l2_norm(before), 1e-6 * train::l2_norm(before));
  EXPECT_NEAR(r->modules[0].update_ratio, exact, 0.05 * exact);
}

TEST(HealthMonitor, DeadReluFraction) {
  manual_seed(3);
  Net net;
  train::HealthMonitor monitor(net, {.every = 1});
  // Half of a's units have a bias so negative that no input lifts them above zero.
  {
    NoGradGuard ng;
    float* bias = net.a->bias.data_ptr<float>();
    for (int i = 0; i < 8; ++i) bias[i] = -100.f;
  }
  monitor.begin_step(1);
  net(randn({64, 8})).sum().backward();
  auto r = monitor.end_step();
  ASSERT_TRUE(r);
  ASSERT_EQ(r->activations.size(), 1u);
  EXPECT_EQ(r->activations[0].name, "relu");
  EXPECT_EQ(r->activations[0].units, 16);
  EXPECT_DOUBLE_EQ(r->activations[0].dead_fraction, 0.5);
}

TEST(HealthMonitor, HooksOnlyOnSampledSteps) {
  Net net;
  train::HealthMonitor monitor(net, {.every = 2});
  monitor.begin_step(1);
  EXPECT_FALSE(net.relu->has_forward_hooks());
  monitor.begin_step(2);
  EXPECT_TRUE(net.relu->has_forward_hooks());
  EXPECT_TRUE(net.a->has_forward_hooks());
  monitor.end_step();
  EXPECT_FALSE(net.relu->has_forward_hooks());
  EXPECT_FALSE(net.a->has_forward_hooks());
}

TEST(HealthMonitor, RejectsZeroInterval) {
  Net net;
  try {
    train::HealthMonitor monitor(net, {.every = 0});
    FAIL() << "every = 0 accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("every must be at least 1 step, got 0"), std::string::npos) << e.what();
  }
}
