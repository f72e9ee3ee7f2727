// The record hook (include/kiln/core/record.h): scopes nest with parent ids and
// depths, callbacks get complete events with children before parents, nothing
// is recorded unless recording is enabled and a listener is registered,
// listeners come and go, allocations are charged to the innermost open scope,
// and each thread has its own index and scope stack.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/core/record.h"
#include "kiln/kiln.h"

using namespace kiln;

namespace {

// What a test keeps of an Event: copies, since the event's views die with the callback.
struct Seen {
  record::Kind kind = record::Kind::Op;
  std::string name, detail;
  std::vector<std::vector<int64_t>> input_shapes;
  int64_t start_ns = 0, end_ns = 0, seq = -1, bytes = 0, alloc_bytes = 0, freed_bytes = 0;
  double flops = 0;
  uint32_t thread = 0, depth = 0;
  uint64_t id = 0, parent = 0;
};

// A listener that keeps every event (and, when asked, memory event) it is given.
class Collector {
 public:
  explicit Collector(bool memory = false, bool enable = true) {
    handle_ = record::add_callbacks(&on_event, memory ? &on_memory : nullptr, this);
    if (enable) record::set_enabled(true);
  }
  ~Collector() {
    record::set_enabled(false);
    record::remove_callbacks(handle_);
  }
  Collector(const Collector&) = delete;
  Collector& operator=(const Collector&) = delete;

  std::vector<Seen> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  std::vector<record::MemoryEvent> memory() {
    std::lock_guard<std::mutex> lock(mu_);
    return memory_;
  }
  // The events named `name` (of kind User unless said otherwise).
  std::vector<Seen> named(const std::string& name) {
    std::vector<Seen> out;
    for (const Seen& e : events())
      if (e.name == name) out.push_back(e);
    return out;
  }
  int handle() const { return handle_; }

 private:
  static void on_event(const record::Event& ev, void* user) {
    auto* self = static_cast<Collector*>(user);
    Seen s;
    s.kind = ev.kind;
    s.name = std::string(ev.name);
    s.detail = std::string(ev.detail);
    s.start_ns = ev.start_ns;
    s.end_ns = ev.end_ns;
    s.seq = ev.seq;
    s.bytes = ev.bytes;
    s.alloc_bytes = ev.alloc_bytes;
    s.freed_bytes = ev.freed_bytes;
    s.flops = ev.flops;
    s.thread = ev.thread;
    s.depth = ev.depth;
    s.id = ev.id;
    s.parent = ev.parent;
    for (int i = 0; i < ev.num_inputs; ++i) {
      const IntArrayRef sz = ev.inputs[i]->sizes();
      s.input_shapes.emplace_back(sz.begin(), sz.end());
    }
    std::lock_guard<std::mutex> lock(self->mu_);
    self->events_.push_back(std::move(s));
  }
  static void on_memory(const record::MemoryEvent& m, void* user) {
    auto* self = static_cast<Collector*>(user);
    std::lock_guard<std::mutex> lock(self->mu_);
    self->memory_.push_back(m);
  }

  int handle_ = -1;
  std::mutex mu_;
  std::vector<Seen> events_;
  std::vector<record::MemoryEvent> memory_;
};

}  // namespace

TEST(Record, ScopesNestWithParentsAndDepthsAndChildrenCloseFirst) {
  Collector c;
  {
    record::Scope a(record::Kind::User, "a");
    {
      record::Scope b(record::Kind::User, "b");
      record::Scope x(record::Kind::User, "c");
    }
    record::Scope d(record::Kind::User, "d");
  }
  const std::vector<Seen> ev = c.events();
  ASSERT_EQ(ev.size(), 4u);
  // Callbacks run as scopes close: children before their parents.
  EXPECT_EQ(ev[0].name, "c");
  EXPECT_EQ(ev[1].name, "b");
  EXPECT_EQ(ev[2].name, "d");
  EXPECT_EQ(ev[3].name, "a");
  const Seen &c_ = ev[0], &b = ev[1], &d = ev[2], &a = ev[3];
  EXPECT_EQ(a.depth, 0u);
  EXPECT_EQ(b.depth, 1u);
  EXPECT_EQ(c_.depth, 2u);
  EXPECT_EQ(d.depth, 1u);
  EXPECT_EQ(a.parent, 0u);
  EXPECT_EQ(b.parent, a.id);
  EXPECT_EQ(c_.parent, b.id);
  EXPECT_EQ(d.parent, a.id);
  std::vector<uint64_t> ids{a.id, b.id, c_.id, d.id};
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end()) << "event ids must be unique";
  // Children lie inside their parents' spans.
  EXPECT_LE(a.start_ns, b.start_ns);
  EXPECT_LE(b.start_ns, c_.start_ns);
  EXPECT_LE(c_.end_ns, b.end_ns);
  EXPECT_LE(b.end_ns, d.start_ns);
  EXPECT_LE(d.end_ns, a.end_ns);
  // A scope opened after the others closed is a root again, at depth 0.
  { record::Scope e(record::Kind::User, "e"); }
  const std::vector<Seen> after = c.named("e");
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].depth, 0u);
  EXPECT_EQ(after[0].parent, 0u);
}

