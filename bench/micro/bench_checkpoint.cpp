// Activation checkpointing (nn::checkpoint, docs/memory.md): one training
// step's forward + backward of a zoo model at its bench/WORKLOADS.md size,
// without and with per-block checkpointing.
//   BM_Checkpoint/model/policy/threads  model 0: gpt (batch 16 x 128 tokens,
//     4 layers, d_model 256), 1: resnet (batch 32, 3x32x32, three stages of
//     one BasicBlock); policy 0: none, 1: blocks (ResNet: the stem too, and a
//     downsample block as three segments).
// Counters: act_peak_MiB, the peak of the allocator's Activation category
// during the step above what was live before it (memory::reset_peak_stats()
// first), and the time per step. The goal: with checkpointing, the
// peak <= 40% of the uncheckpointed one at <= 1.35x the step time.
//   BM_CheckpointPaired/model/threads  the goal's two ratios from one run:
//     each iteration times one step without and one with checkpointing, in
//     alternating order, so a machine's load shifts both alike. Counters:
//     none_ms and blocks_ms (medians), step_ratio (median of the per-iteration
//     ratios), step_ratio_min (fastest blocks step / fastest none step),
//     act_peak_none_MiB, act_peak_blocks_MiB and act_peak_pct (blocks / none, %).
//   BM_CheckpointResNetFloor  why the resnet cannot reach 40 %: the working set
//     of the backward of layer2.0's bn2 + shortcut + ReLU (one fused node: its
//     incoming gradient, its two saved inputs, its two input gradients; the
//     output it is rooted at is not counted), measured; plus the one earlier
//     activation any schedule that does not recompute the network's prefix
//     from the image keeps then (layer2.0's input). Counters: node_MiB,
//     floor_MiB, floor_pct (of the uncheckpointed peak).
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Checkpoint
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "bench_threads.h"
#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/models/gpt.h"
#include "kiln/models/resnet.h"

