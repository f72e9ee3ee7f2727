// Internal to the kernels layer: the process-wide oneDNN engine, per-thread
// streams and primitive caches, cache keys, scratch memory from kiln's
// allocator, and allocation-free primitive execution.
//
// Note [oneDNN primitive cache]
// Creating a oneDNN primitive descriptor costs 10–800 µs (it dispatches over
// implementations and JIT-compiles), far more than running a small op. So
// every kernel builds a Key from everything the primitive depends on — op
// kind, dtype, dims, strides, attributes and the OpenMP thread count (oneDNN
// sizes its per-thread scratch and work split at creation) — and keeps the
// primitive with its dnnl::memory objects in a per-thread cache. A call then
// only swaps data handles into those memory objects and executes through the
// C API with a stack array of arguments: no heap allocation besides the
// scratch block from kiln's caching allocator. Per-thread caches make the
// memory objects safe to re-point without locks.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>

#include "kiln/core/dtype.h"
#include "kiln/core/error.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kernels/int8.h"

namespace kiln::kernels::dnnl_detail {

/// The one CPU engine of the process (never destroyed: thread-local caches
/// holding primitives may outlive static destructors).
const dnnl::engine& engine();
/// This thread's stream on that engine (in-order; CPU execution is synchronous).
const dnnl::stream& stream();

dnnl::memory::data_type to_dnnl(DType dt);

/// Counts a primitive (or reorder) creation for dnnl_primitives_created().
void note_created();

/// Op kinds, the first word of every key.
enum class PrimKind : int64_t {
  Matmul = 1,
  ConvFwd,
  PoolFwd,
  PoolFwdTraining,
  Probe,
  ConvBwdData,
  ConvBwdWeights,
  PoolBwd,
};

struct Key {
  static constexpr int kMax = 40;
  int64_t v[kMax];
  int n = 0;

  explicit Key(PrimKind kind);
  void add(int64_t x) {
    KILN_ASSERT(n < kMax, "oneDNN cache key overflow");
    v[n++] = x;
  }
  template <typename... T>
  void add_all(T... xs) {
    (add(static_cast<int64_t>(xs)), ...);
  }
  bool operator==(const Key& o) const;
};

struct KeyHash {
  size_t operator()(const Key& k) const;
};

/// A per-thread map from Key to a kernel's cached state. Cleared wholesale
/// when it grows past kMaxEntries (shape churn), which keeps it bounded
/// without LRU bookkeeping on the hot path.
template <typename Entry>
class PrimCache {
 public:
  static constexpr size_t kMaxEntries = 2048;

  Entry* find(const Key& k) {
    auto it = map_.find(k);
    return it == map_.end() ? nullptr : it->second.get();
  }
  /// For a kiln::compile record, which calls the entry directly on every
  /// replay: it stays alive though the cache is cleared.
  std::shared_ptr<Entry> find_shared(const Key& k) {
    auto it = map_.find(k);
    return it == map_.end() ? nullptr : it->second;
  }
  Entry* insert(const Key& k, std::unique_ptr<Entry> e) {
    if (map_.size() >= kMaxEntries) map_.clear();
    Entry* raw = e.get();
    map_.emplace(k, std::shared_ptr<Entry>(std::move(e)));
    return raw;
  }
  void clear() { map_.clear(); }
  size_t size() const { return map_.size(); }

