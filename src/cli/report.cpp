// report.html for a run directory (see report.h): reads the run's files
// forgivingly (a report of a broken run is when it is needed most), then lays
// out the run's status, a summary block, notes about what was missing, the
// charts and the config.
#include "cli/report.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli/report_chart.h"
#include "cli/report_health.h"
#include "cli/report_profile.h"
#include "kiln/core/error.h"
#include "kiln/core/format.h"

namespace kiln::cli {
namespace {

using nlohmann::json;
using namespace report_detail;
namespace fs = std::filesystem;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct TrainRecord {
  double step = kNaN, epoch = kNaN, loss = kNaN, lr = kNaN, grad_norm = kNaN, samples_per_s = kNaN, data_wait = kNaN,
         time_s = kNaN;
  bool has_memory = false;
  std::map<std::string, double> memory;
};

struct EvalRecord {
  double step = kNaN, loss = kNaN, accuracy = kNaN, bits_per_char = kNaN;
};

// A start, resume, nonfinite or end record (Note [Run story] in train.cpp), in file order.
struct Event {
  std::string kind;
  double step;
  json j;
};

struct RunData {
  fs::path dir;  // as given, for the `kiln resume` hint
  std::string name;
  std::vector<Event> events;
  std::optional<std::string> config;
  std::vector<TrainRecord> train;
  std::vector<EvalRecord> eval;
  std::optional<json> summary;
  std::vector<std::string> notes;                        // plain text, escaped when written
  std::optional<json> memory_peak;                       // the last "memory_peak" record
  std::vector<std::pair<double, std::string>> warnings;  // "warning" records: step, message
  std::vector<json> health;                              // "health" records (cli/health_log.h)
  std::vector<json> rank_lines;                          // train records with per-rank step times (cli/step_skew.h)
};

std::optional<std::string> slurp(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// A step number exactly (12345, not 12.3k).
std::string format_step(double step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, step == std::floor(step) && std::fabs(step) < 1e15 ? "%.0f" : "%g", step);
  return buf;
}

// How often a field was absent (or null, or not a number), and the first step it was.
struct Missing {
  size_t count = 0;
  double first_step = kNaN;
};
using MissingFields = std::map<std::string, Missing>;

void note_missing(MissingFields& missing, const std::string& what, double step) {
  Missing& m = missing[what];
  if (m.count++ == 0) m.first_step = step;
}

// The number at `key`, or NaN when absent, null or not a number; `missing` keeps why.
double number(const json& j, const char* key, double step, MissingFields& missing) {
  auto it = j.find(key);
  if (it == j.end()) {
    note_missing(missing, key, step);
  } else if (it->is_null()) {  // nlohmann::json writes NaN and Inf as null
    note_missing(missing, std::string(key) + " (null: not finite when written)", step);
  } else if (!it->is_number()) {
    note_missing(missing, std::string(key) + " (not a number)", step);
  } else {
    return it->get<double>();
  }
  return kNaN;
}

std::string list_lines(const std::vector<size_t>& lines) {
  std::string s;
  for (size_t i = 0; i < lines.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(lines[i]);
  if (lines.size() > 8) s += ", ... (" + std::to_string(lines.size()) + " in all)";
  return s;
}

// Later records of a step replace earlier ones (a resumed run logs some steps again).
template <typename Record>
size_t sort_and_dedupe(std::vector<Record>& records) {
  std::stable_sort(records.begin(), records.end(), [](const Record& a, const Record& b) { return a.step < b.step; });
  std::vector<Record> out;
  size_t dupes = 0;
  for (Record& r : records) {
    if (!out.empty() && out.back().step == r.step) {
      out.back() = std::move(r);
      ++dupes;
    } else {
      out.push_back(std::move(r));
    }
  }
  records = std::move(out);
  return dupes;
}

void read_metrics(const fs::path& path, RunData& run) {
  std::ifstream in(path, std::ios::binary);  // streamed: a long run's metrics can be large
  if (!in) {
    run.notes.push_back("metrics.jsonl not found: there is nothing to chart.");
    return;
  }
  std::vector<size_t> malformed, no_step;
  std::map<std::string, std::vector<size_t>> unknown_kind;
  MissingFields train_missing, eval_missing;
  bool partial_last = false;
  size_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    const bool terminated = !in.eof();  // getline stopped at a '\n'
    ++line_no;
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      if (!terminated && j.is_discarded()) {
        partial_last = true;
      } else {
        malformed.push_back(line_no);
      }
      continue;
    }
    std::string kind = j.contains("kind") && j["kind"].is_string() ? j["kind"].get<std::string>() : "";
    const bool event = kind == "start" || kind == "resume" || kind == "nonfinite" || kind == "end";
    if (kind == "memory_peak" && j.contains("sites") && j["sites"].is_array()) {
      run.memory_peak = std::move(j);
      continue;
    }
    if (kind == "warning" && j.contains("message") && j["message"].is_string()) {
      const double step = j.contains("step") && j["step"].is_number() ? j["step"].get<double>() : kNaN;
      run.warnings.emplace_back(step, j["message"].get<std::string>());
      continue;
    }
    if (kind == "health" && j.contains("step") && j["step"].is_number()) {
      run.health.push_back(std::move(j));
      continue;
    }
    if (kind != "train" && kind != "eval" && !event) {
      unknown_kind[kind.empty() ? "(none)" : kind].push_back(line_no);
      continue;
    }
    if (!j.contains("step") || !j["step"].is_number()) {
      no_step.push_back(line_no);
      continue;
    }
    if (event) {
      run.events.push_back({kind, j["step"].get<double>(), std::move(j)});
    } else if (kind == "train") {
      MissingFields& m = train_missing;
      TrainRecord r;
      const double step = r.step = j["step"].get<double>();
      r.epoch = number(j, "epoch", step, m);
      r.loss = number(j, "loss", step, m);
      r.lr = number(j, "lr", step, m);
      r.grad_norm = number(j, "grad_norm", step, m);
      r.samples_per_s = number(j, "samples_per_s", step, m);
      r.data_wait = number(j, "data_wait", step, m);
      r.time_s = number(j, "time_s", step, m);
      if (j.contains("ranks") && j["ranks"].is_object()) run.rank_lines.push_back(j);
      auto mem = j.find("memory");
      if (mem != j.end() && mem->is_object()) {
        r.has_memory = true;
        for (auto& [category, bytes] : mem->items())
          if (bytes.is_number()) r.memory[category] = bytes.get<double>();
      } else {
        note_missing(m, mem == j.end() ? "memory" : "memory (not an object)", step);
      }
      run.train.push_back(std::move(r));
    } else {
      MissingFields either;  // an eval record has accuracy or bits_per_char, not both
      EvalRecord r;
      const double step = r.step = j["step"].get<double>();
      r.loss = number(j, "loss", step, eval_missing);
      r.accuracy = number(j, "accuracy", step, either);
      r.bits_per_char = number(j, "bits_per_char", step, either);
      if (std::isnan(r.accuracy) && std::isnan(r.bits_per_char))
        note_missing(eval_missing, "accuracy and bits_per_char", step);
      run.eval.push_back(r);
    }
  }
  if (partial_last)
    run.notes.push_back("metrics.jsonl: the last line (" + std::to_string(line_no) +
                        ") is incomplete, probably because the run was stopped while writing it; it was ignored.");
  if (!malformed.empty())
    run.notes.push_back("metrics.jsonl: " + std::to_string(malformed.size()) +
                        " malformed line(s) skipped (not a JSON object): line " + list_lines(malformed) + ".");
  if (!no_step.empty())
    run.notes.push_back("metrics.jsonl: " + std::to_string(no_step.size()) +
                        " record(s) without a numeric \"step\" skipped: line " + list_lines(no_step) + ".");
  for (auto& [kind, lines] : unknown_kind)
    run.notes.push_back("metrics.jsonl: " + std::to_string(lines.size()) + " record(s) of kind \"" + kind +
                        "\" not shown (only train, eval and the run's start, resume, nonfinite and end are): line " +
                        list_lines(lines) + ".");
  auto missing_notes = [&](const MissingFields& fields, size_t records, const char* kind) {
    for (auto& [field, m] : fields)
      run.notes.push_back("metrics.jsonl: \"" + field + "\" missing from " + std::to_string(m.count) + " of " +
                          std::to_string(records) + " " + kind + " records" +
                          (m.count < records ? " (first at step " + format_step(m.first_step) + ")." : "."));
  };
  missing_notes(train_missing, run.train.size(), "train");
  missing_notes(eval_missing, run.eval.size(), "eval");
  if (run.train.empty()) run.notes.push_back("metrics.jsonl has no train records.");
  if (run.eval.empty()) run.notes.push_back("metrics.jsonl has no eval records: the run has not been evaluated.");
  size_t dupes = sort_and_dedupe(run.train) + sort_and_dedupe(run.eval);
  if (dupes)
    run.notes.push_back("metrics.jsonl: " + std::to_string(dupes) +
                        " step(s) logged more than once (a resumed run?); the later record is shown.");
}

RunData read_run(const fs::path& dir) {
  RunData run;
  run.dir = dir;
  run.name = fs::absolute(dir).lexically_normal().filename().string();
  if (run.name.empty()) run.name = fs::absolute(dir).lexically_normal().parent_path().filename().string();
  run.config = slurp(dir / "config.toml");
  if (!run.config) run.notes.push_back("config.toml not found: the config cannot be shown.");
  if (std::optional<std::string> s = slurp(dir / "summary.json")) {
    json j = json::parse(*s, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      run.notes.push_back("summary.json is not a JSON object; final figures come from metrics.jsonl.");
    } else {
      run.summary = std::move(j);
      if (run.summary->contains("name") && (*run.summary)["name"].is_string())
        run.name = (*run.summary)["name"].get<std::string>();
    }
  } else {
    run.notes.push_back("summary.json not found (run unfinished?); final figures come from metrics.jsonl.");
  }
  read_metrics(dir / "metrics.jsonl", run);
  return run;
}

// ---- the run's story: how it ended, where it was resumed ---------------------

double json_number(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

std::string format_lr(double lr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", lr);
  return buf;
}

struct RunStatus {
  std::string key;  // completed, stopped, interrupted, nan, unfinished, none
  std::string headline;
  std::vector<std::string> details;
  std::vector<double> resumes;  // steps, in order
  double step = kNaN;           // where the run is now (the last finished step)
  double nan_step = kNaN;       // the step whose loss was not finite
  bool summary_current = true;  // summary.json was written by the latest process
};

std::string step_list(const std::vector<double>& steps) {
  std::string s;
  for (size_t i = 0; i < steps.size(); ++i)
    s += (i == 0 ? "" : i + 1 == steps.size() ? " and " : ", ") + format_step(steps[i]);
  return s;
}

// From the start/resume/nonfinite/end records when the run has them (the last
// process's end, if it wrote one); from summary.json for runs written before them.
RunStatus run_status(const RunData& run) {
  RunStatus st;
  const json* end = nullptr;
  const json* nonfinite = nullptr;
  double total = kNaN, started = kNaN;
  for (const Event& e : run.events) {
    if (std::isfinite(json_number(e.j, "total_steps"))) total = json_number(e.j, "total_steps");
    if (e.kind == "start" || e.kind == "resume") {
      end = nonfinite = nullptr;
      started = e.step;
      if (e.kind == "resume") st.resumes.push_back(e.step);
    } else if (e.kind == "nonfinite") {
      nonfinite = &e.j;
    } else {
      end = &e.j;
    }
  }
  const double last_logged = run.train.empty() ? kNaN : run.train.back().step;
  const json* summary = run.summary ? &*run.summary : nullptr;
  if (!std::isfinite(total) && summary) total = json_number(*summary, "total_steps");
  if (end) {
    st.key = end->contains("status") && (*end)["status"].is_string() ? (*end)["status"].get<std::string>() : "";
    st.step = json_number(*end, "step");
  } else if (!run.events.empty()) {
    st.key = "unfinished";
    st.summary_current = false;
    st.step = std::isfinite(last_logged) ? std::max(last_logged, started) : started;
  } else if (summary && summary->contains("status") && (*summary)["status"].is_string()) {
    st.key = (*summary)["status"].get<std::string>();
    st.step = json_number(*summary, "steps");
  } else {
    st.key = run.train.empty() ? "none" : "unfinished";
    st.step = last_logged;
  }
  if (!std::isfinite(st.step)) st.step = last_logged;

  const std::string of_total = std::isfinite(total) ? " of " + format_step(total) : "";
  const std::string at = std::isfinite(st.step) ? " at step " + format_step(st.step) + of_total : "";
  const std::string resume_hint = "Continue with: kiln resume " + run.dir.string();
  if (st.key == "completed") {
    st.headline = "Completed: " + (std::isfinite(st.step) ? format_step(st.step) + of_total : "all") + " steps";
  } else if (st.key == "stopped") {
    st.headline = "Paused" + at + " (train.max_steps)";
    st.details.push_back("A checkpoint was saved. " + resume_hint);
  } else if (st.key == "interrupted") {
    st.headline = "Interrupted" + at + " (Ctrl-C or SIGTERM)";
    st.details.push_back("A checkpoint was saved at step " + format_step(st.step) + ". " + resume_hint);
  } else if (st.key == "nan") {
    st.nan_step = nonfinite ? json_number(*nonfinite, "step") : st.step + 1;
    st.headline = "Stopped on NaN at step " + format_step(st.nan_step) + of_total;
    std::string what = "The loss became ";
    if (nonfinite && nonfinite->contains("loss") && (*nonfinite)["loss"].is_string()) {
      what += (*nonfinite)["loss"].get<std::string>() + " at step " + format_step(st.nan_step);
      const double epoch = json_number(*nonfinite, "epoch"), lr = json_number(*nonfinite, "lr");
      if (std::isfinite(epoch) && std::isfinite(lr))
        what += " (epoch " + format_step(epoch) + ", learning rate " + format_lr(lr) + ")";
    } else {
      what += "NaN or Inf at step " + format_step(st.nan_step);
    }
    st.details.push_back(what +
                         "; the run stopped before that step's update, and the charts end there. Rerun with "
                         "--set train.anomaly=true to find the op that first produced it; a lower optim.lr "
                         "or optim.grad_clip often cures it.");
  } else if (st.key == "unfinished") {
    st.headline = "In progress, or ended without a word (killed)" +
                  (std::isfinite(st.step) ? ": last logged step " + format_step(st.step) + of_total : "");
    st.details.push_back("While it trains, the run rewrites this report at every checkpoint. A killed run: " +
                         resume_hint + " (from its last checkpoint).");
  } else if (st.key == "none") {
    st.headline = "No training recorded";
  } else {
    st.headline = "Ended with status \"" + st.key + "\"" + at;
  }
  if (!st.resumes.empty())
    st.details.push_back(st.resumes.size() == 1 ? "Resumed at step " + step_list(st.resumes) + "."
                                                : "Resumed " + std::to_string(st.resumes.size()) + " times, at steps " +
                                                      step_list(st.resumes) + ".");
  return st;
}

// ---- figures for the header ----------------------------------------------

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kNaN;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// An accuracy in [0, 1] reads as a percentage.
std::string format_metric(const std::string& key, const json& v) {
  if (v.is_number()) {
    double d = v.get<double>();
    if (key.find("acc") != std::string::npos && d >= 0 && d <= 1) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2f%%", d * 100);
      return buf;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4g", d);
    return buf;
  }
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

struct Card {
  std::string label, value, note = "";
};

// The summary block: the eval figures, the last train loss, how far the run
// got and how fast: one throughput and one data-wait figure, each the median
// over the logged windows (the last window alone is noisy).
std::vector<Card> header_cards(const RunData& run, const RunStatus& st) {
  std::vector<Card> cards;
  const json* final_metrics = nullptr;
  if (st.summary_current && run.summary && run.summary->contains("final") && (*run.summary)["final"].is_object())
    final_metrics = &(*run.summary)["final"];
  const std::string eval_note = run.eval.empty() ? "" : "at step " + format_step(run.eval.back().step);
  // Train-window figures of summary.final are covered by the cards below.
  static const std::set<std::string> train_keys = {"loss", "lr", "grad_norm", "samples_per_s", "data_wait"};
  if (final_metrics) {
    for (const char* key : {"accuracy", "bits_per_char", "eval_loss"})
      if (final_metrics->contains(key))
        cards.push_back({label(key), format_metric(key, (*final_metrics)[key]), eval_note});
    for (auto& [key, v] : final_metrics->items())
      if ((v.is_number() || v.is_string()) && !train_keys.count(key) && key != "accuracy" && key != "bits_per_char" &&
          key != "eval_loss")
        cards.push_back({label(key), format_metric(key, v)});
  } else if (!run.eval.empty()) {
    const EvalRecord& e = run.eval.back();
    if (std::isfinite(e.accuracy))
      cards.push_back({label("accuracy"), format_metric("accuracy", e.accuracy), eval_note});
    if (std::isfinite(e.bits_per_char))
      cards.push_back({label("bits_per_char"), format_value(e.bits_per_char), eval_note});
    if (std::isfinite(e.loss)) cards.push_back({label("eval_loss"), format_value(e.loss), eval_note});
  }
  for (auto r = run.train.rbegin(); r != run.train.rend(); ++r)
    if (std::isfinite(r->loss)) {
      cards.push_back({label("loss"), format_metric("loss", r->loss), "at step " + format_step(r->step)});
      break;
    }

  double total = run.summary && st.summary_current ? json_number(*run.summary, "total_steps") : kNaN;
  for (const Event& e : run.events)
    if (std::isfinite(json_number(e.j, "total_steps"))) total = json_number(e.j, "total_steps");
  cards.push_back({"steps", std::isfinite(st.step) ? format_step(st.step) : "n/a",
                   std::isfinite(total) ? "of " + format_step(total) : ""});
  double wall = st.summary_current && run.summary ? json_number(*run.summary, "wall_s") : kNaN;
  for (auto r = run.train.rbegin(); !std::isfinite(wall) && r != run.train.rend(); ++r) wall = r->time_s;
  cards.push_back({"wall time", format_duration(wall)});
  std::vector<double> sps, wait;
  double peak = kNaN;
  for (const TrainRecord& r : run.train) {
    sps.push_back(r.samples_per_s);
    wait.push_back(r.data_wait);
    if (r.has_memory) {
      double total_bytes = 0;
      for (auto& [c, b] : r.memory) total_bytes += b;
      peak = std::isfinite(peak) ? std::max(peak, total_bytes) : total_bytes;
    }
  }
  const double m = median(sps);
  cards.push_back({"throughput (samples/s)", format_value(m), "median"});
  const double w = median(wait);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", w * 100);
  cards.push_back({"data wait", std::isfinite(w) ? buf : "n/a", "median share of step time"});
  if (std::isfinite(peak)) cards.push_back({"peak memory", format_bytes(peak), "logged"});
  return cards;
}

// ---- charts ----------------------------------------------------------------

// A centred moving average over the finite values, so a noisy loss shows its
// trend without the lag of an exponential average; the window narrows near the
// ends (staying centred) so the steep start of a loss curve is not flattened.
std::vector<double> smooth(const std::vector<double>& y) {
  const size_t n = y.size(), half = std::max<size_t>(1, n / 100);
  std::vector<double> sum(n + 1, 0.0), cnt(n + 1, 0.0), out(n, kNaN);
  for (size_t i = 0; i < n; ++i) {
    bool ok = std::isfinite(y[i]);
    sum[i + 1] = sum[i] + (ok ? y[i] : 0.0);
    cnt[i + 1] = cnt[i] + (ok ? 1.0 : 0.0);
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(y[i])) continue;
    const size_t h = std::min({half, i, n - 1 - i});
    const size_t lo = i - h, hi = i + h + 1;
    out[i] = (sum[hi] - sum[lo]) / (cnt[hi] - cnt[lo]);
  }
  return out;
}

template <typename Record>
Series column(const std::vector<Record>& records, double Record::*field, std::string name, std::string colour) {
  Series s{.name = std::move(name), .colour = std::move(colour)};
  for (const Record& r : records) {
    s.x.push_back(r.step);
    s.y.push_back(r.*field);
  }
  return s;
}

bool any_finite(const Series& s) {
  return std::any_of(s.y.begin(), s.y.end(), [](double v) { return std::isfinite(v); });
}

// A chart, or a placeholder saying which data it lacked.
struct Figure {
  Chart chart;
  std::string missing;  // non-empty: no chart, this explains why
};

inline constexpr const char* kResumeColour = "#6b7280";
inline constexpr const char* kNaNColour = "#dc2626";

std::vector<Figure> build_charts(const RunData& run, const RunStatus& st) {
  // Every chart marks the resumes and the NaN stop, at the steps they happened.
  std::vector<Mark> marks;
  for (double s : st.resumes) marks.push_back({s, "resumed", kResumeColour});
  if (std::isfinite(st.nan_step)) marks.push_back({st.nan_step, "loss NaN", kNaNColour});
  const std::string before_nan =
      std::isfinite(st.nan_step) && run.train.empty()
          ? " (the loss was not finite at step " + format_step(st.nan_step) + ", before any step was logged)"
          : "";
  std::vector<Figure> figs;
  auto add = [&](Chart c, const std::string& why_missing) {
    std::erase_if(c.series, [](const Series& s) { return !any_finite(s); });
    c.marks = marks;
    figs.push_back({std::move(c), ""});
    if (figs.back().chart.series.empty()) figs.back().missing = why_missing + before_nan;
  };

  Chart loss{.id = "chart-loss", .title = "Loss", .y_label = "loss"};
  Series train = column(run.train, &TrainRecord::loss, "train loss", palette(0));
  if (train.y.size() >= 50) {
    Series smoothed = train;
    smoothed.y = smooth(train.y);
    smoothed.name = "train loss (smoothed)";
    train.opacity = 0.3;
    train.width = 1.2;
    loss.series.push_back(std::move(train));
    loss.series.push_back(std::move(smoothed));
  } else {
    loss.series.push_back(std::move(train));
  }
  Series eval_loss = column(run.eval, &EvalRecord::loss, "test loss (eval)", palette(1));
  eval_loss.markers = true;
  loss.series.push_back(std::move(eval_loss));
  add(std::move(loss), "no train or eval record has a \"loss\".");

  Series acc = column(run.eval, &EvalRecord::accuracy, "test accuracy (eval)", palette(3));
  Series bpc = column(run.eval, &EvalRecord::bits_per_char, "test bits/char (eval)", palette(3));
  acc.markers = bpc.markers = true;
  if (any_finite(bpc) && !any_finite(acc)) {
    add(Chart{.id = "chart-eval", .title = "Test bits per character", .y_label = "bits/char", .series = {bpc}}, "");
  } else {
    const bool fraction = std::all_of(acc.y.begin(), acc.y.end(), [](double v) { return !(v > 1); });
    add(Chart{.id = "chart-eval",
              .title = "Test accuracy",
              .y_label = "accuracy",
              .y_format = fraction ? YFormat::percent : YFormat::number,
              .series = {acc}},
        run.eval.empty() ? "no eval records." : "no eval record has \"accuracy\" or \"bits_per_char\".");
    if (any_finite(bpc))
      add(Chart{.id = "chart-bpc", .title = "Test bits per character", .y_label = "bits/char", .series = {bpc}}, "");
  }

  add(Chart{.id = "chart-lr",
            .title = "Learning rate",
            .y_label = "learning rate",
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::lr, "learning rate", palette(2))}},
      "no train record has \"lr\".");
  add(Chart{.id = "chart-throughput",
            .title = "Throughput",
            .y_label = "samples/s",
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::samples_per_s, "samples/s", palette(4))}},
      "no train record has \"samples_per_s\".");
  add(Chart{.id = "chart-data-wait",
            .title = "Data wait",
            .y_label = "share of time waiting for data",
            .y_format = YFormat::percent,
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::data_wait, "data wait", palette(5))}},
      "no train record has \"data_wait\".");
  add(Chart{.id = "chart-grad-norm",
            .title = "Gradient norm",
            .y_label = "gradient norm",
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::grad_norm, "gradient norm", palette(7))}},
      "no train record has \"grad_norm\".");

  // One line per memory category (absent from a record means none of it), and their total.
  std::set<std::string> categories;
  for (const TrainRecord& r : run.train)
    for (auto& [c, b] : r.memory) categories.insert(c);
  Chart mem{.id = "chart-memory",
            .title = "Memory by category (peak per window)",
            .y_label = "bytes",
            .y_format = YFormat::bytes,
            .y_from_zero = true};
  size_t k = 0;
  for (const std::string& c : categories) {
    Series s{.name = label(c), .colour = palette(k++)};
    for (const TrainRecord& r : run.train) {
      s.x.push_back(r.step);
      auto it = r.memory.find(c);
      s.y.push_back(!r.has_memory ? kNaN : it == r.memory.end() ? 0.0 : it->second);
    }
    mem.series.push_back(std::move(s));
  }
  if (categories.size() > 1) {
    Series total{.name = "total", .colour = "#111827", .width = 1.5, .dashed = true};
    for (const TrainRecord& r : run.train) {
      double t = 0;
      for (auto& [c, b] : r.memory) t += b;
      total.x.push_back(r.step);
      total.y.push_back(r.has_memory ? t : kNaN);
    }
    mem.series.push_back(std::move(total));
  }
  add(std::move(mem), "no train record has \"memory\".");
  for (Chart& c : health_charts(run.health)) add(std::move(c), "");
  for (Chart& c : rank_charts(run.rank_lines)) add(std::move(c), "");
  return figs;
}

