// The profiler's collection, schedule and tables (issue 17): scopes opened
// directly with made-up names, so every expected figure is known; real
// tensors for the memory timeline.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <thread>

#include "kiln/kiln.h"
#include "profiler_util.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::find_row;
using kiln::test::spin;
using kiln::test::timed_scope;
using record::Kind;

namespace {

// Step numbers (from the ProfilerStep#N scopes) of the window the profiler keeps now.
std::vector<int64_t> kept_steps(const profiler::Profiler& p) {
  std::vector<int64_t> steps;
  for (const auto& b : p.step_breakdown()) steps.push_back(b.step);
  return steps;
}

}  // namespace

TEST(ProfilerSchedule, WaitWarmupActiveRepeat) {
  // torch.profiler.schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2):
  // step 0 skipped, then cycles [wait, warmup, active, active] over steps 1-4 and 5-8.
  std::vector<std::vector<int64_t>> windows;
  std::vector<int64_t> work_calls;
  profiler::Options o;
  o.use_schedule = true;
  o.schedule = {.skip_first = 1, .wait = 1, .warmup = 1, .active = 2, .repeat = 2};
  o.on_trace_ready = [&](profiler::Profiler& p) {
    windows.push_back(kept_steps(p));
    const auto* row = find_row(p.key_averages(), "work");
    work_calls.push_back(row ? row->calls : 0);
  };
  profiler::Profiler prof(o);
  std::vector<bool> recording;
  prof.start();
  for (int step = 0; step < 12; ++step) {
    recording.push_back(prof.recording());
    timed_scope(Kind::Op, "work", 1000);
    prof.step();
  }
  prof.stop();
  const std::vector<bool> want_recording = {false, false, true, true, true, false,
                                            true,  true,  true, false, false, false};
  EXPECT_EQ(recording, want_recording);  // warmup steps record too (and are dropped)
  ASSERT_EQ(windows.size(), 2u);
  EXPECT_EQ(windows[0], (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(windows[1], (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(work_calls, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(kept_steps(prof), (std::vector<int64_t>{7, 8}));  // the last window stays
  EXPECT_EQ(prof.step_num(), 12);
}

TEST(ProfilerSchedule, RepeatZeroCyclesUntilStopped) {
  int ready = 0;
  profiler::Options o;
  o.use_schedule = true;
  o.schedule = {.wait = 1, .warmup = 0, .active = 1, .repeat = 0};
  o.on_trace_ready = [&](profiler::Profiler& p) {
    ++ready;
    EXPECT_EQ(kept_steps(p).size(), 1u);
  };
  profiler::Profiler prof(o);
  prof.start();
  for (int step = 0; step < 10; ++step) prof.step();  // active on odd steps: windows end at 2, 4, ..., 10
  EXPECT_EQ(ready, 5);
  prof.stop();
  EXPECT_EQ(ready, 5);  // step 10 waits: nothing to save
  EXPECT_EQ(kept_steps(prof), (std::vector<int64_t>{9}));
}

TEST(ProfilerSchedule, StopInsideActiveWindowSavesIt) {
  int ready = 0;
  profiler::Options o;
  o.use_schedule = true;
  o.schedule = {.wait = 0, .warmup = 1, .active = 3};
  o.on_trace_ready = [&](profiler::Profiler&) { ++ready; };
  profiler::Profiler prof(o);
  prof.start();
  prof.step();  // 0 warmup -> 1 active
  prof.step();  // 2 active
  prof.stop();  // as torch: the partial window is saved and on_trace_ready fires
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(kept_steps(prof), (std::vector<int64_t>{1, 2}));
}

TEST(ProfilerSchedule, NoScheduleKeepsEverythingAndFiresAtStop) {
  int ready = 0;
  profiler::Options o;
  o.on_trace_ready = [&](profiler::Profiler&) { ++ready; };
  profiler::Profiler prof(o);
  prof.start();
  EXPECT_TRUE(prof.recording());
  for (int i = 0; i < 3; ++i) {
    timed_scope(Kind::Op, "work", 1000);
    prof.step();
  }
  EXPECT_EQ(find_row(prof.key_averages(), "work")->calls, 3);  // readable while running
  prof.stop();
  EXPECT_FALSE(prof.recording());
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(kept_steps(prof), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(find_row(prof.key_averages(), "work")->calls, 3);
  // Nothing is recorded once stopped.
  timed_scope(Kind::Op, "after", 1000);
  EXPECT_EQ(find_row(prof.key_averages(), "after"), nullptr);
  EXPECT_FALSE(record::active());
}

TEST(ProfilerSchedule, BadScheduleAndDoubleStart) {
  profiler::Options o;
  o.use_schedule = true;
  o.schedule.active = 0;
  EXPECT_NE(test::error_message<ValueError>([&] { profiler::Profiler p(o); }).find("expected active >= 1, got 0"),
            std::string::npos);
  o.schedule = {.wait = -1};
  EXPECT_NE(test::error_message<ValueError>([&] { profiler::Profiler p(o); }).find("wait=-1"), std::string::npos);
  profiler::Profiler p;
  p.start();
  EXPECT_NE(test::error_message<ValueError>([&] { p.start(); }).find("already started"), std::string::npos);
  p.stop();
  p.stop();  // a second stop is a no-op
}

TEST(ProfilerTable, SelfTotalCallsFlops) {
  profiler::Profiler prof;
  prof.start();
  for (int i = 0; i < 3; ++i) {
    record::Scope outer(Kind::Op, "outer_op");
    spin(500000);
    for (int j = 0; j < 2; ++j) {
      record::Scope inner(Kind::Op, "inner_mm");
      inner.set_flops(2e6);
      spin(100000);
    }
  }
  prof.stop();
  const auto rows = prof.key_averages();
  const auto* outer = find_row(rows, "outer_op");
  const auto* inner = find_row(rows, "inner_mm");
  ASSERT_TRUE(outer && inner);
  EXPECT_EQ(outer->calls, 3);
  EXPECT_EQ(inner->calls, 6);
  EXPECT_EQ(outer->kind, "op");
  EXPECT_EQ(outer->self_ns, outer->total_ns - inner->total_ns);  // children: the inner scopes, exactly
  EXPECT_EQ(inner->self_ns, inner->total_ns);
  EXPECT_GE(outer->self_ns, 3 * 500000);
  EXPECT_GE(inner->total_ns, 6 * 100000);
  EXPECT_DOUBLE_EQ(inner->flops, 12e6);
  EXPECT_DOUBLE_EQ(inner->gflops_per_s(), 12e6 / static_cast<double>(inner->total_ns));
  EXPECT_EQ(outer->gflops_per_s(), 0.0);
  EXPECT_EQ(find_row(rows, "ProfilerStep#0"), nullptr);  // steps are step_breakdown's, not op rows
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_GE(rows[i - 1].self_ns, rows[i].self_ns);  // by self time
  // Which of the two has more self time is up to the scheduler on a loaded machine: read it off.
  const bool outer_first = outer->self_ns >= inner->self_ns;
  const char* first = outer_first ? "outer_op" : "inner_mm";
  const char* second = outer_first ? "inner_mm" : "outer_op";

  const std::string t = prof.table();
  for (const char* want : {"Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "# of Calls",
                           "GFLOP/s", "outer_op", "inner_mm", "Self CPU time total:"}) {
    EXPECT_NE(t.find(want), std::string::npos) << want << " missing in\n" << t;
  }
  EXPECT_LT(t.find(first), t.find(second));
  const std::string by_calls = prof.table("calls");
  EXPECT_LT(by_calls.find("inner_mm"), by_calls.find("outer_op"));
  const std::string one = prof.table("self", 1);
  EXPECT_NE(one.find(first), std::string::npos);
  EXPECT_EQ(one.find(second), std::string::npos);
  EXPECT_NE(one.find("1 more rows not shown"), std::string::npos);
  EXPECT_NE(test::error_message<ValueError>([&] { (void)prof.table("cpu_time"); })
                .find("expected sort_by \"self\", \"total\", \"calls\" or \"flops\", got \"cpu_time\""),
            std::string::npos);

  const auto j = nlohmann::json::parse(prof.key_averages_json());
  ASSERT_TRUE(j["rows"].is_array());
  bool seen = false;
  for (const auto& r : j["rows"]) {
    if (r["name"] != "inner_mm") continue;
    seen = true;
    EXPECT_EQ(r["calls"], 6);
    EXPECT_DOUBLE_EQ(r["flops"].get<double>(), 12e6);
    EXPECT_NEAR(r["total_us"].get<double>(), inner->total_ns / 1e3, 1e-6);
    EXPECT_NEAR(r["gflops_per_s"].get<double>(), inner->gflops_per_s(), 1e-9);
  }
  EXPECT_TRUE(seen);
}

TEST(ProfilerTable, GroupByInputShape) {
  Tensor a = zeros({2, 3});
  Tensor b = zeros({4, 5}, TensorOptions().dtype(kFloat64));
  profiler::Profiler prof;
  prof.start();
  for (int i = 0; i < 2; ++i) {
    record::Scope s(Kind::Op, "shaped", {&a});
  }
  {
    record::Scope s(Kind::Op, "shaped", {&b, &a});
  }
  prof.stop();
  const auto flat = prof.key_averages();
  ASSERT_NE(find_row(flat, "shaped"), nullptr);
  EXPECT_EQ(find_row(flat, "shaped")->calls, 3);
  const auto grouped = prof.key_averages(true);
  const auto* r1 = find_row(grouped, "shaped", "[[2, 3]]");
  const auto* r2 = find_row(grouped, "shaped", "[[4, 5], [2, 3]]");
  ASSERT_TRUE(r1 && r2);
  EXPECT_EQ(r1->calls, 2);
  EXPECT_EQ(r2->calls, 1);
  EXPECT_NE(prof.table("self", 20, true).find("[[4, 5], [2, 3]]"), std::string::npos);
  // The dtypes go into the trace.
  const auto j = nlohmann::json::parse(prof.chrome_trace_json());
  bool seen = false;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X" && e["name"] == "shaped" && e["args"]["input_shapes"].size() == 2) {
      seen = true;
      EXPECT_EQ(e["args"]["input_dtypes"], (nlohmann::json{"float64", "float32"}));
      EXPECT_EQ(e["args"]["input_shapes"], (nlohmann::json{{4, 5}, {2, 3}}));
    }
  }
  EXPECT_TRUE(seen);
}

TEST(ProfilerTable, RecordShapesOff) {
  Tensor a = zeros({2, 3});
  profiler::Options o;
  o.record_shapes = false;
  profiler::Profiler prof(o);
  prof.start();
  { record::Scope s(Kind::Op, "shaped", {&a}); }
  prof.stop();
  EXPECT_NE(find_row(prof.key_averages(true), "shaped", ""), nullptr);
}

TEST(ProfilerStepBreakdown, CategoriesSumToTotal) {
  profiler::Options o;
  profiler::Profiler prof(o);
  prof.start();
  for (int step = 0; step < 2; ++step) {
    timed_scope(Kind::DataWait, "DataLoader.next", 300000);
    {
      profiler::Range fwd("forward");
      timed_scope(Kind::Op, "linear", 200000);
      spin(50000);
    }
    {
      record::Scope bwd(Kind::Backward, "MmBackward0");
      timed_scope(Kind::Op, "mm", 150000);  // an op inside a backward node is backward time
      {
        record::Scope coll(Kind::Collective, "all_reduce");
        timed_scope(Kind::CollectiveWait, "all_reduce.wait", 120000);
      }
    }
    {
      record::Scope opt(Kind::Optimizer, "SGD.step");
      timed_scope(Kind::Op, "add_", 80000);
    }
    timed_scope(Kind::User, "logging", 60000);  // no category: other
    prof.step();
  }
  prof.stop();
  const auto rows = prof.key_averages();
  const auto steps = prof.step_breakdown();
  ASSERT_EQ(steps.size(), 3u);  // ProfilerStep#2 is the (empty) one stop() closed
  auto total_ms = [&](const char* name) { return static_cast<double>(find_row(rows, name)->total_ns) / 1e6; };
  double data = 0, fwd = 0, bwd = 0, opt = 0, comm = 0, other = 0, total = 0;
  for (size_t i = 0; i < 2; ++i) {
    const auto& s = steps[i];
    EXPECT_EQ(s.step, static_cast<int64_t>(i));
    EXPECT_NEAR(s.data_ms + s.forward_ms + s.backward_ms + s.optimizer_ms + s.comm_exposed_ms + s.other_ms,
                s.total_ms, 1e-9);
    EXPECT_GE(s.data_ms, 0.3);
    EXPECT_GE(s.forward_ms, 0.25);
    EXPECT_GE(s.backward_ms, 0.15);
    EXPECT_GE(s.comm_exposed_ms, 0.12);
    EXPECT_GE(s.optimizer_ms, 0.08);
    EXPECT_GE(s.other_ms, 0.06);
    data += s.data_ms, fwd += s.forward_ms, bwd += s.backward_ms, opt += s.optimizer_ms;
    comm += s.comm_exposed_ms, other += s.other_ms, total += s.total_ms;
  }
  // Each category is exactly its scopes' time: nothing counted twice.
  EXPECT_NEAR(data, total_ms("DataLoader.next"), 1e-6);
  EXPECT_NEAR(fwd, total_ms("forward"), 1e-6);
  EXPECT_NEAR(bwd + comm, total_ms("MmBackward0"), 1e-6);
  EXPECT_NEAR(comm, total_ms("all_reduce.wait"), 1e-6);
  EXPECT_NEAR(opt, total_ms("SGD.step"), 1e-6);
  EXPECT_GE(other, total_ms("logging"));
  EXPECT_NEAR(total, data + fwd + bwd + opt + comm + other, 1e-6);
}

TEST(ProfilerMemory, PeaksEqualAllocatorPeaksAfterReset) {
  memory::reset_peak_stats();
  profiler::Profiler prof;
  prof.start();
  {
    MemoryCategoryGuard g(MemoryCategory::Parameter);
    Tensor w = zeros({256, 256});
    Tensor act1 = zeros({512, 512});
    {
      MemoryCategoryGuard og(MemoryCategory::OptimizerState);
      Tensor m = zeros({128, 128});
    }
    Tensor act2;
    {
      MemoryCategoryGuard ag(MemoryCategory::Activation);
      act2 = zeros({300, 300});
      Tensor tmp = ones({200, 200});
    }
    act1 = Tensor();
  }
  prof.stop();
  const memory::Stats st = memory::stats();
  const profiler::MemoryTimeline t = prof.memory_timeline();
  ASSERT_GT(t.points.size(), 8u);
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    EXPECT_EQ(t.peak[c], st.by_category[c].peak_bytes) << memory_category_name(static_cast<MemoryCategory>(c));
  }
  EXPECT_EQ(t.peak_total, st.peak_bytes);
  EXPECT_GT(t.peak[static_cast<int>(MemoryCategory::OptimizerState)], 0);
  for (size_t i = 1; i < t.points.size(); ++i) {
    EXPECT_LE(t.points[i - 1].time_ns, t.points[i].time_ns);
    int64_t sum = 0;
    for (int64_t v : t.points[i].live) sum += v;
    EXPECT_EQ(sum, t.points[i].total);
  }
  // Everything made in the window is freed again: the last point is the first.
  EXPECT_EQ(t.points.back().live, t.points.front().live);
  EXPECT_GE(t.peak_time_ns, t.points.front().time_ns);
  EXPECT_LE(t.peak_time_ns, t.points.back().time_ns);
}

TEST(ProfilerMemory, LiveAtPeakWithHistory) {
  memory::record_history(true);
  memory::reset_peak_snapshot();
  profiler::Profiler prof;
  prof.start();
  { Tensor big = zeros({1024, 1024}); }
  prof.stop();
  memory::record_history(false);
  const auto t = prof.memory_timeline();
  ASSERT_FALSE(t.live_at_peak.empty());
  EXPECT_NE(t.live_at_peak.front().find("test_profiler.cpp"), std::string::npos) << t.live_at_peak.front();
}

TEST(ProfilerMemory, OffMeansNoTimeline) {
  profiler::Options o;
  o.profile_memory = false;
  profiler::Profiler prof(o);
  prof.start();
  { Tensor x = zeros({64, 64}); }
  prof.stop();
  EXPECT_TRUE(prof.memory_timeline().points.empty());
}

TEST(ProfilerThreads, TwoThreadsTwoTracks) {
  profiler::Profiler prof;
  prof.start();
  auto work = [](const char* thread_name, const char* op) {
    record::set_thread_name(thread_name);
    for (int i = 0; i < 50; ++i) timed_scope(Kind::Op, op, 2000);
  };
  std::thread t1(work, "worker one", "op_one");
  std::thread t2(work, "worker two", "op_two");
  t1.join();
  t2.join();
  prof.stop();
  const auto rows = prof.key_averages();
  EXPECT_EQ(find_row(rows, "op_one")->calls, 50);
  EXPECT_EQ(find_row(rows, "op_two")->calls, 50);
  const auto j = nlohmann::json::parse(prof.chrome_trace_json());
  std::set<int64_t> tid_one, tid_two;
  std::map<int64_t, std::string> names;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X" && e["name"] == "op_one") tid_one.insert(e["tid"].get<int64_t>());
    if (e["ph"] == "X" && e["name"] == "op_two") tid_two.insert(e["tid"].get<int64_t>());
    if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"].get<int64_t>()] = e["args"]["name"].get<std::string>();
  }
  ASSERT_EQ(tid_one.size(), 1u);
  ASSERT_EQ(tid_two.size(), 1u);
  EXPECT_NE(*tid_one.begin(), *tid_two.begin());
  EXPECT_EQ(names[*tid_one.begin()], "worker one");
  EXPECT_EQ(names[*tid_two.begin()], "worker two");
}

TEST(ProfilerThreads, StepOnAnotherThreadIsAnError) {
  profiler::Profiler prof;
  prof.start();
  std::string msg;
  std::thread t([&] { msg = test::error_message<ValueError>([&] { prof.step(); }); });
  t.join();
  EXPECT_NE(msg.find("expected the thread that called start()"), std::string::npos) << msg;
  prof.stop();
}

TEST(ProfilerRange, UserRangesNest) {
  profiler::Profiler prof;
  prof.start();
  {
    profiler::Range r("attention");
    std::string name = "head_";
    name += "0";
    profiler::Range inner(name);  // a name the caller builds: copied by the range and the profiler
    spin(1000);
  }
  prof.stop();
  const auto rows = prof.key_averages();
  ASSERT_NE(find_row(rows, "attention"), nullptr);
  ASSERT_NE(find_row(rows, "head_0"), nullptr);
  EXPECT_EQ(find_row(rows, "attention")->kind, "user");
  EXPECT_EQ(find_row(rows, "attention")->self_ns,
            find_row(rows, "attention")->total_ns - find_row(rows, "head_0")->total_ns);
}

TEST(ProfilerMemory, BytesAllocatedAndFreedPerRow) {
  profiler::Profiler prof;
  prof.start();
  {
    profiler::Range r("makes_and_drops");
    Tensor t = zeros({256, 256});
    {
      profiler::Range inner("inner_alloc");
      Tensor u = zeros({64, 64});  // allocated and freed while "inner_alloc" is innermost
    }
  }
  prof.stop();
  const auto rows = prof.key_averages();
  const auto* outer = find_row(rows, "makes_and_drops");
  const auto* inner = find_row(rows, "inner_alloc");
  const auto* made = find_row(rows, "zeros");
  ASSERT_TRUE(outer && inner && made);
  const auto big = static_cast<int64_t>(memory::rounded_size(256 * 256 * 4));
  const auto small = static_cast<int64_t>(memory::rounded_size(64 * 64 * 4));
  // Self, not total: an allocation is charged to the innermost open scope (the
  // op `zeros` that made it), a free to whatever is innermost when the last
  // reference goes (the user ranges here).
  EXPECT_EQ(made->alloc_bytes, big + small);
  EXPECT_EQ(inner->alloc_bytes, 0);
  EXPECT_EQ(inner->freed_bytes, small);
  EXPECT_EQ(outer->alloc_bytes, 0);
  EXPECT_EQ(outer->freed_bytes, big);  // t, declared after the range, dies before it closes
  EXPECT_NE(prof.table().find("256.00 KiB"), std::string::npos) << prof.table();
}

TEST(ProfilerThreads, ProfilersComeAndGoWhileThreadsRecord) {
  // Note [Callbacks in flight] (src/profiler/profiler.cpp): a profiler may be
  // destroyed while other threads are inside its callbacks; it waits for them.
  // Under the sanitizers this is the use-after-free check.
  std::atomic<bool> done{false};
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&] {
      while (!done.load()) {
        record::Scope s(Kind::DataLoad, "load");
        void* p = memory::allocate(256, MemoryCategory::Data);
        memory::deallocate(p, 256, MemoryCategory::Data);
      }
    });
  }
  size_t recorded = 0;
  for (int i = 0; i < 20; ++i) {
    profiler::Profiler prof;
    prof.start();
    spin(200000);
    prof.stop();
    recorded += prof.num_events();
  }
  done = true;
  for (auto& t : workers) t.join();
  EXPECT_GT(recorded, 0u);
  EXPECT_FALSE(record::active());
}
