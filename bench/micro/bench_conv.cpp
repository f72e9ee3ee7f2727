// A convolution's weight gradient (Note [Weight gradient by unfolding] in
// src/kernels/cpu/conv_weight_gemm.cpp): oneDNN's backward-weights primitive
// against the unfolded input and one product, on resnet's convolutions
// (batch 32, NHWC), at 1 and 2 threads.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=ConvWeightGrad
#include <benchmark/benchmark.h>

#include <vector>

#include "bench_threads.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using kiln_micro::ThreadScope;

// state: threads, bf16, path (0 primitive, 1 product), shape index.
void BM_ConvWeightGrad(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const DType dt = state.range(1) ? kBFloat16 : kFloat32;
  struct Shape {
    int64_t c, hw, o, k, stride;
  };
  static const Shape shapes[] = {{16, 32, 32, 3, 2},  {32, 16, 64, 3, 2},  {16, 32, 32, 1, 2},
                                 {16, 32, 16, 3, 1},  {32, 16, 32, 3, 1},  {64, 8, 64, 3, 1},
                                 {64, 16, 128, 3, 2}, {128, 8, 256, 3, 2}, {3, 32, 16, 7, 2}};
  const Shape s = shapes[state.range(3)];
  kernels::Conv2dParams p;
  p.dtype = dt;
  p.n = 32;
  p.c = s.c;
  p.h = p.w = s.hw;
  p.o = s.o;
  p.kh = p.kw = s.k;
  p.stride[0] = p.stride[1] = s.stride;
  p.pad_l[0] = p.pad_l[1] = p.pad_r[0] = p.pad_r[1] = s.k / 2;
  p.oh = p.ow = (s.hw + 2 * (s.k / 2) - s.k) / s.stride + 1;
  p.input_nhwc = p.output_nhwc = true;
  Generator g(3);
  const Tensor x = randn({p.n * p.h * p.w * p.c}, kFloat32, &g).to(dt);
  const Tensor dy = randn({p.n * p.oh * p.ow * p.o}, kFloat32, &g).to(dt);
  Tensor dw = empty({p.o * p.c * p.kh * p.kw}, dt);
  const kernels::ConvWeightGradPath prev = kernels::conv_weight_grad_path();
  kernels::set_conv_weight_grad_path(state.range(2) ? kernels::ConvWeightGradPath::Product
                                                    : kernels::ConvWeightGradPath::Primitive);
  for (auto _ : state) {
    kernels::conv2d_backward_weight(p, dy.data_ptr(), x.data_ptr(), dw.data_ptr(), nullptr);
    benchmark::ClobberMemory();
  }
  kernels::set_conv_weight_grad_path(prev);
  const double flops = 2.0 * p.n * p.oh * p.ow * p.o * p.c * p.kh * p.kw;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ConvWeightGrad)
    ->ArgsProduct({{1, 2}, {1, 0}, {0, 1}, {0, 1, 2, 3, 4, 5, 6, 7, 8}})
    ->ArgNames({"threads", "bf16", "product", "shape"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
