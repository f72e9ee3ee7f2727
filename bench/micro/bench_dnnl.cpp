// Dense math throughput through kiln's public ops (oneDNN underneath):
// matmul 1024^3 in float32/bfloat16, conv2d N=64 C=32 14x14 K=64 3x3 pad 1
// forward and backward (data, weights + bias, both), linear backward for
// x [128, 784] · W [512, 784]ᵀ, at 1 and 2 threads, reported as GFLOP/s;
// plus the per-call cost of a tiny matmul (framework overhead + kiln's own
// tile, Note [Tiny products]) and a max pool. Backward runs autograd::grad over a graph
// recorded once (retain_graph), so it times the backward nodes and kernels.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Dnnl --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <vector>
#include "bench_threads.h"

#include "kiln/autograd/engine.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/linalg.h"
#include "kiln/ops/memory_format.h"

namespace {

using kiln::DType;
using kiln::Tensor;

// Sets kiln's (and so oneDNN's) thread count for one benchmark run.
using kiln_micro::ThreadScope;

void set_gflops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iter * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_DnnlMatmul(benchmark::State& state, DType dt) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t n = 1024;
  kiln::Generator g(1);
  const Tensor a = kiln::randn({n, n}, kiln::kFloat32, &g).to(dt);
  const Tensor b = kiln::randn({n, n}, kiln::kFloat32, &g).to(dt);
  benchmark::DoNotOptimize(kiln::mm(a, b));  // warm: primitive creation and output block
  for (auto _ : state) benchmark::DoNotOptimize(kiln::mm(a, b));
  set_gflops(state, 2.0 * n * n * n);
}

void BM_DnnlConv2d(benchmark::State& state, DType dt) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t N = 64, C = 32, H = 14, W = 14, K = 64, R = 3;
  kiln::Generator g(2);
  const Tensor x = kiln::randn({N, C, H, W}, kiln::kFloat32, &g).to(dt);
  const Tensor w = kiln::randn({K, C, R, R}, kiln::kFloat32, &g).to(dt);
  const Tensor b = kiln::randn({K}, kiln::kFloat32, &g).to(dt);
  benchmark::DoNotOptimize(kiln::conv2d(x, w, b, 1, 1));
  for (auto _ : state) benchmark::DoNotOptimize(kiln::conv2d(x, w, b, 1, 1));
  set_gflops(state, 2.0 * N * K * C * R * R * H * W);
}

// What conv2d backward computes: the input gradient, the weight (and bias) gradient, or both.
enum ConvGrad { kData = 1, kWeights = 2, kBoth = 3 };

void BM_DnnlConv2dBackward(benchmark::State& state, DType dt, int which) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t N = 64, C = 32, H = 14, W = 14, K = 64, R = 3;
  kiln::Generator g(2);
  Tensor x = kiln::randn({N, C, H, W}, kiln::kFloat32, &g).to(dt);
  Tensor w = kiln::randn({K, C, R, R}, kiln::kFloat32, &g).to(dt);
  Tensor b = kiln::randn({K}, kiln::kFloat32, &g).to(dt);
  kiln::TensorList wrt;
  if (which & kData) wrt.push_back(x.requires_grad_());
  if (which & kWeights) {
    wrt.push_back(w.requires_grad_());
    wrt.push_back(b.requires_grad_());
  }
  const Tensor y = kiln::conv2d(x, w, b, 1, 1);
  const Tensor gy = kiln::randn(y.sizes(), kiln::kFloat32, &g).to(dt);
  benchmark::DoNotOptimize(kiln::autograd::grad({y}, wrt, {gy}, true));  // warm: primitives
  for (auto _ : state) benchmark::DoNotOptimize(kiln::autograd::grad({y}, wrt, {gy}, true));
  const double one = 2.0 * N * K * C * R * R * H * W;  // each direction costs one forward
  set_gflops(state, which == kBoth ? 2 * one : one);
}

