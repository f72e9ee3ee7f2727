#include "kiln/core/parallel.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

#include "kiln/core/threads.h"

namespace kiln {

namespace {
std::atomic<int64_t> g_regions{0};
}  // namespace

int64_t parallel_regions() { return g_regions.load(std::memory_order_relaxed); }

void parallel_for(int64_t n, int64_t grain, void (*fn)(int64_t, int64_t, void*), void* ctx) {
  if (n <= 0) return;
  const int max_threads = get_num_threads();
  const int64_t by_grain = grain > 0 ? (n + grain - 1) / grain : n;
  const int nthreads = static_cast<int>(std::min<int64_t>(max_threads, by_grain));
  if (nthreads <= 1 || omp_in_parallel()) {
    fn(0, n, ctx);
    return;
  }
  g_regions.fetch_add(1, std::memory_order_relaxed);
  std::exception_ptr error;
  std::mutex error_mu;
#pragma omp parallel num_threads(nthreads)
  {
    detail::sync_flush_denormal();
    const int tid = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = tid * chunk;
    const int64_t e = std::min(n, b + chunk);
    if (b < e) {
      try {
        fn(b, e, ctx);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kiln
