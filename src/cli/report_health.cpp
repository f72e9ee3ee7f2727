// The health charts of report.html (cli/report_health.h).
#include "cli/report_health.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

namespace kiln::cli::report_detail {
using json = nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr size_t kMaxSeries = 10;

/// One series per entry name of `array_key` (in first-seen order), y = f(entry) at each record's step.
template <typename F>
std::vector<Series> by_name(const std::vector<json>& health, const char* array_key, F&& f) {
  std::vector<std::string> names;
  std::map<std::string, size_t> index;
  for (const json& h : health)
    for (const json& e : h.value(array_key, json::array())) {
      const std::string n = e.value("name", std::string());
      if (index.emplace(n, names.size()).second) names.push_back(n);
    }
  // Evenly spread, first and last kept: depth is what the charts show.
  std::vector<size_t> keep;
  if (names.size() <= kMaxSeries) {
    for (size_t i = 0; i < names.size(); ++i) keep.push_back(i);
  } else {
    for (size_t k = 0; k < kMaxSeries; ++k) keep.push_back(k * (names.size() - 1) / (kMaxSeries - 1));
  }
  std::vector<Series> out;
  for (size_t k = 0; k < keep.size(); ++k) {
    const std::string& name = names[keep[k]];
    Series s{.name = name, .colour = palette(k)};
    for (const json& h : health) {
      double y = kNaN;
      for (const json& e : h.value(array_key, json::array()))
        if (e.value("name", std::string()) == name) y = f(e);
      s.x.push_back(h.value("step", 0.0));
      s.y.push_back(y);
    }
    out.push_back(std::move(s));
  }
  return out;
}

double log10_or_nan(double v) { return v > 0 ? std::log10(v) : kNaN; }

}  // namespace

std::vector<Chart> health_charts(const std::vector<json>& health) {
  std::vector<Chart> out;
  if (health.empty()) return out;
  out.push_back(Chart{.id = "chart-health-grad",
                      .title = "Gradient norm by module",
                      .y_label = "gradient norm",
                      .y_from_zero = true,
                      .series = by_name(health, "modules", [](const json& m) { return m.value("grad_norm", kNaN); })});
  out.push_back(Chart{
      .id = "chart-health-update",
      .title = "Update-to-weight ratio by module (log10)",
      .y_label = "log10 ||dw|| / ||w|| (healthy near -3)",
      .series = by_name(health, "modules", [](const json& m) { return log10_or_nan(m.value("update_ratio", kNaN)); })});
  out.push_back(Chart{.id = "chart-health-dead",
                      .title = "Dead units by layer",
                      .y_label = "units inactive on the whole batch",
                      .y_format = YFormat::percent,
                      .y_from_zero = true,
                      .series = by_name(health, "dead", [](const json& d) { return d.value("fraction", kNaN); })});
  out.push_back(
      Chart{.id = "chart-health-act",
            .title = "Activation RMS by block (log10)",
            .y_label = "log10 RMS of the block's output",
            .series = by_name(health, "blocks", [](const json& b) { return log10_or_nan(b.value("act_rms", kNaN)); })});
  out.push_back(Chart{
      .id = "chart-health-gradrms",
      .title = "Gradient RMS by block (log10)",
      .y_label = "log10 RMS of the gradient at the block's output",
      .series = by_name(health, "blocks", [](const json& b) { return log10_or_nan(b.value("grad_rms", kNaN)); })});
  Series missing{.name = "parameters without a gradient", .colour = palette(3)};
  for (const json& h : health) {
    missing.x.push_back(h.value("step", 0.0));
    missing.y.push_back(h.value("no_grad_count", 0.0));
  }
  out.push_back(Chart{.id = "chart-health-nograd",
                      .title = "Parameters without a gradient",
                      .y_label = "parameters",
                      .y_from_zero = true,
                      .series = {missing}});
  // A family with no data at all (a model without ReLU/GELU modules) is left out.
  std::erase_if(out, [](const Chart& c) {
    for (const Series& s : c.series)
      for (double y : s.y)
        if (std::isfinite(y)) return false;
    return true;
  });
  return out;
}

std::vector<Chart> rank_charts(const std::vector<json>& train) {
  if (train.empty()) return {};
  size_t ranks = 0;
  for (const json& t : train) ranks = std::max(ranks, t["ranks"].value("busy_ms", json::array()).size());
  Chart c{.id = "chart-rank-busy",
          .title = "Own work per step by rank (outside the collective the others wait in)",
          .y_label = "ms per step",
          .y_from_zero = true};
  for (size_t r = 0; r < std::min(ranks, kMaxSeries); ++r) {
    Series s{.name = "rank " + std::to_string(r), .colour = palette(r)};
    for (const json& t : train) {
      const json busy = t["ranks"].value("busy_ms", json::array());
      s.x.push_back(t.value("step", 0.0));
      s.y.push_back(r < busy.size() && busy[r].is_number() ? busy[r].get<double>() : kNaN);
    }
    c.series.push_back(std::move(s));
  }
  if (c.series.empty()) return {};
  return {std::move(c)};
}

}  // namespace kiln::cli::report_detail
