// Collection and the schedule (include/kiln/profiler/profiler.h): the record
// callbacks, the per-thread buffers, the step scopes and torch.profiler's
// wait / warmup / active / repeat state machine. The outputs read the windows
// this file closes (stats.cpp, trace.cpp).
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <thread>

#include "collector.h"
#include "kiln/core/error.h"
#include "kiln/core/memory_history.h"
#include "kiln/core/tensor.h"

namespace kiln::profiler {
namespace detail {
namespace {

std::atomic<uint64_t> g_next_generation{1};

// record::set_enabled is process-wide: it stays on while any profiler runs.
std::mutex g_enable_mu;
int g_running = 0;

void enable_recording() {
  std::lock_guard<std::mutex> lock(g_enable_mu);
  if (g_running++ == 0) record::set_enabled(true);
}

void disable_recording() {
  std::lock_guard<std::mutex> lock(g_enable_mu);
  if (--g_running == 0) record::set_enabled(false);
}

struct BufferCache {
  uint64_t generation = 0;
  ThreadBuffer* buffer = nullptr;
};
thread_local BufferCache t_cache;

void append_int(std::string& out, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, static_cast<size_t>(r.ptr - buf));
}

// Formats the inputs as "[[32, 784], [784, 256]]" and ["float32", "float32"]
// (both valid JSON, so the trace embeds them as they are).
void format_inputs(const record::Event& e, std::string& shapes, std::string& dtypes) {
  shapes.clear();
  dtypes.clear();
  shapes += '[';
  dtypes += '[';
  for (int i = 0; i < e.num_inputs; ++i) {
    if (i) {
      shapes += ", ";
      dtypes += ", ";
    }
    const Tensor* t = e.inputs[i];
    shapes += '[';
    if (t && t->defined()) {
      const IntArrayRef sizes = t->sizes();
      for (size_t d = 0; d < sizes.size(); ++d) {
        if (d) shapes += ", ";
        append_int(shapes, sizes[d]);
      }
      dtypes += '"';
      dtypes += dtype_name(t->dtype());
      dtypes += '"';
    } else {
      dtypes += "null";
    }
    shapes += ']';
  }
  shapes += ']';
  dtypes += ']';
}

// Note [Callbacks in flight]: the record hook may call a callback on another
// thread after remove_callbacks() returned (it loaded the pointer before).
// So each thread marks, in a flag of its own, which listener it is inside,
// then checks `listening`; unlisten() clears `listening`, then waits until no
// thread's mark names its listener. Both sides store then load with seq_cst:
// either the thread sees `listening` false and leaves without touching the
// profiler, or unlisten() sees its mark and waits. A thread's mark is its own
// cache line: recording shares nothing between threads.
struct alignas(64) InCallback {
  std::atomic<const Listener*> inside{nullptr};
  InCallback();
  ~InCallback();
};

std::mutex& marks_mu() {
  static auto* m = new std::mutex();  // outlives static destruction, as the marks
  return *m;
}
std::vector<InCallback*>& marks() {
  static auto* v = new std::vector<InCallback*>();  // outlives static destruction
  return *v;
}
InCallback::InCallback() {
  std::lock_guard<std::mutex> lock(marks_mu());
  marks().push_back(this);
}
InCallback::~InCallback() {
  std::lock_guard<std::mutex> lock(marks_mu());
  auto& v = marks();
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
}

// Enters a callback for `l`: null when the profiler no longer listens.
class Entered {
 public:
  explicit Entered(const Listener* l) {
    thread_local InCallback mark;
    mark_ = &mark;
    mark_->inside.store(l, std::memory_order_seq_cst);
    if (l->listening.load(std::memory_order_seq_cst)) state_ = l->state;
  }
  ~Entered() { mark_->inside.store(nullptr, std::memory_order_release); }
  Entered(const Entered&) = delete;
  Entered& operator=(const Entered&) = delete;
  State* state() const { return state_; }

