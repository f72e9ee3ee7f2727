// The profiler's tables (include/kiln/profiler/profiler.h): key_averages and
// its text and JSON forms, the per-step breakdown and the memory timeline, all
// computed from one closed window (collector.h).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "collector.h"
#include "kiln/core/error.h"

namespace kiln::profiler {
namespace detail {

Analysis analyse(const Window& w) {
  Analysis a;
  a.self_ns.resize(w.events.size());
  a.by_id.reserve(w.events.size());
  for (size_t i = 0; i < w.events.size(); ++i) {
    a.self_ns[i] = w.events[i].dur();
    a.by_id.emplace(w.events[i].id, i);
  }
  // Scopes nest on their thread, so a child lies inside its parent and the
  // parent's self time is what its children leave.
  for (const Rec& e : w.events) {
    auto it = a.by_id.find(e.parent);
    if (e.parent != 0 && it != a.by_id.end()) a.self_ns[it->second] -= e.dur();
  }
  for (int64_t& s : a.self_ns) s = std::max<int64_t>(s, 0);
  return a;
}

}  // namespace detail

namespace {

using detail::Rec;
using detail::Window;

std::vector<OpStats> averages(const Window& w, bool by_shape) {
  const detail::Analysis an = detail::analyse(w);
  std::vector<OpStats> rows;
  std::unordered_map<std::string, size_t> index;
  std::string key;
  for (size_t i = 0; i < w.events.size(); ++i) {
    const Rec& e = w.events[i];
    if (e.kind == record::Kind::Step) continue;  // steps are step_breakdown's rows, not ops
    const std::string& name = w.str(e.name);
    const std::string& shapes = by_shape ? w.str(e.shapes) : w.str(detail::kNoString);
    key.assign(name);
    key += '\0';
    key += record::kind_name(e.kind);
    key += '\0';
    key += shapes;
    auto [it, fresh] = index.emplace(key, rows.size());
    if (fresh) {
      OpStats r;
      r.name = name;
      r.kind = record::kind_name(e.kind);
      r.input_shapes = shapes;
      rows.push_back(std::move(r));
    }
    OpStats& r = rows[it->second];
    r.calls += 1;
    r.self_ns += an.self_ns[i];
    r.total_ns += e.dur();
    r.flops += e.flops;
    r.bytes += e.bytes;
    r.alloc_bytes += e.alloc_bytes;
    r.freed_bytes += e.freed_bytes;
  }
  std::stable_sort(rows.begin(), rows.end(), [](const OpStats& a, const OpStats& b) { return a.self_ns > b.self_ns; });
  return rows;
}

// torch's _format_time: microseconds below 1 ms, then ms, then s.
std::string format_time(int64_t ns) {
  char buf[32];
  const double us = static_cast<double>(ns) / 1e3;
  if (us >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.3fs", us / 1e6);
  } else if (us >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.3fms", us / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.3fus", us);
  }
  return buf;
}

std::string format_bytes(int64_t b) {
  char buf[32];
  const double v = static_cast<double>(b);
  if (b >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1 << 30));
  } else if (b >= (int64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1 << 20));
  } else if (b >= (int64_t{1} << 10)) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", v / (1 << 10));
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  }
  return buf;
}

std::string format_pct(int64_t part, int64_t whole) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.2f%%", whole > 0 ? 100.0 * static_cast<double>(part) / whole : 0.0);
  return buf;
}

std::string format_double(double v, const char* fmt) {
  char buf[32];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// What one instant of a step was spent on (docs/profiler.md, "The step breakdown").
enum class Phase { Other, Data, Forward, Backward, Optimizer, Comm };

Phase own_phase(const Rec& e, const Window& w) {
  switch (e.kind) {
    case record::Kind::DataWait: return Phase::Data;
    case record::Kind::Backward: return Phase::Backward;
    case record::Kind::Optimizer: return Phase::Optimizer;
    case record::Kind::CollectiveWait: return Phase::Comm;
    case record::Kind::User: {
      const std::string& n = w.str(e.name);
      if (n == "forward") return Phase::Forward;
      if (n == "backward") return Phase::Backward;
      return Phase::Other;
    }
    default: return Phase::Other;
  }
}

}  // namespace

std::vector<OpStats> Profiler::key_averages(bool group_by_input_shape) const {
  return averages(*s_->current(), group_by_input_shape);
}

