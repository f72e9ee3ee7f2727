// scaled_dot_product_attention forward + backward (q, k, v gradients) at the
// gpt workload's shape: B=16, H=4, T=128, E=64, causal and unmasked.
// Fused: nn::functional::detail::sdpa_fused (query-row blocks of 64, saves
// out + log-sum-exp, recomputes the weights in backward). Composite: matmul +
// masked_fill + softmax + matmul in kiln ops (keeps the T x T weights).
// The argument is the thread count.
#include <benchmark/benchmark.h>

#include <utility>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/nn/attention.h"

namespace {

using namespace kiln;
namespace FN = kiln::nn::functional;

template <typename Attn>
void run_sdpa(benchmark::State& state, bool causal, Attn attn, DType dt = kFloat32) {
  const int before = get_num_threads();
  set_num_threads(static_cast<int>(state.range(0)));
  const int64_t B = 16, H = 4, T = 128, E = 64;
  Tensor q = randn({B, H, T, E}).to(dt).requires_grad_(), k = randn({B, H, T, E}).to(dt).requires_grad_(),
         v = randn({B, H, T, E}).to(dt).requires_grad_();
  Tensor g = randn({B, H, T, E}).to(dt);
  for (auto _ : state) {
    Tensor o = attn(q, k, v, causal);
    benchmark::DoNotOptimize(autograd::grad({o}, {q, k, v}, {g}));
  }
  set_num_threads(before);
  state.SetItemsProcessed(state.iterations() * B * H * T);
}

Tensor fused(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  return FN::detail::sdpa_fused(q, k, v, {}, causal);
}
Tensor composite(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  return FN::detail::sdpa_composite(q, k, v, {}, 0.0, causal, true);
}

void BM_SdpaFusedCausal(benchmark::State& s) { run_sdpa(s, true, fused); }
void BM_SdpaCompositeCausal(benchmark::State& s) { run_sdpa(s, true, composite); }
void BM_SdpaFused(benchmark::State& s) { run_sdpa(s, false, fused); }
// bf16 operands, as gpt's bf16 autocast step hands them over.
void BM_SdpaFusedCausalBf16(benchmark::State& s) { run_sdpa(s, true, fused, kBFloat16); }
void BM_SdpaComposite(benchmark::State& s) { run_sdpa(s, false, composite); }

}  // namespace

BENCHMARK(BM_SdpaFusedCausal)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SdpaCompositeCausal)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SdpaFused)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SdpaFusedCausalBf16)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SdpaComposite)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

namespace {
// Forward alone (graph recorded, no backward), to split the figures above.
template <typename Attn>
void run_sdpa_forward(benchmark::State& state, Attn attn) {
  const int before = kiln::get_num_threads();
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  kiln::Tensor q = kiln::randn({16, 4, 128, 64}).requires_grad_(), k = kiln::randn({16, 4, 128, 64}),
               v = kiln::randn({16, 4, 128, 64});
  for (auto _ : state) benchmark::DoNotOptimize(attn(q, k, v, true));
  kiln::set_num_threads(before);
}
void BM_SdpaFusedCausalForward(benchmark::State& s) { run_sdpa_forward(s, fused); }
void BM_SdpaCompositeCausalForward(benchmark::State& s) { run_sdpa_forward(s, composite); }

// q, k, v heads of one fused [B, T, 3C] projection (T 128, H 4) through
// `attend`, at state.range(0) threads, with backward when state.range(1).
template <typename Attend>
void run_projection_heads(benchmark::State& state, kiln::DType dt, int64_t B, int64_t E, Attend attend) {
  const int before = kiln::get_num_threads();
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  const int64_t H = 4, T = 128, C = H * E;
  const kiln::Tensor x = kiln::randn({B, T, 3 * C}).to(dt).requires_grad_(state.range(1) != 0);
  const kiln::Tensor g = kiln::randn({B, H, T, E}).to(dt);
  auto heads = [&](const kiln::Tensor& t) { return t.view({B, T, H, E}).transpose(1, 2); };
  for (auto _ : state) {
    auto parts = x.split(C, 2);
    kiln::Tensor o = attend(heads(parts[0]), heads(parts[1]), heads(parts[2]));
    if (state.range(1)) benchmark::DoNotOptimize(kiln::autograd::grad({o}, {x}, {g}));
    benchmark::DoNotOptimize(o);
  }
  kiln::set_num_threads(before);
}
// Forward and backward as gpt's step runs them: q, k, v the heads of one
// fused [B, T, 3C] projection (row stride 3C), the weights kept for backward.
// Arguments: threads; 0 forward alone (no graph), 1 forward + backward; query
// rows per block (Note [Query blocks for bf16 training] in
// src/ops/attention.cpp); the batch.
void run_gpt_heads(benchmark::State& state, kiln::DType dt) {
  run_projection_heads(state, dt, state.range(3), 64,
                       [&](const kiln::Tensor& q, const kiln::Tensor& k, const kiln::Tensor& v) {
                         return FN::detail::sdpa_fused(q, k, v, {}, true, state.range(2));
                       });
}
void BM_SdpaGptHeadsBf16(benchmark::State& state) { run_gpt_heads(state, kiln::kBFloat16); }
// The same in float32 (gpt's float32 step).
void BM_SdpaGptHeadsF32(benchmark::State& state) { run_gpt_heads(state, kiln::kFloat32); }
}  // namespace