void BM_DnnlLinearBackward(benchmark::State& state, DType dt, bool with_bias) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t M = 128, IN = 784, OUT = 512;
  kiln::Generator g(4);
  const Tensor x = kiln::randn({M, IN}, kiln::kFloat32, &g).to(dt).requires_grad_();
  const Tensor w = kiln::randn({OUT, IN}, kiln::kFloat32, &g).to(dt).requires_grad_();
  const Tensor b = with_bias ? kiln::randn({OUT}, kiln::kFloat32, &g).to(dt).requires_grad_() : Tensor();
  const Tensor y = kiln::linear(x, w, b);
  const Tensor gy = kiln::randn(y.sizes(), kiln::kFloat32, &g).to(dt);
  const kiln::TensorList wrt = with_bias ? kiln::TensorList{x, w, b} : kiln::TensorList{x, w};
  benchmark::DoNotOptimize(kiln::autograd::grad({y}, wrt, {gy}, true));
  for (auto _ : state) benchmark::DoNotOptimize(kiln::autograd::grad({y}, wrt, {gy}, true));
  set_gflops(state, 2.0 * 2.0 * M * IN * OUT);  // grad_x = g · W and grad_W = gᵀ · x
}

// Per-call cost on a tiny product: framework overhead plus the product, which
// since 2026-12-05 runs on kiln's own tile rather than oneDNN (Note [Tiny
// products] in src/kernels/cpu/small_gemm.h): 911 ns for the 8 x 8 mm and
// 1224 ns for the 4 x 32 -> 16 linear through oneDNN's cached primitive before,
// 259 ns and 653 ns on the tile (1 thread).
void BM_DnnlSmallMatmul(benchmark::State& state) {
  const ThreadScope threads(1);
  const Tensor a = kiln::ones({8, 8}), b = kiln::ones({8, 8});
  for (auto _ : state) benchmark::DoNotOptimize(kiln::mm(a, b));
}

void BM_DnnlSmallLinear(benchmark::State& state) {
  const ThreadScope threads(1);
  const Tensor x = kiln::ones({4, 32}), w = kiln::ones({16, 32}), bias = kiln::ones({16});
  for (auto _ : state) benchmark::DoNotOptimize(kiln::linear(x, w, bias));
}

void BM_DnnlMaxPool(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  kiln::Generator g(3);
  const Tensor x = kiln::randn({32, 64, 56, 56}, kiln::kFloat32, &g);
  benchmark::DoNotOptimize(kiln::max_pool2d(x, 3, 2, 1));
  for (auto _ : state) benchmark::DoNotOptimize(kiln::max_pool2d(x, 3, 2, 1));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 5 / 4);  // read input, write a quarter
}

// cnn's two 2x2 max pools on channels-last inputs (kiln's own kernel, Note
// [Channels-last max pooling] in src/kernels/cpu/pool_max_nhwc.cpp): forward
// with the workspace, then the backward. state: threads, shape (0: 32
// channels 28x28, 1: 64 channels 14x14).
void BM_MaxPoolChannelsLast(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t c = state.range(1) ? 64 : 32, hw = state.range(1) ? 14 : 28;
  kiln::Generator g(5);
  const Tensor x = kiln::contiguous(kiln::randn({64, c, hw, hw}, kiln::kFloat32, &g), kiln::MemoryFormat::ChannelsLast)
                       .requires_grad_();
  const Tensor y = kiln::max_pool2d(x, 2);
  const Tensor gy = kiln::contiguous(kiln::randn(y.sizes(), kiln::kFloat32, &g), kiln::MemoryFormat::ChannelsLast);
  for (auto _ : state) {
    const Tensor out = kiln::max_pool2d(x, 2);
    benchmark::DoNotOptimize(kiln::autograd::grad({out}, {x}, {gy}));
  }
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 2);  // read the input, write its gradient
}

