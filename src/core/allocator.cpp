// The caching allocator. See include/kiln/core/allocator.h for the contract.
//
// Size classes: requests round up to 64 bytes, then to one of four steps per
// power of two (waste <= 25%), and blocks of 1 MiB and more to a multiple of
// 2 MiB so they can be backed by transparent huge pages. Freed blocks go to
// an exact-class free list; a training step asks for the same sizes every
// iteration, so after the first step every request is a cache hit and no
// fresh page is touched.
#include "kiln/core/allocator.h"
#include "kiln/core/pool_frees.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iomanip>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/format.h"
#include "kiln/core/memory_history.h"
#include "kiln/core/record.h"
#include "memory_history_internal.h"

namespace kiln {

namespace {

constexpr size_t kAlign = 64;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kLargeThreshold = size_t{1} << 20;
// Requests above this cannot be served and would overflow the size-class rounding.
constexpr size_t kMaxRequest = size_t{1} << 56;

thread_local MemoryCategory t_category = MemoryCategory::Activation;
thread_local memory::PrivatePool* t_pool = nullptr;
// Set by memory::HoldFrees: blocks this thread frees to the shared cache wait there.
thread_local std::vector<std::pair<void*, size_t>>* t_held_frees = nullptr;

// Which private pool owns a block (the map is consulted only while some pool exists).
struct PoolRegistry {
  std::mutex mu;
  std::unordered_map<void*, memory::PrivatePool::Impl*> owner;
  std::atomic<int> pools{0};
  // Every free would otherwise take the mutex while a compiled function lives: a bit per
  // hash of an address, set when a pool adopts the block, answers "not a pool's" without it.
  // Bits are never cleared; a stale or shared one only costs a lookup.
  static constexpr size_t kFilterBits = size_t{1} << 16;
  std::atomic<uint64_t> filter[kFilterBits / 64] = {};

  static size_t bit(const void* p) {
    const uint64_t x = (reinterpret_cast<uintptr_t>(p) >> 6) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(x >> 48);
  }
  void mark(const void* p) {
    const size_t b = bit(p);
    filter[b / 64].fetch_or(uint64_t{1} << (b % 64), std::memory_order_relaxed);
  }
  bool maybe_pooled(const void* p) const {
    const size_t b = bit(p);
    return (filter[b / 64].load(std::memory_order_relaxed) >> (b % 64)) & 1;
  }
};
PoolRegistry& pool_registry() {
  static auto* r = new PoolRegistry();  // outlives static destruction, as the allocator
  return *r;
}

int64_t parse_limit_env() {
  const char* s = std::getenv("KILN_MEMORY_LIMIT");
  if (!s || !*s) return 0;
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end == s || v < 0) return 0;
  switch (*end) {
    case 'k':
    case 'K': v *= 1024.0; break;
    case 'm':
    case 'M': v *= 1024.0 * 1024.0; break;
    case 'g':
    case 'G': v *= 1024.0 * 1024.0 * 1024.0; break;
    default: break;
  }
  return static_cast<int64_t>(v);
}

struct CategoryCounters {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> count{0};
};

void update_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t p = peak.load(std::memory_order_relaxed);
  while (value > p && !peak.compare_exchange_weak(p, value, std::memory_order_relaxed)) {
  }
}

class CachingAllocator {
 public:
  CachingAllocator() : limit_(parse_limit_env()) {}
  ~CachingAllocator() = default;  // cached blocks are left to the OS at exit

  void* allocate(size_t nbytes, MemoryCategory cat) {
    if (nbytes > kMaxRequest) throw_oom(nbytes, cat, "the address space (the request is larger than any machine)");
    const size_t size = memory::rounded_size(nbytes);
    auto& cc = cats_[static_cast<int>(cat)];
    const int64_t lim = limit_.load(std::memory_order_relaxed);
    if (lim > 0 && live_.load(std::memory_order_relaxed) + static_cast<int64_t>(size) > lim) {
      throw_oom(nbytes, cat, "the memory limit");
    }
    memory::PrivatePool::Impl* pool = t_pool ? t_pool->impl() : nullptr;
    void* p = pool ? take_pooled(pool, size) : nullptr;
    const bool pooled = p != nullptr;
    if (!p) p = take_cached(size);
    if (!p) p = os_alloc(size);
    if (!p) {
      memory::empty_cache();
      p = os_alloc(size);
      if (!p) throw_oom(nbytes, cat, "the operating system (allocation failed)");
    }
    if (pool && !pooled) adopt(pool, p, size);
    const int64_t s = static_cast<int64_t>(size);
    const int64_t cat_live = cc.live.fetch_add(s, std::memory_order_relaxed) + s;
    update_peak(cc.peak, cat_live);
    cc.count.fetch_add(1, std::memory_order_relaxed);
    const int64_t live = live_.fetch_add(s, std::memory_order_relaxed) + s;
    update_peak(peak_, live);
    if (memory::history::g_recording.load(std::memory_order_relaxed)) memory::history::on_alloc(p, size, cat, live);
    record::memory_event(s, cat, cat_live, live, p);
    return p;
  }

