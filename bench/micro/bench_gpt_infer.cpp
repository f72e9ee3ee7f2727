// The gpt_infer workload (models::GPT forward under no-grad, eval mode, one
// sequence of 128 tokens) taken apart: each piece of one transformer block at
// its own shape, so the time outside the matmuls can be located:
//   BM_InferPart/which/threads   0 ln_1, 1 attn.c_attn, 2 attention (sdpa from
//     the c_attn output, heads merged back to [1, 128, 256]), 3 attn.c_proj,
//     4 residual add, 5 mlp.c_fc, 6 GELU(tanh), 7 mlp.c_proj, 8 mlp (c_fc, GELU,
//     c_proj together), 9 the whole attention module, 10 the whole block,
//     11 the embeddings (token and position lookups and their sum).
//   BM_InferModel/threads        the whole GPT forward (what kiln_bench times).
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Infer
#include <benchmark/benchmark.h>

#include <memory>

#include "bench_threads.h"
#include "kiln/kiln.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/attention.h"

namespace {

using namespace kiln;

using kiln_micro::ThreadScope;

void BM_InferPart(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(1)));
  const NoGradGuard no_grad;
  const int64_t T = 128, C = 256, H = 4;
  nn::TransformerBlock block({.d_model = C, .n_head = H});
  block.eval();
  const Tensor x = randn({1, T, C}) * 0.5;
  const Tensor qkv = (*block.attn->c_attn)(x);
  const Tensor y = randn({1, T, C}) * 0.5;
  const Tensor hidden = (*block.mlp->c_fc)(x);
  nn::Embedding wte({.num_embeddings = 256, .embedding_dim = C}), wpe({.num_embeddings = T, .embedding_dim = C});
  const Tensor idx = randint(0, 256, {1, T});
  auto attention = [&] {
    auto parts = qkv.split(C, 2);
    auto heads = [&](const Tensor& t) { return t.view({1, T, H, C / H}).transpose(1, 2); };
    Tensor o = nn::functional::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, 0.0,
                                                            true, false);
    return o.transpose(1, 2).reshape({1, T, C});
  };
  for (auto _ : state) {
    switch (state.range(0)) {
      case 0: benchmark::DoNotOptimize((*block.ln_1)(x)); break;
      case 1: benchmark::DoNotOptimize((*block.attn->c_attn)(x)); break;
      case 2: benchmark::DoNotOptimize(attention()); break;
      case 3: benchmark::DoNotOptimize((*block.attn->c_proj)(y)); break;
      case 4: benchmark::DoNotOptimize(x + y); break;
      case 5: benchmark::DoNotOptimize((*block.mlp->c_fc)(x)); break;
      case 6: benchmark::DoNotOptimize((*block.mlp->gelu)(hidden)); break;
      case 7: benchmark::DoNotOptimize((*block.mlp->c_proj)(hidden)); break;
      case 8: benchmark::DoNotOptimize((*block.mlp)(x)); break;
      case 9: benchmark::DoNotOptimize((*block.attn)(x)); break;
      case 10: benchmark::DoNotOptimize(block(x)); break;
      default: benchmark::DoNotOptimize(wte(idx) + wpe(arange(T, TensorOptions(kInt64)))); break;
    }
  }
}
BENCHMARK(BM_InferPart)
    ->ArgsProduct({{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {1, 2}})
    ->ArgNames({"which", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_InferModel(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const NoGradGuard no_grad;
  models::GPT model;
  model.eval();
  const Tensor idx = randint(0, 256, {1, 128});
  for (auto _ : state) benchmark::DoNotOptimize(model(idx));
}
BENCHMARK(BM_InferModel)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

namespace {
// gpt_infer's c_fc product ([128, 256] x [256, 1024]) with its weights cold:
// `count` distinct Linears (1 MiB of weights each) taken in turn, so that at
// 12 a product finds its weights where the whole model's forward leaves them,
// past the L2. Time per product. Arguments: threads; count.
void BM_InferColdWeights(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  const NoGradGuard no_grad;
  std::vector<std::shared_ptr<nn::Linear>> fcs;
  for (int64_t i = 0; i < state.range(1); ++i)
    fcs.push_back(std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 256, .out_features = 1024}));
  const Tensor x = randn({1, 128, 256});
  size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize((*fcs[i])(x));
    i = (i + 1) % fcs.size();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(static_cast<double>(state.iterations()) * 2.0 * 128 * 256 * 1024 / 1e9,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_InferColdWeights)
    ->ArgsProduct({{1, 2}, {1, 12}})
    ->ArgNames({"threads", "count"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
}  // namespace
