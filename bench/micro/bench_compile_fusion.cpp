// kiln::compile's elementwise fusion on a memory-bound chain (docs/compile.md,
// "Fusion"): out = ((x * 2 + y).relu() * 0.5 - y), five kernels. Eagerly each
// kernel streams its operands through memory: 7 arrays read and 5 written.
// Fused, the four intermediates live in a tile-sized scratch and only x, y
// and out cross memory: 3 arrays. Bytes processed count what the eager chain
// moves, so the fused figure reads as the effective bandwidth.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=CompileFusion
//
// Args: mode (0 eager, 1 compiled without fusion, 2 compiled and fused),
// elements (16 KiB per array: the whole chain in L1/L2; 256 KiB: in L2 or beyond;
// 64 MiB: far beyond every cache). In cache, fusion saves no traffic and the
// figures move with where the allocator placed the arrays.
#include <benchmark/benchmark.h>

#include "bench_threads.h"
#include "kiln/core/guards.h"
#include "kiln/export/compile.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;

Tensor chain(const Tensor& x, const Tensor& y) {
  const NoGradGuard ng;
  return (x * 2.0 + y).relu() * 0.5 - y;
}

/// Times `fn(x, y)` eagerly (mode 0), compiled without fusion (1) or fused (2) on arrays of
/// n floats; bytes processed count the `passes` arrays the eager form streams, so the
/// compiled figures read as effective bandwidth.
void run_modes(benchmark::State& state, const char* name, Tensor (*fn)(const Tensor&, const Tensor&), int passes) {
  const kiln_micro::ThreadScope threads(1);
  const int mode = static_cast<int>(state.range(0));
  const int64_t n = state.range(1);
  const Tensor x = randn({n}), y = randn({n});
  // x and y are read where they are (no inputs, so a call copies nothing in).
  CompiledFunction step = compile([&] { return fn(x, y); }, {.name = name, .modules = {}, .fuse = mode == 2});
  step();  // captures
  for (auto _ : state) {
    const Tensor out = mode == 0 ? fn(x, y) : step()[0];
    benchmark::DoNotOptimize(out.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * passes * n * static_cast<int64_t>(sizeof(float)));
  state.counters["unwritten_MiB"] = static_cast<double>(step.stats().unwritten_bytes) / (1 << 20);
}

void BM_CompileFusionChain(benchmark::State& state) { run_modes(state, "chain", chain, 12); }
BENCHMARK(BM_CompileFusionChain)
    ->ArgsProduct({{0, 1, 2}, {int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 24}})
    ->ArgNames({"mode", "n"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// A squared error written out, ((x - y) * (x - y)).mean(): eagerly sub, mul and mean, 6 array
// passes (x, y, d, d*d read, d as one stream for both of mul's operands; d, d*d written).
// Fused, the mean reduces each tile of squares while it is in cache: only x and y are read.
Tensor mse(const Tensor& x, const Tensor& y) {
  const NoGradGuard ng;
  const Tensor d = x - y;
  return (d * d).mean();
}

void BM_CompileFusionMse(benchmark::State& state) { run_modes(state, "mse", mse, 6); }
BENCHMARK(BM_CompileFusionMse)
    ->ArgsProduct({{0, 1, 2}, {int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 24}})
    ->ArgNames({"mode", "n"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
