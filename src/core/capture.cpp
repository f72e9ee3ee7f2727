// The capture hook (include/kiln/core/capture.h): the thread-local recorder,
// the depth that keeps nested kernels out of the record, and host actions
// that step outside the capture's private pool.
#include "kiln/core/capture.h"

#include <atomic>
#include <cstring>

#include "kiln/core/allocator.h"
#include "kiln/core/capture_loop.h"
#include "kiln/core/capture_ops.h"
#include "kiln/core/storage.h"

namespace kiln::capture {

namespace detail {
constinit thread_local Recorder* t_recorder = nullptr;
constinit thread_local int t_depth = 0;
constinit thread_local LoopSink* t_loop_sink = nullptr;
constinit thread_local uint64_t t_capture_id = 0;
constinit thread_local OpSink* t_op_sink = nullptr;
}  // namespace detail

namespace {
std::atomic<uint64_t> g_captures{0};
std::atomic<uint32_t> g_watch_ids{0};
std::atomic<uint64_t> g_unattributed{0};
}  // namespace

namespace detail {
void note_watched_access(uint32_t id) {
  if (t_recorder)
    t_recorder->watched_access(id);
  else
    g_unattributed.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace detail

uint64_t unattributed_watched_accesses() noexcept { return g_unattributed.load(std::memory_order_relaxed); }

void watch(StorageImpl& s, const char* role) {
  if (!recording() || detail::t_recorder->defers) return;
  uint32_t id = g_watch_ids.fetch_add(1, std::memory_order_relaxed) + 1;
  if (id == 0) id = g_watch_ids.fetch_add(1, std::memory_order_relaxed) + 1;  // 0 means "not watched"
  s.set_watch_id(0);  // the recorder hears of it before the next access is reported
  detail::t_recorder->watched(id, s.data(), role);
  s.set_watch_id(id);
}

RecorderGuard::RecorderGuard(Recorder* r, memory::PrivatePool* pool) noexcept
    : prev_(detail::t_recorder),
      prev_depth_(detail::t_depth),
      prev_id_(detail::t_capture_id),
      prev_pool_(memory::exchange_private_pool(pool)) {
  detail::t_recorder = r;
  detail::t_depth = 0;
  if (r) detail::t_capture_id = g_captures.fetch_add(1, std::memory_order_relaxed) + 1;
}

RecorderGuard::~RecorderGuard() {
  detail::t_recorder = prev_;
  detail::t_depth = prev_depth_;
  detail::t_capture_id = prev_id_;
  memory::exchange_private_pool(prev_pool_);
}

void HostAction::enter() {
  ++detail::t_depth;
  saved_pool_ = memory::exchange_private_pool(nullptr);
}

void HostAction::leave() {
  --detail::t_depth;
  memory::exchange_private_pool(saved_pool_);
}

void graph_break(const char* what) {
  if (detail::t_recorder) detail::t_recorder->graph_break(what);
}

ScalarBytes::ScalarBytes(const void* p, int nbytes) {
  if (!p) return;
  present = true;
  std::memcpy(bytes, p, static_cast<size_t>(nbytes < 16 ? nbytes : 16));
}

}  // namespace kiln::capture