std::string Profiler::table(const std::string& sort_by, size_t row_limit, bool group_by_input_shape) const {
  KILN_CHECK(sort_by == "self" || sort_by == "total" || sort_by == "calls" || sort_by == "flops", ValueError,
             "Profiler::table: expected sort_by \"self\", \"total\", \"calls\" or \"flops\", got \"", sort_by, "\"");
  std::vector<OpStats> rows = key_averages(group_by_input_shape);
  int64_t self_total = 0;
  for (const OpStats& r : rows) self_total += r.self_ns;
  std::stable_sort(rows.begin(), rows.end(), [&](const OpStats& a, const OpStats& b) {
    if (sort_by == "total") return a.total_ns > b.total_ns;
    if (sort_by == "calls") return a.calls > b.calls;
    if (sort_by == "flops") return a.flops > b.flops;
    return a.self_ns > b.self_ns;
  });
  const size_t shown = row_limit == 0 ? rows.size() : std::min(rows.size(), row_limit);

  std::vector<std::string> head = {"Name",         "Kind",       "Self CPU %", "Self CPU", "CPU total %", "CPU total",
                                   "CPU time avg", "# of Calls", "GFLOP",      "GFLOP/s",  "Alloc",       "Freed"};
  if (group_by_input_shape) head.push_back("Input Shapes");
  std::vector<std::vector<std::string>> cells;
  for (size_t i = 0; i < shown; ++i) {
    const OpStats& r = rows[i];
    std::string name = r.name.size() > 55 ? r.name.substr(0, 52) + "..." : r.name;
    std::vector<std::string> c = {name,
                                  r.kind,
                                  format_pct(r.self_ns, self_total),
                                  format_time(r.self_ns),
                                  format_pct(r.total_ns, self_total),
                                  format_time(r.total_ns),
                                  format_time(r.calls ? r.total_ns / r.calls : 0),
                                  std::to_string(r.calls),
                                  r.flops > 0 ? format_double(r.flops / 1e9, "%.3f") : "--",
                                  r.flops > 0 ? format_double(r.gflops_per_s(), "%.2f") : "--",
                                  r.alloc_bytes > 0 ? format_bytes(r.alloc_bytes) : "--",
                                  r.freed_bytes > 0 ? format_bytes(r.freed_bytes) : "--"};
    if (group_by_input_shape)
      c.push_back(r.input_shapes.size() > 60 ? r.input_shapes.substr(0, 57) + "..." : r.input_shapes);
    cells.push_back(std::move(c));
  }
  std::vector<size_t> width(head.size());
  for (size_t j = 0; j < head.size(); ++j) {
    width[j] = head[j].size();
    for (const auto& c : cells) width[j] = std::max(width[j], c[j].size());
  }
  std::string rule, out;
  for (size_t j = 0; j < head.size(); ++j) rule += std::string(width[j], '-') + "  ";
  rule += '\n';
  auto line = [&](const std::vector<std::string>& c) {
    for (size_t j = 0; j < c.size(); ++j) {
      const std::string pad(width[j] - c[j].size(), ' ');
      out += j < 2 ? c[j] + pad : pad + c[j];  // names left, numbers right, as torch
      out += "  ";
    }
    out += '\n';
  };
  out += rule;
  line(head);
  out += rule;
  for (const auto& c : cells) line(c);
  out += rule;
  out += "Self CPU time total: " + format_time(self_total) + "\n";
  if (shown < rows.size()) out += std::to_string(rows.size() - shown) + " more rows not shown\n";
  return out;
}

std::string Profiler::key_averages_json(bool group_by_input_shape) const {
  const std::vector<OpStats> rows = key_averages(group_by_input_shape);
  nlohmann::json out = nlohmann::json::object();
  nlohmann::json arr = nlohmann::json::array();
  int64_t self_total = 0;
  for (const OpStats& r : rows) {
    self_total += r.self_ns;
    arr.push_back({{"name", r.name},
                   {"kind", r.kind},
                   {"input_shapes", r.input_shapes},
                   {"calls", r.calls},
                   {"self_us", static_cast<double>(r.self_ns) / 1e3},
                   {"total_us", static_cast<double>(r.total_ns) / 1e3},
                   {"avg_us", r.calls ? static_cast<double>(r.total_ns) / 1e3 / static_cast<double>(r.calls) : 0.0},
                   {"flops", r.flops},
                   {"gflops_per_s", r.gflops_per_s()},
                   {"bytes", r.bytes},
                   {"alloc_bytes", r.alloc_bytes},
                   {"freed_bytes", r.freed_bytes}});
  }
  out["rows"] = std::move(arr);
  out["self_total_us"] = static_cast<double>(self_total) / 1e3;
  out["group_by_input_shape"] = group_by_input_shape;
  return out.dump(1);
}

