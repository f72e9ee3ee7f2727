// The profile of a training run's steps (cli/profile_run.h).
//
// The window maps onto torch.profiler's schedule: the profiler starts as the
// step before the window begins (until then the record hook stays off, so the
// steps before cost nothing), takes that step as the warm-up (recorded and
// discarded: first-call costs such as primitive creation stay out of the
// profile), then the window's steps as the active ones, once, and stops when
// its files are written. The ranks of a data-parallel run meet at a barrier as
// the profiler starts and each notes that moment (mark_clock_sync), so the
// merged trace shows their steps side by side.
#include "cli/profile_run.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "cli/config.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/profiler/profiler.h"

namespace kiln::cli {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

bool parse_step(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && p == end;
}

void write_file(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    KILN_CHECK(out.good(), IOError, "kiln profile: cannot write ", tmp.string(), " (is the run directory writable?)");
    out << text;
    out.flush();
    KILN_CHECK(out.good(), IOError, "kiln profile: cannot write ", tmp.string(), " (disk full?)");
  }
  fs::rename(tmp, path);
}

json steps_json(const std::vector<profiler::StepBreakdown>& steps, const ProfileWindow& w, int64_t recorded_from,
                int rank, int world) {
  json rows = json::array();
  // A window the run cut short ends with the open step stop() closed (the loop's end, the last
  // evaluation): not a training step, so only the window's steps that ran are listed.
  const auto ran = static_cast<size_t>(std::max<int64_t>(0, w.end - recorded_from));
  for (size_t k = 0; k < std::min(ran, steps.size()); ++k) {
    const profiler::StepBreakdown& s = steps[k];
    rows.push_back({{"step", recorded_from + static_cast<int64_t>(k)},
                    {"profiler_step", s.step},
                    {"total_ms", s.total_ms},
                    {"data_ms", s.data_ms},
                    {"forward_ms", s.forward_ms},
                    {"backward_ms", s.backward_ms},
                    {"optimizer_ms", s.optimizer_ms},
                    {"comm_exposed_ms", s.comm_exposed_ms},
                    {"other_ms", s.other_ms}});
  }
  return {{"window", {{"first", w.first}, {"end", w.end}}}, {"rank", rank}, {"world_size", world}, {"steps", rows}};
}

// The timeline is kept short (at most this many points, the peak among them): the trace has every event.
constexpr size_t kTimelinePoints = 240;

json memory_json(const profiler::MemoryTimeline& m) {
  json peak = json::object();
  for (int c = 0; c < kNumMemoryCategories; ++c)
    peak[memory_category_name(static_cast<MemoryCategory>(c))] = m.peak[static_cast<size_t>(c)];
  const int64_t t0 = m.points.empty() ? m.peak_time_ns : m.points.front().time_ns;
  json out = {{"peak", peak},
              {"peak_total", m.peak_total},
              {"peak_time_ms", static_cast<double>(m.peak_time_ns - t0) / 1e6},
              {"live_at_peak", m.live_at_peak},
              {"events", m.points.size()}};
  json time_ms = json::array(), total = json::array();
  std::vector<json> by_cat(kNumMemoryCategories, json::array());
  const size_t n = m.points.size();
  const size_t stride = std::max<size_t>(1, (n + kTimelinePoints - 1) / kTimelinePoints);
  for (size_t i = 0; i < n; ++i) {
    const auto& p = m.points[i];
    if (i % stride != 0 && i + 1 != n && p.time_ns != m.peak_time_ns) continue;
    time_ms.push_back(static_cast<double>(p.time_ns - t0) / 1e6);
    total.push_back(p.total);
    for (int c = 0; c < kNumMemoryCategories; ++c)
      by_cat[static_cast<size_t>(c)].push_back(p.live[static_cast<size_t>(c)]);
  }
  json timeline = {{"time_ms", time_ms}, {"total", total}};
  for (int c = 0; c < kNumMemoryCategories; ++c)
    timeline[memory_category_name(static_cast<MemoryCategory>(c))] = by_cat[static_cast<size_t>(c)];
  out["timeline"] = timeline;
  return out;
}

std::string steps_text(const ProfileWindow& w) {
  return w.end - w.first == 1 ? "step " + std::to_string(w.first)
                              : "steps " + std::to_string(w.first) + "-" + std::to_string(w.end - 1);
}

}  // namespace