BENCHMARK(BM_SdpaGptHeadsBf16)
    ->ArgsProduct({{1, 2}, {0, 1}, {64, 128}, {16}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SdpaGptHeadsF32)
    ->ArgsProduct({{1, 2}, {0, 1}, {64, 128}, {16}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
// gpt_infer's attention: one sequence, forward alone, no graph.
BENCHMARK(BM_SdpaGptHeadsF32)->ArgsProduct({{1, 2}, {0}, {64, 128}, {1}})->UseRealTime()->Unit(benchmark::kMicrosecond);

namespace {
// configs/gpt_mobydick.toml's attention (B 32, H 4, T 128, E 32, causal, heads
// of one projection) with dropout on its weights, as the step runs it
// (Note [Dropout inside the heads] in kiln/kernels/attention.h). Arguments:
// threads; 0 forward alone, 1 forward + backward; dropout in percent; 0
// scaled_dot_product_attention's choice, 1 the composite; 0 float32, 1 bf16.
void BM_SdpaDropoutHeads(benchmark::State& state) {
  const double p = static_cast<double>(state.range(2)) / 100.0;
  run_projection_heads(state, state.range(4) ? kiln::kBFloat16 : kiln::kFloat32, 32, 32,
                       [&](const kiln::Tensor& q, const kiln::Tensor& k, const kiln::Tensor& v) {
                         return state.range(3) ? FN::detail::sdpa_composite(q, k, v, {}, p, true, true)
                                               : FN::scaled_dot_product_attention(q, k, v, {}, p, true, true);
                       });
}
}  // namespace
BENCHMARK(BM_SdpaDropoutHeads)
    ->ArgsProduct({{1, 2}, {0, 1}, {0, 10}, {0, 1}, {0, 1}})
    ->ArgNames({"threads", "backward", "dropout_pct", "composite", "bf16"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_SdpaFusedCausalForward)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SdpaCompositeCausalForward)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);

namespace {
// One attention product, q kᵀ over all B x H heads (64 query rows x 64 or 128
// keys, E = 64), 1 thread. Which oneDNN kernel takes it depends on the operands'
// layout (ONEDNN_VERBOSE=1 shows it): only a dense batch of heads reaches brgemm.
//   0  heads as views of gpt's fused [B, T, 3C] projection (what gpt runs)
//   1  dense [B, H, T, E] heads, a 64-row block of them (batch stride T*E)
//   2  the block copied dense, as [B*H, 64, E]; kᵀ a transposed view
//   3  as 2, with kᵀ dense too
//   4  the block copied dense, 4-D (kiln merges B and H itself)
//   5  dense heads viewed [B*H, T, E], then the row block (batch stride T*E)
// Measured 2026-12-04, f32: 0, 1, 5 run gemm:jit at 123-176 GFLOP/s; 2, 3, 4 run
// brg:avx512_core at 196-217 GFLOP/s. The copies that make a block dense cost
// about what brgemm saves (docs/amp.md), so gpt keeps the views.
// bf16 (third arg 1) through oneDNN: 0, 1, 5 at 175-241, 2, 3, 4 at 335-347.
// Through kiln's small-product kernel (src/kernels/cpu/small_gemm.h), which
// now takes both dtypes: bf16 every layout at 299-346, the views included;
// f32 148-179 (layout 3, b read in place, the highest).
void BM_AttentionScoresProduct(benchmark::State& state) {
  const int before = kiln::get_num_threads();
  kiln::set_num_threads(1);
  const int64_t B = 16, T = 128, H = 4, E = 64, keys = state.range(1);
  kiln::Tensor qkv = kiln::randn({B, T, 3 * H * E});
  if (state.range(2) == 1) qkv = qkv.to(kiln::kBFloat16);
  kiln::Tensor q = qkv.narrow(-1, 0, H * E).view({B, T, H, E}).transpose(1, 2);
  kiln::Tensor k = qkv.narrow(-1, H * E, H * E).view({B, T, H, E}).transpose(1, 2);
  if (state.range(0) == 1) {
    q = q.contiguous();
    k = k.contiguous();
  }
  kiln::Tensor qb = q.narrow(-2, T - 64, 64), kb = k.narrow(-2, 0, keys);
  if (state.range(0) == 2) {
    qb = qb.contiguous().view({B * H, 64, E});
    kb = kb.contiguous().view({B * H, keys, E});
  }
  if (state.range(0) == 5) {  // dense heads, a row block of them: batch stride T * E, not 64 * E
    qb = q.contiguous().view({B * H, T, E}).narrow(-2, T - 64, 64);
    kb = k.contiguous().view({B * H, T, E}).narrow(-2, 0, keys);
  }
  if (state.range(0) == 4) {
    qb = qb.contiguous();
    kb = kb.contiguous();
  }
  kiln::Tensor kt = kb.transpose(-2, -1);
  if (state.range(0) == 3) {
    qb = qb.contiguous().view({B * H, 64, E});
    kt = kt.contiguous().view({B * H, E, keys});
  }
  for (auto _ : state) benchmark::DoNotOptimize(qb.matmul(kt));
  kiln::set_num_threads(before);
  state.counters["GFLOP/s"] = benchmark::Counter(static_cast<double>(2 * B * H * 64 * keys * E) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
}  // namespace
BENCHMARK(BM_AttentionScoresProduct)
    ->ArgsProduct({{0, 1, 2, 3, 4, 5}, {64, 128}, {0, 1}})
    ->ArgNames({"layout", "keys", "bf16"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

namespace {
// The six products of one causal attention layer (forward and backward) at
// gpt's shape, straight on kernels::matmul with gpt's operand layouts, both
// query blocks (rows 0-63 against keys 0-63, rows 64-127 against keys 0-127),
// 1 thread. Second arg 1: each through its causal band (Note [Causal
// products]), 0: whole. Products:
//   0  S = q kᵀ (Columns)        1  O = P v into the [B, T, H, E] output (DepthUpTo)
//   2  dP = dO vᵀ (Columns)      3  dV = Pᵀ dO into the joint gradient (DepthFrom)
//   4  dQ = dS k (DepthUpTo)     5  dK = dSᵀ q (DepthFrom)
// GFLOP/s counts the products the band leaves, so with and without the band
// the same useful work is timed.
void BM_AttentionBlockProducts(benchmark::State& state) {
  using Band = kernels::MatmulBand;
  const int before = get_num_threads();
  set_num_threads(1);
  const int64_t B = 16, T = 128, H = 4, E = 64, C = H * E;
  const int which = static_cast<int>(state.range(0));
  const bool banded = state.range(1) == 1;
  const DType dt = state.range(2) == 1 ? kBFloat16 : kFloat32;
  const int64_t es = element_size(dt);
  Tensor qkv = randn({B, T, 3 * C}).to(dt), dout = randn({B, T, C}).to(dt);
  Tensor weights = randn({B, H, 64, T}).mul(0.01).to(dt), result = empty({B, T, 3 * C}, TensorOptions(dt));
  const char* qkv_p = static_cast<const char*>(qkv.data_ptr());
  // A head operand [B, H, rows, E] of a [B, T, width] tensor: (outer, batch, row, col) strides.
  auto head = [&](const void* base, int64_t width, int64_t row0) {
    kernels::MatrixOperand o;
    o.data = static_cast<const char*>(base) + row0 * width * es;
    o.outer_stride = T * width;
    o.stride[0] = E;
    o.stride[1] = width;
    o.stride[2] = 1;
    return o;
  };
  auto transposed = [](kernels::MatrixOperand o) {
    std::swap(o.stride[1], o.stride[2]);
    return o;
  };
  auto dense = [&](int64_t cols) {  // weights / dS [B, H, 64, cols] in a [B, H, 64, T] buffer
    kernels::MatrixOperand o;
    o.data = weights.data_ptr();
    o.outer_stride = H * 64 * T;
    o.stride[0] = 64 * T;
    o.stride[1] = cols;
    o.stride[2] = 1;
    return o;
  };
  const void* q = qkv_p;
  const void* k = qkv_p + C * es;
  const void* v = qkv_p + 2 * C * es;
  std::vector<kernels::MatmulArgs> calls;
  double flops = 0;
  for (int64_t r0 : {0, 64}) {
    const int64_t n = 64, kend = r0 + 64;
    kernels::MatmulArgs g;
    g.dtype = dt;
    g.outer = B;
    g.batch = H;
    Band::Kind kind = Band::Kind::None;
    char* out = static_cast<char*>(result.data_ptr());
    auto into_heads = [&](char* base, int64_t width) {  // c as heads of a [B, T, width] buffer
      g.c = base;
      g.c_outer_stride = T * width;
      g.c_stride[0] = E;
      g.c_stride[1] = width;
    };
    auto into_dense = [&](int64_t cols) {
      g.c = out;
      g.c_outer_stride = H * 64 * cols;
      g.c_stride[0] = 64 * cols;
      g.c_stride[1] = cols;
    };
    switch (which) {
      case 0:
      case 2:
        g.m = n, g.n = kend, g.k = E;
        g.a = which == 0 ? head(q, 3 * C, r0) : head(dout.data_ptr(), C, r0);
        g.b = transposed(head(which == 0 ? k : v, 3 * C, 0));
        into_dense(kend);
        kind = Band::Kind::Columns;
        break;
      case 1:
      case 4:
        g.m = n, g.n = E, g.k = kend;
        g.a = dense(kend);
        g.b = head(which == 1 ? v : k, 3 * C, 0);
        into_heads(out + r0 * 3 * C * es, 3 * C);
        kind = Band::Kind::DepthUpTo;
        break;
      default:
        g.m = kend, g.n = E, g.k = n;
        g.a = transposed(dense(kend));
        g.b = which == 3 ? head(dout.data_ptr(), C, r0) : head(q, 3 * C, r0);
        into_heads(out, 3 * C);
        kind = Band::Kind::DepthFrom;
        break;
    }
    const Band band{kind, r0};
    if (banded) g.band = band;
    flops += 2.0 * B * H * kernels::band_multiply_adds(g.m, g.n, g.k, band);
    calls.push_back(g);
  }
  for (auto _ : state)
    for (const auto& g : calls) kernels::matmul(g);
  set_num_threads(before);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
}  // namespace
BENCHMARK(BM_AttentionBlockProducts)
    ->ArgsProduct({{0, 1, 2, 3, 4, 5}, {0, 1}, {0, 1}})
    ->ArgNames({"product", "band", "bf16"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