// ---- the page ----------------------------------------------------------------

// The charts fill the page in as many columns of at least 520 px as fit; an
// SVG scales to its column through its viewBox.
const char* kStyle = R"(
body{font:14px/1.45 "DejaVu Sans",system-ui,sans-serif;margin:0;padding:14px 12px;color:#1f2937;background:#fff}
h1{font-size:22px;margin:0}
h2{font-size:16px;margin:22px 0 8px}
.sub{color:#6b7280;font-size:13px;margin-top:2px}
.status{border-radius:8px;padding:8px 14px;margin:12px 0 4px;border:1px solid;border-left-width:6px}
.status .headline{font-size:18px;font-weight:600}
.status .detail{font-size:13px;margin-top:2px}
.status-completed{background:#f0fdf4;border-color:#16a34a;color:#14532d}
.status-stopped,.status-interrupted,.status-unfinished{background:#fffbeb;border-color:#d97706;color:#78350f}
.status-nan{background:#fef2f2;border-color:#dc2626;color:#7f1d1d}
.status-none{background:#f8fafc;border-color:#94a3b8;color:#334155}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px;margin:12px 0 4px}
.card{border:1px solid #e5e7eb;border-radius:8px;padding:6px 14px}
.card .v{font-size:19px;font-weight:600}
.card .k{font-size:12px;color:#374151}
.card .n{font-size:11px;color:#6b7280}
.notes{background:#fffbeb;border:1px solid #fcd34d;border-radius:8px;padding:6px 14px 6px 30px;margin:12px 0;font-size:13px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,520px),1fr));gap:12px}
figure.chart{margin:0;border:1px solid #e5e7eb;border-radius:8px;padding:4px;min-width:0}
svg.chart{display:block;width:100%;height:auto}
figure.missing{min-height:120px;display:flex;flex-direction:column;justify-content:center;align-items:center;color:#6b7280;text-align:center}
figure.missing figcaption{font-weight:600;color:#111827}
svg.chart text{font:11px "DejaVu Sans",sans-serif;fill:#4b5563}
svg.chart text.title{font-size:14px;font-weight:600;fill:#111827}
svg.chart text.label{font-size:12px;fill:#374151}
svg.chart text.mark-label{font-size:11px;font-weight:600;paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}
table.peak{border-collapse:collapse;font-size:12px;margin:6px;width:calc(100% - 12px)}
table.peak th,table.peak td{text-align:left;padding:2px 6px;border-bottom:1px solid #e5e7eb}
table.peak td:first-child,table.peak td:nth-child(2),table.peak td:last-child{text-align:right;white-space:nowrap}
figure.chart figcaption{font-weight:600;color:#111827;margin:6px}
table.ops{border-collapse:collapse;font-size:12px;margin:6px;width:calc(100% - 12px)}
table.ops th,table.ops td{text-align:right;padding:2px 6px;border-bottom:1px solid #e5e7eb;white-space:nowrap}
table.ops td:first-child,table.ops th:first-child,table.ops td:nth-child(2),table.ops th:nth-child(2){text-align:left}
table.ops td:first-child{white-space:normal;word-break:break-all}
#warnings li{white-space:pre-wrap}
pre.config{background:#f8fafc;border:1px solid #e5e7eb;border-radius:8px;padding:10px 14px;overflow:auto;font:12px/1.45 "DejaVu Sans Mono",monospace}
)";

// The page's one script: while a run is in progress its report is rewritten at
// every checkpoint, so a fresh report of an unfinished run reloads itself every
// 30 s (keeping the scroll position); one older than an hour is a killed run's
// and stays put. It marks <html data-script="ran"> when it ran to the end,
// which the rendering test checks.
const char* kScript = R"(
(function () {
  var status = document.getElementById('status');
  var written = Number(document.documentElement.getAttribute('data-written'));
  var live = status && status.getAttribute('data-status') === 'unfinished' && Date.now() / 1000 - written < 3600;
  var key = 'kiln-report-scroll:' + location.pathname;
  var store = null;
  try { store = window.sessionStorage; } catch (e) { store = null; }
  if (live) {
    if (store && store.getItem(key)) window.scrollTo(0, Number(store.getItem(key)));
    setTimeout(function () {
      if (store) store.setItem(key, String(window.scrollY));
      location.reload();
    }, 30000);
  }
  document.documentElement.setAttribute('data-refresh', live ? 'on' : 'off');
  document.documentElement.setAttribute('data-script', 'ran');
})();
)";

// Beside the memory chart: the call sites that held the most at the run's
// highest live memory (train.cpp writes them from kiln::memory::peak_snapshot).
void render_memory_peak(std::ostream& o, const RunData& run) {
  // Runs from before memory history, or stopped before their first checkpoint, have none.
  if (!run.memory_peak) return;
  o << "<figure class=\"chart\" id=\"memory-at-peak\">";
  const json& m = *run.memory_peak;
  const double total = m.contains("peak_bytes") && m["peak_bytes"].is_number() ? m["peak_bytes"].get<double>() : kNaN;
  o << "<figcaption>Memory at peak: " << (std::isfinite(total) ? html_escape(format_bytes(total)) : "?")
    << " live, by call site</figcaption>\n<table class=\"peak\"><tr><th>bytes</th><th>share</th><th>category</th>"
       "<th>call site</th><th>op</th><th>tensors</th></tr>\n";
  for (const json& u : m["sites"]) {
    if (!u.is_object()) continue;
    const double b = u.contains("bytes") && u["bytes"].is_number() ? u["bytes"].get<double>() : kNaN;
    auto text = [&](const char* k) { return u.contains(k) && u[k].is_string() ? u[k].get<std::string>() : ""; };
    char share[16] = "";
    if (std::isfinite(b) && total > 0) std::snprintf(share, sizeof share, "%.0f%%", 100 * b / total);
    o << "<tr><td>" << (std::isfinite(b) ? html_escape(format_bytes(b)) : "?") << "</td><td>" << share << "</td><td>"
      << html_escape(text("category")) << "</td><td>" << html_escape(text("site")) << "</td><td>"
      << html_escape(text("op")) << "</td><td>"
      << (u.contains("tensors") && u["tensors"].is_number() ? std::to_string(u["tensors"].get<int64_t>()) : "")
      << "</td></tr>\n";
  }
  o << "</table></figure>\n";
}

std::string render_html(const RunData& run) {
  const RunStatus st = run_status(run);
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\" data-written=\"" << static_cast<long long>(std::time(nullptr))
    << "\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, "
       "initial-scale=1\">\n<title>kiln run "
    << html_escape(run.name) << ": " << html_escape(st.headline) << "</title>\n<style>" << kStyle
    << "</style>\n</head>\n<body>\n";
  o << "<h1>kiln run: " << html_escape(run.name) << "</h1>\n";
  o << "<div class=\"status status-" << html_escape(st.key) << "\" id=\"status\" data-status=\"" << html_escape(st.key)
    << "\"" << (std::isfinite(st.step) ? " data-step=\"" + format_step(st.step) + "\"" : "") << ">\n"
    << "<div class=\"headline\">" << html_escape(st.headline) << "</div>\n";
  for (const std::string& d : st.details) o << "<div class=\"detail\">" << html_escape(d) << "</div>\n";
  o << "</div>\n";
  std::string config_path;
  if (run.summary && run.summary->contains("config_path") && (*run.summary)["config_path"].is_string())
    config_path = (*run.summary)["config_path"].get<std::string>();
  o << "<div class=\"sub\">" << run.train.size() << " train records, " << run.eval.size() << " eval records"
    << (config_path.empty() ? "" : ", config " + html_escape(config_path)) << "</div>\n";
  o << "<div class=\"cards\" id=\"summary\">\n";
  for (const Card& c : header_cards(run, st))
    o << "<div class=\"card\"><div class=\"v\">" << html_escape(c.value) << "</div><div class=\"k\">"
      << html_escape(c.label) << "</div>"
      << (c.note.empty() ? "" : "<div class=\"n\">" + html_escape(c.note) + "</div>") << "</div>\n";
  o << "</div>\n";
  std::vector<std::string> notes = run.notes;
  if (!st.summary_current && run.summary)
    notes.push_back("summary.json is from an earlier process of this run; the figures above come from metrics.jsonl.");
  if (!run.warnings.empty()) {
    o << "<ul class=\"notes\" id=\"warnings\">\n";
    for (const auto& [step, message] : run.warnings)
      o << "<li class=\"warning\">" << (std::isfinite(step) ? "step " + format_step(step) + ": " : std::string())
        << html_escape(message) << "</li>\n";
    o << "</ul>\n";
  }
  if (!notes.empty()) {
    o << "<ul class=\"notes\" id=\"notes\">\n";
    for (const std::string& n : notes) o << "<li>" << html_escape(n) << "</li>\n";
    o << "</ul>\n";
  }
  o << "<h2>Charts</h2>\n<div class=\"charts\">\n";
  for (const Figure& f : build_charts(run, st)) {
    if (f.missing.empty()) {
      o << "<figure class=\"chart\" id=\"" << f.chart.id << "\">\n" << render_svg(f.chart) << "\n</figure>\n";
    } else {
      o << "<figure class=\"chart missing\" id=\"" << f.chart.id << "\"><figcaption>" << html_escape(f.chart.title)
        << "</figcaption><p>no data: " << html_escape(f.missing) << "</p></figure>\n";
    }
  }
  render_memory_peak(o, run);
  o << "</div>\n";
  render_profile_section(o, run.dir);  // when the run was trained with --profile
  o << "<h2>Config</h2>\n";
  if (run.config) {
    o << "<pre class=\"config\" id=\"config\">" << html_escape(*run.config) << "</pre>\n";
  } else {
    o << "<p>config.toml not found.</p>\n";
  }
  o << "<script>" << kScript << "</script>\n</body>\n</html>\n";
  return o.str();
}

// Temp file, fsync, rename: a reader never sees half a report.
void write_atomically(const fs::path& path, const std::string& data) {
  fs::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd >= 0, IOError, "cannot create ", tmp.string(), ": ", std::strerror(errno));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      KILN_CHECK(false, IOError, "cannot write ", tmp.string(), ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  bool synced = ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (!synced) ::unlink(tmp.c_str());
  KILN_CHECK(synced, IOError, "cannot flush ", tmp.string(), ": ", std::strerror(err));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    KILN_CHECK(false, IOError, "cannot rename ", tmp.string(), " to ", path.string(), ": ", std::strerror(err));
  }
}

}  // namespace

void write_report(const fs::path& run_dir) {
  std::error_code ec;
  fs::file_status st = fs::status(run_dir, ec);
  KILN_CHECK(fs::is_directory(st), IOError, "kiln report: expected a run directory, got ", run_dir.string(), " (",
             st.type() == fs::file_type::not_found ? "does not exist"
             : fs::exists(st)                      ? "not a directory"
                                                   : ec.message(),
             ")");
  write_atomically(run_dir / "report.html", render_html(read_run(run_dir)));
}

}  // namespace kiln::cli