 private:
  std::unordered_map<Key, std::shared_ptr<Entry>, KeyHash> map_;
};

/// FNV-1a over n bytes: a cheap, stable hash for cache keys and layout ids.
uint64_t fnv1a(const void* p, size_t n);
/// A memory descriptor's identity (its raw C struct hashed): two descriptors
/// with the same hash are the same layout, which is what packed-weight
/// layouts are compared by.
uint64_t desc_hash(const dnnl::memory::desc& md);

/// Registers a per-thread cache's clear() so dnnl_clear_cache() reaches it.
void register_clear(void (*clear)());

/// The calling thread's PrimCache of Entry; the first use registers its
/// clear() so dnnl_clear_cache() reaches every kernel's cache.
template <typename Entry>
PrimCache<Entry>& thread_cache() {
  thread_local PrimCache<Entry> c;
  static const bool registered = (register_clear([] { thread_cache<Entry>().clear(); }), true);
  (void)registered;
  return c;
}

/// Bytes from kiln's allocator charged to MemoryCategory::Workspace, freed at
/// scope exit (the caching allocator makes this cheap after the first call).
class ScratchBlock {
 public:
  ScratchBlock() = default;
  explicit ScratchBlock(size_t bytes) { reset(bytes); }
  ~ScratchBlock();
  ScratchBlock(const ScratchBlock&) = delete;
  ScratchBlock& operator=(const ScratchBlock&) = delete;
  void reset(size_t bytes);
  char* data() const { return ptr_; }

 private:
  char* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// Rounds up to 64 bytes (sub-buffers carved from one ScratchBlock stay aligned).
inline size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

/// A memory object with no buffer yet; handles are set per call.
dnnl::memory make_memory(const dnnl::memory::desc& md);

/// Attributes every kiln primitive uses: user-managed scratchpad.
dnnl::primitive_attr default_attr();

struct Arg {
  int arg;
  const dnnl::memory* mem;
  const void* handle;
};

/// Points each memory at its handle and executes `p` on this thread's stream.
/// Up to 8 arguments; no heap allocation.
void execute(const dnnl::primitive& p, std::initializer_list<Arg> args);

/// Turns a oneDNN failure at primitive creation into a kiln error naming the op.
[[noreturn]] void rethrow(const dnnl::error& e, const char* what);

/// OpenMP's current thread budget (part of every key).
int64_t max_threads();

/// Runs the oneDNN calls inside it on the calling thread alone when `serial`:
/// for problems of a few microseconds, where an OpenMP fork and join costs
/// more than a second thread saves (the tiny workload took 16.7 us a step at
/// 2 threads against 14.4 at 1). Primitives created inside plan for one
/// thread and are cached under max_threads() = 1, apart from the others.
class SerialScope {
 public:
  explicit SerialScope(bool serial);
  ~SerialScope();
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  int saved_ = 0;  // the thread budget to restore; 0 when nothing changed
};

/// Multiply-adds below which a matmul or convolution runs serially.
inline constexpr int64_t kSerialMacs = int64_t{1} << 17;

/// A bfloat16 product where oneDNN has no bfloat16 kernel or a slower one
/// than float32's (bf16_products_on_dnnl() is false): its operands widened to
/// float32, the float32 product, c rounded once (matmul_through_float32.cpp).
void matmul_through_float32(const MatmulArgs& g);

/// Whether the ISA oneDNN's kernels run with (ONEDNN_MAX_CPU_ISA may lower
/// it) includes `bits`, a dnnl_cpu_isa_t value: each holds the bits of the
/// ISAs it includes.
bool isa_has(unsigned bits);

/// Whether oneDNN's jit int8 kernels sum exactly on this CPU (it has VNNI);
/// where not, int8 runs through float32 (Note [Int8 sums without VNNI] in
/// dnnl_int8.cpp; int8_through_float32.cpp).
bool int8_jit_is_exact();
/// out[i] = weight[i], int8 to float32: the packed form of a weight there.
void int8_widen_weight(const void* weight, int64_t n, float* out);
/// int8_linear_forward and int8_conv_forward with float32-packed weights.
void int8_linear_through_float32(const Int8LinearArgs& a, const void* x, const float* w, const void* bias, void* y);
void int8_conv_through_float32(const Int8ConvArgs& a, const void* input, const float* w, const void* bias, void* output,
                               const void* residual);

}  // namespace kiln::kernels::dnnl_detail
