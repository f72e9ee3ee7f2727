// Binary ops on operands of mixed dtypes (issue 28): a [4096, 1024] float32
// tensor with a bfloat16, float16 or int64 one, and float64 with float32. The
// odd-dtype operand is converted to the compute dtype on the way; the figure
// to watch is how close this comes to the same-dtype add (one pass over
// memory). Bytes count each array once at its own dtype: the two reads and
// the write, which is all a single pass touches.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Mixed
#include <benchmark/benchmark.h>

#include "bench_threads.h"
#include "kiln/kiln.h"
#include "kiln/ops/elementwise.h"

namespace {

using namespace kiln;
using kiln_micro::ThreadScope;

constexpr int64_t kRows = 4096, kCols = 1024;

Tensor filled(IntArrayRef shape, DType dt) {
  Generator g(7);
  Tensor t = randn(shape, kFloat32, &g);
  if (!is_floating_point(dt)) t = (t * 100.0).to(dt);
  return t.to(dt);
}

int64_t bytes_of(const Tensor& t) { return t.numel() * t.element_size(); }

// out = a op b, out of place.
template <typename F>
void mixed_binary(benchmark::State& state, DType da, DType db, IntArrayRef shape_b, F f) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor a = filled({kRows, kCols}, da), b = filled(shape_b, db);
  int64_t bytes = 0;
  for (auto _ : state) {
    Tensor c = f(a, b);
    benchmark::DoNotOptimize(c.data_ptr());
    bytes = bytes_of(a) + bytes_of(b) + bytes_of(c);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_MixedAddF32BF16(benchmark::State& state) {
  mixed_binary(state, kFloat32, kBFloat16, {kRows, kCols}, [](const Tensor& a, const Tensor& b) { return a + b; });
}
BENCHMARK(BM_MixedAddF32BF16)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

// bf16 on the left: the converted operand is `a`, not `b`.
void BM_MixedAddBF16F32(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const Tensor a = filled({kRows, kCols}, kBFloat16), b = filled({kRows, kCols}, kFloat32);
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kRows * kCols * (2 + 4 + 4));
}
BENCHMARK(BM_MixedAddBF16F32)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_MixedAddF32F16(benchmark::State& state) {
  mixed_binary(state, kFloat32, kFloat16, {kRows, kCols}, [](const Tensor& a, const Tensor& b) { return a + b; });
}
BENCHMARK(BM_MixedAddF32F16)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_MixedAddF64F32(benchmark::State& state) {
  mixed_binary(state, kFloat64, kFloat32, {kRows, kCols}, [](const Tensor& a, const Tensor& b) { return a + b; });
}
BENCHMARK(BM_MixedAddF64F32)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_MixedMulF32I64(benchmark::State& state) {
  mixed_binary(state, kFloat32, kInt64, {kRows, kCols}, [](const Tensor& a, const Tensor& b) { return a * b; });
}
BENCHMARK(BM_MixedMulF32I64)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

// Broadcast: [4096, 1024] float32 + [1024] bfloat16 (a row added to every row).
void BM_MixedAddF32BF16BroadcastRow(benchmark::State& state) {
  mixed_binary(state, kFloat32, kBFloat16, {kCols}, [](const Tensor& a, const Tensor& b) { return a + b; });
}
BENCHMARK(BM_MixedAddF32BF16BroadcastRow)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// In place: a.add_(b), a float32 and b bfloat16 (self is the compute dtype).
void BM_MixedAddInplaceF32BF16(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  Tensor a = filled({kRows, kCols}, kFloat32);
  const Tensor b = filled({kRows, kCols}, kBFloat16);
  for (auto _ : state) {
    a.add_(b);
    benchmark::DoNotOptimize(a.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kRows * kCols * (4 + 2 + 4));
}
BENCHMARK(BM_MixedAddInplaceF32BF16)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

// The same-dtype add of the same shape: the one-pass figure to compare with.
void BM_MixedRefAddF32F32(benchmark::State& state) {
  mixed_binary(state, kFloat32, kFloat32, {kRows, kCols}, [](const Tensor& a, const Tensor& b) { return a + b; });
}
BENCHMARK(BM_MixedRefAddF32F32)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

namespace {
// The casts autocast makes: float32 activations and weights to bfloat16, and
// bfloat16 gradients back. One read and one write at each side's dtype.
void cast(benchmark::State& state, kiln::DType from, kiln::DType to) {
  kiln_micro::ThreadScope threads(static_cast<int>(state.range(0)));
  const kiln::Tensor a = filled({kRows, kCols}, from);
  for (auto _ : state) benchmark::DoNotOptimize(a.to(to).data_ptr());
  state.SetBytesProcessed(state.iterations() * kRows * kCols * (4 + 2));
}
void BM_CastF32ToBF16(benchmark::State& state) { cast(state, kiln::kFloat32, kiln::kBFloat16); }
void BM_CastBF16ToF32(benchmark::State& state) { cast(state, kiln::kBFloat16, kiln::kFloat32); }
BENCHMARK(BM_CastF32ToBF16)->Arg(1)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastBF16ToF32)->Arg(1)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);
}  // namespace

namespace {

// Tensor::to between float32 and bfloat16 at gpt's autocast sizes: a layer
// norm's output [2048, 256] going into a linear, a weight [1024, 256] cast once
// per step, and the gradients coming back. One pass over memory each.
void BM_CastFloatBf16(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t rows = state.range(1), cols = 256;
  const bool narrow = state.range(2) != 0;
  const Tensor x = filled({rows, cols}, narrow ? kFloat32 : kBFloat16);
  const DType to = narrow ? kBFloat16 : kFloat32;
  for (auto _ : state) benchmark::DoNotOptimize(x.to(to).data_ptr());
  state.SetBytesProcessed(state.iterations() * rows * cols * 6);
}
BENCHMARK(BM_CastFloatBf16)
    ->ArgsProduct({{1, 2}, {1024, 2048}, {1, 0}})
    ->ArgNames({"threads", "rows", "narrow"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
