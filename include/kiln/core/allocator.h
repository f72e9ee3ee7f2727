// The caching CPU allocator and per-category memory accounting (DESIGN.md §2).
//
// Every tensor's bytes come from here. Freed blocks are kept in size-class
// free lists and reused, so a training step reaches a steady state that
// touches no fresh pages (fresh pages cost ~12 µs per 4 KiB on these
// machines). Large blocks are 2 MiB aligned and advised MADV_HUGEPAGE.
// Each allocation is tagged with a MemoryCategory; live and peak bytes per
// category are kept at all times, and an optional limit turns an over-budget
// allocation into kiln::OutOfMemory with the breakdown in its message.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln {

enum class MemoryCategory : uint8_t {
  Parameter,
  Gradient,
  OptimizerState,
  Activation,
  Buffer,
  Data,
  Workspace,
};
inline constexpr int kNumMemoryCategories = 7;
const char* memory_category_name(MemoryCategory c);

/// The category new tensors on this thread are charged to (Activation unless a
/// MemoryCategoryGuard says otherwise).
MemoryCategory current_memory_category();

/// RAII: tensors created on this thread while alive are charged to `c`.
class MemoryCategoryGuard {
 public:
  explicit MemoryCategoryGuard(MemoryCategory c);
  ~MemoryCategoryGuard();
  MemoryCategoryGuard(const MemoryCategoryGuard&) = delete;
  MemoryCategoryGuard& operator=(const MemoryCategoryGuard&) = delete;

 private:
  MemoryCategory prev_;
};

namespace memory {

struct CategoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;  // live tensors' storages in this category
};

struct Stats {
  std::array<CategoryStats, kNumMemoryCategories> by_category{};
  int64_t live_bytes = 0;      // sum over categories (bytes requested, rounded to 64)
  int64_t peak_bytes = 0;      // peak of live_bytes
  int64_t cached_bytes = 0;    // freed blocks kept for reuse
  int64_t reserved_bytes = 0;  // obtained from the OS (live + cached + rounding)
  int64_t num_os_allocs = 0;   // blocks requested from the OS since start
  int64_t num_cache_hits = 0;  // allocations served from the cache
  int64_t limit_bytes = 0;     // 0: no limit

  const CategoryStats& operator[](MemoryCategory c) const { return by_category[static_cast<int>(c)]; }
};

Stats stats();
/// A human-readable table of live/peak bytes per category plus cache figures.
std::string summary();
/// Resets peaks to the current live values.
void reset_peak_stats();
/// Returns all cached (free) blocks to the OS.
void empty_cache();
/// Caps live bytes; 0 removes the cap. Also read at start-up from KILN_MEMORY_LIMIT
/// (bytes, or with a K/M/G suffix).
void set_limit(int64_t bytes);
int64_t limit();

/// Low-level: 64-byte aligned bytes charged to `category`. Throws OutOfMemory.
/// Most code should create tensors instead.
void* allocate(size_t nbytes, MemoryCategory category);
void deallocate(void* ptr, size_t nbytes, MemoryCategory category);

/// Moves a live block's bytes from one category to another.
void recharge(void* ptr, size_t nbytes, MemoryCategory from, MemoryCategory to);

/// A private block pool, as a CUDA graph's memory pool: while it is a
/// thread's active pool (exchange_private_pool), that thread's allocations come
/// from it, and every block it ever handed out comes back to it when freed —
/// never to the shared cache — until the pool is destroyed. kiln::compile's
/// replay writes into addresses recorded at capture, so they must stay
/// reserved for it; within the capture, a block freed by one op is reused by
/// a later one of the same size class, which is the static, lifetime-based
/// memory plan of the step. Destroying the pool returns its free blocks to
/// the shared cache; blocks still held by tensors go there when freed.
class PrivatePool {
 public:
  PrivatePool();
  ~PrivatePool();
  PrivatePool(const PrivatePool&) = delete;
  PrivatePool& operator=(const PrivatePool&) = delete;
  /// Bytes of every block the pool owns (live in tensors or free in it).
  int64_t reserved_bytes() const;

  struct Impl;
  Impl* impl() const { return impl_; }

 private:
  Impl* impl_;
};

/// Makes `pool` (null: none) the source of this thread's allocations; returns
/// the previous one (capture::RecorderGuard and HostAction restore it).
PrivatePool* exchange_private_pool(PrivatePool* pool);

/// Rounds a request to what the allocator actually hands out.
size_t rounded_size(size_t nbytes);

/// Where an allocation was asked for: the call site in user code of the op
/// that made it (file:line), the op's name once autograd knows it, and
/// whether it happened in the backward of that op. Op entry points note their
/// caller's site on this thread (note_call_site); the allocator reads it only
/// while memory history is recorded (kiln/core/memory_history.h).
struct AllocSite {
  const char* file = nullptr;
  uint32_t line = 0;
  const char* op = nullptr;
  bool backward = false;
  bool pinned = false;  // set by AllocSiteGuard: nested op calls do not override it
};

namespace detail {
extern constinit thread_local AllocSite t_alloc_site;
}  // namespace detail

/// Op entry points call this with their caller's std::source_location. Calls
/// made from inside kiln's ops, autograd and kernels are ignored, so the site
/// stays the outermost one a user (or a module, optimizer, model) wrote.
void note_call_site(const char* file, uint32_t line);
inline AllocSite current_alloc_site() { return detail::t_alloc_site; }

/// RAII: allocations on this thread are charged to `site` until it ends, and
/// nested ops do not change it (the engine uses it around each backward node).
class AllocSiteGuard {
 public:
  explicit AllocSiteGuard(AllocSite site) : prev_(detail::t_alloc_site) {
    site.pinned = true;
    detail::t_alloc_site = site;
  }
  ~AllocSiteGuard() { detail::t_alloc_site = prev_; }
  AllocSiteGuard(const AllocSiteGuard&) = delete;
  AllocSiteGuard& operator=(const AllocSiteGuard&) = delete;

 private:
  AllocSite prev_;
};

}  // namespace memory
}  // namespace kiln
