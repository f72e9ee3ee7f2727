// The Chrome trace (Trace Event Format, JSON object form) of a profiler
// window, and merge_traces, which puts per-rank traces on one clock.
//
// Layout: pid = rank; a track (tid) per record thread; collectives and their
// waits of thread t on a track of their own, tid kCollectiveTid + t, so that
// communication shows beside the compute it overlaps; "X" complete events with
// ts/dur in microseconds (three decimals: nanoseconds, exactly); a flow arrow
// ("s" -> "f", bound to the enclosing slice) from each forward op to the
// backward node that shares its autograd sequence number; a "C" counter per
// memory category. Timestamps count from the profiler's start(). The "kiln"
// object carries the rank and the clock-sync mark merge_traces aligns on.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_map>

#include "collector.h"
#include "kiln/core/error.h"

namespace kiln::profiler {
namespace detail {

void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\t': out += "\\t"; break;
        case '\r': out += "\\r"; break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
          } else {
            out += static_cast<char>(c);
          }
      }
      ++i;
      continue;
    }
    // Multi-byte UTF-8: copied when well formed, else one '?' per bad byte.
    const int len = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size() && !(len == 2 && c < 0xc2);
    for (int k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
    if (ok && len == 3) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      ok = !(c == 0xe0 && c1 < 0xa0) && !(c == 0xed && c1 >= 0xa0);  // overlong, surrogates
    }
    if (ok && len == 4) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      ok = c <= 0xf4 && !(c == 0xf0 && c1 < 0x90) && !(c == 0xf4 && c1 >= 0x90);
    }
    if (ok) {
      out.append(s.substr(i, static_cast<size_t>(len)));
      i += static_cast<size_t>(len);
    } else {
      out += '?';
      ++i;
    }
  }
  out += '"';
}

void append_us(std::string& out, int64_t ns) {
  char buf[40];
  const char* sign = ns < 0 ? "-" : "";
  const uint64_t a = ns < 0 ? static_cast<uint64_t>(-(ns + 1)) + 1 : static_cast<uint64_t>(ns);
  std::snprintf(buf, sizeof buf, "%s%llu.%03llu", sign, static_cast<unsigned long long>(a / 1000),
                static_cast<unsigned long long>(a % 1000));
  out += buf;
}

}  // namespace detail