  void deallocate(void* p, size_t nbytes, MemoryCategory cat) {
    if (!p) return;
    const size_t size = memory::rounded_size(nbytes);
    if (memory::history::g_tracked.load(std::memory_order_relaxed) > 0) memory::history::on_free(p);
    auto& cc = cats_[static_cast<int>(cat)];
    const int64_t s = static_cast<int64_t>(size);
    const int64_t cat_live = cc.live.fetch_sub(s, std::memory_order_relaxed) - s;
    cc.count.fetch_sub(1, std::memory_order_relaxed);
    const int64_t live = live_.fetch_sub(s, std::memory_order_relaxed) - s;
    record::memory_event(-s, cat, cat_live, live, p);
    const PoolRegistry& r = pool_registry();
    if (r.pools.load(std::memory_order_acquire) > 0 && r.maybe_pooled(p) && give_back_to_pool(p, size)) return;
    if (t_held_frees) {
      t_held_frees->emplace_back(p, size);
      return;
    }
    cache_block(p, size);
  }

  void cache_block(void* p, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[size].push_back(p);
    cached_ += static_cast<int64_t>(size);
  }

  void recharge(void* p, size_t nbytes, MemoryCategory from, MemoryCategory to) {
    if (memory::history::g_tracked.load(std::memory_order_relaxed) > 0) memory::history::on_recharge(p, to);
    const int64_t s = static_cast<int64_t>(memory::rounded_size(nbytes));
    auto& a = cats_[static_cast<int>(from)];
    auto& b = cats_[static_cast<int>(to)];
    const int64_t a_live = a.live.fetch_sub(s, std::memory_order_relaxed) - s;
    a.count.fetch_sub(1, std::memory_order_relaxed);
    const int64_t b_live = b.live.fetch_add(s, std::memory_order_relaxed) + s;
    update_peak(b.peak, b_live);
    b.count.fetch_add(1, std::memory_order_relaxed);
    if (record::active()) {
      const int64_t live = live_.load(std::memory_order_relaxed);
      record::memory_event(-s, from, a_live, live, p, true);
      record::memory_event(s, to, b_live, live, p, true);
    }
  }

