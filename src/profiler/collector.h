// The profiler's private state (include/kiln/profiler/profiler.h): what the
// record callbacks copy events into, and the kept window the outputs read.
//
// Collection runs on every thread that closes a scope, so it must not take a
// lock that all threads share: each thread appends to its own buffer, found
// through a thread_local cache and registered once under the profiler's mutex.
// A buffer's own mutex is taken per event, uncontended except while a window
// is being collected (a step boundary), which is what keeps the outputs'
// reads safe while other threads still record.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kiln/profiler/profiler.h"

namespace kiln::profiler::detail {

/// Strings interned per buffer (names, details, shapes): an event keeps ids.
class StringTable {
 public:
  uint32_t intern(std::string_view s);
  const std::string& at(uint32_t id) const { return strings_[id]; }
  size_t size() const { return strings_.size(); }
  std::vector<std::string> release() { return std::move(strings_); }

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::vector<std::string> strings_;
  std::unordered_map<std::string, uint32_t, Hash, std::equal_to<>> ids_;
};

inline constexpr uint32_t kNoString = 0xffffffffu;

/// One record::Event, copied.
struct Rec {
  record::Kind kind = record::Kind::Op;
  uint32_t name = kNoString;
  uint32_t detail = kNoString;
  uint32_t shapes = kNoString;  // "[[32, 784], [784, 256]]" with record_shapes
  uint32_t dtypes = kNoString;  // "[float32, float32]"
  uint32_t thread = 0;
  uint32_t depth = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t seq = -1;
  double flops = 0;
  int64_t bytes = 0;
  int64_t alloc_bytes = 0;
  int64_t freed_bytes = 0;
  uint64_t id = 0;
  uint64_t parent = 0;
  int64_t dur() const { return end_ns - start_ns; }
};

/// One record::MemoryEvent, copied.
struct MemRec {
  int64_t time_ns = 0;
  int64_t bytes = 0;
  int64_t category_live = 0;
  int64_t total_live = 0;
  uint32_t thread = 0;
  MemoryCategory category = MemoryCategory::Activation;
  bool recharge = false;
};

/// An append-only list in fixed chunks that come from a process-wide pool:
/// appending never copies what is there, and a window after the first (or a
/// later profiler) reuses chunks whose pages are already touched — fresh
/// pages cost ~12 us per 4 KiB on these machines (DESIGN.md §2), ten times
/// what recording an event costs.
template <typename T>
class Chunked {
 public:
  static constexpr size_t kChunk = 1024;
  using Chunk = std::array<T, kChunk>;

  Chunked() = default;
  Chunked(const Chunked&) = delete;
  Chunked& operator=(const Chunked&) = delete;
  ~Chunked() { clear(); }

  void push_back(const T& v) {
    if (size_ == chunks_.size() * kChunk) chunks_.push_back(take());
    (*chunks_[size_ / kChunk])[size_ % kChunk] = v;
    ++size_;
  }
  size_t size() const { return size_; }
  template <typename F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < size_; ++i) f((*chunks_[i / kChunk])[i % kChunk]);
  }
  /// Empties the list; its chunks go back to the pool.
  void clear() {
    std::lock_guard<std::mutex> lock(pool_mu());
    auto& p = pool();
    for (Chunk* c : chunks_) {
      if (p.size() < kMaxPooled) {
        p.push_back(c);
      } else {
        delete c;
      }
    }
    chunks_.clear();
    size_ = 0;
  }

 private:
  // At most this many chunks are kept for reuse (~100 MiB of events).
  static constexpr size_t kMaxPooled = 1024;
  static std::mutex& pool_mu() {
    static auto* m = new std::mutex();  // a static Profiler's buffers may be freed during static destruction
    return *m;
  }
  static std::vector<Chunk*>& pool() {
    static auto* p = new std::vector<Chunk*>();  // outlives static destruction
    return *p;
  }
  static Chunk* take() {
    {
      std::lock_guard<std::mutex> lock(pool_mu());
      auto& p = pool();
      if (!p.empty()) {
        Chunk* c = p.back();
        p.pop_back();
        return c;
      }
    }
    return new Chunk;
  }
  std::vector<Chunk*> chunks_;
  size_t size_ = 0;
};

