// report.html for a run directory (see report.h): reads the run's files
// forgivingly (a report of a broken run is when it is needed most), then lays
// out a header summary, notes about what was missing, the charts and the config.
#include "cli/report.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
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
#include "kiln/core/error.h"

namespace kiln::cli {
namespace {

using nlohmann::json;
using namespace report_detail;
namespace fs = std::filesystem;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct TrainRecord {
  double step = kNaN, epoch = kNaN, loss = kNaN, lr = kNaN, grad_norm = kNaN, samples_per_s = kNaN,
         data_wait = kNaN, time_s = kNaN;
  bool has_memory = false;
  std::map<std::string, double> memory;
};

struct EvalRecord {
  double step = kNaN, loss = kNaN, accuracy = kNaN, bits_per_char = kNaN;
};

struct RunData {
  std::string name;
  std::optional<std::string> config;
  std::vector<TrainRecord> train;
  std::vector<EvalRecord> eval;
  std::optional<json> summary;
  std::vector<std::string> notes;  // plain text, escaped when written
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
  std::optional<std::string> text = slurp(path);
  if (!text) {
    run.notes.push_back("metrics.jsonl not found: there is nothing to chart.");
    return;
  }
  std::vector<size_t> malformed, no_step;
  std::map<std::string, std::vector<size_t>> unknown_kind;
  MissingFields train_missing, eval_missing;
  bool partial_last = false;
  size_t pos = 0, line_no = 0;
  while (pos < text->size()) {
    size_t end = text->find('\n', pos);
    bool terminated = end != std::string::npos;
    if (!terminated) end = text->size();
    std::string line = text->substr(pos, end - pos);
    pos = end + 1;
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
    if (kind != "train" && kind != "eval") {
      unknown_kind[kind.empty() ? "(none)" : kind].push_back(line_no);
      continue;
    }
    if (!j.contains("step") || !j["step"].is_number()) {
      no_step.push_back(line_no);
      continue;
    }
    if (kind == "train") {
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
                        "\" not charted (only \"train\" and \"eval\" are): line " + list_lines(lines) + ".");
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

// ---- figures for the header ----------------------------------------------

std::string format_duration(double s) {
  if (!std::isfinite(s)) return "n/a";
  char buf[64];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.1f s", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%d min %02d s", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%d h %02d min", static_cast<int>(s) / 3600, static_cast<int>(s) % 3600 / 60);
  }
  return buf;
}

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kNaN;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

double summary_number(const RunData& run, const char* key) {
  if (!run.summary) return kNaN;
  auto it = run.summary->find(key);
  return it != run.summary->end() && it->is_number() ? it->get<double>() : kNaN;
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
  std::string label, value;
};

std::vector<Card> header_cards(const RunData& run) {
  std::vector<Card> cards;
  // Final metrics first: the figure a person opened the report for.
  json final_metrics = json::object();
  if (run.summary && run.summary->contains("final") && (*run.summary)["final"].is_object()) {
    final_metrics = (*run.summary)["final"];
  } else if (!run.eval.empty()) {
    const EvalRecord& e = run.eval.back();
    if (std::isfinite(e.accuracy)) final_metrics["last eval accuracy"] = e.accuracy;
    if (std::isfinite(e.bits_per_char)) final_metrics["last eval bits_per_char"] = e.bits_per_char;
    if (std::isfinite(e.loss)) final_metrics["last eval loss"] = e.loss;
  }
  for (auto& [key, v] : final_metrics.items())
    if (v.is_number() || v.is_string()) cards.push_back({key, format_metric(key, v)});

  double steps = summary_number(run, "steps");
  if (!std::isfinite(steps) && !run.train.empty()) steps = run.train.back().step;
  cards.push_back({"steps", std::isfinite(steps) ? format_step(steps) : "n/a"});
  double wall = summary_number(run, "wall_s");
  for (auto r = run.train.rbegin(); !std::isfinite(wall) && r != run.train.rend(); ++r) wall = r->time_s;
  cards.push_back({"wall time", format_duration(wall)});
  std::vector<double> sps, wait;
  double peak = kNaN;
  for (const TrainRecord& r : run.train) {
    sps.push_back(r.samples_per_s);
    wait.push_back(r.data_wait);
    if (r.has_memory) {
      double total = 0;
      for (auto& [c, b] : r.memory) total += b;
      peak = std::isfinite(peak) ? std::max(peak, total) : total;
    }
  }
  double m = median(sps);
  cards.push_back({"throughput (median)", std::isfinite(m) ? format_value(m) + " samples/s" : "n/a"});
  double w = median(wait);
  if (std::isfinite(w)) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f%%", w * 100);
    cards.push_back({"data wait (median)", buf});
  }
  if (std::isfinite(peak)) cards.push_back({"peak memory (logged)", format_bytes(peak)});
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

std::vector<Figure> build_charts(const RunData& run) {
  std::vector<Figure> figs;
  auto add = [&](Chart c, const std::string& why_missing) {
    std::erase_if(c.series, [](const Series& s) { return !any_finite(s); });
    figs.push_back({std::move(c), ""});
    if (figs.back().chart.series.empty()) figs.back().missing = why_missing;
  };

  Chart loss{.id = "chart-loss", .title = "Loss", .y_label = "loss"};
  Series train = column(run.train, &TrainRecord::loss, "train", palette(0));
  if (train.y.size() >= 50) {
    Series smoothed = train;
    smoothed.y = smooth(train.y);
    smoothed.name = "train (smoothed)";
    train.name = "train";
    train.opacity = 0.3;
    train.width = 1.2;
    loss.series.push_back(std::move(train));
    loss.series.push_back(std::move(smoothed));
  } else {
    loss.series.push_back(std::move(train));
  }
  Series eval_loss = column(run.eval, &EvalRecord::loss, "eval", palette(1));
  eval_loss.markers = true;
  loss.series.push_back(std::move(eval_loss));
  add(std::move(loss), "no train or eval record has a \"loss\".");

  Series acc = column(run.eval, &EvalRecord::accuracy, "eval accuracy", palette(3));
  Series bpc = column(run.eval, &EvalRecord::bits_per_char, "eval bits/char", palette(3));
  if (any_finite(bpc) && !any_finite(acc)) {
    bpc.markers = true;
    add(Chart{.id = "chart-eval", .title = "Eval bits per character", .y_label = "bits/char", .series = {bpc}}, "");
  } else {
    acc.markers = true;
    const bool fraction = std::all_of(acc.y.begin(), acc.y.end(), [](double v) { return !(v > 1); });
    add(Chart{.id = "chart-eval",
              .title = "Eval accuracy",
              .y_label = "accuracy",
              .y_format = fraction ? YFormat::percent : YFormat::number,
              .series = {acc}},
        run.eval.empty() ? "no eval records." : "no eval record has \"accuracy\" or \"bits_per_char\".");
    if (any_finite(bpc)) {
      bpc.markers = true;
      add(Chart{.id = "chart-bpc", .title = "Eval bits per character", .y_label = "bits/char", .series = {bpc}}, "");
    }
  }

  add(Chart{.id = "chart-lr",
            .title = "Learning rate",
            .y_label = "lr",
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::lr, "lr", palette(2))}},
      "no train record has \"lr\".");
  add(Chart{.id = "chart-throughput",
            .title = "Throughput",
            .y_label = "samples/s",
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::samples_per_s, "samples/s", palette(4))}},
      "no train record has \"samples_per_s\".");
  add(Chart{.id = "chart-data-wait",
            .title = "Data-wait fraction",
            .y_label = "time waiting for data",
            .y_format = YFormat::percent,
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::data_wait, "data wait", palette(5))}},
      "no train record has \"data_wait\".");
  add(Chart{.id = "chart-grad-norm",
            .title = "Gradient norm",
            .y_label = "grad norm",
            .y_from_zero = true,
            .series = {column(run.train, &TrainRecord::grad_norm, "grad norm", palette(7))}},
      "no train record has \"grad_norm\".");

  // One line per memory category (absent from a record means none of it), and their total.
  std::set<std::string> categories;
  for (const TrainRecord& r : run.train)
    for (auto& [c, b] : r.memory) categories.insert(c);
  Chart mem{.id = "chart-memory",
            .title = "Memory by category",
            .y_label = "bytes",
            .y_format = YFormat::bytes,
            .y_from_zero = true};
  size_t k = 0;
  for (const std::string& c : categories) {
    Series s{.name = c, .colour = palette(k++)};
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
  return figs;
}