namespace {

using detail::append_json_string;
using detail::append_us;
using detail::Rec;
using detail::Window;

constexpr uint32_t kCollectiveTid = 1000000;

bool on_collective_track(record::Kind k) { return k == record::Kind::Collective || k == record::Kind::CollectiveWait; }

void append_num(std::string& out, int64_t v) { out += std::to_string(v); }

void append_double(std::string& out, double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", std::isfinite(v) ? v : 0.0);
  out += buf;
}

// The fields every event shares: "ph", "ts", "pid", "tid" (and "name").
void open_event(std::string& out, const char* ph, std::string_view name, int64_t ts_ns, int pid, uint32_t tid) {
  out += "{\"ph\":\"";
  out += ph;
  out += "\",\"name\":";
  append_json_string(out, name);
  out += ",\"ts\":";
  append_us(out, ts_ns);
  out += ",\"pid\":";
  append_num(out, pid);
  out += ",\"tid\":";
  append_num(out, tid);
}

void metadata(std::string& out, const char* what, int pid, uint32_t tid, const char* key, const std::string& value) {
  open_event(out, "M", what, 0, pid, tid);
  out += ",\"args\":{\"";
  out += key;
  out += "\":";
  out += value;
  out += "}},\n";
}

std::string json_quoted(std::string_view s) {
  std::string q;
  append_json_string(q, s);
  return q;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw IOError("merge_traces: cannot open '" + path + "' for reading");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

std::string Profiler::chrome_trace_json() const {
  const auto wp = s_->current();
  const Window& w = *wp;
  int64_t clock_sync = 0;
  bool has_sync = false;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    clock_sync = s_->clock_sync_ns;
    has_sync = s_->has_clock_sync;
  }
  const int pid = s_->opts.rank;
  const std::string pname = s_->opts.process_name.empty() ? "rank " + std::to_string(pid) : s_->opts.process_name;
  const int64_t origin = w.origin_ns;

  std::string out;
  out.reserve(256 + w.events.size() * 200 + w.memory.size() * 160);
  out += "{\"traceEvents\":[\n";
  metadata(out, "process_name", pid, 0, "name", json_quoted(pname));
  metadata(out, "process_sort_index", pid, 0, "sort_index", std::to_string(pid));
  std::set<uint32_t> tids;
  for (const Rec& e : w.events) tids.insert(on_collective_track(e.kind) ? kCollectiveTid + e.thread : e.thread);
  if (tids.empty()) tids.insert(0);
  for (uint32_t tid : tids) {
    const bool coll = tid >= kCollectiveTid;
    const uint32_t thread = coll ? tid - kCollectiveTid : tid;
    const std::string tname = coll ? "collectives (" + record::thread_name(thread) + ")" : record::thread_name(thread);
    metadata(out, "thread_name", pid, tid, "name", json_quoted(tname));
    metadata(out, "thread_sort_index", pid, tid, "sort_index", std::to_string(tid));
  }

  // Complete events, per track in start order (they are sorted by thread, start, depth).
  for (const Rec& e : w.events) {
    const uint32_t tid = on_collective_track(e.kind) ? kCollectiveTid + e.thread : e.thread;
    open_event(out, "X", w.str(e.name), e.start_ns - origin, pid, tid);
    out += ",\"dur\":";
    append_us(out, e.dur());
    out += ",\"cat\":\"";
    out += record::kind_name(e.kind);
    out += "\",\"args\":{";
    bool first = true;
    auto key = [&](const char* k) {
      if (!first) out += ',';
      first = false;
      out += '"';
      out += k;
      out += "\":";
    };
    if (e.shapes != detail::kNoString) {
      key("input_shapes");
      out += w.str(e.shapes);  // formatted as JSON when recorded
      key("input_dtypes");
      out += w.str(e.dtypes);
    }
    if (e.detail != detail::kNoString) {
      key(e.kind == record::Kind::Collective || e.kind == record::Kind::CollectiveWait ? "group" : "detail");
      append_json_string(out, w.str(e.detail));
    }
    if (e.seq >= 0) {
      key("seq");
      append_num(out, e.seq);
    }
    if (e.flops > 0) {
      key("flops");
      append_double(out, e.flops);
    }
    if (e.bytes != 0) {
      key("bytes");
      append_num(out, e.bytes);
    }
    if (e.alloc_bytes != 0) {
      key("alloc_bytes");
      append_num(out, e.alloc_bytes);
    }
    if (e.freed_bytes != 0) {
      key("freed_bytes");
      append_num(out, e.freed_bytes);
    }
    out += "}},\n";
  }

  // Forward -> backward flows: the first op that took each sequence number.
  std::unordered_map<int64_t, const Rec*> forward;
  for (const Rec& e : w.events) {
    if (e.kind != record::Kind::Op || e.seq < 0) continue;
    auto [it, fresh] = forward.emplace(e.seq, &e);
    if (!fresh && e.start_ns < it->second->start_ns) it->second = &e;
  }
  int64_t flow_id = 0;
  for (const Rec& b : w.events) {
    if (b.kind != record::Kind::Backward || b.seq < 0) continue;
    auto it = forward.find(b.seq);
    if (it == forward.end()) continue;
    const Rec& f = *it->second;
    ++flow_id;
    open_event(out, "s", "fwdbwd", f.start_ns - origin, pid, f.thread);
    out += ",\"cat\":\"fwdbwd\",\"id\":" + std::to_string(flow_id) + "},\n";
    open_event(out, "f", "fwdbwd", b.start_ns - origin, pid, b.thread);
    out += ",\"cat\":\"fwdbwd\",\"bp\":\"e\",\"id\":" + std::to_string(flow_id) + "},\n";
  }

  // Memory counters: live bytes per category after each allocation or free.
  if (w.profile_memory) {
    std::array<int64_t, kNumMemoryCategories> live = w.base_live;
    auto counter = [&](int64_t t) {
      open_event(out, "C", "memory", t - origin, pid, 0);
      out += ",\"args\":{";
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        if (c) out += ',';
        out += '"';
        out += memory_category_name(static_cast<MemoryCategory>(c));
        out += "\":";
        append_num(out, live[c]);
      }
      out += "}},\n";
    };
    counter(w.begin_ns);
    for (const detail::MemRec& m : w.memory) {
      live[static_cast<int>(m.category)] = m.category_live;
      counter(m.time_ns);
    }
  }
  // No trailing comma: the last line is the step-free end marker of the metadata.
  if (out.size() >= 2 && out.compare(out.size() - 2, 2, ",\n") == 0) out.resize(out.size() - 2);
  out += "\n],\n\"displayTimeUnit\":\"ms\",\n\"kiln\":{\"version\":1,\"rank\":";
  append_num(out, pid);
  out += ",\"process_name\":";
  append_json_string(out, pname);
  out += ",\"start_ns\":";
  append_num(out, origin);
  out += ",\"clock_sync_ns\":";
  if (has_sync) {
    append_num(out, clock_sync - origin);
  } else {
    out += "null";
  }
  out += ",\"events\":";
  append_num(out, static_cast<int64_t>(w.events.size()));
  out += "}}\n";
  return out;
}

