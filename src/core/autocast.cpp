#include "kiln/core/autocast.h"

#include <tuple>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"

namespace kiln {

namespace {

struct CacheEntry {
  Tensor src;  // keeps the TensorImpl alive, so its address identifies it for the region
  uint32_t version;
  DType dtype;
  bool grad_mode;
  Tensor cast;
  uint64_t capture = 0;  // the kiln::compile capture that made the cast (its cast is recorded), 0: none
};

struct AutocastState {
  bool enabled = false;
  bool suspended = false;
  DType dtype = DType::BFloat16;
  int nesting = 0;
  std::optional<DType> last_dtype;
  // A model has tens to hundreds of parameters: a flat vector scanned by
  // identity beats hashing and keeps insertion order for nothing extra.
  std::vector<CacheEntry> cache;
  AutocastCounters counters;
};

thread_local AutocastState t_state;

}  // namespace

bool autocast_enabled() { return t_state.enabled && !t_state.suspended; }
DType autocast_dtype() { return t_state.dtype; }
std::optional<DType> autocast_last_dtype() { return t_state.last_dtype; }

AutocastGuard::AutocastGuard(DType dtype, bool enabled) : prev_enabled_(t_state.enabled), prev_dtype_(t_state.dtype) {
  KILN_CHECK(dtype == kBFloat16 || dtype == kFloat16, DTypeError,
             "AutocastGuard: expected a lower-precision dtype (bfloat16 or float16), got ", dtype_name(dtype));
  t_state.enabled = enabled;
  t_state.dtype = dtype;
  if (enabled) t_state.last_dtype = dtype;
  ++t_state.nesting;
}

AutocastGuard::AutocastGuard(bool enabled) : prev_enabled_(t_state.enabled), prev_dtype_(t_state.dtype) {
  t_state.enabled = enabled;
  if (enabled) t_state.last_dtype = t_state.dtype;
  ++t_state.nesting;
}

AutocastGuard::~AutocastGuard() {
  t_state.enabled = prev_enabled_;
  t_state.dtype = prev_dtype_;
  // As torch.autocast.__exit__: the cache lives until the outermost region ends.
  if (--t_state.nesting == 0) t_state.cache.clear();
}

AutocastCounters autocast_counters() { return t_state.counters; }
void reset_autocast_counters() { t_state.counters = {}; }

namespace autocast_detail {

SuspendGuard::SuspendGuard() : prev_(t_state.suspended) { t_state.suspended = true; }
SuspendGuard::~SuspendGuard() { t_state.suspended = prev_; }

AutocastCounters& counters() { return t_state.counters; }

bool cache_active() { return t_state.nesting > 0; }

Tensor cache_lookup(const Tensor& src, DType dtype) {
  const bool grad = grad_mode_enabled();
  for (const CacheEntry& e : t_state.cache) {
    if (e.src.impl() == src.impl() && e.dtype == dtype && e.grad_mode == grad) {
      if (e.version == src.version()) {
        // A copy made before a capture is replayed as it is: the compiled step must
        // recapture if the source changes outside it.
        if (e.capture != capture::current_capture()) capture::note_reused_derivation("an autocast copy", src);
        return e.cast;
      }
      return {};  // modified in place since the cast: stale, recast (cache_store replaces it)
    }
  }
  return {};
}

void cache_store(const Tensor& src, DType dtype, const Tensor& cast) {
  const bool grad = grad_mode_enabled();
  for (CacheEntry& e : t_state.cache) {
    if (e.src.impl() == src.impl() && e.dtype == dtype && e.grad_mode == grad) {
      e.version = src.version();
      e.cast = cast;
      e.capture = capture::current_capture();
      return;
    }
  }
  t_state.cache.push_back(CacheEntry{src, src.version(), dtype, grad, cast, capture::current_capture()});
}

void clear_cache() { t_state.cache.clear(); }

}  // namespace autocast_detail

}  // namespace kiln