// ---- the page ----------------------------------------------------------------

const char* kStyle = R"(
body{font:14px/1.45 "DejaVu Sans",system-ui,sans-serif;margin:0;padding:14px 12px;color:#1f2937;background:#fff}
h1{font-size:22px;margin:0}
h2{font-size:16px;margin:22px 0 8px}
.sub{color:#6b7280;font-size:13px;margin-top:2px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0 4px}
.card{border:1px solid #e5e7eb;border-radius:8px;padding:6px 14px;min-width:110px}
.card .v{font-size:19px;font-weight:600}
.card .k{font-size:12px;color:#6b7280}
.notes{background:#fffbeb;border:1px solid #fcd34d;border-radius:8px;padding:6px 14px 6px 30px;margin:12px 0;font-size:13px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
figure.chart{margin:0;border:1px solid #e5e7eb;border-radius:8px;padding:4px}
figure.missing{width:560px;height:120px;display:flex;flex-direction:column;justify-content:center;align-items:center;color:#6b7280}
figure.missing figcaption{font-weight:600;color:#111827}
svg.chart text{font:11px "DejaVu Sans",sans-serif;fill:#4b5563}
svg.chart text.title{font-size:14px;font-weight:600;fill:#111827}
svg.chart text.label{font-size:12px;fill:#374151}
table.final{border-collapse:collapse;font-size:13px}
table.final td{border-bottom:1px solid #eef0f3;padding:3px 14px 3px 0}
pre.config{background:#f8fafc;border:1px solid #e5e7eb;border-radius:8px;padding:10px 14px;overflow:auto;font:12px/1.45 "DejaVu Sans Mono",monospace}
)";

std::string render_html(const RunData& run) {
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>kiln run "
    << html_escape(run.name) << "</title>\n<style>" << kStyle << "</style>\n</head>\n<body>\n";
  o << "<h1>kiln run: " << html_escape(run.name) << "</h1>\n";
  std::string config_path;
  if (run.summary && run.summary->contains("config_path") && (*run.summary)["config_path"].is_string())
    config_path = (*run.summary)["config_path"].get<std::string>();
  o << "<div class=\"sub\">" << run.train.size() << " train records, " << run.eval.size() << " eval records"
    << (config_path.empty() ? "" : ", config " + html_escape(config_path)) << "</div>\n";
  o << "<div class=\"cards\" id=\"summary\">\n";
  for (const Card& c : header_cards(run))
    o << "<div class=\"card\"><div class=\"v\">" << html_escape(c.value) << "</div><div class=\"k\">"
      << html_escape(c.label) << "</div></div>\n";
  o << "</div>\n";
  if (!run.notes.empty()) {
    o << "<ul class=\"notes\" id=\"notes\">\n";
    for (const std::string& n : run.notes) o << "<li>" << html_escape(n) << "</li>\n";
    o << "</ul>\n";
  }
  o << "<h2>Charts</h2>\n<div class=\"charts\">\n";
  for (const Figure& f : build_charts(run)) {
    if (f.missing.empty()) {
      o << "<figure class=\"chart\" id=\"" << f.chart.id << "\">\n" << render_svg(f.chart) << "\n</figure>\n";
    } else {
      o << "<figure class=\"chart missing\" id=\"" << f.chart.id << "\"><figcaption>" << html_escape(f.chart.title)
        << "</figcaption><p>no data: " << html_escape(f.missing) << "</p></figure>\n";
    }
  }
  o << "</div>\n";
  if (run.summary && run.summary->contains("final") && (*run.summary)["final"].is_object()) {
    o << "<h2>Final metrics</h2>\n<table class=\"final\" id=\"final\">\n";
    for (auto& [key, v] : (*run.summary)["final"].items())
      o << "<tr><td>" << html_escape(key) << "</td><td>" << html_escape(format_metric(key, v)) << "</td></tr>\n";
    o << "</table>\n";
  }
  o << "<h2>Config</h2>\n";
  if (run.config) {
    o << "<pre class=\"config\" id=\"config\">" << html_escape(*run.config) << "</pre>\n";
  } else {
    o << "<p>config.toml not found.</p>\n";
  }
  o << "</body>\n</html>\n";
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
