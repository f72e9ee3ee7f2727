// A convolution's weight gradient (Note [Weight gradient by unfolding] in
// src/kernels/cpu/conv_weight_gemm.cpp): oneDNN's backward-weights primitive
// against the unfolded input and one product, on resnet's convolutions
// (batch 32, NHWC), at 1 and 2 threads.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=ConvWeightGrad
#include <benchmark/benchmark.h>

#include <utility>
#include <vector>

#include "bench_threads.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using kiln_micro::ThreadScope;

// state: threads, bf16, path (0 primitive, 1 product, 2 direct), shape index.
void BM_ConvWeightGrad(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const DType dt = state.range(1) ? kBFloat16 : kFloat32;
  struct Shape {
    int64_t c, hw, o, k, stride;
  };
  static const Shape shapes[] = {{16, 32, 32, 3, 2}, {32, 16, 64, 3, 2}, {16, 32, 32, 1, 2},  {16, 32, 16, 3, 1},
                                 {32, 16, 32, 3, 1}, {64, 8, 64, 3, 1},  {64, 16, 128, 3, 2}, {128, 8, 256, 3, 2},
                                 {3, 32, 16, 7, 2},  {1, 28, 32, 3, 1},  {3, 32, 16, 3, 1}};
  const Shape s = shapes[state.range(3)];
  kernels::Conv2dParams p;
  p.dtype = dt;
  p.n = state.range(3) == 9 ? 64 : 32;  // 9: cnn's first layer at its batch
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
  kernels::set_conv_weight_grad_path(state.range(2) == 2   ? kernels::ConvWeightGradPath::Direct
                                     : state.range(2) == 1 ? kernels::ConvWeightGradPath::Product
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
    ->ArgsProduct({{1, 2}, {1, 0}, {0, 1, 2}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}})
    ->ArgNames({"threads", "bf16", "product", "shape"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

namespace {

// cnn's first layer in backward (64 images, 1 -> 32 channels, 3x3 over 28x28,
// then a 2x2 max pool): the pool's backward then the weight gradient (0), or
// the weight gradient read through the pool (1, kiln::compile's rewrite,
// conv2d_backward_weight_pooled). state: threads, form.
// cnn's conv1 (64 images, 1 -> 32 channels, 3x3 over 28x28, NHWC) and the 2x2 max pool after it.
std::pair<kernels::Conv2dParams, kernels::Pool2dParams> cnn_first_layer() {
  kernels::Conv2dParams p;
  p.n = 64, p.c = 1, p.h = p.w = 28, p.o = 32, p.kh = p.kw = 3, p.oh = p.ow = 28;
  p.pad_l[0] = p.pad_l[1] = p.pad_r[0] = p.pad_r[1] = 1;
  p.input_nhwc = p.output_nhwc = true;
  kernels::Pool2dParams q;
  q.n = 64, q.c = 32, q.h = q.w = 28, q.oh = q.ow = 14;
  q.kernel[0] = q.kernel[1] = q.stride[0] = q.stride[1] = 2;
  q.nhwc = true;
  return {p, q};
}

void BM_ConvWeightGradPooled(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const auto [p, q] = cnn_first_layer();
  Generator g(4);
  const Tensor x = randn({64 * 28 * 28}, kFloat32, &g);
  const Tensor y = randn({64 * 28 * 28 * 32}, kFloat32, &g);
  const Tensor pooled = empty({64 * 14 * 14 * 32}, kFloat32), gp = randn({64 * 14 * 14 * 32}, kFloat32, &g);
  std::vector<uint8_t> ws(kernels::pool2d_workspace_bytes(q));
  kernels::pool2d_forward(q, y.data_ptr(), pooled.data_ptr(), ws.data());
  Tensor gi = empty({64 * 28 * 28 * 32}, kFloat32), dw = empty({32 * 9}, kFloat32), db = empty({32}, kFloat32);
  for (auto _ : state) {
    if (state.range(1)) {
      kernels::conv2d_backward_weight_pooled(p, q, gp.data_ptr(), ws.data(), x.data_ptr(), dw.data_ptr(),
                                             db.data_ptr());
    } else {
      kernels::max_pool2d_backward_workspace(q, gp.data_ptr(), ws.data(), gi.data_ptr());
      kernels::conv2d_backward_weight(p, gi.data_ptr(), x.data_ptr(), dw.data_ptr(), db.data_ptr());
    }
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_ConvWeightGradPooled)->ArgsProduct({{1, 2}, {0, 1}})->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

namespace {

// cnn's first layer forward (64 images, 1 -> 32 channels, 3x3 over 28x28,
// then a 2x2 max pool): the convolution then the pool (0), or the two as one
// (1, kiln::compile's rewrite, conv2d_forward_pooled). state: threads, form.
void BM_ConvForwardPooled(benchmark::State& state) {
  ThreadScope threads(static_cast<int>(state.range(0)));
  const auto [p, q] = cnn_first_layer();
  Generator g(5);
  const Tensor x = randn({64 * 28 * 28}, kFloat32, &g), w = randn({32 * 9}, kFloat32, &g),
               b = randn({32}, kFloat32, &g);
  Tensor y = empty({64 * 28 * 28 * 32}, kFloat32), pooled = empty({64 * 14 * 14 * 32}, kFloat32);
  std::vector<uint8_t> ws(kernels::pool2d_workspace_bytes(q));
  for (auto _ : state) {
    if (state.range(1)) {
      kernels::conv2d_forward_pooled(p, q, x.data_ptr(), w.data_ptr(), b.data_ptr(), pooled.data_ptr(), ws.data(),
                                     nullptr);
    } else {
      kernels::conv2d_forward(p, x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr());
      kernels::pool2d_forward(q, y.data_ptr(), pooled.data_ptr(), ws.data());
    }
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_ConvForwardPooled)->ArgsProduct({{1, 2}, {0, 1}})->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
