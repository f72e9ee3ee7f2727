// The Chrome trace (Trace Event Format) and merge_traces (issue 17): the
// format's rules checked here on the parsed JSON and again by an independent
// parser, tests/profiler/validate_trace.py, which must accept every trace.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "kiln/kiln.h"
#include "profiler_util.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::read_json;
using kiln::test::spin;
using kiln::test::timed_scope;
using kiln::test::write_text;
using record::Kind;
using nlohmann::json;

namespace {

// Runs the Python validator on `path`; its output goes into the failure message.
void expect_valid(const std::string& path, const std::string& extra = "") {
  const std::string& problem = test::python_problem(false);
  ASSERT_TRUE(problem.empty()) << problem;
  std::string out;
  const int rc = test::run_command(std::string(test::kPython) + " " + KILN_SOURCE_DIR +
                                       "/tests/profiler/validate_trace.py " + path + " " + extra,
                                   out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("validate_trace: ok"), std::string::npos) << out;
}

// One training-like step: forward ops with sequence numbers, their backward
// nodes, a collective with its wait, a user range; on two threads.
void record_workload(profiler::Profiler& prof, int steps) {
  for (int s = 0; s < steps; ++s) {
    {
      profiler::Range fwd("forward");
      for (int64_t seq = 0; seq < 3; ++seq) {
        record::Scope op(Kind::Op, "mm");
        op.set_seq(100 * s + seq);
        op.set_flops(1e6);
        {
          record::Scope inner(Kind::Op, "empty");
          spin(3000);
        }
        spin(5000);
      }
    }
    std::thread loader([] {
      record::set_thread_name("loader worker 0");
      record::Scope load(Kind::DataLoad, "batch");
      load.set_bytes(4096);
      spin(20000);
    });
    {
      profiler::Range bwd("backward");
      for (int64_t seq = 2; seq >= 0; --seq) {
        record::Scope node(Kind::Backward, "MmBackward0");
        node.set_seq(100 * s + seq);
        spin(6000);
        if (seq == 1) {
          record::Scope coll(Kind::Collective, "all_reduce");
          coll.set_bytes(1 << 20);
          coll.set_detail("world");
          timed_scope(Kind::CollectiveWait, "all_reduce.wait", 4000);
        }
      }
    }
    loader.join();
    { Tensor t = zeros({64, 64}); }
    prof.step();
  }
}

}  // namespace

