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
