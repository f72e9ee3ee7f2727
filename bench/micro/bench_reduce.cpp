// Reduction and softmax kernels: the shapes that matter in training.
//   sum over 16M floats            (a loss, a norm of all gradients)
//   softmax over [4096, 1024] rows (attention, classification heads)
//   sum over dim 0 of [4096, 1024] (a bias gradient: the column kernel)
//   sum over the last 64 of [16, 4, 128, 64] (attention backward's row dots)
//   softmax backward over [4096, 1024] rows: the fused kernel (through the
//   engine, as loss.backward() runs it) and, for comparison, the same formula
//   in tensor ops (what create_graph runs)
// The argument is the thread count. Bytes are what the kernel must move at
// least (input read, output written), so GB/s compares with memory bandwidth.
#include <benchmark/benchmark.h>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/ops/reduce.h"

namespace {

using namespace kiln;

// Runs body() per iteration at range(0) threads, restoring the setting after.
template <typename F>
void run(benchmark::State& state, int64_t bytes, F body) {
  const int before = get_num_threads();
  set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(body());
  set_num_threads(before);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_SumAll16M(benchmark::State& state) {
  const Tensor x = randn({int64_t{1} << 24});
  run(state, x.nbytes(), [&] { return x.sum(); });
}

void BM_SoftmaxRows(benchmark::State& state) {
  const Tensor x = randn({4096, 1024});
  run(state, 2 * x.nbytes(), [&] { return x.softmax(-1); });
}

void BM_LogSoftmaxRows(benchmark::State& state) {
  const Tensor x = randn({4096, 1024});
  run(state, 2 * x.nbytes(), [&] { return x.log_softmax(-1); });
}

void BM_SoftmaxBackwardRows(benchmark::State& state) {
  Tensor x = randn({4096, 1024}).requires_grad_();
  const Tensor y = x.softmax(-1);
  const Tensor g = randn({4096, 1024});
  // Reads y and g, writes the gradient.
  run(state, 3 * x.nbytes(), [&] { return autograd::grad({y}, {x}, {g}, /*retain_graph=*/true)[0]; });
}

void BM_LogSoftmaxBackwardRows(benchmark::State& state) {
  Tensor x = randn({4096, 1024}).requires_grad_();
  const Tensor y = x.log_softmax(-1);
  const Tensor g = randn({4096, 1024});
  run(state, 3 * x.nbytes(), [&] { return autograd::grad({y}, {x}, {g}, /*retain_graph=*/true)[0]; });
}

void BM_SoftmaxBackwardRowsComposite(benchmark::State& state) {
  const Tensor y = randn({4096, 1024}).softmax(-1);
  const Tensor g = randn({4096, 1024});
  run(state, 3 * y.nbytes(), [&] { return y * (g - (g * y).sum({1}, true)); });
}

void BM_SoftmaxDim0(benchmark::State& state) {
  const Tensor x = randn({1024, 4096});
  run(state, 2 * x.nbytes(), [&] { return x.softmax(0); });
}

void BM_SumDim0(benchmark::State& state) {
  const Tensor x = randn({4096, 1024});
  run(state, x.nbytes(), [&] { return x.sum({0}); });
}

// gpt's bf16 bias gradients: [2048, cols] over the rows, cols = range(1).
void BM_SumDim0Bf16(benchmark::State& state) {
  const Tensor x = randn({2048, state.range(1)}).to(kBFloat16);
  run(state, x.nbytes(), [&] { return x.sum({0}); });
}

void BM_SumDim1(benchmark::State& state) {
  const Tensor x = randn({4096, 1024});
  run(state, x.nbytes(), [&] { return x.sum({1}); });
}

// Short rows: attention backward's D = rowsum(dO * O) over gpt's heads,
// [16, 4, 128, 64] summed over the last 64: 8192 rows of 4 vectors each, where
// what a row costs beyond its loads shows.
void BM_SumShortRows(benchmark::State& state) {
  const Tensor x = randn({16, 4, 128, 64});
  run(state, x.nbytes(), [&] { return x.sum({-1}, /*keepdim=*/true); });
}

void BM_ArgmaxRows(benchmark::State& state) {
  const Tensor x = randn({4096, 1024});
  run(state, x.nbytes(), [&] { return x.argmax(1); });
}

void BM_VarRows(benchmark::State& state) {
  const Tensor x = randn({4096, 1024});
  run(state, x.nbytes(), [&] { return x.var({1}); });
}

void BM_SumSmall(benchmark::State& state) {
  // Framework overhead on a tiny tensor (one thread: below the grain anyway).
  const Tensor x = randn({8, 16});
  run(state, x.nbytes(), [&] { return x.sum({1}); });
}

}  // namespace

BENCHMARK(BM_SumAll16M)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SumShortRows)->Arg(1)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SoftmaxRows)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_LogSoftmaxRows)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SoftmaxBackwardRows)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_LogSoftmaxBackwardRows)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SoftmaxBackwardRowsComposite)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SoftmaxDim0)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SumDim0)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SumDim0Bf16)->ArgsProduct({{1, 2}, {256, 768, 1024}})->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SumDim1)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_ArgmaxRows)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_VarRows)->Arg(1)->Arg(2)->MinTime(0.3)->UseRealTime();
BENCHMARK(BM_SumSmall)->Arg(1)->MinTime(0.3);
