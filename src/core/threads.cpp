#include "kiln/core/threads.h"
#include "kiln/core/openmp_policy.h"

#include <dlfcn.h>
#include <omp.h>
#include <sys/auxv.h>
#include <unistd.h>

#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#include <cstdlib>
#include <cstring>

#include "kiln/core/error.h"

namespace kiln {

namespace {
// Process-wide: OpenMP's own setting is per thread, and a loader or
// communication thread must see the count the user chose on the main thread.
std::atomic<int>& thread_setting() {
  static std::atomic<int> n{omp_get_max_threads()};
  return n;
}

// Note [OpenMP waiting under load]
// A thread of libgomp that finishes its share of a parallel loop spins for
// GOMP_SPINCOUNT iterations (default 300000, about 3 ms) before it sleeps,
// and the master spins the same way at the closing barrier. On an idle
// machine that saves a futex wake-up per loop. When other processes want the
// cores, it is ruinous: a training step is hundreds of short loops, each
// spinning thread burns the time slice its partner needs, and every barrier
// waits a scheduler tick for a descheduled thread — a 300-step MLP took 10x
// longer next to two busy processes. With a spin of ~10^4 iterations
// (tens of microseconds: longer than the gap between two loops of one step,
// so the idle-machine speed stays) a waiting thread sleeps almost at once
// when it is not going to be woken soon, and the slowdown under load is about
// proportional to the cores lost (docs/decisions.md, bench "under load").
//
// libgomp reads its environment once, in its own constructor, which runs
// before any constructor of the program. So when neither OMP_WAIT_POLICY nor
// GOMP_SPINCOUNT is set, kiln sets GOMP_SPINCOUNT and re-executes the program
// (same pid, same arguments) before main; the user's own setting always wins,
// and KILN_OMP_DEFAULTS=0 turns this off. Only a program kiln is linked into
// does this, never a shared library (a Python extension must not re-exec the
// interpreter). LLVM's runtime reads its environment lazily, so for it the
// variable alone is enough.
constexpr const char* kDefaultSpinCount = "10000";
constexpr const char* kDefaultBlockTimeMs = "0";
const char* g_policy_source = "the OpenMP runtime's default";

bool in_main_executable() {
  Dl_info self{}, exe{};
  const auto phdr = getauxval(AT_PHDR);
  if (phdr == 0 || !dladdr(reinterpret_cast<void*>(&in_main_executable), &self) ||
      !dladdr(reinterpret_cast<void*>(phdr), &exe)) {
    return false;
  }
  return self.dli_fbase == exe.dli_fbase;
}

// glibc passes (argc, argv, envp) to constructors, so the re-exec keeps the arguments exactly.
__attribute__((constructor(101))) void bound_openmp_spin(int /*argc*/, char** argv, char** /*envp*/) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT") || std::getenv("KMP_BLOCKTIME")) {
    g_policy_source = std::getenv("KILN_OMP_DEFAULTS_APPLIED") ? "kiln's default" : "set by the user";
    return;
  }
  const char* opt = std::getenv("KILN_OMP_DEFAULTS");
  if ((opt && std::strcmp(opt, "0") == 0) || !in_main_executable() || argv == nullptr) return;
  ::setenv("GOMP_SPINCOUNT", kDefaultSpinCount, 1);
  ::setenv("KMP_BLOCKTIME", kDefaultBlockTimeMs, 1);
  ::setenv("KILN_OMP_DEFAULTS_APPLIED", "1", 1);
  g_policy_source = "kiln's default";
  // LLVM's libomp exports kmp_set_blocktime and has not read its environment yet.
  if (dlsym(RTLD_DEFAULT, "kmp_set_blocktime") != nullptr) return;
  ::execv("/proc/self/exe", argv);
  // The exec failed (no /proc, a sandbox): run on with the runtime's defaults.
  ::unsetenv("GOMP_SPINCOUNT");
  ::unsetenv("KMP_BLOCKTIME");
  ::unsetenv("KILN_OMP_DEFAULTS_APPLIED");
  g_policy_source = "the OpenMP runtime's default (kiln could not re-execute the program to bound it)";
}
}  // namespace

int get_num_threads() { return thread_setting().load(std::memory_order_relaxed); }

// Note [Flushing subnormals]
// x86 handles a subnormal input or result of SSE/AVX arithmetic in microcode,
// a hundred cycles or more per vector. Tensors whose values decay toward 0
// keep meeting them: AdamW's moments for a parameter whose gradient stays 0
// (an embedding row no batch uses) decay into the subnormals and stay there
// (k * 2^-149 times beta1 = 0.9 rounds back to itself for k <= 4, times
// beta2 = 0.999 for k < 500), and AdamW over 1 M such
// values took 15.6 ms a step against 0.74 ms for ordinary ones, and 0.73 ms
// with the flush (BM_OptimStepSubnormal, 1 thread, 2026-12-07). kiln keeps
// IEEE results by default, as torch does; set_flush_denormal(true) trades
// them for speed by setting DAZ and FTZ in MXCSR. MXCSR is per thread: the caller sets its own, then every thread of a
// parallel region sets its own when the generation it last applied is old,
// so threads made later (a larger set_num_threads) follow too.
namespace {
std::atomic<bool> g_flush{false};
std::atomic<int> g_flush_generation{0};
thread_local int t_flush_applied = 0;

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kDaz = 1u << 6, kFtz = 1u << 15;
void apply_flush(bool on) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kDaz | kFtz) : (csr & ~(kDaz | kFtz)));
}
constexpr bool kFlushSupported = true;
#else
void apply_flush(bool) {}
constexpr bool kFlushSupported = false;
#endif
}  // namespace

bool set_flush_denormal(bool on) {
  if (!kFlushSupported) return false;
  g_flush.store(on, std::memory_order_relaxed);
  const int generation = g_flush_generation.fetch_add(1, std::memory_order_release) + 1;
  apply_flush(on);
  t_flush_applied = generation;
#pragma omp parallel num_threads(get_num_threads())
  detail::sync_flush_denormal();
  return true;
}

bool flush_denormal() { return g_flush.load(std::memory_order_relaxed); }

namespace detail {
void sync_flush_denormal() {
  const int generation = g_flush_generation.load(std::memory_order_acquire);
  if (t_flush_applied == generation) return;
  apply_flush(g_flush.load(std::memory_order_relaxed));
  t_flush_applied = generation;
}
}  // namespace detail

void set_num_threads(int n) {
  KILN_CHECK(n >= 1, ValueError, "set_num_threads: expected a thread count >= 1, got ", n);
  thread_setting().store(n, std::memory_order_relaxed);
  omp_set_num_threads(n);
}

std::string openmp_wait_policy() {
  for (const char* var : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"}) {
    if (const char* v = std::getenv(var)) return std::string(var) + "=" + v + " (" + g_policy_source + ")";
  }
  return std::string("spin ~3 ms before sleeping (") + g_policy_source + ")";
}

}  // namespace kiln
