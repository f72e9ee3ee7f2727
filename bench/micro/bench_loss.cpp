// cross_entropy forward + backward (class-index targets, mean reduction):
//   [128, 10]    an MNIST-sized classifier batch
//   [2048, 256]  the gpt workload's logits (16 * 128 rows x 256 vocab)
// Fused: kiln::nn::F::cross_entropy (one kernel pass per row forward, one
// backward). Composed: log_softmax + nll_loss in tensor ops, for comparison.
// The argument is the thread count.
#include <benchmark/benchmark.h>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/nn/functional.h"

namespace {

using namespace kiln;
namespace F = kiln::nn::F;

template <typename Loss>
void run_ce(benchmark::State& state, int64_t rows, int64_t classes, Loss loss) {
  const int before = get_num_threads();
  set_num_threads(static_cast<int>(state.range(0)));
  Tensor x = randn({rows, classes}).requires_grad_();
  const Tensor t = randint(0, classes, {rows}, TensorOptions().dtype(kInt64));
  for (auto _ : state) {
    Tensor l = loss(x, t);
    benchmark::DoNotOptimize(autograd::grad({l}, {x})[0]);
  }
  set_num_threads(before);
  // Forward reads the logits; backward reads them and writes the gradient.
  state.SetBytesProcessed(state.iterations() * 3 * x.nbytes());
  state.SetItemsProcessed(state.iterations() * rows);
}

Tensor fused(const Tensor& x, const Tensor& t) { return F::cross_entropy(x, t); }
Tensor composed(const Tensor& x, const Tensor& t) { return F::nll_loss(x.log_softmax(1), t); }

void BM_CrossEntropyFused_128x10(benchmark::State& s) { run_ce(s, 128, 10, fused); }
void BM_CrossEntropyComposed_128x10(benchmark::State& s) { run_ce(s, 128, 10, composed); }
void BM_CrossEntropyFused_2048x256(benchmark::State& s) { run_ce(s, 2048, 256, fused); }
void BM_CrossEntropyComposed_2048x256(benchmark::State& s) { run_ce(s, 2048, 256, composed); }

}  // namespace

BENCHMARK(BM_CrossEntropyFused_128x10)->Arg(1)->Arg(2);
BENCHMARK(BM_CrossEntropyComposed_128x10)->Arg(1)->Arg(2);
BENCHMARK(BM_CrossEntropyFused_2048x256)->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_CrossEntropyComposed_2048x256)->Arg(1)->Arg(2)->UseRealTime();

namespace {
// Forward alone (no graph recorded), to split the fused figure.
void BM_CrossEntropyFusedForward_2048x256(benchmark::State& state) {
  const int before = kiln::get_num_threads();
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  const kiln::Tensor x = kiln::randn({2048, 256});
  const kiln::Tensor t = kiln::randint(0, 256, {2048}, kiln::TensorOptions().dtype(kiln::kInt64));
  for (auto _ : state) benchmark::DoNotOptimize(kiln::nn::F::cross_entropy(x, t));
  kiln::set_num_threads(before);
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
}  // namespace
BENCHMARK(BM_CrossEntropyFusedForward_2048x256)->Arg(1)->Arg(2)->UseRealTime();
