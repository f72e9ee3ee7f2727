// LeakWatch (kiln/train/leak_watch.h): the classic leaks are found and named
// by the line that causes them; a healthy loop raises nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <deque>
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

namespace {

// A batch of input-pipeline memory, as a loader's worker makes it.
Tensor data_batch() {
  MemoryCategoryGuard data(MemoryCategory::Data);
  return zeros({1024});  // 4 KiB
}

}  // namespace

// A prefetch queue that fills by a batch per step (workers briefly faster than
// the loop, as on a loaded machine) and then stays full is no leak, once the
// watch knows how many batches the loader may hold.
TEST(LeakWatch, ALoaderQueueFillingUpIsNotALeak) {
  constexpr int kInFlight = 7;  // 2 workers: 1 in use + 2 being built + 2 × prefetch_factor 2 ready
  auto run = [](int64_t data_in_flight) {
    train::LeakWatch watch({.print = false, .data_in_flight = data_in_flight});
    std::deque<Tensor> queue;
    for (int step = 0; step < 40; ++step) {
      queue.push_back(data_batch());
      if (step < 4 || step >= 4 + kInFlight - 1) queue.pop_front();  // steady, then filling for 6 steps, then full
      if (const train::LeakReport* r = watch.step()) return std::string(r->message);
    }
    EXPECT_LE(queue.size(), static_cast<size_t>(kInFlight));
    return std::string();
  };
  const std::string unaware = run(0);
  EXPECT_NE(unaware.find("data memory grew at each of the last 5 steps"), std::string::npos)
      << "the pattern must look like a leak to a watch that does not know the queue: " << unaware;
  EXPECT_EQ(run(kInFlight), "");
}

TEST(LeakWatch, DataKeptStepAfterStepIsStillALeakPastTheQueue) {
  train::LeakWatch watch({.print = false, .data_in_flight = 7});
  std::vector<Tensor> kept;
  const train::LeakReport* found = nullptr;
  int step = 0;
  for (; step < 40 && !found; ++step) {
    kept.push_back(data_batch());
    found = watch.step();
  }
  ASSERT_NE(found, nullptr);
  EXPECT_EQ(found->category, MemoryCategory::Data);
  EXPECT_EQ(found->growth_per_step, 4096);
  // warm-up 3, then 8 growths (one more than the queue can make) need 9 samples.
  EXPECT_EQ(step, 3 + 9);
  EXPECT_NE(found->message.find("data memory grew at each of the last 8 steps"), std::string::npos) << found->message;
}

TEST(LeakWatch, RejectsANegativeQueue) {
  EXPECT_THROW(train::LeakWatch({.data_in_flight = -1}), ValueError);
}