 private:
  InCallback* mark_;
  State* state_ = nullptr;
};

void wait_for_callbacks(const Listener* l) {
  std::lock_guard<std::mutex> lock(marks_mu());
  for (InCallback* m : marks()) {
    while (m->inside.load(std::memory_order_seq_cst) == l) std::this_thread::yield();
  }
}

void on_event(const record::Event& e, void* user) {
  const Entered entered(static_cast<const Listener*>(user));
  State* s = entered.state();
  if (!s) return;
  thread_local std::string shapes, dtypes;
  const bool with_inputs = s->opts.record_shapes && e.num_inputs > 0;
  if (with_inputs) format_inputs(e, shapes, dtypes);
  ThreadBuffer* b = s->buffer();
  std::lock_guard<std::mutex> lock(b->mu);
  Rec r;
  r.kind = e.kind;
  r.name = b->strings.intern(e.name);
  if (!e.detail.empty()) r.detail = b->strings.intern(e.detail);
  if (with_inputs) {
    r.shapes = b->strings.intern(shapes);
    r.dtypes = b->strings.intern(dtypes);
  }
  r.thread = e.thread;
  r.depth = e.depth;
  r.start_ns = e.start_ns;
  r.end_ns = e.end_ns;
  r.seq = e.seq;
  r.flops = e.flops;
  r.bytes = e.bytes;
  r.alloc_bytes = e.alloc_bytes;
  r.freed_bytes = e.freed_bytes;
  r.id = e.id;
  r.parent = e.parent;
  b->events.push_back(r);
}

void on_memory(const record::MemoryEvent& m, void* user) {
  const Entered entered(static_cast<const Listener*>(user));
  State* s = entered.state();
  if (!s) return;
  ThreadBuffer* b = s->buffer();
  std::lock_guard<std::mutex> lock(b->mu);
  MemRec r;
  r.time_ns = m.time_ns;
  r.bytes = m.bytes;
  r.category_live = m.category_live;
  r.total_live = m.total_live;
  r.thread = m.thread;
  r.category = m.category;
  r.recharge = m.recharge;
  b->memory.push_back(r);
}

std::string format_site(const memory::SiteUsage& u) {
  char buf[96];
  std::snprintf(buf, sizeof buf, ": %.2f MiB %s in %lld tensor%s", static_cast<double>(u.bytes) / (1 << 20),
                memory_category_name(u.category), static_cast<long long>(u.tensors), u.tensors == 1 ? "" : "s");
  return u.label() + buf;
}

}  // namespace

uint32_t StringTable::intern(std::string_view s) {
  auto it = ids_.find(s);
  if (it != ids_.end()) return it->second;
  const auto id = static_cast<uint32_t>(strings_.size());
  strings_.emplace_back(s);
  ids_.emplace(strings_.back(), id);
  return id;
}

namespace {
// Listeners are never freed (Note [Callbacks in flight]); kept in a list so
// that they stay reachable (16 bytes per profiler ever made).
Listener* new_listener(State* s) {
  static std::mutex mu;
  static auto* all = new std::vector<std::unique_ptr<Listener>>();  // outlives static destruction
  auto l = std::make_unique<Listener>();
  l->state = s;
  std::lock_guard<std::mutex> lock(mu);
  all->push_back(std::move(l));
  return all->back().get();
}
}  // namespace

State::State(Options o)
    : opts(std::move(o)), generation(g_next_generation.fetch_add(1)), listener(new_listener(this)) {}

ThreadBuffer* State::buffer() {
  if (t_cache.generation == generation) return t_cache.buffer;
  const uint32_t thread = record::thread_index();
  std::lock_guard<std::mutex> lock(buffers_mu);
  auto& b = buffers[thread];
  if (!b) {
    b = std::make_unique<ThreadBuffer>();
    b->thread = thread;
  }
  t_cache = {generation, b.get()};
  return b.get();
}

Action State::action_at(int64_t step) const {
  if (!opts.use_schedule) return Action::Record;
  const Schedule& sc = opts.schedule;
  if (step < sc.skip_first) return Action::None;
  step -= sc.skip_first;
  const int64_t cycle = sc.wait + sc.warmup + sc.active;
  if (sc.repeat > 0 && step / cycle >= sc.repeat) return Action::None;
  const int64_t m = step % cycle;
  if (m < sc.wait) return Action::None;
  if (m < sc.wait + sc.warmup) return Action::Warmup;
  return m < cycle - 1 ? Action::Record : Action::RecordAndSave;
}

void State::listen() {
  if (handle >= 0) return;
  listener->listening.store(true, std::memory_order_seq_cst);
  handle = record::add_callbacks(on_event, opts.profile_memory ? on_memory : nullptr, listener);
}

void State::unlisten() {
  if (handle < 0) return;
  listener->listening.store(false, std::memory_order_seq_cst);
  record::remove_callbacks(handle);
  handle = -1;
  wait_for_callbacks(listener);
}

void State::clear_buffers() {
  std::lock_guard<std::mutex> lock(buffers_mu);
  for (auto& [thread, b] : buffers) {
    std::lock_guard<std::mutex> block(b->mu);
    b->events.clear();
    b->memory.clear();
  }
}

void State::begin_window() {
  clear_buffers();
  window_begin_ns = record::now_ns();
  const memory::Stats st = memory::stats();
  for (int c = 0; c < kNumMemoryCategories; ++c) window_base[c] = st.by_category[c].live_bytes;
  window_base_total = st.live_bytes;
}

std::shared_ptr<const Window> State::collect(int64_t end_ns) {
  auto w = std::make_shared<Window>();
  StringTable table;
  {
    std::lock_guard<std::mutex> lock(buffers_mu);
    for (auto& entry : buffers) {
      auto& b = entry.second;  // not a structured binding: clang 14 (the fuzz build) cannot capture one
      std::lock_guard<std::mutex> block(b->mu);
      std::vector<uint32_t> remap(b->strings.size(), kNoString);
      auto map = [&](uint32_t id) {
        if (id == kNoString) return kNoString;
        if (remap[id] == kNoString) remap[id] = table.intern(b->strings.at(id));
        return remap[id];
      };
      w->events.reserve(w->events.size() + b->events.size());
      b->events.for_each([&](Rec r) {
        r.name = map(r.name);
        r.detail = map(r.detail);
        r.shapes = map(r.shapes);
        r.dtypes = map(r.dtypes);
        w->events.push_back(r);
      });
      w->memory.reserve(w->memory.size() + b->memory.size());
      b->memory.for_each([&](const MemRec& m) { w->memory.push_back(m); });
    }
  }
  w->strings = table.release();
  std::sort(w->events.begin(), w->events.end(), [](const Rec& a, const Rec& b) {
    if (a.thread != b.thread) return a.thread < b.thread;
    if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
    return a.depth < b.depth;
  });
  std::stable_sort(w->memory.begin(), w->memory.end(),
                   [](const MemRec& a, const MemRec& b) { return a.time_ns < b.time_ns; });
  w->base_live = window_base;
  w->base_total = window_base_total;
  w->origin_ns = start_ns;
  w->begin_ns = window_begin_ns;
  w->end_ns = end_ns;
  w->profile_memory = opts.profile_memory;
  if (opts.profile_memory && memory::recording_history()) {
    const memory::Snapshot snap = memory::peak_snapshot(10);
    for (const auto& site : snap.sites) w->live_at_peak.push_back(format_site(site));
  }
  return w;
}

std::shared_ptr<const Window> State::current() {
  std::lock_guard<std::mutex> lock(mu);
  if (kept) return kept;
  if (!opts.use_schedule && started) return collect(record::now_ns());
  auto w = std::make_shared<Window>();
  w->origin_ns = start_ns;
  return w;
}

bool State::transit(Action prev, Action cur) {
  bool saved = false;
  if (prev == Action::RecordAndSave) {
    kept = collect(record::now_ns());
    saved = true;
  }
  if (cur == Action::None) {
    unlisten();
    clear_buffers();
    return saved;
  }
  listen();
  const bool record_cur = cur == Action::Record || cur == Action::RecordAndSave;
  // A window (re)starts on entering warmup, and on entering the active steps
  // from anything but an active step: warmup's events are dropped here.
  if ((cur == Action::Warmup && prev != Action::Warmup) || (record_cur && prev != Action::Record)) begin_window();
  return saved;
}

bool State::stop_locked() {
  if (!started) return false;
  step_scope.reset();
  bool saved = false;
  if (action == Action::Record || action == Action::RecordAndSave) {
    kept = collect(record::now_ns());
    saved = true;
  }
  unlisten();
  clear_buffers();
  started = false;
  action = Action::None;
  disable_recording();
  return saved;
}

void State::open_step_scope() {
  step_name = "ProfilerStep#" + std::to_string(step_num);
  step_scope.emplace(record::Kind::Step, step_name);
}

}  // namespace detail

