// What memory forensics cost (kiln/core/memory_history.h, graph_census.h).
//   BM_MemoryHistorySmallOp/history  a one-element multiply that records
//     autograd (an allocation, a node, a claim): history 0 is the default
//     (off: a note of the call site and two relaxed loads), 1 records
//     history and runs the graph census, as `kiln train` and LeakWatch do.
//   BM_MemoryHistoryMlpStep/history  a training step of a small MLP (batch
//     64, 784-256-10), forward + backward + SGD, off and on.
//   BM_MemoryHistoryNoteCallSite  what every op entry pays whether history is
//     on or not: noting its caller's file:line on the thread.
// The ratio on/off is what a run pays for call-site tracking.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=MemoryHistory
#include <benchmark/benchmark.h>

#include <optional>
#include <source_location>

#include "kiln/kiln.h"

namespace {

using namespace kiln;

struct Recording {
  explicit Recording(bool on) {
    if (on) {
      memory::record_history(true);
      census.emplace();
    }
  }
  ~Recording() { memory::record_history(false); }
  std::optional<autograd::GraphCensusGuard> census;
};

void BM_MemoryHistorySmallOp(benchmark::State& state) {
  set_num_threads(1);
  const Recording rec(state.range(0) != 0);
  Tensor a = ones({1}, TensorOptions().requires_grad(true));
  Tensor b = ones({1});
  for (auto _ : state) {
    Tensor c = a.mul(b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
}
BENCHMARK(BM_MemoryHistorySmallOp)->Arg(0)->Arg(1)->ArgName("history")->Unit(benchmark::kNanosecond);

void BM_MemoryHistoryNoteCallSite(benchmark::State& state) {
  const std::source_location here = std::source_location::current();
  for (auto _ : state) {
    memory::note_call_site(here.file_name(), here.line());
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_MemoryHistoryNoteCallSite)->Unit(benchmark::kNanosecond);

void BM_MemoryHistoryMlpStep(benchmark::State& state) {
  set_num_threads(1);
  const Recording rec(state.range(0) != 0);
  manual_seed(0);
  nn::Linear l1({.in_features = 784, .out_features = 256}), l2({.in_features = 256, .out_features = 10});
  optim::SGD opt(
      optim::NamedParams{
          {"l1.weight", l1.weight}, {"l1.bias", l1.bias}, {"l2.weight", l2.weight}, {"l2.bias", l2.bias}},
      optim::SGDOptions{.lr = 0.01});
  Tensor x = randn({64, 784});
  Tensor y = randint(0, 10, {64});
  for (auto _ : state) {
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy(l2(l1(x).relu()), y);
    loss.backward();
    opt.step();
  }
}
BENCHMARK(BM_MemoryHistoryMlpStep)->Arg(0)->Arg(1)->ArgName("history")->Unit(benchmark::kMicrosecond);

}  // namespace
