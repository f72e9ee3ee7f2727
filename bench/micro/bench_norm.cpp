// Normalisation layers at the workloads' shapes, forward and forward + backward
// (input and affine gradients through the engine, as loss.backward() runs them):
//   LayerNorm(256) over [16, 128, 256]   the gpt workload's ln_1/ln_2/ln_f (9 per step)
//   BatchNorm2d(16) over [32, 16, 32, 32] the resnet workload's first stage, train mode
//   BatchNorm2d(c) channels-last over resnet's three stages ([32, 16, 32, 32],
//   [32, 32, 16, 16], [32, 64, 8, 8]: the layout resnet runs), forward alone
//   and forward + backward. Measured 2026-12-05, 1 thread, [32, 16, 32, 32]:
//   forward 157-168 us with one block of rows at a time, 109-130 us with four
//   in lockstep (Note [Blocks in lockstep] in src/kernels/cpu/batch_norm.cpp).
// Bytes are what the kernel must move at least (input read, output written;
// backward: grad_output and input read, grad_input written), so GB/s compares
// with memory bandwidth. The argument is the thread count.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Norm
#include <benchmark/benchmark.h>

#include <optional>

#include "bench_threads.h"
#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/nn/norm.h"
#include "kiln/ops/layer_norm.h"
#include "kiln/ops/memory_format.h"

namespace {

using namespace kiln;

using kiln_micro::ThreadScope;

void BM_NormLayerNormForward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  nn::LayerNorm ln({.normalized_shape = {256}});
  const Tensor x = randn({16, 128, 256});
  const NoGradGuard no_grad;
  for (auto _ : state) benchmark::DoNotOptimize(ln(x));
  state.SetBytesProcessed(state.iterations() * x.numel() * 4 * 2);
}
BENCHMARK(BM_NormLayerNormForward)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_NormLayerNormForwardBackward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  nn::LayerNorm ln({.normalized_shape = {256}});
  const Tensor x = randn({16, 128, 256}).requires_grad_();
  const Tensor g = randn({16, 128, 256});
  for (auto _ : state) {
    Tensor y = ln(x);
    benchmark::DoNotOptimize(autograd::grad({y}, {x, ln.weight, ln.bias}, {g}));
  }
  state.SetBytesProcessed(state.iterations() * x.numel() * 4 * 5);
}
BENCHMARK(BM_NormLayerNormForwardBackward)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// A layer norm whose output goes into a bf16 product (Note [Layer norm into a
// product]): the float32 norm followed by the cast (fused:0) against the norm
// writing bf16 itself (fused:1), forward and backward with a bf16 gradient, on
// gpt's [2048, 256] (fits in L2) and on [16384, 1024] (64 MiB of float32, from
// memory). Both give the same bits; the figure is what the extra passes cost.
void BM_NormLayerNormIntoBf16(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t rows = state.range(1), n = state.range(2);
  const bool fused = state.range(3) != 0;
  nn::LayerNorm ln({.normalized_shape = {n}});
  const Tensor x = randn({rows, n}).requires_grad_();
  const Tensor g = randn({rows, n}).to(kBFloat16);
  for (auto _ : state) {
    Tensor y = fused ? ops::layer_norm_to(x, {n}, ln.weight, ln.bias, 1e-5, kBFloat16) : ln(x).to(kBFloat16);
    benchmark::DoNotOptimize(autograd::grad({y}, {x, ln.weight, ln.bias}, {g}));
  }
  // The fused op's minimum: x read twice (forward, backward), y and g in bf16, grad_x written.
  state.SetBytesProcessed(state.iterations() * rows * n * (4 + 2 + 2 + 4 + 4));
}
BENCHMARK(BM_NormLayerNormIntoBf16)
    ->ArgsProduct({{1, 2}, {2048}, {256}, {0, 1}})
    ->ArgsProduct({{1, 2}, {16384}, {1024}, {0, 1}})
    ->ArgNames({"threads", "rows", "n", "fused"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_NormBatchNorm2dTrainForwardBackward(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  nn::BatchNorm2d bn({.num_features = 16});
  const Tensor x = randn({32, 16, 32, 32}).requires_grad_();
  const Tensor g = randn({32, 16, 32, 32});
  for (auto _ : state) {
    Tensor y = bn(x);
    benchmark::DoNotOptimize(autograd::grad({y}, {x, bn.weight, bn.bias}, {g}));
  }
  state.SetBytesProcessed(state.iterations() * x.numel() * 4 * 5);
}
BENCHMARK(BM_NormBatchNorm2dTrainForwardBackward)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// state: channels (16, 32, 64: the spatial size is resnet's for that stage), backward (0, 1),
// bf16 (0, 1: bf16 activations under autocast, the parameters float32).
void BM_NormBatchNorm2dChannelsLast(benchmark::State& state) {
  const ThreadScope threads(1);
  const int64_t c = state.range(0), hw = 32 * 16 / c;
  const bool bf16 = state.range(2) == 1;
  const DType dt = bf16 ? kBFloat16 : kFloat32;
  std::optional<AutocastGuard> amp;
  if (bf16) amp.emplace(kBFloat16);
  nn::BatchNorm2d bn({.num_features = c});
  const Tensor x = contiguous(randn({32, c, hw, hw}).to(dt), MemoryFormat::ChannelsLast).requires_grad_();
  const Tensor g = contiguous(randn({32, c, hw, hw}).to(dt), MemoryFormat::ChannelsLast);
  const bool backward = state.range(1) == 1;
  for (auto _ : state) {
    if (!backward) {
      const NoGradGuard no_grad;
      benchmark::DoNotOptimize(bn(x));
      continue;
    }
    Tensor y = bn(x);
    benchmark::DoNotOptimize(autograd::grad({y}, {x, bn.weight, bn.bias}, {g}));
  }
  state.SetBytesProcessed(state.iterations() * x.numel() * (bf16 ? 2 : 4) * (backward ? 5 : 2));
}
BENCHMARK(BM_NormBatchNorm2dChannelsLast)
    ->ArgsProduct({{16, 32, 64}, {0, 1}, {0, 1}})
    ->ArgNames({"channels", "backward", "bf16"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