TEST(ProfilerTrace, TraceEventFormat) {
  test::TempDir dir;
  profiler::Options o;
  o.rank = 3;
  profiler::Profiler prof(o);
  prof.start();
  record_workload(prof, 2);
  prof.stop();
  const std::string path = dir.file("trace.json");
  prof.export_chrome_trace(path);
  const json j = read_json(path);

  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  EXPECT_EQ(j["kiln"]["rank"], 3);
  EXPECT_TRUE(j["kiln"]["clock_sync_ns"].is_null());
  const json& evs = j["traceEvents"];
  ASSERT_TRUE(evs.is_array());
  std::map<std::pair<int64_t, int64_t>, double> last_begin;
  std::map<int64_t, std::string> thread_names;
  std::map<int64_t, json> flows_s, flows_f;
  std::set<std::string> counter_keys;
  std::vector<json> xs;
  bool process_named = false;
  for (const json& e : evs) {
    ASSERT_TRUE(e.contains("ph") && e.contains("ts") && e.contains("pid") && e.contains("tid")) << e.dump();
    EXPECT_EQ(e["pid"], 3);
    const std::string ph = e["ph"];
    if (ph == "X") {
      ASSERT_GE(e["dur"].get<double>(), 0.0);
      const auto key = std::make_pair(e["pid"].get<int64_t>(), e["tid"].get<int64_t>());
      const double ts = e["ts"];
      if (last_begin.count(key)) {
        EXPECT_GE(ts, last_begin[key]) << e.dump();
      }
      last_begin[key] = ts;
      xs.push_back(e);
    } else if (ph == "M") {
      if (e["name"] == "thread_name") thread_names[e["tid"].get<int64_t>()] = e["args"]["name"];
      if (e["name"] == "process_name") process_named = e["args"]["name"] == "rank 3";
    } else if (ph == "s") {
      flows_s[e["id"].get<int64_t>()] = e;
    } else if (ph == "f") {
      EXPECT_EQ(e["bp"], "e");
      flows_f[e["id"].get<int64_t>()] = e;
    } else if (ph == "C") {
      for (auto it = e["args"].begin(); it != e["args"].end(); ++it) counter_keys.insert(it.key());
    }
  }
  EXPECT_TRUE(process_named);
  for (const auto& [key, ts] : last_begin) EXPECT_TRUE(thread_names.count(key.second)) << "tid " << key.second;
  // Every flow starts at a forward mm and finishes at the MmBackward0 with its seq.
  ASSERT_EQ(flows_s.size(), 6u);
  ASSERT_EQ(flows_f.size(), 6u);
  auto slice_at = [&](const json& flow, const char* name) -> const json* {
    for (const json& x : xs) {
      if (x["tid"] == flow["tid"] && x["name"] == name && x["ts"] == flow["ts"]) return &x;
    }
    return nullptr;
  };
  for (const auto& [id, s] : flows_s) {
    ASSERT_TRUE(flows_f.count(id));
    const json* fwd = slice_at(s, "mm");
    const json* bwd = slice_at(flows_f[id], "MmBackward0");
    ASSERT_TRUE(fwd && bwd) << s.dump() << flows_f[id].dump();
    EXPECT_EQ((*fwd)["args"]["seq"], (*bwd)["args"]["seq"]);
  }
  // Collectives on their own track, named; the loader on its own thread.
  bool coll_seen = false, loader_seen = false;
  for (const json& x : xs) {
    if (x["name"] == "all_reduce" || x["name"] == "all_reduce.wait") {
      coll_seen = true;
      EXPECT_NE(thread_names[x["tid"].get<int64_t>()].find("collectives"), std::string::npos);
      if (x["name"] == "all_reduce") {
        EXPECT_EQ(x["args"]["bytes"], 1 << 20);
        EXPECT_EQ(x["args"]["group"], "world");
      }
    }
    if (x["name"] == "batch") {
      loader_seen = true;
      EXPECT_EQ(thread_names[x["tid"].get<int64_t>()], "loader worker 0");
    }
    if (x["name"] == "mm") {
      EXPECT_DOUBLE_EQ(x["args"]["flops"].get<double>(), 1e6);
    }
  }
  EXPECT_TRUE(coll_seen);
  EXPECT_TRUE(loader_seen);
  for (const char* c : {"parameter", "activation", "gradient"}) EXPECT_TRUE(counter_keys.count(c)) << c;
  expect_valid(path, "--expect-flows 6 --expect-pids 1");
}

TEST(ProfilerTrace, HostileNamesStayValidJson) {
  test::TempDir dir;
  profiler::Profiler prof;
  prof.start();
  {
    profiler::Range a(std::string("quote\" backslash\\ newline\n tab\t ctrl\x01 bad utf8 \xff\xfe end"));
    profiler::Range b("ünïcødé ✓");
  }
  prof.stop();
  const std::string path = dir.file("hostile.json");
  prof.export_chrome_trace(path);
  const json j = read_json(path);  // throws on invalid JSON or UTF-8
  bool seen = false;
  for (const json& e : j["traceEvents"]) seen = seen || e["name"] == "ünïcødé ✓";
  EXPECT_TRUE(seen);
  expect_valid(path);
}