std::vector<StepBreakdown> Profiler::step_breakdown() const {
  const auto wp = s_->current();
  const Window& w = *wp;
  const detail::Analysis an = detail::analyse(w);
  const size_t n = w.events.size();
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<Phase> phase(n, Phase::Other);
  std::vector<size_t> step_of(n, kNone);
  std::vector<std::array<int64_t, 6>> sums;
  std::vector<size_t> steps;  // event index of each step, by time
  std::vector<size_t> slot(n, kNone);
  // Events come parents first (by thread, start, depth), so one pass inherits.
  for (size_t i = 0; i < n; ++i) {
    const Rec& e = w.events[i];
    auto it = e.parent ? an.by_id.find(e.parent) : an.by_id.end();
    const size_t p = it == an.by_id.end() ? kNone : it->second;
    const Phase inherited = p == kNone ? Phase::Other : phase[p];
    const Phase own = own_phase(e, w);
    if (e.kind == record::Kind::Op) {
      // An op is forward unless it runs inside a backward node, an optimizer
      // step, a collective or a data wait: then it is that phase's work.
      phase[i] = inherited == Phase::Other ? Phase::Forward : inherited;
    } else {
      phase[i] = own != Phase::Other ? own : inherited;
    }
    if (e.kind == record::Kind::Step) {
      phase[i] = Phase::Other;
      step_of[i] = i;
      slot[i] = sums.size();
      sums.push_back({});
      steps.push_back(i);
    } else {
      step_of[i] = p == kNone ? kNone : step_of[p];
    }
    if (step_of[i] != kNone) sums[slot[step_of[i]]][static_cast<int>(phase[i])] += an.self_ns[i];
  }
  std::sort(steps.begin(), steps.end(),
            [&](size_t a, size_t b) { return w.events[a].start_ns < w.events[b].start_ns; });
  std::vector<StepBreakdown> out;
  for (size_t i : steps) {
    const Rec& e = w.events[i];
    const auto& s = sums[slot[i]];
    StepBreakdown b;
    const std::string& name = w.str(e.name);
    const size_t hash = name.rfind('#');
    b.step = hash == std::string::npos ? static_cast<int64_t>(out.size()) : std::atoll(name.c_str() + hash + 1);
    auto ms = [](int64_t ns) { return static_cast<double>(ns) / 1e6; };
    b.total_ms = ms(e.dur());
    b.data_ms = ms(s[static_cast<int>(Phase::Data)]);
    b.forward_ms = ms(s[static_cast<int>(Phase::Forward)]);
    b.backward_ms = ms(s[static_cast<int>(Phase::Backward)]);
    b.optimizer_ms = ms(s[static_cast<int>(Phase::Optimizer)]);
    b.comm_exposed_ms = ms(s[static_cast<int>(Phase::Comm)]);
    b.other_ms = ms(s[static_cast<int>(Phase::Other)]);
    out.push_back(b);
  }
  return out;
}

MemoryTimeline Profiler::memory_timeline() const {
  const auto wp = s_->current();
  const Window& w = *wp;
  MemoryTimeline t;
  if (!w.profile_memory) return t;
  MemoryTimeline::Point p;
  p.time_ns = w.begin_ns - w.origin_ns;
  p.live = w.base_live;
  p.total = w.base_total;
  t.points.reserve(w.memory.size() + 1);
  t.points.push_back(p);
  t.peak = p.live;
  t.peak_total = p.total;
  t.peak_time_ns = p.time_ns;
  for (const detail::MemRec& m : w.memory) {
    const int c = static_cast<int>(m.category);
    p.time_ns = m.time_ns - w.origin_ns;
    p.live[c] = m.category_live;
    p.total = m.total_live;
    t.points.push_back(p);
    t.peak[c] = std::max(t.peak[c], m.category_live);
    if (m.total_live > t.peak_total) {
      t.peak_total = m.total_live;
      t.peak_time_ns = p.time_ns;
    }
  }
  t.live_at_peak = w.live_at_peak;
  return t;
}

}  // namespace kiln::profiler
