// The caching allocator (DESIGN.md §2): per-category accounting, category
// guards, cache reuse without fresh OS allocations, 2 MiB alignment of large
// blocks, the memory limit and its OutOfMemory message, peaks, empty_cache.
// The allocator is process-wide, so every check works on differences.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

const memory::CategoryStats& cat(const memory::Stats& s, MemoryCategory c) { return s[c]; }

// Restores the limit even when a test fails.
struct LimitGuard {
  int64_t prev = memory::limit();
  ~LimitGuard() { memory::set_limit(prev); }
};

}  // namespace

TEST(Allocator, RoundedSizes) {
  EXPECT_EQ(memory::rounded_size(0), 64u);
  EXPECT_EQ(memory::rounded_size(1), 64u);
  EXPECT_EQ(memory::rounded_size(64), 64u);
  EXPECT_EQ(memory::rounded_size(65), 128u);
  EXPECT_EQ(memory::rounded_size(1000), 1024u);
  EXPECT_EQ(memory::rounded_size(1100), 1280u);
  EXPECT_EQ(memory::rounded_size(size_t{3} << 20), size_t{4} << 20);
  for (size_t n = 1; n < (size_t{64} << 20); n = n * 3 / 2 + 1) {
    const size_t r = memory::rounded_size(n);
    EXPECT_GE(r, n);
    EXPECT_EQ(r % 64, 0u);
    if (n >= (size_t{1} << 20)) {
      EXPECT_EQ(r % (size_t{2} << 20), 0u) << n;
    } else if (n > 256) {
      EXPECT_LE(static_cast<double>(r), 1.25 * static_cast<double>(n) + 64) << n;
    }
  }
}

TEST(Allocator, PerCategoryLiveAndPeak) {
  const auto before = memory::stats();
  const size_t n = 100'000;
  const auto r = static_cast<int64_t>(memory::rounded_size(n));
  void* p = memory::allocate(n, MemoryCategory::OptimizerState);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  auto mid = memory::stats();
  EXPECT_EQ(cat(mid, MemoryCategory::OptimizerState).live_bytes - cat(before, MemoryCategory::OptimizerState).live_bytes, r);
  EXPECT_EQ(cat(mid, MemoryCategory::OptimizerState).allocations - cat(before, MemoryCategory::OptimizerState).allocations, 1);
  EXPECT_GE(cat(mid, MemoryCategory::OptimizerState).peak_bytes, cat(mid, MemoryCategory::OptimizerState).live_bytes);
  EXPECT_EQ(mid.live_bytes - before.live_bytes, r);
  EXPECT_EQ(cat(mid, MemoryCategory::Gradient).live_bytes, cat(before, MemoryCategory::Gradient).live_bytes);
  memory::deallocate(p, n, MemoryCategory::OptimizerState);
  const auto after = memory::stats();
  EXPECT_EQ(cat(after, MemoryCategory::OptimizerState).live_bytes, cat(before, MemoryCategory::OptimizerState).live_bytes);
  EXPECT_GE(cat(after, MemoryCategory::OptimizerState).peak_bytes,
            cat(before, MemoryCategory::OptimizerState).live_bytes + r);
}

TEST(Allocator, CategoryGuardsAndOptions) {
  EXPECT_EQ(current_memory_category(), MemoryCategory::Activation);
  EXPECT_EQ(zeros({4}).storage()->category(), MemoryCategory::Activation);
  {
    MemoryCategoryGuard g(MemoryCategory::Parameter);
    EXPECT_EQ(zeros({4}).storage()->category(), MemoryCategory::Parameter);
    {
      MemoryCategoryGuard inner(MemoryCategory::Buffer);
      EXPECT_EQ(ones({4}).storage()->category(), MemoryCategory::Buffer);
      // Options win over the guard.
      EXPECT_EQ(zeros({4}, TensorOptions().category(MemoryCategory::Workspace)).storage()->category(),
                MemoryCategory::Workspace);
    }
    EXPECT_EQ(current_memory_category(), MemoryCategory::Parameter);
  }
  EXPECT_EQ(current_memory_category(), MemoryCategory::Activation);
  // Guards are per thread.
  MemoryCategoryGuard g(MemoryCategory::Data);
  MemoryCategory seen{};
  std::thread([&] { seen = current_memory_category(); }).join();
  EXPECT_EQ(seen, MemoryCategory::Activation);
}

TEST(Allocator, TensorsAreChargedAndRecharged) {
  const auto before = memory::stats();
  Tensor t = empty({1000}, TensorOptions(kFloat64).category(MemoryCategory::Gradient));
  const auto r = static_cast<int64_t>(memory::rounded_size(8000));
  EXPECT_EQ(cat(memory::stats(), MemoryCategory::Gradient).live_bytes - cat(before, MemoryCategory::Gradient).live_bytes, r);
  t.storage()->set_category(MemoryCategory::Parameter);
  const auto moved = memory::stats();
  EXPECT_EQ(cat(moved, MemoryCategory::Gradient).live_bytes, cat(before, MemoryCategory::Gradient).live_bytes);
  EXPECT_EQ(cat(moved, MemoryCategory::Parameter).live_bytes - cat(before, MemoryCategory::Parameter).live_bytes, r);
  EXPECT_EQ(moved.live_bytes - before.live_bytes, r) << "recharging moves bytes, it does not add them";
  t = Tensor();
  const auto after = memory::stats();
  EXPECT_EQ(cat(after, MemoryCategory::Parameter).live_bytes, cat(before, MemoryCategory::Parameter).live_bytes);
  EXPECT_EQ(after.live_bytes, before.live_bytes);
}