void Profiler::export_chrome_trace(const std::string& path) const {
  const std::string text = chrome_trace_json();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw IOError("Profiler::export_chrome_trace: cannot open '" + path + "' for writing");
  f << text;
  f.close();
  if (!f) throw IOError("Profiler::export_chrome_trace: writing '" + path + "' failed");
}

namespace {

struct RankTrace {
  std::string path;
  nlohmann::json doc;
  int64_t rank = 0;
  int64_t start_ns = 0;
  bool has_sync = false;
  int64_t sync_ns = 0;  // relative to start_ns
};

[[noreturn]] void not_a_trace(const std::string& path, const std::string& why) {
  throw ValueError("merge_traces: '" + path + "' is not a kiln trace: " + why);
}

RankTrace load_trace(const std::string& path) {
  RankTrace t;
  t.path = path;
  const std::string text = read_file(path);
  try {
    t.doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    not_a_trace(path, std::string("invalid JSON (") + e.what() + ")");
  }
  if (!t.doc.is_object()) not_a_trace(path, "expected a JSON object, got " + std::string(t.doc.type_name()));
  auto evs = t.doc.find("traceEvents");
  if (evs == t.doc.end() || !evs->is_array()) not_a_trace(path, "expected a \"traceEvents\" array");
  auto k = t.doc.find("kiln");
  if (k == t.doc.end() || !k->is_object()) {
    not_a_trace(path, "no \"kiln\" object (traces written by Profiler::export_chrome_trace carry one)");
  }
  auto rank = k->find("rank");
  if (rank == k->end() || !rank->is_number_integer() || rank->get<int64_t>() < 0) {
    not_a_trace(path, "expected \"kiln\".\"rank\" to be an integer >= 0 (a merged trace cannot be merged again)");
  }
  t.rank = rank->get<int64_t>();
  auto start = k->find("start_ns");
  if (start == k->end() || !start->is_number_integer()) not_a_trace(path, "expected \"kiln\".\"start_ns\" integer");
  t.start_ns = start->get<int64_t>();
  auto sync = k->find("clock_sync_ns");
  if (sync != k->end() && !sync->is_null()) {
    if (!sync->is_number_integer()) not_a_trace(path, "expected \"kiln\".\"clock_sync_ns\" to be an integer or null");
    t.has_sync = true;
    t.sync_ns = sync->get<int64_t>();
  }
  size_t i = 0;
  for (const auto& e : *evs) {
    const std::string where = "event " + std::to_string(i++);
    if (!e.is_object()) not_a_trace(path, where + " is not an object");
    auto ph = e.find("ph");
    if (ph == e.end() || !ph->is_string()) not_a_trace(path, where + " has no \"ph\" string");
    auto ts = e.find("ts");
    if (ts != e.end() && (!ts->is_number() || std::fabs(ts->get<double>()) > 1e15)) {
      not_a_trace(path, where + " has a \"ts\" that is not a number of microseconds");
    }
    auto dur = e.find("dur");
    if (dur != e.end() && (!dur->is_number() || dur->get<double>() < 0)) {
      not_a_trace(path, where + " has a \"dur\" that is not a duration >= 0");
    }
  }
  return t;
}

}  // namespace

