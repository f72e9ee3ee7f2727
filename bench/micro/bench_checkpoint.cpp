// Activation checkpointing (nn::checkpoint, docs/memory.md): one training
// step's forward + backward of a zoo model at its bench/WORKLOADS.md size,
// without and with per-block checkpointing.
//   BM_Checkpoint/model/policy/threads  model 0: gpt (batch 16 x 128 tokens,
//     4 layers, d_model 256), 1: resnet (batch 32, 3x32x32, three stages of
//     one BasicBlock); policy 0: none, 1: every block.
// Counters: act_peak_MiB, the peak of the allocator's Activation category
// during the step above what was live before it (memory::reset_peak_stats()
// first), and the time per step. The goal: with checkpointing, the
// peak <= 40% of the uncheckpointed one at <= 1.35x the step time.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Checkpoint
#include <benchmark/benchmark.h>

#include <memory>

#include "bench_threads.h"
#include "kiln/kiln.h"
#include "kiln/models/gpt.h"
#include "kiln/models/resnet.h"

namespace {

using namespace kiln;

using kiln_micro::ThreadScope;

void BM_Checkpoint(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(2)));
  const nn::CheckpointPolicy policy = state.range(1) ? nn::CheckpointPolicy::blocks() : nn::CheckpointPolicy::none();
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  std::function<Tensor()> loss;
  Tensor idx, tgt, x, y;
  if (state.range(0) == 0) {
    auto gpt = std::make_shared<models::GPT>(models::GPTOptions{.activation_checkpointing = policy});
    idx = randint(0, 256, {16, 128}, TensorOptions(kInt64));
    tgt = randint(0, 256, {16, 128}, TensorOptions(kInt64));
    loss = [gpt, &idx, &tgt] { return gpt->loss(idx, tgt); };
    model = gpt;
  } else {
    auto net = std::make_shared<models::ResNet>(models::ResNetOptions{.activation_checkpointing = policy});
    x = randn({32, 3, 32, 32});
    y = randint(0, 10, {32}, TensorOptions(kInt64));
    loss = [net, &x, &y] { return nn::functional::cross_entropy((*net)(x), y); };
    model = net;
  }
  model->train();
  int64_t peak = 0;
  for (auto _ : state) {
    model->zero_grad();
    memory::reset_peak_stats();
    const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
    loss().backward();
    peak = std::max(peak, memory::stats()[MemoryCategory::Activation].peak_bytes - before);
  }
  state.counters["act_peak_MiB"] = static_cast<double>(peak) / (1 << 20);
}
BENCHMARK(BM_Checkpoint)
    ->ArgsProduct({{0, 1}, {0, 1}, {1}})
    ->ArgNames({"model", "policy", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