namespace {

using namespace kiln;

using kiln_micro::ThreadScope;

// A zoo model at its workload size and the loss of one step on a fixed batch.
struct Workload {
  std::shared_ptr<nn::Module> model;
  nn::CheckpointPolicy* policy = nullptr;  // the model's public `checkpointing`
  Tensor a, b;                             // inputs and targets
  std::function<Tensor()> loss;
};

std::unique_ptr<Workload> make_workload(int64_t which) {
  manual_seed(0);
  auto w = std::make_unique<Workload>();
  if (which == 0) {
    auto gpt = std::make_shared<models::GPT>(models::GPTOptions{});
    w->a = randint(0, 256, {16, 128}, TensorOptions(kInt64));
    w->b = randint(0, 256, {16, 128}, TensorOptions(kInt64));
    w->loss = [gpt, p = w.get()] { return gpt->loss(p->a, p->b); };
    w->policy = &gpt->checkpointing;
    w->model = gpt;
  } else {
    auto net = std::make_shared<models::ResNet>(models::ResNetOptions{});
    w->a = randn({32, 3, 32, 32});
    w->b = randint(0, 10, {32}, TensorOptions(kInt64));
    w->loss = [net, p = w.get()] { return nn::functional::cross_entropy((*net)(p->a), p->b); };
    w->policy = &net->checkpointing;
    w->model = net;
  }
  w->model->train();
  return w;
}

// One step under `policy`: its activation peak above what was live before it, and its time in ms.
std::pair<int64_t, double> step(Workload& w, nn::CheckpointPolicy policy) {
  *w.policy = policy;
  w.model->zero_grad();
  memory::reset_peak_stats();
  const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
  const auto t0 = std::chrono::steady_clock::now();
  w.loss().backward();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {memory::stats()[MemoryCategory::Activation].peak_bytes - before, ms};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

constexpr double kMiB = 1 << 20;

void BM_Checkpoint(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(2)));
  const nn::CheckpointPolicy policy = state.range(1) ? nn::CheckpointPolicy::blocks() : nn::CheckpointPolicy::none();
  std::unique_ptr<Workload> w = make_workload(state.range(0));
  int64_t peak = 0;
  for (auto _ : state) peak = std::max(peak, step(*w, policy).first);
  state.counters["act_peak_MiB"] = static_cast<double>(peak) / kMiB;
}
BENCHMARK(BM_Checkpoint)
    ->ArgsProduct({{0, 1}, {0, 1}, {1}})
    ->ArgNames({"model", "policy", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_CheckpointPaired(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(1)));
  std::unique_ptr<Workload> w = make_workload(state.range(0));
  step(*w, nn::CheckpointPolicy::none());  // warm the allocator's cache and the kernels
  step(*w, nn::CheckpointPolicy::blocks());
  std::vector<double> none_ms, blocks_ms, ratios;
  int64_t peak_none = 0, peak_blocks = 0;
  bool blocks_first = false;
  for (auto _ : state) {
    std::pair<int64_t, double> n, b;
    if (blocks_first) {
      b = step(*w, nn::CheckpointPolicy::blocks());
      n = step(*w, nn::CheckpointPolicy::none());
    } else {
      n = step(*w, nn::CheckpointPolicy::none());
      b = step(*w, nn::CheckpointPolicy::blocks());
    }
    blocks_first = !blocks_first;
    peak_none = std::max(peak_none, n.first);
    peak_blocks = std::max(peak_blocks, b.first);
    none_ms.push_back(n.second);
    blocks_ms.push_back(b.second);
    ratios.push_back(b.second / n.second);
  }
  state.counters["none_ms"] = median(none_ms);
  state.counters["blocks_ms"] = median(blocks_ms);
  state.counters["step_ratio"] = median(ratios);
  // Of the fastest steps: a single pair's ratio is at the mercy of one interrupted step.
  if (!ratios.empty()) {
    state.counters["step_ratio_min"] =
        *std::min_element(blocks_ms.begin(), blocks_ms.end()) / *std::min_element(none_ms.begin(), none_ms.end());
  }
  state.counters["act_peak_none_MiB"] = static_cast<double>(peak_none) / kMiB;
  state.counters["act_peak_blocks_MiB"] = static_cast<double>(peak_blocks) / kMiB;
  state.counters["act_peak_pct"] = peak_none ? 100.0 * static_cast<double>(peak_blocks) / peak_none : 0.0;
}
// A median needs several pairs, and a gpt pair takes about 0.7 s.
BENCHMARK(BM_CheckpointPaired)
    ->ArgsProduct({{0, 1}, {1}})
    ->ArgNames({"model", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);

void BM_CheckpointResNetFloor(benchmark::State& state) {
  const ThreadScope threads(1);
  std::unique_ptr<Workload> w = make_workload(1);
  const int64_t peak_none = step(*w, nn::CheckpointPolicy::none()).first;
  auto& net = static_cast<models::ResNet&>(*w->model);
  auto& block = static_cast<models::BasicBlock&>(*net.stages[1]->children()[0]);
  // layer2.0's conv2 output and shortcut: [32, 32, 16, 16], as its input gradient.
  const std::vector<int64_t> shape = {32, block.options.out_channels, 16, 16};
  int64_t node = 0;
  for (auto _ : state) {
    memory::reset_peak_stats();
    const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
    Tensor c = randn(shape).requires_grad_(), residual = randn(shape).requires_grad_();
    Tensor g = randn(shape);
    Tensor out = block.bn2->forward_add_relu(c, residual);
    const auto out_bytes = static_cast<int64_t>(memory::rounded_size(static_cast<size_t>(out.nbytes())));
    TensorList grads = autograd::grad({out}, {c, residual}, {g});
    node = memory::stats()[MemoryCategory::Activation].peak_bytes - before - out_bytes;
    benchmark::DoNotOptimize(grads);
  }
  // layer2.0's input, [32, 16, 32, 32].
  const auto kept = static_cast<int64_t>(memory::rounded_size(size_t{32} * block.options.in_channels * 32 * 32 * 4));
  state.counters["node_MiB"] = static_cast<double>(node) / kMiB;
  state.counters["floor_MiB"] = static_cast<double>(node + kept) / kMiB;
  state.counters["floor_pct"] = 100.0 * static_cast<double>(node + kept) / static_cast<double>(peak_none);
}
BENCHMARK(BM_CheckpointResNetFloor)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