  void empty_cache() {
    std::unordered_map<size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      reserved_ -= cached_;
      cached_ = 0;
    }
    for (auto& [size, list] : blocks) {
      for (void* p : list) os_free(p, size);
    }
  }

  memory::Stats stats() {
    memory::Stats s;
    for (int i = 0; i < kNumMemoryCategories; ++i) {
      s.by_category[i].live_bytes = cats_[i].live.load(std::memory_order_relaxed);
      s.by_category[i].peak_bytes = cats_[i].peak.load(std::memory_order_relaxed);
      s.by_category[i].allocations = cats_[i].count.load(std::memory_order_relaxed);
    }
    s.live_bytes = live_.load(std::memory_order_relaxed);
    s.peak_bytes = peak_.load(std::memory_order_relaxed);
    s.limit_bytes = limit_.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    s.cached_bytes = cached_;
    s.reserved_bytes = reserved_;
    s.num_os_allocs = os_allocs_;
    s.num_cache_hits = hits_;
    return s;
  }

  void reset_peak() {
    for (auto& c : cats_) c.peak.store(c.live.load(std::memory_order_relaxed), std::memory_order_relaxed);
    peak_.store(live_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }

  void set_limit(int64_t b) { limit_.store(b, std::memory_order_relaxed); }
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }

 private:
  static void* take_pooled(memory::PrivatePool::Impl* pool, size_t size);
  static void adopt(memory::PrivatePool::Impl* pool, void* p, size_t size);
  static bool give_back_to_pool(void* p, size_t size);

  void* take_cached(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    cached_ -= static_cast<int64_t>(size);
    ++hits_;
    return p;
  }

  void* os_alloc(size_t size) {
    void* p = nullptr;
    if (size >= kLargeThreshold) {
      // Over-map by one huge page so the block can start on a 2 MiB boundary,
      // then trim: THP can only back aligned 2 MiB extents.
      const size_t span = size + kHugePage;
      void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) return nullptr;
      const auto addr = reinterpret_cast<uintptr_t>(raw);
      const uintptr_t aligned = (addr + kHugePage - 1) & ~(kHugePage - 1);
      if (aligned > addr) munmap(raw, aligned - addr);
      const uintptr_t tail = addr + span - (aligned + size);
      if (tail) munmap(reinterpret_cast<void*>(aligned + size), tail);
      p = reinterpret_cast<void*>(aligned);
      madvise(p, size, MADV_HUGEPAGE);
    } else {
      p = std::aligned_alloc(kAlign, size);
      if (!p) return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ += static_cast<int64_t>(size);
    ++os_allocs_;
    return p;
  }

  static void os_free(void* p, size_t size) {
    if (size >= kLargeThreshold)
      munmap(p, size);
    else
      std::free(p);
  }

  [[noreturn]] void throw_oom(size_t nbytes, MemoryCategory cat, const char* by) {
    std::ostringstream os;
    os << "out of memory: cannot allocate " << format_bytes(static_cast<int64_t>(nbytes)) << " for "
       << memory_category_name(cat) << ": refused by " << by;
    const int64_t lim = limit_.load(std::memory_order_relaxed);
    if (lim > 0) os << " (limit " << format_bytes(lim) << ", in use " << format_bytes(live_.load()) << ")";
    os << "\n"
       << memory::summary() << memory::history::oom_report(10)
       << "hint: " << memory::memory_advice(memory::stats(), false)
       << "; free tensors you no longer need, or raise the limit with kiln::memory::set_limit / KILN_MEMORY_LIMIT";
    throw OutOfMemory(os.str());
  }

  CategoryCounters cats_[kNumMemoryCategories];
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> limit_{0};
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  int64_t cached_ = 0;
  int64_t reserved_ = 0;
  int64_t os_allocs_ = 0;
  int64_t hits_ = 0;
};

CachingAllocator& allocator() {
  // Leaked on purpose: tensors in static storage may be freed after main returns.
  static auto* a = new CachingAllocator();
  return *a;
}

}  // namespace

// Every field is guarded by the registry's mutex.
struct memory::PrivatePool::Impl {
  std::unordered_map<size_t, std::vector<void*>> free;
  std::unordered_map<void*, size_t> blocks;  // all it owns, with their rounded sizes
  int64_t bytes = 0;
  bool log_frees = false;
  std::vector<std::pair<void*, size_t>> freed;  // while log_frees (kiln/core/pool_frees.h)
};

namespace {

void* CachingAllocator::take_pooled(memory::PrivatePool::Impl* pool, size_t size) {
  std::lock_guard<std::mutex> lock(pool_registry().mu);
  auto it = pool->free.find(size);
  if (it == pool->free.end() || it->second.empty()) return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  return p;
}

void CachingAllocator::adopt(memory::PrivatePool::Impl* pool, void* p, size_t size) {
  auto& r = pool_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.owner[p] = pool;
  r.mark(p);
  pool->blocks[p] = size;
  pool->bytes += static_cast<int64_t>(size);
}

bool CachingAllocator::give_back_to_pool(void* p, size_t size) {
  auto& r = pool_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.owner.find(p);
  if (it == r.owner.end()) return false;
  it->second->free[size].push_back(p);
  if (it->second->log_frees) it->second->freed.emplace_back(p, size);
  return true;
}

}  // namespace

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::Parameter: return "parameter";
    case MemoryCategory::Gradient: return "gradient";
    case MemoryCategory::OptimizerState: return "optimizer_state";
    case MemoryCategory::Activation: return "activation";
    case MemoryCategory::Buffer: return "buffer";
    case MemoryCategory::Data: return "data";
    case MemoryCategory::Workspace: return "workspace";
  }
  return "?";
}

MemoryCategory current_memory_category() { return t_category; }

MemoryCategoryGuard::MemoryCategoryGuard(MemoryCategory c) : prev_(t_category) { t_category = c; }
MemoryCategoryGuard::~MemoryCategoryGuard() { t_category = prev_; }

