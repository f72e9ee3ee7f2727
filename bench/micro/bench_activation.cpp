// Activations forward + backward at the workloads' shapes, through the engine
// as loss.backward() runs them (the backward pass is where profiles of the
// cnn, resnet and mlp steps spend a quarter of their time, in ReLU's backward):
//   ReLU over [64, 32, 28, 28]   the cnn workload's conv1 output (1.6M values)
//   GELU(tanh) over [16, 128, 1024]  the gpt workload's MLP hidden layer (2.1M values)
// Bytes are the least a fused kernel moves (forward: x read, y written;
// backward: grad and x read, grad_input written), so GB/s compares with memory
// bandwidth. The argument is the thread count.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Activation
#include <benchmark/benchmark.h>

#include "bench_threads.h"
#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;

using kiln_micro::ThreadScope;

template <typename F>
void run_forward_backward(benchmark::State& state, IntArrayRef shape, F f) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor x = randn(shape).requires_grad_();
  const Tensor g = randn(shape);
  for (auto _ : state) {
    Tensor y = f(x);
    benchmark::DoNotOptimize(autograd::grad({y}, {x}, {g}));
  }
  state.SetBytesProcessed(state.iterations() * x.numel() * 4 * 5);
}

void BM_ActivationReluForwardBackward(benchmark::State& state) {
  run_forward_backward(state, {64, 32, 28, 28}, [](const Tensor& x) { return x.relu(); });
}
BENCHMARK(BM_ActivationReluForwardBackward)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_ActivationGeluTanhForwardBackward(benchmark::State& state) {
  run_forward_backward(state, {16, 128, 1024}, [](const Tensor& x) { return x.gelu("tanh"); });
}
BENCHMARK(BM_ActivationGeluTanhForwardBackward)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_ActivationReluForward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor x = randn({64, 32, 28, 28});
  for (auto _ : state) benchmark::DoNotOptimize(x.relu());
  state.SetBytesProcessed(state.iterations() * x.numel() * 4 * 2);
}
BENCHMARK(BM_ActivationReluForward)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMicrosecond);

// The same GELU on bfloat16 values, as gpt's bf16 autocast step runs it: half
// the bytes of float32, so at memory speed it should take about half the time.
void BM_ActivationGeluTanhBf16Forward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor x = randn({16, 128, 1024}).to(kBFloat16);
  for (auto _ : state) benchmark::DoNotOptimize(x.gelu("tanh"));
  state.SetBytesProcessed(state.iterations() * x.numel() * 2 * 2);
}
BENCHMARK(BM_ActivationGeluTanhBf16Forward)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_ActivationGeluTanhBf16ForwardBackward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor x = randn({16, 128, 1024}).to(kBFloat16).requires_grad_();
  const Tensor g = randn({16, 128, 1024}).to(kBFloat16);
  for (auto _ : state) {
    Tensor y = x.gelu("tanh");
    benchmark::DoNotOptimize(autograd::grad({y}, {x}, {g}));
  }
  state.SetBytesProcessed(state.iterations() * x.numel() * 2 * 5);
}
BENCHMARK(BM_ActivationGeluTanhBf16ForwardBackward)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// GELU (tanh) forward alone: float32 or bf16 (range 1), gpt's [16, 128, 1024]
// from memory or a [16, 128, 64] slice that stays in L2 (range 2), to tell
// the arithmetic's cost from the memory's.
void BM_ActivationGeluTanhForward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const DType dt = state.range(1) ? kBFloat16 : kFloat32;
  const Tensor x = randn({16, 128, state.range(2) ? 64 : 1024}).to(dt);
  for (auto _ : state) benchmark::DoNotOptimize(x.gelu("tanh"));
  state.SetItemsProcessed(state.iterations() * x.numel());
}
BENCHMARK(BM_ActivationGeluTanhForward)
    ->ArgsProduct({{1}, {0, 1}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// GELU (tanh) on an L2-resident [16, 128, 64] float32 block whose values are
// randn times `scale` (range 0): 1 as a normalised layer's inputs, 12 as
// large ones (an unnormalised pre-activation), where exp(-2u) passes through
// the subnormals; forward alone or with backward (range 1), 1 thread.
void BM_ActivationGeluTanhLarge(benchmark::State& state) {
  const ThreadScope threads(1);
  const Tensor x = (randn({16, 128, 64}) * static_cast<double>(state.range(0))).requires_grad_(state.range(1) != 0);
  const Tensor g = randn({16, 128, 64});
  for (auto _ : state) {
    Tensor y = x.gelu("tanh");
    if (state.range(1)) benchmark::DoNotOptimize(autograd::grad({y}, {x}, {g}));
    benchmark::DoNotOptimize(y);
  }
  state.SetItemsProcessed(state.iterations() * x.numel());
}
BENCHMARK(BM_ActivationGeluTanhLarge)
    ->ArgsProduct({{1, 12}, {0, 1}})
    ->ArgNames({"scale", "backward"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
