// OpenMP's waiting policy (Note [OpenMP waiting under load] in
// src/core/threads.cpp): a program linked with kiln bounds the spin of idle
// OpenMP threads unless the user chose a policy, keeps its arguments across
// the re-execution that applies it, and can opt out.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <string>

#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/core/openmp_policy.h"

namespace {

std::string run_child(const std::string& env) {
  // `env -u` clears what the developer's shell may have set, so each case starts alike.
  const std::string cmd = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u KMP_BLOCKTIME -u KILN_OMP_DEFAULTS "
                          "-u KILN_OMP_DEFAULTS_APPLIED " + env + " " KILN_THREADS_CHILD
                          " 'two words' --flag= '' 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int status = ::pclose(p);
  if (status != 0) out += "\nexit status " + std::to_string(status);
  return out;
}

}  // namespace

TEST(OpenMPDefaults, ProgramsGetABoundedSpinAndKeepTheirArguments) {
  const std::string out = run_child("");
  EXPECT_NE(out.find("policy: GOMP_SPINCOUNT=10000 (kiln's default)"), std::string::npos) << out;
  EXPECT_NE(out.find("arg: two words\narg: --flag=\narg: \n"), std::string::npos) << out;
}

TEST(OpenMPDefaults, TheUsersSettingWins) {
  std::string out = run_child("OMP_WAIT_POLICY=passive");
  EXPECT_NE(out.find("policy: OMP_WAIT_POLICY=passive (set by the user)"), std::string::npos) << out;
  out = run_child("GOMP_SPINCOUNT=123");
  EXPECT_NE(out.find("policy: GOMP_SPINCOUNT=123 (set by the user)"), std::string::npos) << out;
}

TEST(OpenMPDefaults, CanBeTurnedOff) {
  const std::string out = run_child("KILN_OMP_DEFAULTS=0");
  EXPECT_NE(out.find("policy: spin ~3 ms before sleeping (the OpenMP runtime's default)"), std::string::npos) << out;
  EXPECT_NE(out.find("arg: two words"), std::string::npos) << out;
}

TEST(OpenMPDefaults, ThisTestProgramRunsUnderABoundedSpin) {
  // ctest sets no policy, so the test binaries themselves run as users' programs do.
  const std::string p = kiln::openmp_wait_policy();
  EXPECT_EQ(p.find("the OpenMP runtime's default"), std::string::npos) << p;
}

// kiln::parallel_regions and kernels::dnnl_threaded_calls (Note [Parallel
// regions] in bench/workloads/main.cpp): a loop counts when it runs on more
// than one thread, a oneDNN call when it may; serial work never counts.
TEST(ParallelRegions, CountOnlyWorkThatMayRunOnMoreThanOneThread) {
  const int prev = kiln::get_num_threads();
  kiln::set_num_threads(2);
  std::atomic<int64_t> seen{0};
  const auto body = [&](int64_t b, int64_t e) { seen += e - b; };
  int64_t before = kiln::parallel_regions();
  kiln::parallel_for(1000, 1, body);
  EXPECT_EQ(kiln::parallel_regions() - before, 1);
  before = kiln::parallel_regions();
  kiln::parallel_for(10, 100, body);  // under the grain: one thread
  EXPECT_EQ(kiln::parallel_regions() - before, 0);
  // 2^21 multiply-adds: far above the size under which a product runs serially.
  const kiln::Tensor a = kiln::randn({128, 128}), b = kiln::randn({128, 128});
  int64_t calls = kiln::kernels::dnnl_threaded_calls();
  (void)kiln::mm(a, b);
  EXPECT_EQ(kiln::kernels::dnnl_threaded_calls() - calls, 1);
  const kiln::Tensor small = kiln::randn({16, 16});  // 4096 multiply-adds: serial
  calls = kiln::kernels::dnnl_threaded_calls();
  (void)kiln::mm(small, small);
  EXPECT_EQ(kiln::kernels::dnnl_threaded_calls() - calls, 0);

  kiln::set_num_threads(1);
  before = kiln::parallel_regions();
  calls = kiln::kernels::dnnl_threaded_calls();
  kiln::parallel_for(1000, 1, body);
  (void)kiln::mm(a, b);
  EXPECT_EQ(kiln::parallel_regions() - before, 0);
  EXPECT_EQ(kiln::kernels::dnnl_threaded_calls() - calls, 0);
  EXPECT_EQ(seen.load(), 2010);
  kiln::set_num_threads(prev);
}

// set_flush_denormal (Note [Flushing subnormals] in src/core/threads.cpp):
// a subnormal times 3 stays the subnormal it is by default, and is 0 with
// the flush on, in every thread's share of a 2-thread loop (each thread sets
// its own MXCSR); off again, the subnormal comes back.
TEST(Threads, FlushDenormalReachesEveryThreadOfALoop) {
  using namespace kiln;
  const int threads = get_num_threads();
  set_num_threads(2);
  const float tiny = 1e-40f;  // subnormal
  volatile float three = 3.0f;
  const float kept = tiny * three;
  ASSERT_NE(kept, 0.0f);
  const int64_t n = int64_t{1} << 20;  // two threads' worth
  const Tensor x = full({n}, static_cast<double>(tiny));
  auto zeros_and_kept = [&] {
    const Tensor y = x * 3.0;
    // Bits, not float compares: with DAZ on, this thread would read a subnormal as 0 too.
    int64_t zeros = 0, same = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t v = std::bit_cast<uint32_t>(y.data_ptr<float>()[i]);
      zeros += v == 0u;
      same += v == std::bit_cast<uint32_t>(kept);
    }
    return std::make_pair(zeros, same);
  };
  EXPECT_FALSE(flush_denormal());
  EXPECT_EQ(zeros_and_kept(), std::make_pair(int64_t{0}, n));
  ASSERT_TRUE(set_flush_denormal(true)) << "x86: supported";
  EXPECT_TRUE(flush_denormal());
  EXPECT_EQ(zeros_and_kept(), std::make_pair(n, int64_t{0}));
  set_flush_denormal(false);
  EXPECT_FALSE(flush_denormal());
  EXPECT_EQ(zeros_and_kept(), std::make_pair(int64_t{0}, n));
  set_num_threads(threads);
}