TEST(ProfilerTrace, EmptyProfileIsValid) {
  test::TempDir dir;
  profiler::Options o;
  o.profile_memory = false;
  profiler::Profiler prof(o);
  const std::string path = dir.file("empty.json");
  prof.export_chrome_trace(path);  // never started: an empty, valid trace
  EXPECT_EQ(prof.num_events(), 0u);
  expect_valid(path);
}

TEST(ProfilerTrace, ValidatorRejectsBrokenTraces) {
  test::TempDir dir;
  const std::string& problem = test::python_problem(false);
  ASSERT_TRUE(problem.empty()) << problem;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"truncated", R"({"traceEvents":[{"ph":"X","ts":1,)"},
      {"no_tid", R"({"traceEvents":[{"ph":"X","name":"a","ts":1,"dur":1,"pid":0}]})"},
      {"negative_dur",
       R"({"traceEvents":[{"ph":"M","name":"thread_name","ts":0,"pid":0,"tid":0,"args":{"name":"t"}},)"
       R"({"ph":"M","name":"process_name","ts":0,"pid":0,"tid":0,"args":{"name":"p"}},)"
       R"({"ph":"X","name":"a","ts":1,"dur":-1,"pid":0,"tid":0}]})"},
      {"dangling_flow",
       R"({"traceEvents":[{"ph":"M","name":"thread_name","ts":0,"pid":0,"tid":0,"args":{"name":"t"}},)"
       R"({"ph":"M","name":"process_name","ts":0,"pid":0,"tid":0,"args":{"name":"p"}},)"
       R"({"ph":"X","name":"a","ts":1,"dur":1,"pid":0,"tid":0},{"ph":"s","name":"f","id":1,"ts":1,"pid":0,"tid":0}]})"},
  };
  for (const auto& [name, text] : bad) {
    const std::string path = dir.file(name + ".json");
    write_text(path, text);
    std::string out;
    const int rc = test::run_command(std::string(test::kPython) + " " + KILN_SOURCE_DIR +
                                         "/tests/profiler/validate_trace.py " + path,
                                     out);
    EXPECT_NE(rc, 0) << name << ": " << out;
  }
}

namespace {

json synthetic_trace(int rank, int64_t start_ns, std::optional<int64_t> sync_ns, double event_ts_us) {
  json j;
  j["traceEvents"] = json::array(
      {{{"ph", "M"}, {"name", "process_name"}, {"ts", 0}, {"pid", rank}, {"tid", 0},
        {"args", {{"name", "rank " + std::to_string(rank)}}}},
       {{"ph", "M"}, {"name", "thread_name"}, {"ts", 0}, {"pid", rank}, {"tid", 0}, {"args", {{"name", "main"}}}},
       {{"ph", "X"}, {"name", "barrier_done"}, {"ts", event_ts_us}, {"dur", 1.5}, {"pid", rank}, {"tid", 0},
        {"args", json::object()}},
       {{"ph", "X"}, {"name", "later"}, {"ts", event_ts_us + 10.25}, {"dur", 2.0}, {"pid", rank}, {"tid", 0},
        {"args", json::object()}},
       {{"ph", "s"}, {"name", "fwdbwd"}, {"cat", "fwdbwd"}, {"id", 1}, {"ts", event_ts_us}, {"pid", rank}, {"tid", 0}},
       {{"ph", "f"}, {"name", "fwdbwd"}, {"cat", "fwdbwd"}, {"bp", "e"}, {"id", 1}, {"ts", event_ts_us + 10.25},
        {"pid", rank}, {"tid", 0}}});
  j["displayTimeUnit"] = "ms";
  j["kiln"] = {{"version", 1}, {"rank", rank}, {"start_ns", start_ns}};
  j["kiln"]["clock_sync_ns"] = sync_ns ? json(*sync_ns) : json(nullptr);
  return j;
}

std::map<std::pair<int64_t, std::string>, double> begins(const json& j) {
  std::map<std::pair<int64_t, std::string>, double> out;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "X") out[{e["pid"].get<int64_t>(), e["name"].get<std::string>()}] = e["ts"];
  }
  return out;
}

}  // namespace