struct ThreadBuffer {
  std::mutex mu;
  uint32_t thread = 0;
  Chunked<Rec> events;
  Chunked<MemRec> memory;
  StringTable strings;
};

/// A closed window: every thread's events merged, with one string table.
struct Window {
  std::vector<std::string> strings;
  std::vector<Rec> events;                                // by (thread, start, depth): parents before children
  std::vector<MemRec> memory;                             // by time
  std::array<int64_t, kNumMemoryCategories> base_live{};  // when the window began
  int64_t base_total = 0;
  int64_t origin_ns = 0;  // the profiler's start(): time zero of the outputs (record::now_ns() clock)
  int64_t begin_ns = 0;   // record::now_ns() clock
  int64_t end_ns = 0;
  bool profile_memory = false;
  std::vector<std::string> live_at_peak;
  const std::string& str(uint32_t id) const {
    static const std::string empty;
    return id == kNoString ? empty : strings[id];
  }
};

/// What the record hook hands the callbacks: it is never freed, so a thread
/// that loaded the callback just before the profiler went away still reads
/// valid memory. `listening` and the per-thread in-callback marks (see
/// profiler.cpp, "Callbacks in flight") make unlisten() wait for such a thread.
struct Listener {
  std::atomic<bool> listening{false};
  struct State* state = nullptr;
};

/// torch.profiler.ProfilerAction.
enum class Action { None, Warmup, Record, RecordAndSave };

struct State {
  explicit State(Options o);

  Options opts;
  const uint64_t generation;  // tells a thread's cached buffer pointer which profiler it belongs to

  std::mutex mu;                                              // the schedule's state below
  std::mutex buffers_mu;                                      // the map of buffers (taken after mu, never before it)
  std::map<uint32_t, std::unique_ptr<ThreadBuffer>> buffers;  // by record thread index; never erased
  int handle = -1;                                            // record::add_callbacks, -1 when not listening
  bool started = false;
  Listener* listener;  // leaked on purpose (see Listener)
  int64_t step_num = 0;
  uint32_t step_thread = 0;  // the thread that called start(): its step scopes
  Action action = Action::None;
  int64_t start_ns = 0;       // start(): the trace's time zero
  int64_t clock_sync_ns = 0;  // mark_clock_sync(), 0 when not marked
  bool has_clock_sync = false;
  // The open window (warmup or active) and its baseline.
  int64_t window_begin_ns = 0;
  std::array<int64_t, kNumMemoryCategories> window_base{};
  int64_t window_base_total = 0;
  std::shared_ptr<const Window> kept;  // the last completed active window
  std::optional<record::Scope> step_scope;
  std::string step_name;  // the open step scope's name (the Event views it)

  ThreadBuffer* buffer();
  Action action_at(int64_t step) const;
  void listen();    // under mu
  void unlisten();  // under mu; returns once no thread is inside a callback for this profiler
  void clear_buffers();
  void begin_window();
  /// Moves the schedule from one action to the next; true when an active window was saved.
  bool transit(Action prev, Action cur);
  void open_step_scope();
  /// stop() under mu: closes the step, keeps an active window; true when one was saved.
  bool stop_locked();
  std::shared_ptr<const Window> collect(int64_t end_ns);
  /// The window the outputs read: the kept one, or without a schedule what is recorded so far.
  std::shared_ptr<const Window> current();
};

/// Computed from a window for the outputs.
struct Analysis {
  std::vector<int64_t> self_ns;  // per event: duration minus its children on the same thread
  std::unordered_map<uint64_t, size_t> by_id;
};
Analysis analyse(const Window& w);

/// JSON string literal with escapes; bytes that are not valid UTF-8 become '?'.
void append_json_string(std::string& out, std::string_view s);
/// Nanoseconds as microseconds with three decimals ("12.345"), exact.
void append_us(std::string& out, int64_t ns);

}  // namespace kiln::profiler::detail

namespace kiln::profiler {
struct Profiler::State : detail::State {
  using detail::State::State;
};
}  // namespace kiln::profiler
