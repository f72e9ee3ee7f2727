// The record hook (DESIGN.md §1): the one piece of profiling that lives in core.
//
// Ops, the autograd engine, optimizers, the data loader, collectives and
// checkpoints open a record::Scope around what they do; the allocator reports
// each allocation and free. With nothing listening, a Scope costs one relaxed
// load of a global flag and a branch (the profiler stays compiled in, as
// torch.profiler's RecordFunction). With a listener registered and recording
// switched on, a Scope stamps its start and end on a steady clock and hands one
// complete Event to every callback when it closes — children close before
// their parents, as Chrome's "X" events expect. Everything that turns events
// into traces and tables lives in the profiler layer above.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "kiln/core/allocator.h"

namespace kiln {
class Tensor;
}

namespace kiln::record {

/// What a Scope covers. Each becomes its own category in traces and tables.
enum class Kind : uint8_t {
  Op,              // a public op (add, matmul, conv2d, ...), nested ops included
  Backward,        // one autograd node run by the engine ("MmBackward0")
  Optimizer,       // optimizer.step / zero_grad
  DataWait,        // the training loop waiting for the next batch
  DataLoad,        // a batch being produced (loader worker or main thread)
  Collective,      // all_reduce, broadcast, ... (bytes = payload)
  CollectiveWait,  // the part of a collective spent waiting for peers / completion
  Checkpoint,      // a checkpoint save or load (bytes = file size)
  User,            // profiler::Range and the training loop's phases ("forward", "backward")
  Step,            // one training step ("ProfilerStep#N")
};
inline constexpr int kNumKinds = 10;
const char* kind_name(Kind k);

/// Inputs recorded per op: their shapes and dtypes go into the event.
inline constexpr int kMaxInputs = 4;

/// One closed scope, as callbacks see it. `name` and `detail` and the input
/// pointers are valid only during the callback: a collector copies what it keeps.
struct Event {
  Kind kind = Kind::Op;
  std::string_view name;
  std::string_view detail;  // collectives: the group; backward: unused; free-form otherwise
  const Tensor* inputs[kMaxInputs] = {};
  int num_inputs = 0;
  int64_t start_ns = 0;  // record::now_ns() clock
  int64_t end_ns = 0;
  int64_t seq = -1;         // autograd sequence number: of the node this op made, or the node run
  double flops = 0;         // products and convolutions: the analytic count
  int64_t bytes = 0;        // collectives: payload; data: batch; checkpoint: file
  int64_t alloc_bytes = 0;  // allocated while the scope was innermost (self, not children)
  int64_t freed_bytes = 0;
  uint32_t thread = 0;          // record::thread_index() of the thread it ran on
  uint32_t depth = 0;           // scopes open around it on its thread
  uint64_t id = 0;              // unique per process
  uint64_t parent = 0;          // id of the enclosing scope on this thread (0: none)
  Event* parent_ptr = nullptr;  // internal: the enclosing open scope
};

/// One allocation or free, with the category's live bytes after it.
struct MemoryEvent {
  int64_t time_ns = 0;
  int64_t bytes = 0;  // > 0 allocated, < 0 freed
  MemoryCategory category = MemoryCategory::Activation;
  int64_t category_live = 0;  // after this event
  int64_t total_live = 0;
  const void* ptr = nullptr;
  uint32_t thread = 0;
  bool recharge = false;  // a block moved between categories (not a new allocation)
};

using EventCallback = void (*)(const Event&, void* user);
using MemoryCallback = void (*)(const MemoryEvent&, void* user);

/// Registers callbacks (either may be null); returns a handle for remove_callbacks.
/// Callbacks run on the thread that closed the scope, so they must be thread-safe.
int add_callbacks(EventCallback on_event, MemoryCallback on_memory, void* user);
void remove_callbacks(int handle);

/// Recording happens only while enabled and at least one callback is registered.
void set_enabled(bool on);

namespace detail {
extern std::atomic<bool> g_active;  // enabled && callbacks registered
void begin(Event* ev, Kind kind, std::string_view name, std::initializer_list<const Tensor*> inputs) noexcept;
void end(Event* ev) noexcept;
void note_sequence(int64_t seq) noexcept;
void memory(int64_t bytes, MemoryCategory c, int64_t category_live, int64_t total_live, const void* ptr,
            bool recharge) noexcept;
}  // namespace detail

/// True while events are being recorded: the only check on the fast path.
inline bool active() noexcept { return detail::g_active.load(std::memory_order_relaxed); }

/// Steady-clock nanoseconds, the clock every Event uses.
int64_t now_ns() noexcept;
/// A small, stable index for the calling thread (0 for the first thread that asks).
uint32_t thread_index() noexcept;
/// Names the calling thread's track in traces ("main", "loader worker 2").
void set_thread_name(std::string_view name);
std::string thread_name(uint32_t index);

/// RAII: records what happens until it goes out of scope.
class Scope {
 public:
  Scope(Kind kind, std::string_view name) noexcept {
    if (active()) start(kind, name, {});
  }
  Scope(Kind kind, std::string_view name, std::initializer_list<const Tensor*> inputs) noexcept {
    if (active()) start(kind, name, inputs);
  }
  ~Scope() {
    if (ev_) detail::end(ev_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  bool recording() const { return ev_ != nullptr; }
  void set_flops(double f) {
    if (ev_) ev_->flops = f;
  }
  void set_bytes(int64_t b) {
    if (ev_) ev_->bytes = b;
  }
  void set_seq(int64_t s) {
    if (ev_) ev_->seq = s;
  }
  /// `d` must outlive the scope (a literal, or a string the caller keeps).
  void set_detail(std::string_view d) {
    if (ev_) ev_->detail = d;
  }

 private:
  void start(Kind kind, std::string_view name, std::initializer_list<const Tensor*> inputs) noexcept {
    ev_ = new (storage_) Event;
    detail::begin(ev_, kind, name, inputs);
  }
  Event* ev_ = nullptr;
  alignas(Event) unsigned char storage_[sizeof(Event)];
};

/// Autograd calls this when an op records a node: the innermost open Op scope
/// takes the node's sequence number, linking it to the node's backward event.
inline void note_sequence(int64_t seq) noexcept {
  if (active()) detail::note_sequence(seq);
}

/// The allocator calls this after each allocation (bytes > 0) and free (bytes < 0);
/// a recharge between categories is a free in one and an allocation in the other.
inline void memory_event(int64_t bytes, MemoryCategory c, int64_t category_live, int64_t total_live, const void* ptr,
                         bool recharge = false) noexcept {
  if (active()) detail::memory(bytes, c, category_live, total_live, ptr, recharge);
}

}  // namespace kiln::record
