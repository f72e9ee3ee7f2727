#include "kiln/core/threads.h"

#include <omp.h>

#include <atomic>

#include "kiln/core/error.h"

namespace kiln {

namespace {
// Process-wide: OpenMP's own setting is per thread, and a loader or
// communication thread must see the count the user chose on the main thread.
std::atomic<int>& thread_setting() {
  static std::atomic<int> n{omp_get_max_threads()};
  return n;
}
}  // namespace

int get_num_threads() { return thread_setting().load(std::memory_order_relaxed); }

void set_num_threads(int n) {
  KILN_CHECK(n >= 1, ValueError, "set_num_threads: expected a thread count >= 1, got ", n);
  thread_setting().store(n, std::memory_order_relaxed);
  omp_set_num_threads(n);
}

}  // namespace kiln