TEST(ProfilerMerge, AlignsClockSyncMarks) {
  test::TempDir dir;
  // Rank 0 reached the barrier 5 us after its start, rank 1 at 2 us after its own.
  write_text(dir.file("r0.json"), synthetic_trace(0, 1000000, 5000, 5.0).dump());
  write_text(dir.file("r1.json"), synthetic_trace(1, 9000000, 2000, 2.0).dump());
  profiler::merge_traces({dir.file("r0.json"), dir.file("r1.json")}, dir.file("merged.json"));
  const json m = read_json(dir.file("merged.json"));
  EXPECT_EQ(m["kiln"]["aligned_on"], "clock_sync");
  EXPECT_EQ(m["kiln"]["ranks"], (json{0, 1}));
  const auto b = begins(m);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_DOUBLE_EQ(b.at({0, "barrier_done"}), b.at({1, "barrier_done"}));
  EXPECT_DOUBLE_EQ(b.at({1, "later"}) - b.at({1, "barrier_done"}), 10.25);
  EXPECT_DOUBLE_EQ(b.at({0, "barrier_done"}), 5.0);  // rank 0's clock is the reference
  // The flows of the two ranks keep distinct ids.
  std::set<int64_t> ids;
  for (const json& e : m["traceEvents"]) {
    if (e["ph"] == "s") ids.insert(e["id"].get<int64_t>());
  }
  EXPECT_EQ(ids.size(), 2u);
  expect_valid(dir.file("merged.json"), "--expect-flows 2 --expect-pids 2");

  // Rank 1 recorded an event long before its mark: shifted, it would begin
  // before zero, so every event moves up by the same amount.
  json r1b = synthetic_trace(1, 0, 9000, 9.0);
  r1b["traceEvents"].push_back({{"ph", "X"}, {"name", "early"}, {"ts", 0.5}, {"dur", 1.0}, {"pid", 1}, {"tid", 0}});
  write_text(dir.file("r1b.json"), r1b.dump());
  profiler::merge_traces({dir.file("r0.json"), dir.file("r1b.json")}, dir.file("merged2.json"));
  const auto b2 = begins(read_json(dir.file("merged2.json")));
  EXPECT_DOUBLE_EQ(b2.at({0, "barrier_done"}), b2.at({1, "barrier_done"}));
  for (const auto& [k, ts] : b2) EXPECT_GE(ts, 0.0);
  EXPECT_DOUBLE_EQ(b2.at({1, "early"}), 0.0);  // 0.5 - 4 us, lifted by 3.5 us
  EXPECT_DOUBLE_EQ(b2.at({0, "barrier_done"}), 8.5);
}

TEST(ProfilerMerge, WithoutMarksUsesTheSteadyClock) {
  test::TempDir dir;
  write_text(dir.file("r0.json"), synthetic_trace(0, 1000000, std::nullopt, 5.0).dump());
  write_text(dir.file("r1.json"), synthetic_trace(1, 1003000, 2000, 2.0).dump());  // started 3 us later
  profiler::merge_traces({dir.file("r0.json"), dir.file("r1.json")}, dir.file("merged.json"));
  const json m = read_json(dir.file("merged.json"));
  EXPECT_EQ(m["kiln"]["aligned_on"], "start_clock");
  const auto b = begins(m);
  EXPECT_DOUBLE_EQ(b.at({1, "barrier_done"}) - b.at({0, "barrier_done"}), 3.0 + 2.0 - 5.0);
}