namespace memory {

PrivatePool::PrivatePool() : impl_(new Impl()) { pool_registry().pools.fetch_add(1, std::memory_order_acq_rel); }

PrivatePool::~PrivatePool() {
  auto& r = pool_registry();
  std::vector<std::pair<void*, size_t>> to_cache;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& [size, list] : impl_->free)
      for (void* p : list) to_cache.emplace_back(p, size);
    for (auto& [p, size] : impl_->blocks) r.owner.erase(p);
  }
  // Free blocks go to the shared cache; live ones get there when their tensors free them.
  for (auto& [p, size] : to_cache) allocator().cache_block(p, size);
  r.pools.fetch_sub(1, std::memory_order_acq_rel);
  delete impl_;
}

int64_t PrivatePool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(pool_registry().mu);
  return impl_->bytes;
}

void log_pool_frees(PrivatePool& pool, bool on) {
  std::lock_guard<std::mutex> lock(pool_registry().mu);
  pool.impl()->log_frees = on;
  if (!on) pool.impl()->freed.clear();
}

std::vector<std::pair<void*, size_t>> take_pool_frees(PrivatePool& pool) {
  std::lock_guard<std::mutex> lock(pool_registry().mu);
  return std::exchange(pool.impl()->freed, {});
}

PrivatePool* exchange_private_pool(PrivatePool* pool) { return std::exchange(t_pool, pool); }

HoldFrees::HoldFrees() : prev_(std::exchange(t_held_frees, &held_)) {}

HoldFrees::~HoldFrees() {
  t_held_frees = prev_;
  release();
}

void HoldFrees::release() {
  std::vector<std::pair<void*, size_t>> blocks = std::move(held_);
  held_.clear();
  for (const auto& [p, size] : blocks) allocator().cache_block(p, size);
}

size_t rounded_size(size_t n) {
  if (n <= kAlign) return kAlign;
  if (n > kMaxRequest) return n;  // refused by allocate(); never round into a wrap-around
  n = (n + kAlign - 1) & ~(kAlign - 1);
  if (n >= kLargeThreshold) return (n + kHugePage - 1) & ~(kHugePage - 1);
  // Four classes per power of two.
  const int lg = 63 - __builtin_clzll(n - 1);  // 2^lg < n <= 2^(lg+1)
  const size_t step = std::max<size_t>(kAlign, (size_t{1} << lg) / 4);
  return (n + step - 1) / step * step;
}

void* allocate(size_t nbytes, MemoryCategory category) { return allocator().allocate(nbytes, category); }
void deallocate(void* p, size_t nbytes, MemoryCategory category) { allocator().deallocate(p, nbytes, category); }
void recharge(void* ptr, size_t nbytes, MemoryCategory from, MemoryCategory to) {
  allocator().recharge(ptr, nbytes, from, to);
}
Stats stats() { return allocator().stats(); }
void reset_peak_stats() { allocator().reset_peak(); }
void empty_cache() { allocator().empty_cache(); }
void set_limit(int64_t bytes) {
  KILN_CHECK(bytes >= 0, ValueError, "memory::set_limit: expected a byte count >= 0 (0 = no limit), got ", bytes);
  allocator().set_limit(bytes);
}
int64_t limit() { return allocator().limit(); }

std::string summary() {
  const Stats s = stats();
  std::ostringstream os;
  os << "memory by category:        live        peak   tensors\n";
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    const auto& c = s.by_category[i];
    os << "  " << std::left << std::setw(18) << memory_category_name(static_cast<MemoryCategory>(i)) << std::right
       << std::setw(11) << format_bytes(c.live_bytes) << " " << std::setw(11) << format_bytes(c.peak_bytes) << " "
       << std::setw(9) << c.allocations << "\n";
  }
  os << "  " << std::left << std::setw(18) << "total" << std::right << std::setw(11) << format_bytes(s.live_bytes)
     << " " << std::setw(11) << format_bytes(s.peak_bytes) << "\n";
  os << "  cached " << format_bytes(s.cached_bytes) << ", reserved " << format_bytes(s.reserved_bytes) << ", "
     << s.num_os_allocs << " OS allocations, " << s.num_cache_hits << " cache hits";
  if (s.limit_bytes > 0) os << ", limit " << format_bytes(s.limit_bytes);
  os << "\n";
  return os.str();
}

}  // namespace memory
}  // namespace kiln
