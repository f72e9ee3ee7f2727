// The record hook (include/kiln/core/record.h): the open-scope stack per
// thread, thread indices, and the callback table. Nothing here formats or
// stores events: the listeners (the profiler) do.
#include "kiln/core/record.h"

#include <array>
#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kiln/core/error.h"
#include "kiln/core/tensor.h"

namespace kiln::record {
namespace {

struct Slot {
  std::atomic<EventCallback> on_event{nullptr};
  std::atomic<MemoryCallback> on_memory{nullptr};
  std::atomic<void*> user{nullptr};
  bool used = false;
};
constexpr int kMaxCallbacks = 8;
std::array<Slot, kMaxCallbacks> g_slots;
std::mutex g_mu;  // registration and thread names
std::atomic<int> g_registered{0};
std::atomic<bool> g_enabled{false};
std::atomic<uint64_t> g_next_id{1};
std::atomic<uint32_t> g_next_thread{0};

std::unordered_map<uint32_t, std::string>& thread_names() {
  static auto* names = new std::unordered_map<uint32_t, std::string>();  // outlives static destruction
  return *names;
}

thread_local Event* t_top = nullptr;  // innermost open scope on this thread
thread_local int64_t t_thread = -1;
thread_local uint32_t t_depth = 0;

void refresh_active() {
  detail::g_active.store(g_enabled.load() && g_registered.load() > 0, std::memory_order_relaxed);
}

}  // namespace

namespace detail {
std::atomic<bool> g_active{false};

void begin(Event* ev, Kind kind, std::string_view name, std::initializer_list<const Tensor*> inputs) noexcept {
  ev->kind = kind;
  ev->name = name;
  int n = 0;
  // A Scalar operand or an absent optional tensor (linear without bias) is passed as
  // null or undefined: skipped, so listeners see only real tensors.
  for (const Tensor* t : inputs) {
    if (n == kMaxInputs) break;
    if (t && t->defined()) ev->inputs[n++] = t;
  }
  ev->num_inputs = n;
  ev->thread = thread_index();
  ev->depth = t_depth++;
  ev->id = g_next_id.fetch_add(1, std::memory_order_relaxed);
  ev->parent_ptr = t_top;
  ev->parent = t_top ? t_top->id : 0;
  t_top = ev;
  ev->start_ns = now_ns();
}

void end(Event* ev) noexcept {
  ev->end_ns = now_ns();
  // Scopes close in reverse order of opening on a thread; a scope opened while
  // recording was off is not on the stack, so only pop what is ours.
  if (t_top == ev) t_top = ev->parent_ptr;
  if (t_depth > 0) --t_depth;
  for (auto& s : g_slots) {
    EventCallback cb = s.on_event.load(std::memory_order_acquire);
    if (cb) cb(*ev, s.user.load(std::memory_order_relaxed));
  }
}

void note_sequence(int64_t seq) noexcept {
  for (Event* e = t_top; e; e = e->parent_ptr) {
    if (e->kind == Kind::Op) {
      if (e->seq < 0) e->seq = seq;
      return;
    }
  }
}

void memory(int64_t bytes, MemoryCategory c, int64_t category_live, int64_t total_live, const void* ptr,
            bool recharge) noexcept {
  if (!recharge && t_top) (bytes > 0 ? t_top->alloc_bytes : t_top->freed_bytes) += bytes > 0 ? bytes : -bytes;
  MemoryEvent m;
  m.time_ns = now_ns();
  m.bytes = bytes;
  m.category = c;
  m.category_live = category_live;
  m.total_live = total_live;
  m.ptr = ptr;
  m.thread = thread_index();
  m.recharge = recharge;
  for (auto& s : g_slots) {
    MemoryCallback cb = s.on_memory.load(std::memory_order_acquire);
    if (cb) cb(m, s.user.load(std::memory_order_relaxed));
  }
}
}  // namespace detail

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Op: return "op";
    case Kind::Backward: return "backward";
    case Kind::Optimizer: return "optimizer";
    case Kind::DataWait: return "data_wait";
    case Kind::DataLoad: return "data_load";
    case Kind::Collective: return "collective";
    case Kind::CollectiveWait: return "collective_wait";
    case Kind::Checkpoint: return "checkpoint";
    case Kind::User: return "user";
    case Kind::Step: return "step";
  }
  return "?";
}

int add_callbacks(EventCallback on_event, MemoryCallback on_memory, void* user) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kMaxCallbacks; ++i) {
    Slot& s = g_slots[i];
    if (s.used) continue;
    s.used = true;
    s.user.store(user, std::memory_order_relaxed);
    s.on_memory.store(on_memory, std::memory_order_release);
    s.on_event.store(on_event, std::memory_order_release);
    g_registered.fetch_add(1);
    refresh_active();
    return i;
  }
  throw ValueError("record::add_callbacks: all " + std::to_string(kMaxCallbacks) +
                   " listener slots are taken (is a profiler left running?)");
}

void remove_callbacks(int handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (handle < 0 || handle >= kMaxCallbacks || !g_slots[handle].used) return;
  Slot& s = g_slots[handle];
  s.on_event.store(nullptr, std::memory_order_release);
  s.on_memory.store(nullptr, std::memory_order_release);
  s.used = false;
  g_registered.fetch_sub(1);
  refresh_active();
}

void set_enabled(bool on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_enabled.store(on);
  refresh_active();
}

int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint32_t thread_index() noexcept {
  if (t_thread < 0) t_thread = g_next_thread.fetch_add(1, std::memory_order_relaxed);
  return static_cast<uint32_t>(t_thread);
}

void set_thread_name(std::string_view name) {
  const uint32_t i = thread_index();
  std::lock_guard<std::mutex> lock(g_mu);
  thread_names()[i] = std::string(name);
}

std::string thread_name(uint32_t index) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = thread_names().find(index);
  if (it != thread_names().end()) return it->second;
  return index == 0 ? "main" : "thread " + std::to_string(index);
}

}  // namespace kiln::record
