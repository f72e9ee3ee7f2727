// What a read costs when the other core wrote the data last (2 threads): the
// 2-thread "rest" of docs/benchmarks.md (stop 75). Each op at 2 threads
// splits its work its own way, so part of what it reads was written by the
// other core's half of the op before it, and comes over from that core's
// cache rather than from its own.
//   BM_CrossCoreRead/writer/KiB      thread 0 reads (a vector sum) a buffer that
//     thread 0 (writer 0) or thread 1 (writer 1) wrote just before; the time
//     and the rate are the read's alone (manual time).
//   BM_SdpaAfterOtherCoreWrote/mode  gpt_infer's attention forward (float32,
//     one sequence, heads as views of the [1, 128, 768] projection) at 2
//     threads, after the projection's output was rewritten by both threads:
//     0 not rewritten, 1 in column halves, 2 in row halves, as a 2-thread
//     product may split it; the time is the attention's alone.
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <chrono>
#include <vector>

#include "bench_threads.h"
#include "kiln/core/parallel.h"
#include "kiln/kiln.h"
#include "kiln/nn/attention.h"

namespace {

using Clock = std::chrono::steady_clock;

void BM_CrossCoreRead(benchmark::State& state) {
  const kiln_micro::ThreadScope threads(2);
  const int64_t n = state.range(1) * 1024 / 4;
  std::vector<float> buf(static_cast<size_t>(n), 1.0f);
  const int64_t writer = state.range(0);
  float fill = 0;
  for (auto _ : state) {
    fill += 1.0f;
    // parallel_for over two items at two threads: item i runs on thread i.
    kiln::parallel_for(2, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        if (i == writer)
          for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(&buf[static_cast<size_t>(j)], _mm512_set1_ps(fill));
    });
    double seconds = 0;
    float sum = 0;
    kiln::parallel_for(2, 1, [&](int64_t lo, int64_t) {
      if (lo != 0) return;
      const auto t0 = Clock::now();
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(&buf[static_cast<size_t>(j)]));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc);
      for (const float l : lanes) sum += l;
      seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    });
    benchmark::DoNotOptimize(sum);
    state.SetIterationTime(seconds);
  }
  state.SetBytesProcessed(state.iterations() * n * 4);
}
BENCHMARK(BM_CrossCoreRead)
    ->ArgsProduct({{0, 1}, {384, 1536, 8192}})
    ->ArgNames({"writer", "KiB"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_SdpaAfterOtherCoreWrote(benchmark::State& state) {
  const kiln_micro::ThreadScope threads(2);
  const kiln::NoGradGuard no_grad;
  const int64_t T = 128, H = 4, E = 64, C = H * E, W = 3 * C;
  const kiln::Tensor x = kiln::randn({1, T, W});
  auto heads = [&](const kiln::Tensor& t) { return t.view({1, T, H, E}).transpose(1, 2); };
  auto* p = static_cast<float*>(x.data_ptr());
  const int64_t mode = state.range(0);
  float step = 0;
  for (auto _ : state) {
    step += 1e-7f;
    if (mode != 0)
      kiln::parallel_for(2, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t r0 = mode == 2 ? t * T / 2 : 0, r1 = mode == 2 ? (t + 1) * T / 2 : T;
          const int64_t c0 = mode == 1 ? t * W / 2 : 0, c1 = mode == 1 ? (t + 1) * W / 2 : W;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; c += 16)
              _mm512_storeu_ps(p + r * W + c, _mm512_add_ps(_mm512_loadu_ps(p + r * W + c), _mm512_set1_ps(step)));
        }
      });
    const auto t0 = Clock::now();
    auto parts = x.split(C, 2);
    benchmark::DoNotOptimize(
        kiln::nn::functional::detail::sdpa_fused(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, true, 64));
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
  }
}
BENCHMARK(BM_SdpaAfterOtherCoreWrote)
    ->DenseRange(0, 2)
    ->ArgName("mode")
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
