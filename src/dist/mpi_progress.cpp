// How the MPI backend's communication thread waits for a collective
// (ProgressMode in mpi_process_group.h).
//
// Open MPI's blocking collectives wait by polling: a rank that reaches an
// allreduce before its peer burns a core until the peer arrives. With DDP the
// communication thread waits while the training thread still computes
// backward, so on a machine with no spare core that poll takes time from the
// very compute it should hide behind. A nonblocking collective progresses
// only inside MPI calls, so it is tested in a loop: a short spin keeps the
// latency of quick completions, then sleeps that grow to 100 µs give the core
// away while bounding the delay a completion can go unnoticed.
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "kiln/core/error.h"
#include "mpi_process_group.h"

namespace kiln::dist::detail {

namespace {

std::atomic<int64_t> g_completed{0}, g_tests{0}, g_sleeps{0};

constexpr auto kSpin = std::chrono::microseconds(20);
constexpr auto kFirstSleep = std::chrono::microseconds(5);
constexpr auto kMaxSleep = std::chrono::microseconds(100);

// After a poll that found nothing, idle() keeps spinning for about 20 µs from
// construction, then sleeps 5 µs doubling up to 100 µs, so a rank that arrives
// early leaves the core to compute.
class Backoff {
 public:
  Backoff() : spin_until_(std::chrono::steady_clock::now() + kSpin), sleep_(kFirstSleep) {
    // Sleeps of a few µs are only as short as the thread's timer slack allows
    // (50 µs by default); the communication thread only ever waits, so tighten it.
    thread_local const bool slack_set = prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL) == 0;
    (void)slack_set;
  }
  /// Returns whether it slept.
  bool idle() {
    if (std::chrono::steady_clock::now() < spin_until_) return false;
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
    return true;
  }

 private:
  std::chrono::steady_clock::time_point spin_until_;
  std::chrono::microseconds sleep_;
};

}  // namespace

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw DistributedError(std::string("dist: ") + what + " failed: " + std::string(msg, len));
}

ProgressMode progress_mode_from_env() {
  const char* v = std::getenv("KILN_DIST_PROGRESS");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "backoff") == 0) return ProgressMode::Backoff;
  if (std::strcmp(v, "spin") == 0) return ProgressMode::Spin;
  throw ValueError(std::string("KILN_DIST_PROGRESS: expected 'backoff' (nonblocking collectives tested with "
                               "back-off, the default) or 'spin' (blocking MPI calls), got '") +
                   v + "'");
}

void wait_with_backoff(MPI_Request& req, const char* what) {
  Backoff backoff;
  int done = 0;
  int64_t tests = 0, sleeps = 0;
  for (;;) {
    ++tests;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
    if (done) break;
    if (backoff.idle()) ++sleeps;
  }
  g_completed.fetch_add(1, std::memory_order_relaxed);
  g_tests.fetch_add(tests, std::memory_order_relaxed);
  g_sleeps.fetch_add(sleeps, std::memory_order_relaxed);
}

ProgressCounters progress_counters() {
  return {.completed = g_completed.load(), .tests = g_tests.load(), .sleeps = g_sleeps.load()};
}

}  // namespace kiln::dist::detail