// The mlp workload's products (batch 128, 784 -> 512 -> 512 -> 10), one
// shape per run: 0 the first layer's forward (x · W1ᵀ), 1 the second's, 2 its
// input gradient (g · W2), 3 its weight gradient (gᵀ · x), 4 the first
// layer's weight gradient; and gpt's MLP over 2048 tokens: 5 c_fc's forward,
// 6 its input gradient, 7 its weight gradient, 8 c_proj's weight gradient.
// state: shape, threads, bf16 (0 float32, 1 bf16). c_proj's weight gradient
// (256 x 1024 over 2048 tokens) gained least from a second thread: 1.48-1.71x
// against 1.96x for c_fc's (2026-12-05), until it took a turned copy of its
// first operand (Note [Transposed first operands], dnnl_matmul.cpp). On two
// threads shape 6 now runs as two one-thread row shares, and 7 and 8 in bf16
// as two token shares (Note [Shares of a product on one thread each]).
void BM_MlpProduct(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(1)));
  struct Shape {
    int64_t m, n, k;
    bool a_t, b_t;  // a stored [k, m], b stored [n, k]
  };
  const Shape shapes[] = {
      {128, 512, 784, false, true},    {128, 512, 512, false, true},   {128, 512, 512, false, false},
      {512, 512, 128, true, false},    {512, 784, 128, true, false},   {2048, 1024, 256, false, true},
      {2048, 256, 1024, false, false}, {1024, 256, 2048, true, false}, {256, 1024, 2048, true, false}};
  const Shape s = shapes[state.range(0)];
  kiln::Generator g(6);
  const Tensor a0 = s.a_t ? kiln::randn({s.k, s.m}, kiln::kFloat32, &g) : kiln::randn({s.m, s.k}, kiln::kFloat32, &g);
  const Tensor b0 = s.b_t ? kiln::randn({s.n, s.k}, kiln::kFloat32, &g) : kiln::randn({s.k, s.n}, kiln::kFloat32, &g);
  const kiln::DType dt = state.range(2) ? kiln::kBFloat16 : kiln::kFloat32;
  const Tensor a = s.a_t ? a0.to(dt).t() : a0.to(dt), b = s.b_t ? b0.to(dt).t() : b0.to(dt);
  benchmark::DoNotOptimize(kiln::mm(a, b));
  for (auto _ : state) benchmark::DoNotOptimize(kiln::mm(a, b));
  set_gflops(state, 2.0 * s.m * s.n * s.k);
}

// gpt's bf16 weight gradients dW = dYᵀ X (2048 tokens deep) three ways:
// mode 0 the bf16 product alone, 1 the bf16 product widened to float32
// after (torch's autocast: the cast's backward), 2 the product with a
// float32 c (Note [Float32 weight gradients under autocast] in
// src/ops/linalg.cpp). Shapes: c_fc [1024, 256], c_proj [256, 1024],
// c_attn [768, 256].
void BM_WeightGradOut(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(1)));
  const int64_t shapes[][2] = {{1024, 256}, {256, 1024}, {768, 256}};
  const int64_t m = shapes[state.range(0)][0], n = shapes[state.range(0)][1], k = 2048;
  const int mode = static_cast<int>(state.range(2));
  kiln::Generator g(7);
  const Tensor dy = kiln::randn({k, m}, kiln::kFloat32, &g).to(kiln::kBFloat16);
  const Tensor x = kiln::randn({k, n}, kiln::kFloat32, &g).to(kiln::kBFloat16);
  const Tensor c = kiln::empty({m, n}, mode == 2 ? kiln::kFloat32 : kiln::kBFloat16);
  kiln::kernels::MatmulArgs a;
  a.dtype = kiln::kBFloat16;
  a.m = m;
  a.n = n;
  a.k = k;
  a.a = {dy.data_ptr(), {0, 1, m}, 0};  // dYᵀ: [m, k] read from [k, m]
  a.b = {x.data_ptr(), {0, n, 1}, 0};
  a.c = c.data_ptr();
  a.float_c = mode == 2;
  for (auto _ : state) {
    kiln::kernels::matmul(a);
    if (mode == 1) benchmark::DoNotOptimize(c.to(kiln::kFloat32));
  }
  set_gflops(state, 2.0 * m * n * k);
}

}  // namespace