std::optional<ProfileWindow> parse_profile_steps(const std::string& spec, const std::string& origin) {
  if (spec.empty()) return std::nullopt;
  const std::string expected = "expected FIRST:END (steps FIRST to END-1, e.g. \"20:25\") or FIRST (FIRST:FIRST+" +
                               std::to_string(kDefaultProfileSteps) + "), with 1 <= FIRST < END";
  ProfileWindow w;
  const auto colon = spec.find(':');
  bool ok;
  if (colon == std::string::npos) {
    ok = parse_step(spec, w.first);
    w.end = w.first + kDefaultProfileSteps;
  } else {
    ok = parse_step(spec.substr(0, colon), w.first) && parse_step(spec.substr(colon + 1), w.end);
  }
  if (!ok || w.first < 1 || w.end <= w.first)
    throw ConfigError(origin + ": profile steps: " + expected + ", got \"" + spec + "\"");
  return w;
}

ProfileRun::ProfileRun(ProfileWindow window, int64_t done_steps, fs::path run_dir, dist::ProcessGroupPtr group)
    : window_(window), dir_(std::move(run_dir) / "profile"), group_(std::move(group)) {
  first_run_ = done_steps + 1;
  const int64_t first_run = first_run_;
  if (window_.end <= first_run) {
    message_ = "profile: " + steps_text(window) + " ran before this process (it starts at step " +
               std::to_string(first_run) + "); nothing profiled";
    return;
  }
  recorded_from_ = std::max(window_.first, first_run);
  const int64_t offset = recorded_from_ - first_run;  // steps before the window in this process
  profiler::Options o;
  o.use_schedule = true;
  // The profiler starts as the warm-up step begins (before_step): the steps before it run with
  // the record hook off, at no cost.
  o.schedule.warmup = offset >= 1 ? 1 : 0;
  o.schedule.skip_first = 0;
  o.schedule.wait = 0;
  o.schedule.active = window_.end - recorded_from_;
  o.schedule.repeat = 1;
  o.rank = group_ ? group_->rank() : 0;
  o.process_name = "rank " + std::to_string(o.rank);
  o.on_trace_ready = [this](profiler::Profiler&) { ready_ = true; };
  sync_step_ = recorded_from_ - o.schedule.warmup;
  prof_ = std::make_unique<profiler::Profiler>(std::move(o));
}

ProfileRun::~ProfileRun() = default;

void ProfileRun::before_step(int64_t step) {
  if (!prof_ || synced_ || step != sync_step_) return;
  synced_ = true;
  if (group_ && group_->size() > 1) group_->barrier()->wait();
  prof_->start();
  prof_->mark_clock_sync();  // after start(), which clears it
}

void ProfileRun::after_step() {
  if (!prof_ || !synced_ || written_) return;
  ++steps_done_;
  prof_->step();
  if (ready_) write_files();
}

void ProfileRun::finish() {
  if (!prof_ || written_) return;
  // Every rank ran the same steps, so they all take this branch alike (write_files takes a barrier).
  const int64_t recorded = steps_done_ - (recorded_from_ - sync_step_);  // the window's steps that ran
  if (synced_) prof_->stop();
  if (recorded <= 0) {
    message_ = "profile: the run ended before step " + std::to_string(recorded_from_) + "; nothing profiled";
    prof_.reset();
    return;
  }
  window_.end = recorded_from_ + std::min(recorded, window_.end - recorded_from_);
  write_files();
}

std::string ProfileRun::take_message() { return std::exchange(message_, std::string()); }

void ProfileRun::write_files() {
  written_ = true;
  prof_->stop();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  KILN_CHECK(!ec, IOError, "kiln train --profile: cannot create ", dir_.string(), ": ", ec.message());
  const int world = group_ ? group_->size() : 1;
  const int rank = group_ ? group_->rank() : 0;
  if (world > 1) {
    prof_->export_chrome_trace((dir_ / ("trace.rank" + std::to_string(rank) + ".json")).string());
    group_->barrier()->wait();  // every rank's trace is on disk
    if (rank == 0) {
      std::vector<std::string> inputs;
      for (int r = 0; r < world; ++r) inputs.push_back((dir_ / ("trace.rank" + std::to_string(r) + ".json")).string());
      profiler::merge_traces(inputs, (dir_ / "trace.json").string());
    }
  } else {
    prof_->export_chrome_trace((dir_ / "trace.json").string());
  }
  if (rank == 0) {
    write_file(dir_ / "ops.txt", prof_->table("self", 40));
    write_file(dir_ / "ops.json", prof_->key_averages_json() + "\n");
    write_file(dir_ / "steps.json", steps_json(prof_->step_breakdown(), window_, recorded_from_, rank, world).dump(2));
    write_file(dir_ / "memory.json", memory_json(prof_->memory_timeline()).dump(2));
    message_ = "profile: " + steps_text({recorded_from_, window_.end}) + " written to " + dir_.string() +
               " (trace.json opens in https://ui.perfetto.dev or chrome://tracing; `kiln profile " +
               dir_.parent_path().string() + "` prints the op table)";
  }
  prof_.reset();
}

}  // namespace kiln::cli