TEST(ProfilerMerge, RealRankTraces) {
  test::TempDir dir;
  std::vector<std::string> paths;
  for (int rank = 0; rank < 2; ++rank) {
    profiler::Options o;
    o.rank = rank;
    profiler::Profiler prof(o);
    prof.start();
    spin(1000000 + 30000000 * rank);  // the ranks reach the barrier 30 ms apart on their own clocks
    prof.mark_clock_sync();
    timed_scope(Kind::Collective, "all_reduce", 5000);
    prof.stop();
    paths.push_back(dir.file("rank" + std::to_string(rank) + ".json"));
    prof.export_chrome_trace(paths.back());
  }
  profiler::merge_traces(paths, dir.file("merged.json"));
  const auto b = begins(read_json(dir.file("merged.json")));
  // Both all_reduces began just after their rank's mark: aligned, they start
  // together (unaligned, 30 ms apart); the margin is for a loaded machine.
  EXPECT_NEAR(b.at({0, "all_reduce"}), b.at({1, "all_reduce"}), 3000.0);
  expect_valid(dir.file("merged.json"), "--expect-pids 2");
}

TEST(ProfilerMerge, HostileInputIsAValueError) {
  test::TempDir dir;
  write_text(dir.file("good.json"), synthetic_trace(0, 0, 0, 1.0).dump());
  json no_kiln = synthetic_trace(1, 0, 0, 1.0);
  no_kiln.erase("kiln");
  json rank_string = synthetic_trace(1, 0, 0, 1.0);
  rank_string["kiln"]["rank"] = "1";
  json bad_event = synthetic_trace(1, 0, 0, 1.0);
  bad_event["traceEvents"].push_back(42);
  json bad_ts = synthetic_trace(1, 0, 0, 1.0);
  bad_ts["traceEvents"][2]["ts"] = "soon";
  json huge_ts = synthetic_trace(1, 0, 0, 1.0);
  huge_ts["traceEvents"][2]["ts"] = 1e300;
  json neg_dur = synthetic_trace(1, 0, 0, 1.0);
  neg_dur["traceEvents"][2]["dur"] = -3;
  json no_ph = synthetic_trace(1, 0, 0, 1.0);
  no_ph["traceEvents"][2].erase("ph");
  const std::string good = synthetic_trace(1, 0, 0, 1.0).dump();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not_json", "this is not a trace"},
      {"truncated", good.substr(0, good.size() / 2)},
      {"array", "[1, 2, 3]"},
      {"empty", ""},
      {"binary", std::string("\x00\xff\xfe", 3) + "{\"traceEvents\":[]}"},
      {"no_kiln", no_kiln.dump()},
      {"rank_string", rank_string.dump()},
      {"bad_event", bad_event.dump()},
      {"bad_ts", bad_ts.dump()},
      {"huge_ts", huge_ts.dump()},
      {"neg_dur", neg_dur.dump()},
      {"no_ph", no_ph.dump()},
      {"same_rank", synthetic_trace(0, 0, 0, 1.0).dump()},
  };
  for (const auto& [name, text] : cases) {
    const std::string path = dir.file(name + ".json");
    write_text(path, text);
    const std::string msg =
        test::error_message<ValueError>([&] { profiler::merge_traces({dir.file("good.json"), path}, dir.file("o.json")); });
    EXPECT_NE(msg.find(name == "same_rank" ? "again: expected one trace per rank" : "is not a kiln trace"),
              std::string::npos)
        << name << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << name << ": " << msg;
  }
  // A merged trace has no single rank: merging it again says so.
  profiler::merge_traces({dir.file("good.json")}, dir.file("merged.json"));
  EXPECT_NE(test::error_message<ValueError>([&] { profiler::merge_traces({dir.file("merged.json")}, dir.file("o.json")); })
                .find("a merged trace cannot be merged again"),
            std::string::npos);
  EXPECT_NE(test::error_message<ValueError>([&] { profiler::merge_traces({}, dir.file("o.json")); })
                .find("expected at least one input trace"),
            std::string::npos);
  EXPECT_NE(test::error_message<IOError>([&] { profiler::merge_traces({dir.file("missing.json")}, dir.file("o.json")); })
                .find("cannot open"),
            std::string::npos);
}
