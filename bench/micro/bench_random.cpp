// Philox's float32 draws (rand, dropout's masks, attention's dropout), 1 thread.
//   BM_PhiloxUniformFloats/n   one call of detail::philox_uniform_floats for n
//     values, as dropout inside the attention heads makes one per row of a
//     block (n = the keys the row sees) and rand one per chunk of 1024.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=Philox
#include <benchmark/benchmark.h>

#include <vector>

#include "kiln/core/generator.h"

namespace {

void BM_PhiloxUniformFloats(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> out(static_cast<size_t>(n));
  uint64_t block = 0;
  for (auto _ : state) {
    kiln::detail::philox_uniform_floats(out.data(), n, 42, block, 0.0f, 1.0f);
    block += static_cast<uint64_t>(n / 4);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_PhiloxUniformFloats)->Arg(64)->Arg(128)->Arg(1024);

}  // namespace
