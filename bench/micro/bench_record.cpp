// What the record hook and the profiler cost per scope (kiln/core/record.h,
// kiln/profiler/profiler.h): the figures docs/profiler.md quotes.
//   BM_RecordScope/0  a Scope with nothing listening: what every op, backward
//     node and optimizer step pays with the profiler compiled in and off
//   BM_RecordScope/1  the same Scope while a Profiler records: time stamps,
//     the callback, a copy into the thread's buffer, the name interned
//   BM_RecordScopeShapes/1  with two tensor inputs whose shapes and dtypes
//     are recorded (record_shapes)
//   BM_RecordScopeThreads/1  four threads recording at once (no lock shared
//     between them: each has its own buffer)
// The recording profiler is restarted every 1<<16 scopes (outside the timing)
// so that its buffers stay small.
//
//   ./build/release/bench/micro/kiln_micro_bench --benchmark_filter=RecordScope
#include <benchmark/benchmark.h>

#include <memory>

#include "kiln/kiln.h"

namespace {

using namespace kiln;

constexpr int64_t kRestartEvery = int64_t{1} << 16;

std::unique_ptr<profiler::Profiler> started(bool on, bool shapes) {
  if (!on) return nullptr;
  profiler::Options o;
  o.record_shapes = shapes;
  auto p = std::make_unique<profiler::Profiler>(o);
  p->start();
  return p;
}

void restart_now_and_then(benchmark::State& state, std::unique_ptr<profiler::Profiler>& p, int64_t& n) {
  if (!p || ++n % kRestartEvery) return;
  state.PauseTiming();
  p->stop();
  p->start();
  state.ResumeTiming();
}

void BM_RecordScope(benchmark::State& state) {
  auto p = started(state.range(0) != 0, false);
  int64_t n = 0;
  for (auto _ : state) {
    record::Scope s(record::Kind::Op, "bench_op");
    benchmark::DoNotOptimize(&s);
    restart_now_and_then(state, p, n);
  }
  if (p) p->stop();
}
BENCHMARK(BM_RecordScope)->Arg(0)->Arg(1);

void BM_RecordScopeShapes(benchmark::State& state) {
  Tensor a = zeros({32, 784});
  Tensor b = zeros({784, 256});
  auto p = started(state.range(0) != 0, true);
  int64_t n = 0;
  for (auto _ : state) {
    record::Scope s(record::Kind::Op, "bench_mm", {&a, &b});
    s.set_flops(2.0 * 32 * 784 * 256);
    benchmark::DoNotOptimize(&s);
    restart_now_and_then(state, p, n);
  }
  if (p) p->stop();
}
BENCHMARK(BM_RecordScopeShapes)->Arg(0)->Arg(1);

// Threads share one profiler, started by thread 0 (Google Benchmark runs the
// setup in thread 0 between barriers). No restarts here: a short fixed run.
std::unique_ptr<profiler::Profiler> g_shared;

void BM_RecordScopeThreads(benchmark::State& state) {
  if (state.thread_index() == 0 && state.range(0) != 0) {
    g_shared = std::make_unique<profiler::Profiler>();
    g_shared->start();
  }
  for (auto _ : state) {
    record::Scope s(record::Kind::Op, "bench_op");
    benchmark::DoNotOptimize(&s);
  }
  if (state.thread_index() == 0 && g_shared) {
    g_shared->stop();
    g_shared.reset();
  }
}
BENCHMARK(BM_RecordScopeThreads)->Arg(0)->Arg(1)->Threads(1)->Threads(4)->Iterations(200000);

}  // namespace