BENCHMARK(BM_MlpProduct)->ArgsProduct({{0, 1, 2, 3, 4, 5, 6, 7, 8}, {1, 2}, {0, 1}})->UseRealTime();
BENCHMARK(BM_WeightGradOut)->ArgsProduct({{0, 1, 2}, {1, 2}, {0, 1, 2}})->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlMatmul, f32, kiln::kFloat32)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlMatmul, bf16, kiln::kBFloat16)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlConv2d, f32, kiln::kFloat32)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlConv2d, bf16, kiln::kBFloat16)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlConv2dBackward, f32_data, kiln::kFloat32, kData)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlConv2dBackward, f32_weights, kiln::kFloat32, kWeights)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlConv2dBackward, f32_both, kiln::kFloat32, kBoth)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlConv2dBackward, bf16_both, kiln::kBFloat16, kBoth)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlLinearBackward, f32, kiln::kFloat32, true)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlLinearBackward, f32_no_bias, kiln::kFloat32, false)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_DnnlLinearBackward, bf16, kiln::kBFloat16, true)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DnnlSmallMatmul);
BENCHMARK(BM_DnnlSmallLinear);
BENCHMARK(BM_DnnlMaxPool)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MaxPoolChannelsLast)
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->ArgNames({"threads", "shape"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
namespace {
// Note [Packing b first on two threads] (src/kernels/cpu/dnnl_matmul.cpp):
// gpt's products over 2048 tokens. shape: 0 c_fc forward (b = Wᵀ, 1024
// columns), 1 c_proj forward (256), 2 c_attn forward (768), 3 attn c_proj
// forward (256), 4 c_proj's input gradient (b = W, 1024), 5 c_fc's (256),
// 6 c_attn's (256). mode: 0 kernels::matmul, which packs b itself where the
// Note says; 1 b packed once outside the loop (what packing could reach if it
// were free); 2 b packed on every call, then the product on it. state:
// threads, mode, shape, bf16.
void BM_PackBFirst(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const int64_t mode = state.range(1);
  const int64_t shapes[][3] = {{2048, 1024, 256}, {2048, 256, 1024}, {2048, 768, 256}, {2048, 256, 256},
                               {2048, 1024, 256}, {2048, 256, 1024}, {2048, 256, 768}};
  const int64_t* sh = shapes[state.range(2)];
  const bool plain = state.range(2) >= 4;
  const int64_t m = sh[0], n = sh[1], k = sh[2];
  const kiln::DType dt = state.range(3) ? kiln::kBFloat16 : kiln::kFloat32;
  kiln::Generator gen(7);
  const Tensor x = kiln::randn({m, k}, kiln::kFloat32, &gen).to(dt);
  const Tensor w =
      kiln::randn(plain ? std::vector<int64_t>{k, n} : std::vector<int64_t>{n, k}, kiln::kFloat32, &gen).to(dt);
  Tensor c = kiln::empty({m, n}, dt);
  kiln::kernels::MatmulArgs g;
  g.dtype = dt;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = {x.data_ptr(), {0, k, 1}, 0};
  g.b = plain ? kiln::kernels::MatrixOperand{w.data_ptr(), {0, n, 1}, 0}
              : kiln::kernels::MatrixOperand{w.data_ptr(), {0, 1, k}, 0};
  g.c = c.data_ptr();
  const kiln::kernels::PackedLayout layout = kiln::kernels::matmul_packed_layout(g);
  Tensor packed = kiln::empty({static_cast<int64_t>(layout.bytes) + 64}, kiln::kUInt8);
  if (layout.bytes > 0) kiln::kernels::matmul_pack_b(g, packed.data_ptr());
  for (auto _ : state) {
    if (mode == 0 || layout.bytes == 0) {
      kiln::kernels::matmul(g);
      continue;
    }
    if (mode == 2) kiln::kernels::matmul_pack_b(g, packed.data_ptr());
    kiln::kernels::matmul_with_packed_b(g, packed.data_ptr());
  }
  set_gflops(state, 2.0 * m * n * k);
}
}  // namespace
BENCHMARK(BM_PackBFirst)->ArgsProduct({{1, 2}, {0, 1, 2}, {0, 1, 2, 3, 4, 5, 6}, {0, 1}})->UseRealTime();
