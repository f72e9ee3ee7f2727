// Elementwise micro-benchmarks: memory bandwidth of a large add (bytes count
// all three arrays: two reads and one write), the framework overhead of an op
// on a one-element tensor (without autograd, recording a node, and a whole
// forward + backward), and the vectorised exp/gelu over a large tensor.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Elementwise
#include <benchmark/benchmark.h>

#include "bench_threads.h"
#include "kiln/kiln.h"
#include "kiln/ops/elementwise.h"

namespace {

using namespace kiln;

constexpr int64_t kBig = int64_t{1} << 24;  // 16M floats: 64 MiB per array, far beyond the caches

// Restores the thread setting after a benchmark that changes it.
using kiln_micro::ThreadScope;

void BM_ElementwiseAddF32(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor a = ones({kBig}), b = ones({kBig});
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 3 * kBig * static_cast<int64_t>(sizeof(float)));
}
BENCHMARK(BM_ElementwiseAddF32)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ElementwiseAddInplaceF32(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  Tensor a = zeros({kBig});
  const Tensor b = ones({kBig});
  for (auto _ : state) {
    a.add_(b);
    benchmark::DoNotOptimize(a.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 3 * kBig * static_cast<int64_t>(sizeof(float)));
}
BENCHMARK(BM_ElementwiseAddInplaceF32)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Framework time per op: a 1-element add is all dispatch (promotion, shape,
// output allocation, loop setup), no arithmetic to speak of.
void BM_ElementwiseAddOneElement(benchmark::State& state) {
  const Tensor a = ones({1}), b = ones({1});
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
}
BENCHMARK(BM_ElementwiseAddOneElement)->Unit(benchmark::kNanosecond);

void BM_ElementwiseAddScalarOneElement(benchmark::State& state) {
  const Tensor a = ones({1});
  for (auto _ : state) {
    Tensor c = a * 2.5;
    benchmark::DoNotOptimize(c.data_ptr());
  }
}
BENCHMARK(BM_ElementwiseAddScalarOneElement)->Unit(benchmark::kNanosecond);

void BM_ElementwiseAddInplaceOneElement(benchmark::State& state) {
  Tensor a = zeros({1});
  const Tensor b = ones({1});
  for (auto _ : state) {
    a.add_(b);
    benchmark::DoNotOptimize(a.data_ptr());
  }
}
BENCHMARK(BM_ElementwiseAddInplaceOneElement)->Unit(benchmark::kNanosecond);

// Autograd's cost per op on a one-element tensor: y = x * x recording
// MulBackward0 (the node, its edges and saved tensors), without backward.
void BM_ElementwiseMulRecordOneElement(benchmark::State& state) {
  Tensor x = ones({1}).requires_grad_();
  for (auto _ : state) {
    Tensor y = x * x;
    benchmark::DoNotOptimize(y.data_ptr());
  }
}
BENCHMARK(BM_ElementwiseMulRecordOneElement)->Unit(benchmark::kNanosecond);

// Forward and backward of a one-element mul: y = x * x; y.backward() (the
// engine, MulBackward0's two products, AccumulateGrad), .grad reset each
// time as zero_grad(set_to_none) does.
void BM_ElementwiseMulForwardBackwardOneElement(benchmark::State& state) {
  Tensor x = ones({1}).requires_grad_();
  for (auto _ : state) {
    Tensor y = x * x;
    y.backward();
    benchmark::DoNotOptimize(x.grad().data_ptr());
    x.mutable_grad() = Tensor();
  }
}
BENCHMARK(BM_ElementwiseMulForwardBackwardOneElement)->Unit(benchmark::kNanosecond);

template <typename F>
void unary_big(benchmark::State& state, F f, DType dt = kFloat32) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  Generator g(1);
  const Tensor a = randn({kBig}, kFloat32, &g).to(dt);
  for (auto _ : state) {
    Tensor c = f(a);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * kBig);
  state.SetBytesProcessed(state.iterations() * 2 * kBig * element_size(dt));
}

void BM_ElementwiseExpF32(benchmark::State& state) {
  unary_big(state, [](const Tensor& x) { return x.exp(); });
}
BENCHMARK(BM_ElementwiseExpF32)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ElementwiseGeluF32(benchmark::State& state) {
  unary_big(state, [](const Tensor& x) { return x.gelu(); });
}
BENCHMARK(BM_ElementwiseGeluF32)->Arg(1)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ElementwiseSigmoidBF16(benchmark::State& state) {
  unary_big(
      state, [](const Tensor& x) { return x.sigmoid(); }, kBFloat16);
}
BENCHMARK(BM_ElementwiseSigmoidBF16)->Arg(1)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ElementwiseAddBF16(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor a = ones({kBig}, kBFloat16), b = ones({kBig}, kBFloat16);
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 3 * kBig * 2);
}
BENCHMARK(BM_ElementwiseAddBF16)->Arg(1)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ElementwiseAddF16(benchmark::State& state) {
  const Tensor a = ones({kBig}, kFloat16), b = ones({kBig}, kFloat16);
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 3 * kBig * 2);
}
BENCHMARK(BM_ElementwiseAddF16)->UseRealTime()->Unit(benchmark::kMillisecond);

// A broadcast add over rows ([4096, 4096] + [4096]) and a transposed (strided) operand.
void BM_ElementwiseAddBroadcastRows(benchmark::State& state) {
  const Tensor a = ones({4096, 4096}), b = ones({4096});
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 2 * 4096 * 4096 * 4);
}
BENCHMARK(BM_ElementwiseAddBroadcastRows)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ElementwiseAddTransposed(benchmark::State& state) {
  const Tensor a = ones({4096, 4096}), b = ones({4096, 4096});
  const Tensor bt = b.t();
  for (auto _ : state) {
    Tensor c = a + bt;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 3 * 4096 * 4096 * 4);
}
BENCHMARK(BM_ElementwiseAddTransposed)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