TEST(Record, CallbacksSeeCompleteEvents) {
  Collector c;
  const Tensor x = zeros({2, 3}), y = zeros({4});
  const Tensor undefined;
  {
    record::Scope s(record::Kind::Collective, "all_reduce", {&x, nullptr, &undefined, &y});
    EXPECT_TRUE(s.recording());
    s.set_flops(12.5);
    s.set_bytes(4096);
    s.set_seq(7);
    s.set_detail("group 0");
  }
  const std::vector<Seen> ev = c.named("all_reduce");
  ASSERT_EQ(ev.size(), 1u);
  const Seen& e = ev[0];
  EXPECT_EQ(e.kind, record::Kind::Collective);
  EXPECT_EQ(e.detail, "group 0");
  EXPECT_EQ(e.flops, 12.5);
  EXPECT_EQ(e.bytes, 4096);
  EXPECT_EQ(e.seq, 7);
  EXPECT_GE(e.end_ns, e.start_ns);
  EXPECT_GT(e.start_ns, 0);
  EXPECT_EQ(e.thread, record::thread_index());
  // A null pointer (a Scalar operand) and an undefined tensor (no bias) are not inputs.
  ASSERT_EQ(e.input_shapes.size(), 2u);
  EXPECT_EQ(e.input_shapes[0], (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(e.input_shapes[1], (std::vector<int64_t>{4}));
  EXPECT_STREQ(record::kind_name(record::Kind::Collective), "collective");
  EXPECT_STREQ(record::kind_name(record::Kind::Backward), "backward");
}

TEST(Record, InputsBeyondTheLimitAreDropped) {
  Collector c;
  const Tensor t[5] = {zeros({1}), zeros({2}), zeros({3}), zeros({4}), zeros({5})};
  { record::Scope s(record::Kind::Op, "five", {&t[0], &t[1], &t[2], &t[3], &t[4]}); }
  const std::vector<Seen> ev = c.named("five");
  ASSERT_EQ(ev.size(), 1u);
  ASSERT_EQ(ev[0].input_shapes.size(), static_cast<size_t>(record::kMaxInputs));
  EXPECT_EQ(ev[0].input_shapes[3], (std::vector<int64_t>{4}));
}

TEST(Record, NothingIsRecordedUnlessEnabledWithAListener) {
  EXPECT_FALSE(record::active());
  {
    // Enabled with nobody listening: still the fast path.
    record::set_enabled(true);
    EXPECT_FALSE(record::active());
    record::Scope s(record::Kind::User, "unheard");
    EXPECT_FALSE(s.recording());
    record::set_enabled(false);
  }
  Collector c(/*memory=*/true, /*enable=*/false);
  EXPECT_FALSE(record::active());
  {
    record::Scope s(record::Kind::User, "disabled");
    EXPECT_FALSE(s.recording());
    s.set_flops(1);  // no-ops on a scope that is not recording
    s.set_seq(1);
    record::note_sequence(3);
    void* p = memory::allocate(1000, MemoryCategory::Activation);
    memory::deallocate(p, 1000, MemoryCategory::Activation);
  }
  EXPECT_TRUE(c.events().empty());
  EXPECT_TRUE(c.memory().empty());
  record::set_enabled(true);
  EXPECT_TRUE(record::active());
  { record::Scope s(record::Kind::User, "enabled"); }
  record::set_enabled(false);
  { record::Scope s(record::Kind::User, "disabled again"); }
  const std::vector<Seen> ev = c.events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].name, "enabled");
}

TEST(Record, ListenersAreAddedAndRemoved) {
  Collector first;
  int second_calls = 0;
  const int h = record::add_callbacks([](const record::Event&, void* n) { ++*static_cast<int*>(n); }, nullptr,
                                      &second_calls);
  { record::Scope s(record::Kind::User, "both"); }
  EXPECT_EQ(second_calls, 1);
  EXPECT_EQ(first.named("both").size(), 1u);
  record::remove_callbacks(h);
  record::remove_callbacks(h);  // twice, or an unknown handle: ignored
  record::remove_callbacks(-1);
  { record::Scope s(record::Kind::User, "first only"); }
  EXPECT_EQ(second_calls, 1);
  EXPECT_EQ(first.named("first only").size(), 1u);
  // Removing the last listener stops recording although it stays enabled.
  record::remove_callbacks(first.handle());
  EXPECT_FALSE(record::active());
  // The slots are limited: a leak of listeners is reported, not ignored.
  std::vector<int> handles;
  std::string message;
  try {
    for (int i = 0; i < 64; ++i) handles.push_back(record::add_callbacks(nullptr, nullptr, nullptr));
  } catch (const ValueError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("listener slots are taken"), std::string::npos) << message;
  EXPECT_LT(handles.size(), 64u);
  for (int hh : handles) record::remove_callbacks(hh);
}

