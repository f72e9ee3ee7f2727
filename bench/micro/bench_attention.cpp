// scaled_dot_product_attention forward + backward (q, k, v gradients) at the
// gpt workload's shape: B=16, H=4, T=128, E=64, causal and unmasked.
// Fused: nn::functional::detail::sdpa_fused (query-row blocks of 64, saves
// out + log-sum-exp, recomputes the weights in backward). Composite: matmul +
// masked_fill + softmax + matmul in kiln ops (keeps the T x T weights).
// The argument is the thread count.
#include <benchmark/benchmark.h>

#include "kiln/autograd/engine.h"
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
}  // namespace

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
