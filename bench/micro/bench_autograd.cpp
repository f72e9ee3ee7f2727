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
//   Counters per node, in this thread's CPU time: fwd_ns (recorded forward),
//   bwd_ns (backward), op_ns (one 1-element mul without grad: what
//   MulBackward0's formula g * 1.0001 costs as an op), and engine_ns =
//   bwd_ns - op_ns, the engine's own cost per node (scheduling, dependency
//   counts, gradient validation and buffers). The graph is freed outside the
//   timed phases.
//
// Not measurable yet: the backward of the gpt workload's graph with its
// matmuls excluded needs the nn modules (issue 4); there is no such graph to
// time before they exist.
#include <benchmark/benchmark.h>

#include <ctime>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
// This thread's CPU time in ns: the phases of one iteration are timed with it, so
// that other processes sharing the cores do not inflate the per-node figures.
double thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

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
    const double t0 = thread_ns();
    Tensor y = x;
    for (int64_t i = 0; i < n; ++i) y = y * 1.0001;
    const double t1 = thread_ns();
    y.backward();
    const double t2 = thread_ns();
    {
      Tensor z = one;
      for (int64_t i = 0; i < n; ++i) z = z * 1.0001;  // the formulas' own cost, as plain ops
      benchmark::DoNotOptimize(z.data_ptr());
    }
    const double t3 = thread_ns();
    fwd += t1 - t0;
    bwd += t2 - t1;
    op += t3 - t2;
  }
  const double per = 1.0 / (static_cast<double>(state.iterations()) * static_cast<double>(n));
  state.counters["fwd_ns"] = fwd * per;
  state.counters["bwd_ns"] = bwd * per;
  state.counters["op_ns"] = op * per;
  state.counters["engine_ns"] = (bwd - op) * per;
}
BENCHMARK(BM_AutogradChainBackward)->Arg(1000)->ArgName("N")->Unit(benchmark::kMicrosecond);

// BM_ViewTracking/int64: narrow + transpose + unsqueeze of a small tensor that needs
// no grad, grad mode on. A float32 view is tracked (it records its base, so
// an in-place write of a value that requires grad reaches the base: docs/
// autograd.md, "Views"); an int64 one is not. The difference per three views
// is what tracking costs (0 float32, 1 int64).
void BM_ViewTracking(benchmark::State& state) {
  const Tensor x = zeros({8, 8}, state.range(0) == 0 ? kFloat32 : kInt64);
  for (auto _ : state) {
    Tensor v = x.narrow(0, 1, 4).transpose(0, 1).unsqueeze(0);
    benchmark::DoNotOptimize(v.data_ptr());
  }
}
BENCHMARK(BM_ViewTracking)->Arg(0)->Arg(1)->ArgName("int64");

}  // namespace
