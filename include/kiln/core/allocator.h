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
void recharge(size_t nbytes, MemoryCategory from, MemoryCategory to);

/// Rounds a request to what the allocator actually hands out.
size_t rounded_size(size_t nbytes);

}  // namespace memory
}  // namespace kiln