using detail::Action;

double OpStats::gflops_per_s() const { return flops > 0 && total_ns > 0 ? flops / static_cast<double>(total_ns) : 0.0; }

Profiler::Profiler(Options options) {
  const Schedule& sc = options.schedule;
  if (options.use_schedule) {
    KILN_CHECK(sc.skip_first >= 0 && sc.wait >= 0 && sc.warmup >= 0 && sc.repeat >= 0, ValueError,
               "profiler::Schedule: expected skip_first, wait, warmup and repeat >= 0, got skip_first=", sc.skip_first,
               " wait=", sc.wait, " warmup=", sc.warmup, " repeat=", sc.repeat);
    KILN_CHECK(sc.active >= 1, ValueError, "profiler::Schedule: expected active >= 1, got ", sc.active);
  }
  KILN_CHECK(options.rank >= 0, ValueError, "profiler::Options: expected rank >= 0, got ", options.rank);
  s_ = std::make_unique<State>(std::move(options));
}

// Saves an open window but does not call on_trace_ready: a destructor may run
// while an exception unwinds, and user code must not run then.
Profiler::~Profiler() {
  try {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop_locked();
  } catch (...) {  // a destructor must not throw: the window is simply not saved
  }
}

void Profiler::start() {
  std::lock_guard<std::mutex> lock(s_->mu);
  KILN_CHECK(!s_->started, ValueError, "Profiler::start: the profiler is already started (call stop() first)");
  s_->started = true;
  s_->start_ns = record::now_ns();
  s_->step_num = 0;
  s_->kept.reset();
  s_->has_clock_sync = false;
  s_->step_thread = record::thread_index();
  detail::enable_recording();
  s_->action = s_->action_at(0);
  s_->transit(Action::None, s_->action);
  s_->open_step_scope();
}