void merge_traces(const std::vector<std::string>& inputs, const std::string& output) {
  KILN_CHECK(!inputs.empty(), ValueError, "merge_traces: expected at least one input trace, got none");
  std::vector<RankTrace> traces;
  std::set<int64_t> ranks;
  bool all_synced = true;
  for (const std::string& p : inputs) {
    traces.push_back(load_trace(p));
    const RankTrace& t = traces.back();
    KILN_CHECK(ranks.insert(t.rank).second, ValueError, "merge_traces: '", p, "' is rank ", t.rank,
               " again: expected one trace per rank");
    all_synced = all_synced && t.has_sync;
  }
  // Shift per trace, in ns, so that the clock-sync marks coincide with the
  // first trace's (the same barrier seen on every rank). Without a mark on
  // every rank, the steady clocks' starts are used: right on one host only.
  std::vector<int64_t> shift(traces.size());
  for (size_t i = 0; i < traces.size(); ++i) {
    shift[i] = all_synced ? traces[0].sync_ns - traces[i].sync_ns : traces[i].start_ns - traces[0].start_ns;
  }
  double min_ts = 0;
  for (size_t i = 0; i < traces.size(); ++i) {
    for (const auto& e : traces[i].doc["traceEvents"]) {
      auto ts = e.find("ts");
      if (ts != e.end() && e["ph"] != "M") min_ts = std::min(min_ts, ts->get<double>() + shift[i] / 1e3);
    }
  }
  const int64_t lift = min_ts < 0 ? static_cast<int64_t>(std::ceil(-min_ts * 1e3)) : 0;

  nlohmann::json merged = nlohmann::json::object();
  nlohmann::json& events = merged["traceEvents"] = nlohmann::json::array();
  int64_t next_flow = 1;
  nlohmann::json rank_list = nlohmann::json::array();
  for (size_t i = 0; i < traces.size(); ++i) {
    RankTrace& t = traces[i];
    rank_list.push_back(t.rank);
    std::map<std::string, int64_t> flow_ids;  // this trace's flow ids, renumbered to stay unique
    for (auto& e : t.doc["traceEvents"]) {
      e["pid"] = t.rank;
      auto ts = e.find("ts");
      if (ts != e.end() && e["ph"] != "M") {
        const int64_t ns = std::llround(ts->get<double>() * 1e3) + shift[i] + lift;
        *ts = static_cast<double>(ns) / 1e3;
      }
      const std::string ph = e["ph"].get<std::string>();
      if ((ph == "s" || ph == "t" || ph == "f") && e.contains("id")) {
        auto [it, fresh] = flow_ids.emplace(e["id"].dump(), next_flow);
        if (fresh) ++next_flow;
        e["id"] = it->second;
      }
      events.push_back(std::move(e));
    }
  }
  merged["displayTimeUnit"] = "ms";
  merged["kiln"] = {{"version", 1},
                    {"merged", true},
                    {"ranks", rank_list},
                    {"aligned_on", all_synced ? "clock_sync" : "start_clock"}};
  std::ofstream f(output, std::ios::binary | std::ios::trunc);
  if (!f) throw IOError("merge_traces: cannot open '" + output + "' for writing");
  f << merged.dump() << '\n';
  f.close();
  if (!f) throw IOError("merge_traces: writing '" + output + "' failed");
}

}  // namespace kiln::profiler
