// LeakWatch (kiln/train/leak_watch.h): the classic leaks are found and named
// by the line that causes them; a healthy loop raises nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "kiln/kiln.h"

using namespace kiln;

namespace {

std::string here(int line) { return "test_leak_watch.cpp:" + std::to_string(line); }

struct Net {
  Net() : a({.in_features = 16, .out_features = 64}), b({.in_features = 64, .out_features = 4}) {}
  Tensor operator()(const Tensor& x) { return b(a(x).relu()); }
  nn::Linear a, b;
  optim::NamedParams params() { return {{"a.weight", a.weight}, {"a.bias", a.bias}, {"b.weight", b.weight}, {"b.bias", b.bias}}; }
};

Tensor batch_loss(Net& net, int64_t step) {
  Generator g(static_cast<uint64_t>(step));
  Tensor x = randn({32, 16}, {}, &g);
  Tensor y = randn({32, 4}, {}, &g);
  return (net(x) - y).pow(2).mean();
}

}  // namespace

TEST(LeakWatch, TotalPlusEqualsLossInATrainingLoopIsNamedByItsLine) {
  manual_seed(0);
  Net net;
  optim::SGD opt(net.params(), optim::SGDOptions{.lr = 0.01});
  train::LeakWatch watch({.print = false});
  Tensor total = zeros({});
  int line = 0;
  const train::LeakReport* found = nullptr;
  for (int64_t step = 0; step < 20 && !found; ++step) {
    opt.zero_grad();
    Tensor loss = batch_loss(net, step);
    loss.backward();
    opt.step();
    line = __LINE__ + 1;
    total += loss;  // the bug: total keeps every step's graph
    found = watch.step();
  }
  ASSERT_NE(found, nullptr) << "no leak reported";
  // backward freed the saved tensors: the nodes pile up, not tensor bytes.
  EXPECT_FALSE(found->bytes_grow) << found->message;
  ASSERT_TRUE(found->graph.has_value());
  EXPECT_TRUE(found->graph->site.str().ends_with(here(line))) << found->graph->site.str();
  EXPECT_EQ(found->graph->node, "AddBackward0");
  EXPECT_NE(found->message.find(here(line)), std::string::npos) << found->message;
  EXPECT_NE(found->message.find("total += loss"), std::string::npos);
  EXPECT_EQ(watch.step(), nullptr) << "warns once";
}

TEST(LeakWatch, EvalLossSummedWithItsGraphGrowsActivationsAndNamesTheLine) {
  manual_seed(0);
  Net net;
  train::LeakWatch watch({.print = false});
  Tensor total = zeros({});
  int line = 0;
  const train::LeakReport* found = nullptr;
  for (int64_t step = 0; step < 20 && !found; ++step) {
    Tensor loss = batch_loss(net, step);  // no NoGradGuard, no backward: the graph keeps its saved tensors
    line = __LINE__ + 1;
    total = total + loss;
    found = watch.step();
  }
  ASSERT_NE(found, nullptr) << "no leak reported";
  EXPECT_TRUE(found->bytes_grow);
  EXPECT_EQ(found->category, MemoryCategory::Activation);
  // Each step keeps what its graph saved: the 32x64 hidden activation relu saved (the second
  // linear's input too), the batch, the difference the square saved.
  EXPECT_EQ(found->growth_per_step, 32 * 64 * 4 + 32 * 16 * 4 + 32 * 4 * 4) << found->message;
  ASSERT_TRUE(found->graph.has_value());
  EXPECT_TRUE(found->graph->site.str().ends_with(here(line))) << found->graph->site.str();
  EXPECT_NE(found->message.find(here(line)), std::string::npos) << found->message;
  ASSERT_FALSE(found->growing_sites.empty());
  EXPECT_NE(found->growing_sites[0].first.find("(Relu)"), std::string::npos) << found->message;
  EXPECT_EQ(found->growing_sites[0].second, 32 * 64 * 4);
  EXPECT_NE(found->message.find("Growing call sites"), std::string::npos);
}

TEST(LeakWatch, TensorsKeptInAListAreNamedByTheirSite) {
  train::LeakWatch watch({.print = false});
  std::vector<Tensor> kept;
  int line = 0;
  const train::LeakReport* found = nullptr;
  for (int step = 0; step < 20 && !found; ++step) {
    line = __LINE__ + 1;
    kept.push_back(zeros({1024}));  // 4 KiB a step, no autograd involved
    found = watch.step();
  }
  ASSERT_NE(found, nullptr);
  EXPECT_TRUE(found->bytes_grow);
  EXPECT_FALSE(found->graph.has_value());
  ASSERT_FALSE(found->growing_sites.empty());
  EXPECT_TRUE(found->growing_sites[0].first.ends_with(here(line))) << found->message;
  EXPECT_EQ(found->growing_sites[0].second, 4096);
  EXPECT_NE(found->message.find("No autograd graph is kept"), std::string::npos);
}

TEST(LeakWatch, AHealthyLoopRaisesNothing) {
  manual_seed(0);
  Net net;
  optim::Adam opt(net.params(), optim::AdamOptions{.lr = 1e-3});
  train::LeakWatch watch({.print = false});
  double total = 0;
  for (int64_t step = 0; step < 30; ++step) {
    opt.zero_grad();
    Tensor loss = batch_loss(net, step);
    loss.backward();
    opt.step();
    total += loss.item<double>();  // the fix
    EXPECT_EQ(watch.step(), nullptr) << "false alarm at step " << step << ": " << watch.report()->message;
  }
  EXPECT_TRUE(std::isfinite(total));
}

TEST(LeakWatch, RejectsAWindowTooShort) {
  EXPECT_THROW(train::LeakWatch({.window = 1}), ValueError);
}
