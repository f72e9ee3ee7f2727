// report.html's "Profile" section (cli/report_profile.h).
#include "cli/report_profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "cli/report_chart.h"
#include "kiln/core/format.h"

namespace kiln::cli::report_detail {
namespace {

// The geometry of report_chart.cpp's line charts, so the bars sit in the same grid and frame.
constexpr int kLeft = 72, kRight = 18, kTop = 36;
constexpr int kPlotWidth = kChartWidth - kLeft - kRight;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

double category_ms(const StepRow& s, int i) {
  switch (i) {
    case 0: return s.data_ms;
    case 1: return s.forward_ms;
    case 2: return s.backward_ms;
    case 3: return s.optimizer_ms;
    case 4: return s.comm_exposed_ms;
    default: return s.other_ms;
  }
}

/// A step's height: its total, or the sum of its parts when that is larger (a total missing from the file).
double step_height(const StepRow& s) {
  double sum = 0;
  for (int i = 0; i < kStepCategories; ++i) sum += std::max(0.0, category_ms(s, i));
  return std::max(s.total_ms, sum);
}

std::string ms_cell(double us) { return us >= 1e5 ? fmt("%.1f", us / 1e3) : fmt("%.3f", us / 1e3); }

}  // namespace

const char* step_category_name(int i) {
  static const char* const names[] = {"data wait", "forward", "backward", "optimizer", "comm (exposed)", "other"};
  return names[std::clamp(i, 0, kStepCategories - 1)];
}

const char* step_category_colour(int i) {
  // The report's palette (tab10): data brown, forward blue, backward orange, optimizer green,
  // communication red, other grey.
  static const int slots[] = {5, 0, 1, 2, 3, 9};
  return palette(static_cast<size_t>(slots[std::clamp(i, 0, kStepCategories - 1)]));
}

std::string render_step_bars(const std::vector<StepRow>& steps) {
  const int plot_bottom = kTop + kPlotHeight;
  const int height = plot_bottom + 46 + 2 * 18 + 6;
  std::ostringstream o;
  const std::string title = "Per-step breakdown (profiled steps)";
  o << "<svg class=\"chart\" width=\"" << kChartWidth << "\" height=\"" << height << "\" viewBox=\"0 0 " << kChartWidth
    << ' ' << height << "\" role=\"img\" aria-label=\"" << html_escape(title) << "\">\n";
  o << "<text class=\"title\" x=\"" << kLeft << "\" y=\"22\">" << html_escape(title) << "</text>\n";
  o << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << kPlotWidth << "\" height=\"" << kPlotHeight
    << "\" fill=\"#ffffff\"/>\n";
  double top = 0;
  for (const StepRow& s : steps) top = std::max(top, step_height(s));
  if (!(top > 0) || !std::isfinite(top)) top = 1;
  const std::vector<double> yt = nice_ticks(0, top, 5);
  const double yhi = yt.back() > 0 ? yt.back() : top;
  const double spacing = yt.size() > 1 ? yt[1] - yt[0] : yhi;
  auto py = [&](double v) { return plot_bottom - v / yhi * kPlotHeight; };
  for (double t : yt) {
    const double y = std::round(py(t)) + 0.5;
    if (t != yt.front() && t != yt.back())
      o << "<line class=\"grid\" stroke=\"#eceff3\" x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlotWidth << "\" y1=\""
        << y << "\" y2=\"" << y << "\"/>";
    o << "<text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
      << format_tick(t, spacing, YFormat::number) << "</text>\n";
  }
  const size_t n = std::max<size_t>(1, steps.size());
  const double slot = static_cast<double>(kPlotWidth) / static_cast<double>(n);
  const double bar = std::min(80.0, slot * 0.7);
  // Label every step when they fit, else about ten of them.
  const size_t label_every = std::max<size_t>(1, (steps.size() + 9) / 10);
  for (size_t k = 0; k < steps.size(); ++k) {
    const StepRow& s = steps[k];
    const double x = kLeft + slot * (static_cast<double>(k) + 0.5) - bar / 2;
    double base = 0;
    o << "<g class=\"bar\" data-step=\"" << s.step << "\">";
    for (int i = 0; i < kStepCategories; ++i) {
      const double v = std::max(0.0, category_ms(s, i));
      if (!(v > 0)) continue;
      const double y0 = py(base), y1 = py(base + v);
      o << "<rect class=\"segment\" data-category=\"" << step_category_name(i) << "\" x=\"" << fmt("%.1f", x)
        << "\" y=\"" << fmt("%.1f", y1) << "\" width=\"" << fmt("%.1f", bar) << "\" height=\"" << fmt("%.1f", y0 - y1)
        << "\" fill=\"" << step_category_colour(i) << "\"><title>step " << s.step << ": " << step_category_name(i)
        << " " << fmt("%.2f", v) << " ms</title></rect>";
      base += v;
    }
    o << "</g>\n";
    if (k % label_every == 0) {
      const double cx = kLeft + slot * (static_cast<double>(k) + 0.5);
      o << "<line class=\"axis\" stroke=\"" << kFrameColour << "\" x1=\"" << fmt("%.1f", cx) << "\" x2=\""
        << fmt("%.1f", cx) << "\" y1=\"" << plot_bottom << "\" y2=\"" << plot_bottom + 4 << "\"/>"
        << "<text class=\"tick\" x=\"" << fmt("%.1f", cx) << "\" y=\"" << plot_bottom + 17
        << "\" text-anchor=\"middle\">" << s.step << "</text>\n";
    }
  }
  if (steps.empty())
    o << "<text class=\"nodata\" x=\"" << kLeft + kPlotWidth / 2 << "\" y=\"" << kTop + kPlotHeight / 2
      << "\" text-anchor=\"middle\">no steps</text>\n";
  o << "<text class=\"label\" x=\"" << kLeft + kPlotWidth / 2 << "\" y=\"" << plot_bottom + 35
    << "\" text-anchor=\"middle\">step</text>\n";
  o << "<text class=\"label\" transform=\"translate(16 " << kTop + kPlotHeight / 2
    << ") rotate(-90)\" text-anchor=\"middle\">ms</text>\n";
  // The legend: three entries a row.
  for (int i = 0; i < kStepCategories; ++i) {
    const double x = kLeft + (i % 3) * 160.0, y = plot_bottom + 56 + (i / 3) * 18;
    o << "<g class=\"legend\"><rect x=\"" << x << "\" y=\"" << y - 10 << "\" width=\"22\" height=\"10\" fill=\""
      << step_category_colour(i) << "\"/><text x=\"" << x + 28 << "\" y=\"" << y << "\">" << step_category_name(i)
      << "</text></g>\n";
  }
  // The frame last, as report_chart.cpp draws it (the rendering test finds frames by its exact colour).
  o << "<rect class=\"frame\" x=\"" << kLeft - 0.5 << "\" y=\"" << kTop - 0.5 << "\" width=\"" << kPlotWidth + 1
    << "\" height=\"" << kPlotHeight + 1 << "\" fill=\"none\" stroke=\"" << kFrameColour
    << "\" shape-rendering=\"crispEdges\" vector-effect=\"non-scaling-stroke\"/>\n";
  o << "</svg>";
  return o.str();
}

void render_profile_section(std::ostream& o, const std::filesystem::path& run_dir) {
  std::optional<ProfileFiles> p = read_profile(run_dir);
  if (!p) return;
  o << "<h2 id=\"profile\">Profile</h2>\n";
  std::string what = "kiln profile";
  if (!p->steps.empty())
    what += " of step" + std::string(p->steps.size() > 1 ? "s " : " ") + std::to_string(p->steps.front().step) +
            (p->steps.size() > 1 ? "&ndash;" + std::to_string(p->steps.back().step) : std::string());
  if (p->world_size > 1) what += " (tables: rank 0; the trace has all " + std::to_string(p->world_size) + " ranks)";
  o << "<div class=\"sub\">" << what
    << ". The Chrome trace is profile/trace.json (open it in https://ui.perfetto.dev or chrome://tracing); "
       "<code>kiln profile RUN_DIR --sort total</code> prints the whole table."
    << "</div>\n";
  if (!p->problems.empty()) {
    o << "<ul class=\"notes\" id=\"profile-notes\">\n";
    for (const std::string& s : p->problems) o << "<li>profile/" << html_escape(s) << "</li>\n";
    o << "</ul>\n";
  }
  o << "<div class=\"charts\">\n";
  if (!p->steps.empty())
    o << "<figure class=\"chart\" id=\"chart-profile-steps\">\n" << render_step_bars(p->steps) << "\n</figure>\n";
  std::vector<OpRow> rows = p->ops;
  sort_ops(rows, "self");
  double self_sum = 0;
  for (const OpRow& r : rows) self_sum += r.self_us;
  o << "<figure class=\"chart\" id=\"profile-ops\"><figcaption>Top " << std::min(kProfileTopOps, rows.size()) << " of "
    << rows.size()
    << " ops by self time</figcaption>\n<table class=\"ops\"><tr><th>op</th><th>kind</th>"
       "<th>calls</th><th>self ms</th><th>self %</th><th>total ms</th><th>GFLOP/s</th></tr>\n";
  for (size_t i = 0; i < std::min(kProfileTopOps, rows.size()); ++i) {
    const OpRow& r = rows[i];
    o << "<tr><td>" << html_escape(r.name) << "</td><td>" << html_escape(r.kind) << "</td><td>" << r.calls
      << "</td><td>" << ms_cell(r.self_us) << "</td><td>"
      << (self_sum > 0 ? fmt("%.1f%%", 100 * r.self_us / self_sum) : std::string("-")) << "</td><td>"
      << ms_cell(r.total_us) << "</td><td>" << (r.gflops_per_s > 0 ? fmt("%.3g", r.gflops_per_s) : std::string("-"))
      << "</td></tr>\n";
  }
  o << "</table>";
  if (p->memory && p->memory->contains("peak_total") && (*p->memory)["peak_total"].is_number())
    o << "<p class=\"sub\" style=\"margin:6px\">peak live memory in the profiled steps: "
      << html_escape(format_bytes((*p->memory)["peak_total"].get<double>())) << "</p>";
  o << "</figure>\n</div>\n";
}

}  // namespace kiln::cli::report_detail