void Profiler::stop() {
  bool saved = false;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->started) {
      const uint32_t thread = record::thread_index();
      KILN_CHECK(thread == s_->step_thread, ValueError,
                 "Profiler::stop: expected the thread that called start() (record thread ", s_->step_thread,
                 "), got thread ", thread, ": the step scope lives on that thread's scope stack");
    }
    saved = s_->stop_locked();
  }
  if (saved && s_->opts.on_trace_ready) s_->opts.on_trace_ready(*this);
}

void Profiler::step() {
  bool saved = false;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (!s_->started) return;
    const uint32_t thread = record::thread_index();
    KILN_CHECK(thread == s_->step_thread, ValueError,
               "Profiler::step: expected the thread that called start() (record thread ", s_->step_thread,
               "), got thread ", thread, ": the step scope lives on that thread's scope stack");
    s_->step_scope.reset();  // closes ProfilerStep#N while its window still listens
    const Action prev = s_->action;
    s_->step_num += 1;
    s_->action = s_->action_at(s_->step_num);
    saved = s_->transit(prev, s_->action);
    s_->open_step_scope();
  }
  if (saved && s_->opts.on_trace_ready) s_->opts.on_trace_ready(*this);
}

bool Profiler::recording() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->started && s_->action != Action::None;
}

int64_t Profiler::step_num() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->step_num;
}

size_t Profiler::num_events() const { return s_->current()->events.size(); }

void Profiler::mark_clock_sync() {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->clock_sync_ns = record::now_ns();
  s_->has_clock_sync = true;
}

Range::Range(std::string name) : name_(std::move(name)), scope_(record::Kind::User, name_) {}
Range::~Range() = default;

}  // namespace kiln::profiler