TEST(Allocator, CacheReuseNeedsNoNewOsAllocation) {
  const size_t n = 64 * 12345;  // an unusual size class
  void* p = memory::allocate(n, MemoryCategory::Workspace);
  memory::deallocate(p, n, MemoryCategory::Workspace);
  const auto before = memory::stats();
  void* q = memory::allocate(n, MemoryCategory::Activation);
  const auto after = memory::stats();
  EXPECT_EQ(q, p) << "the freed block is reused";
  EXPECT_EQ(after.num_cache_hits, before.num_cache_hits + 1);
  EXPECT_EQ(after.num_os_allocs, before.num_os_allocs);
  EXPECT_EQ(after.cached_bytes, before.cached_bytes - static_cast<int64_t>(memory::rounded_size(n)));
  memory::deallocate(q, n, MemoryCategory::Activation);
  // A steady "training step" after warm-up touches no fresh memory.
  auto step = [] {
    Tensor a = empty({256, 256});
    Tensor b = empty({3000}, kFloat64);
    Tensor c = zeros({7, 9}, kInt32);
  };
  step();
  const auto warm = memory::stats();
  for (int i = 0; i < 5; ++i) step();
  EXPECT_EQ(memory::stats().num_os_allocs, warm.num_os_allocs);
}

TEST(Allocator, LargeBlocksAreHugePageAligned) {
  for (size_t n : {size_t{1} << 20, size_t{3} << 20, (size_t{5} << 20) + 17}) {
    void* p = memory::allocate(n, MemoryCategory::Activation);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (size_t{2} << 20), 0u) << n;
    static_cast<char*>(p)[n - 1] = 1;  // the whole block is usable
    memory::deallocate(p, n, MemoryCategory::Activation);
  }
}

TEST(Allocator, LimitRaisesOutOfMemoryWithBreakdown) {
  LimitGuard restore;
  MemoryCategoryGuard g(MemoryCategory::Parameter);
  Tensor held = empty({1 << 16});  // something to show in the breakdown
  const auto before = memory::stats();
  memory::set_limit(before.live_bytes + (int64_t{1} << 20));
  EXPECT_EQ(memory::limit(), before.live_bytes + (int64_t{1} << 20));
  try {
    Tensor big = empty({int64_t{4} << 20});  // 16 MiB
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    for (const char* part : {"out of memory", "16.0 MiB", "for parameter", "limit", "memory by category", "parameter",
                             "activation", "optimizer_state", "gradient", "cached", "hint:", "KILN_MEMORY_LIMIT"}) {
      EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in:\n" << msg;
    }
  }
  EXPECT_EQ(memory::stats().live_bytes, before.live_bytes) << "a refused allocation charges nothing";
  Tensor small = empty({1000});  // under the limit: fine
  memory::set_limit(0);
  Tensor big = empty({int64_t{4} << 20});
  EXPECT_EQ(big.numel(), int64_t{4} << 20);
  EXPECT_THROW(memory::set_limit(-1), ValueError);
}

TEST(Allocator, LimitFromEnvironment) {
  // Re-runs this binary with KILN_MEMORY_LIMIT set; the child checks the parsed limit.
  if (const char* want = std::getenv("KILN_TEST_EXPECT_LIMIT")) {
    EXPECT_EQ(memory::limit(), std::atoll(want));
    return;
  }
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(len, 0);
  self[len] = '\0';
  for (auto [env, want] : {std::pair<const char*, int64_t>{"64M", int64_t{64} << 20}, {"1.5G", int64_t{3} << 29},
                           {"123456", 123456}}) {
    std::string out;
    const int rc = test::run_command(std::string("KILN_MEMORY_LIMIT=") + env + " KILN_TEST_EXPECT_LIMIT=" +
                                         std::to_string(want) + " " + test::shell_quote(self) +
                                         " --gtest_filter=Allocator.LimitFromEnvironment",
                                     out);
    EXPECT_EQ(rc, 0) << env << ":\n" << out;
  }
}

TEST(Allocator, ResetPeakAndEmptyCache) {
  const size_t n = size_t{8} << 20;
  void* p = memory::allocate(n, MemoryCategory::Workspace);
  memory::deallocate(p, n, MemoryCategory::Workspace);
  auto s = memory::stats();
  EXPECT_GT(s.peak_bytes, s.live_bytes);
  EXPECT_GE(s.cached_bytes, static_cast<int64_t>(n));
  memory::reset_peak_stats();
  s = memory::stats();
  EXPECT_EQ(s.peak_bytes, s.live_bytes);
  EXPECT_EQ(cat(s, MemoryCategory::Workspace).peak_bytes, cat(s, MemoryCategory::Workspace).live_bytes);
  const int64_t reserved = s.reserved_bytes;
  memory::empty_cache();
  s = memory::stats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_LE(s.reserved_bytes, reserved - static_cast<int64_t>(n));
  EXPECT_GE(s.reserved_bytes, s.live_bytes);
  const std::string sum = memory::summary();
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    EXPECT_NE(sum.find(memory_category_name(static_cast<MemoryCategory>(c))), std::string::npos) << sum;
  }
}

TEST(Allocator, ConcurrentUseKeepsCountsExact) {
  const auto before = memory::stats();
  auto work = [](MemoryCategory c) {
    for (int i = 0; i < 2000; ++i) {
      const size_t n = 64 * (1 + i % 37);
      void* p = memory::allocate(n, c);
      static_cast<char*>(p)[0] = 1;
      memory::deallocate(p, n, c);
    }
  };
  std::thread a(work, MemoryCategory::Activation), b(work, MemoryCategory::Gradient);
  a.join();
  b.join();
  const auto after = memory::stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(cat(after, MemoryCategory::Gradient).allocations, cat(before, MemoryCategory::Gradient).allocations);
}