TEST(Record, AllocationsAreChargedToTheInnermostScope) {
  Collector c(/*memory=*/true);
  const size_t big = memory::rounded_size(4000), small = memory::rounded_size(1000);
  {
    record::Scope outer(record::Kind::User, "outer");
    void* a = memory::allocate(4000, MemoryCategory::Activation);
    {
      record::Scope inner(record::Kind::User, "inner");
      void* b = memory::allocate(1000, MemoryCategory::Gradient);
      memory::deallocate(b, 1000, MemoryCategory::Gradient);
    }
    memory::deallocate(a, 4000, MemoryCategory::Activation);
  }
  const std::vector<Seen> outer = c.named("outer"), inner = c.named("inner");
  ASSERT_EQ(outer.size(), 1u);
  ASSERT_EQ(inner.size(), 1u);
  // Self bytes: the inner scope's allocation is not the outer one's.
  EXPECT_EQ(inner[0].alloc_bytes, static_cast<int64_t>(small));
  EXPECT_EQ(inner[0].freed_bytes, static_cast<int64_t>(small));
  EXPECT_EQ(outer[0].alloc_bytes, static_cast<int64_t>(big));
  EXPECT_EQ(outer[0].freed_bytes, static_cast<int64_t>(big));
  // The memory callback sees each allocation and free with its category, in order.
  std::vector<record::MemoryEvent> mine;
  for (const record::MemoryEvent& m : c.memory())
    if (m.thread == record::thread_index()) mine.push_back(m);
  ASSERT_EQ(mine.size(), 4u);
  EXPECT_EQ(mine[0].bytes, static_cast<int64_t>(big));
  EXPECT_EQ(mine[0].category, MemoryCategory::Activation);
  EXPECT_EQ(mine[1].bytes, static_cast<int64_t>(small));
  EXPECT_EQ(mine[1].category, MemoryCategory::Gradient);
  EXPECT_EQ(mine[2].bytes, -static_cast<int64_t>(small));
  EXPECT_EQ(mine[3].bytes, -static_cast<int64_t>(big));
  EXPECT_EQ(mine[1].total_live - mine[0].total_live, static_cast<int64_t>(small));
  for (size_t i = 1; i < mine.size(); ++i) EXPECT_GE(mine[i].time_ns, mine[i - 1].time_ns);
  EXPECT_FALSE(mine[0].recharge);
}

TEST(Record, EachThreadHasItsIndexAndStack) {
  Collector c;
  const uint32_t main_index = record::thread_index();
  uint32_t indices[2] = {0, 0};
  {
    record::Scope main_scope(record::Kind::User, "main");
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([i, &indices] {
        indices[i] = record::thread_index();
        record::Scope outer(record::Kind::DataLoad, i == 0 ? "worker 0" : "worker 1");
        record::Scope inner(record::Kind::User, "work");
      });
    }
    for (auto& t : threads) t.join();
  }
  EXPECT_NE(indices[0], main_index);
  EXPECT_NE(indices[1], main_index);
  EXPECT_NE(indices[0], indices[1]);
  EXPECT_EQ(record::thread_index(), main_index) << "a thread's index is stable";
  const std::vector<Seen> main_ev = c.named("main");
  ASSERT_EQ(main_ev.size(), 1u);
  for (int i = 0; i < 2; ++i) {
    const std::vector<Seen> w = c.named(i == 0 ? "worker 0" : "worker 1");
    ASSERT_EQ(w.size(), 1u);
    // A thread's scopes do not nest in another thread's.
    EXPECT_EQ(w[0].thread, indices[i]);
    EXPECT_EQ(w[0].depth, 0u);
    EXPECT_EQ(w[0].parent, 0u);
  }
  const std::vector<Seen> work = c.named("work");
  ASSERT_EQ(work.size(), 2u);
  for (const Seen& w : work) {
    EXPECT_EQ(w.depth, 1u);
    EXPECT_NE(w.thread, main_index);
  }
  record::set_thread_name("record test main");
  EXPECT_EQ(record::thread_name(main_index), "record test main");
}

TEST(Record, NoteSequenceGoesToTheInnermostOpScopeOnce) {
  Collector c;
  {
    record::Scope op(record::Kind::Op, "outer_op");
    {
      record::Scope inner(record::Kind::Op, "inner_op");
      {
        record::Scope user(record::Kind::User, "range");
        record::note_sequence(41);  // skips the User scope
      }
      record::note_sequence(99);  // the op already has its node's number
    }
    record::note_sequence(42);
  }
  EXPECT_EQ(c.named("inner_op").at(0).seq, 41);
  EXPECT_EQ(c.named("outer_op").at(0).seq, 42);
  EXPECT_EQ(c.named("range").at(0).seq, -1);
}
