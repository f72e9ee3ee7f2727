// Int8 against float32 for the cnn workload's layers at 1 thread, batch 64
// (issue 22): each of its two convolutions and two linears through kiln's
// float inference path (nn layers under InferenceModeGuard) and through
// ops::Int8Conv2d / ops::Int8Linear (float input quantized on entry, float
// output), plus the cost of that input quantization alone.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Int8 --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include "bench_threads.h"
#include "kiln/kiln.h"
#include "kiln/ops/int8.h"
#include "kiln/quant/observer.h"
#include "kiln/quant/qtensor.h"

namespace {

using kiln::Tensor;
using kiln_micro::ThreadScope;

struct Layer {
  int64_t c, h, o;  // conv: input channels, size, output channels (3x3, pad 1); linear: h = 0, c = in
};
// The cnn workload (bench/WORKLOADS.md): conv1 1->32 at 28x28, conv2 32->64 at 14x14, fc1 3136->128, fc2 128->10.
const Layer kLayers[] = {{1, 28, 32}, {32, 14, 64}, {3136, 0, 128}, {128, 0, 10}};

Tensor input_of(const Layer& l, int64_t batch, kiln::Generator& g) {
  Tensor x =
      l.h > 0 ? kiln::randn({batch, l.c, l.h, l.h}, kiln::kFloat32, &g) : kiln::randn({batch, l.c}, kiln::kFloat32, &g);
  return x.relu();
}

void BM_Int8Float(benchmark::State& state) {
  const ThreadScope threads(1);
  const Layer& l = kLayers[state.range(0)];
  kiln::Generator g(1);
  const Tensor x = input_of(l, 64, g);
  const kiln::InferenceModeGuard inference;
  if (l.h > 0) {
    kiln::nn::Conv2d conv({.in_channels = l.c, .out_channels = l.o, .kernel_size = {3}, .padding = {1}});
    conv.eval();
    for (auto _ : state) benchmark::DoNotOptimize(conv(x));
  } else {
    kiln::nn::Linear fc({.in_features = l.c, .out_features = l.o});
    fc.eval();
    for (auto _ : state) benchmark::DoNotOptimize(fc(x));
  }
}

void BM_Int8Int8(benchmark::State& state) {
  const ThreadScope threads(1);
  const Layer& l = kLayers[state.range(0)];
  kiln::Generator g(1);
  const Tensor x = input_of(l, 64, g);
  const Tensor w =
      l.h > 0 ? kiln::randn({l.o, l.c, 3, 3}, kiln::kFloat32, &g) : kiln::randn({l.o, l.c}, kiln::kFloat32, &g);
  kiln::quant::PerChannelMinMaxObserver wobs;
  wobs.observe(w);
  const kiln::quant::QTensor wq = kiln::quant::quantize(w, wobs.qparams());
  const Tensor bias = kiln::zeros({l.o});
  kiln::quant::MinMaxObserver aobs;
  aobs.observe(x);
  const kiln::quant::QParams aq = aobs.qparams();
  const kiln::ops::Int8Quantization q{aq.scales[0], aq.zero_points[0]};
  const kiln::InferenceModeGuard inference;
  if (l.h > 0) {
    kiln::ops::Int8Conv2dOptions o;
    o.padding = {1, 1};
    o.q = q;
    const kiln::ops::Int8Conv2d conv(wq.data, wq.scales, bias, o);
    for (auto _ : state) benchmark::DoNotOptimize(conv(x));
    state.SetLabel(conv.implementation(x));
  } else {
    const kiln::ops::Int8Linear fc(wq.data, wq.scales, bias, q);
    for (auto _ : state) benchmark::DoNotOptimize(fc(x));
    state.SetLabel(fc.implementation(x));
  }
}

void BM_Int8QuantizeInput(benchmark::State& state) {
  const ThreadScope threads(1);
  const Layer& l = kLayers[state.range(0)];
  kiln::Generator g(1);
  const Tensor x = input_of(l, 64, g);
  for (auto _ : state)
    benchmark::DoNotOptimize(kiln::quant::quantize_per_tensor(x, 0.01, 0, kiln::quant::QDType::QUInt8));
}

}  // namespace

BENCHMARK(BM_Int8Float)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Int8Int8)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Int8QuantizeInput)->DenseRange(0, 1)->Unit(benchmark::kMicrosecond);
