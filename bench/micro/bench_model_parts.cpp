// The pieces a workload step is made of, at the workloads' own shapes, so a
// change to one kernel can be measured where it matters before it shows in
// scripts/bench.sh:
//   BM_PartsGptLinear/which/threads  linear forward + backward (input, weight, bias
//     gradients) on the gpt's [2048, in] activations: 0 attn.c_attn 256→768,
//     1 attn.c_proj 256→256, 2 mlp.c_fc 256→1024, 3 mlp.c_proj 1024→256,
//     4 lm_head 256→256 without bias. GFLOP/s counts 3 matmuls (6·M·K·N); the
//     f32 matmul peak of kiln_bench --workload peak is the ceiling.
//   BM_PartsGptBlock/threads  one nn::TransformerBlock (d_model 256, 4 heads,
//     causal) forward + backward on [16, 128, 256]: a quarter of the gpt's layers.
//   BM_PartsOptimizerStep/model/threads  optimizer.step() over a zoo model's real
//     parameter list: 0 gpt + AdamW (3.3M values in 52 tensors), 1 resnet + SGD
//     momentum + weight decay (78K in 29 tensors: per-parameter overhead
//     dominates), 2 cnn + Adam (0.42M in 8 tensors).
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Parts
#include <benchmark/benchmark.h>

#include <memory>

#include "bench_threads.h"
#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/optim/optimizer.h"

namespace {

using namespace kiln;

using kiln_micro::ThreadScope;

void BM_PartsGptLinear(benchmark::State& state) {
  struct Shape {
    int64_t in, out;
    bool bias;
  };
  static constexpr Shape shapes[] = {
      {256, 768, true}, {256, 256, true}, {256, 1024, true}, {1024, 256, true}, {256, 256, false}};
  const Shape s = shapes[state.range(0)];
  const ThreadScope threads(static_cast<int>(state.range(1)));
  const int64_t M = 16 * 128;
  const Tensor x = (randn({M, s.in}) * 0.1).requires_grad_();
  const Tensor w = (randn({s.out, s.in}) * 0.05).requires_grad_();
  const Tensor b = s.bias ? zeros({s.out}).requires_grad_() : Tensor();
  const Tensor g = randn({M, s.out});
  const TensorList inputs = s.bias ? TensorList{x, w, b} : TensorList{x, w};
  for (auto _ : state) {
    Tensor y = linear(x, w, b);
    benchmark::DoNotOptimize(autograd::grad({y}, inputs, {g}));
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      6.0 * M * s.in * s.out * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PartsGptLinear)
    ->ArgsProduct({{0, 1, 2, 3, 4}, {1, 2}})
    ->ArgNames({"which", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_PartsGptBlock(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(0)));
  nn::TransformerBlock block({.d_model = 256, .n_head = 4});
  const Tensor x = (randn({16, 128, 256}) * 0.5).requires_grad_();
  const Tensor g = randn({16, 128, 256});
  TensorList inputs{x};
  for (const auto& p : block.parameters()) inputs.push_back(p);
  for (auto _ : state) {
    Tensor y = block(x);
    benchmark::DoNotOptimize(autograd::grad({y}, inputs, {g}));
  }
}
BENCHMARK(BM_PartsGptBlock)->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_PartsOptimizerStep(benchmark::State& state) {
  const ThreadScope threads(static_cast<int>(state.range(1)));
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> opt;
  switch (state.range(0)) {
    case 0:
      model = std::make_shared<models::GPT>();
      opt = std::make_unique<optim::AdamW>(model->named_parameters(),
                                           optim::AdamWOptions{.lr = 3e-4, .weight_decay = 0.1});
      break;
    case 1:
      model = std::make_shared<models::ResNet>();
      opt = std::make_unique<optim::SGD>(model->named_parameters(),
                                         optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});
      break;
    default:
      model = std::make_shared<models::CNN>();
      opt = std::make_unique<optim::Adam>(model->named_parameters(), optim::AdamOptions{.lr = 1e-3});
      break;
  }
  int64_t n = 0;
  for (auto& p : model->parameters()) {
    p.mutable_grad() = randn_like(p) * 1e-3;
    n += p.numel();
  }
  opt->step();  // allocates the state
  for (auto _ : state) opt->step();
  state.counters["params"] = static_cast<double>(n);
  state.counters["tensors"] = static_cast<double>(model->parameters().size());
}
BENCHMARK(BM_PartsOptimizerStep)
    ->ArgsProduct({{0, 1, 2}, {1, 2}})
    ->ArgNames({"model", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
