// Autograd micro-benchmarks: what recording a graph and running backward cost
// on top of the ops themselves (one-element tensors, so the arithmetic is nil
// and every nanosecond is framework).
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Autograd
//
// BM_AutogradMulOneElement/mode:
//   0 forward only: c = a * b, nothing requires grad (the inference path; no node)
//   1 forward, recorded: a requires grad, so mul builds MulBackward0 and saves b
//   2 forward + backward: the same, then c.backward() into a.grad
// BM_AutogradChainBackward/N: y = y * 1.0001 N times from a leaf, then backward.
//   Counters per node: fwd_ns (recorded forward), bwd_ns (backward), op_ns (one
//   1-element mul without grad: what MulBackward0's formula g * 1.0001 costs as
//   an op), and engine_ns = bwd_ns - op_ns, the engine's own cost per node
//   (scheduling, dependency counts, gradient validation and buffers).
//
// Not measurable yet: the backward of the gpt workload's graph with its
// matmuls excluded needs the nn modules (issue 4); there is no such graph to
// time before they exist.
#include <benchmark/benchmark.h>

#include <chrono>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using Clock = std::chrono::steady_clock;

void BM_AutogradMulOneElement(benchmark::State& state) {
  const int64_t mode = state.range(0);
  Tensor a = ones({1}), b = full({1}, 2.0);
  if (mode > 0) a.requires_grad_();
  if (mode > 0 && (a * b).grad_fn() == nullptr) {
    state.SkipWithError("mul records no backward node (its backward is not built in)");
    return;
  }
  for (auto _ : state) {
    Tensor c = a * b;
    if (mode == 2) c.backward();
    benchmark::DoNotOptimize(c.data_ptr());
  }
}
BENCHMARK(BM_AutogradMulOneElement)->Arg(0)->Arg(1)->Arg(2)->ArgName("mode")->Unit(benchmark::kNanosecond);

void BM_AutogradChainBackward(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor x = ones({1}).requires_grad_();
  const Tensor one = ones({1});
  if ((x * 1.0001).grad_fn() == nullptr) {
    state.SkipWithError("mul records no backward node (its backward is not built in)");
    return;
  }
  double fwd = 0, bwd = 0, op = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    Tensor y = x;
    for (int64_t i = 0; i < n; ++i) y = y * 1.0001;
    const auto t1 = Clock::now();
    y.backward();
    const auto t2 = Clock::now();
    {
      Tensor z = one;
      for (int64_t i = 0; i < n; ++i) z = z * 1.0001;  // the formulas' own cost, as plain ops
      benchmark::DoNotOptimize(z.data_ptr());
    }
    const auto t3 = Clock::now();
    fwd += std::chrono::duration<double, std::nano>(t1 - t0).count();
    bwd += std::chrono::duration<double, std::nano>(t2 - t1).count();
    op += std::chrono::duration<double, std::nano>(t3 - t2).count();
  }
  const double per = 1.0 / (static_cast<double>(state.iterations()) * static_cast<double>(n));
  state.counters["fwd_ns"] = fwd * per;
  state.counters["bwd_ns"] = bwd * per;
  state.counters["op_ns"] = op * per;
  state.counters["engine_ns"] = (bwd - op) * per;
}
BENCHMARK(BM_AutogradChainBackward)->Arg(1000)->ArgName("N")->Unit(benchmark::kMicrosecond);

}  // namespace
