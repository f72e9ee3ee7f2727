// Inline-SVG line charts for report.html (see report_chart.h).
#include "cli/report_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include "kiln/core/format.h"

namespace kiln::cli::report_detail {
namespace {

constexpr int kLeft = 72, kRight = 18, kTop = 36;
constexpr int kPlotWidth = kChartWidth - kLeft - kRight;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string fmt_dec(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", std::clamp(decimals, 0, 12), v);
  std::string s = buf;
  if (s[0] == '-' && s.find_first_not_of("-0.") == std::string::npos) s.erase(0, 1);  // no "-0"
  return s;
}

int floor_log10(double v) { return static_cast<int>(std::floor(std::log10(std::fabs(v)) + 1e-9)); }

// The finite [lo, hi] over all series' y (or x), NaN when there is none.
void extent(const std::vector<Series>& series, bool of_x, double& lo, double& hi) {
  lo = std::numeric_limits<double>::infinity();
  hi = -lo;
  for (const Series& s : series) {
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) continue;
      double v = of_x ? s.x[i] : s.y[i];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (lo > hi) lo = hi = kNaN;
}

// Marks widen the x range of a chart that has data (a NaN one step after the last record).
void widen_for_marks(const std::vector<Mark>& marks, double& lo, double& hi) {
  if (!std::isfinite(lo)) return;
  for (const Mark& m : marks)
    if (std::isfinite(m.x)) {
      lo = std::min(lo, m.x);
      hi = std::max(hi, m.x);
    }
}

// Legend entries laid out in rows that fit the chart width; returns the rows' count.
struct LegendItem {
  double x;
  int row;
};
int layout_legend(const std::vector<Series>& series, std::vector<LegendItem>& items) {
  double x = kLeft;
  int row = 0;
  for (const Series& s : series) {
    double w = 28 + 6.6 * static_cast<double>(s.name.size()) + 14;
    if (x + w > kChartWidth - kRight && x > kLeft) {
      x = kLeft;
      ++row;
    }
    items.push_back({x, row});
    x += w;
  }
  return series.empty() ? 0 : row + 1;
}

}  // namespace

const char* palette(size_t i) {
  static const char* const colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                        "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};
  return colours[i % 10];
}

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

void downsample(const std::vector<double>& x, const std::vector<double>& y, size_t max_points,
                std::vector<double>& out_x, std::vector<double>& out_y) {
  out_x.clear();
  out_y.clear();
  const size_t n = std::min(x.size(), y.size());
  if (n <= max_points || max_points < 4) {
    out_x.assign(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
    out_y.assign(y.begin(), y.begin() + static_cast<std::ptrdiff_t>(n));
    return;
  }
  // Per bucket its lowest and highest point in order, and a break if it held a
  // non-finite value: at most 3 points a bucket, plus the two ends.
  const size_t buckets = (max_points - 2) / 3;
  out_x.push_back(x[0]);
  out_y.push_back(y[0]);
  for (size_t b = 0; b < buckets; ++b) {
    size_t begin = 1 + b * (n - 2) / buckets, end = 1 + (b + 1) * (n - 2) / buckets;
    size_t lo = end, hi = end;
    bool gap = false;
    for (size_t i = begin; i < end; ++i) {
      if (!std::isfinite(y[i])) {
        gap = true;
        continue;
      }
      if (lo == end || y[i] < y[lo]) lo = i;
      if (hi == end || y[i] > y[hi]) hi = i;
    }
    if (gap) {  // a break in the line where the values were not finite
      out_x.push_back(x[begin]);
      out_y.push_back(kNaN);
    }
    if (lo == end) continue;
    size_t first = std::min(lo, hi), second = std::max(lo, hi);
    out_x.push_back(x[first]);
    out_y.push_back(y[first]);
    if (second != first) {
      out_x.push_back(x[second]);
      out_y.push_back(y[second]);
    }
  }
  out_x.push_back(x[n - 1]);
  out_y.push_back(y[n - 1]);
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {};
  if (hi <= lo) {
    double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  double raw = (hi - lo) / std::max(1, target);
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double norm = raw / mag;
  double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  double start = std::floor(lo / step + 1e-9) * step, end = std::ceil(hi / step - 1e-9) * step;
  // Ranges near the limits of double (1e308 wide, 1e-310 small) have no round ticks.
  if (!std::isfinite(raw) || !(step > 0) || !std::isfinite(start) || !std::isfinite(end) || start == end ||
      (end - start) / step > 100)
    return {lo, hi};
  std::vector<double> ticks;
  for (int i = 0; start + i * step <= end + step * 1e-6 && i < 100; ++i) {
    double t = start + i * step;
    if (std::fabs(t) < step * 1e-9) t = 0;
    ticks.push_back(t);
  }
  return ticks;
}

std::string format_tick(double v, double spacing, YFormat format) {
  if (format == YFormat::percent) {
    v *= 100;
    spacing *= 100;
  }
  std::string suffix = format == YFormat::percent ? "%" : "";
  if (v == 0) return "0" + suffix;
  double av = std::fabs(v);
  if (av >= 1e9) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*e", std::clamp(floor_log10(av) - floor_log10(spacing), 0, 6), v);
    return buf + suffix;
  }
  if (av >= 1e6 && spacing >= 1e5) return fmt_dec(v / 1e6, std::max(0, -floor_log10(spacing / 1e6))) + "M" + suffix;
  if (av >= 1e4 && spacing >= 100) return fmt_dec(v / 1e3, std::max(0, -floor_log10(spacing / 1e3))) + "k" + suffix;
  if (spacing >= 1e-4) return fmt_dec(v, std::max(0, -floor_log10(spacing))) + suffix;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*e", std::max(0, floor_log10(av) - floor_log10(spacing)), v);
  return buf + suffix;
}

std::string format_value(double v) {
  if (!std::isfinite(v)) return "n/a";
  double av = std::fabs(v);
  if (av >= 1e9) return fmt("%.3g", v / 1e9) + "G";
  if (av >= 1e6) return fmt("%.3g", v / 1e6) + "M";
  if (av >= 1e4) return fmt("%.3g", v / 1e3) + "k";
  if (av >= 1000) return fmt("%.0f", v);
  return fmt("%.3g", v);
}

std::string label(const std::string& key) {
  static const std::map<std::string, std::string> labels = {
      {"loss", "train loss"},
      {"lr", "learning rate"},
      {"grad_norm", "gradient norm"},
      {"samples_per_s", "samples/s"},
      {"data_wait", "data wait"},
      {"eval_loss", "test loss"},
      {"accuracy", "test accuracy"},
      {"bits_per_char", "test bits/char"},
      {"optimizer_state", "optimizer state"},
  };
  auto it = labels.find(key);
  if (it != labels.end()) return it->second;
  std::string s = key;
  std::replace(s.begin(), s.end(), '_', ' ');
  return s;
}

std::string render_svg(const Chart& chart) {
  std::vector<LegendItem> legend;
  int legend_rows = layout_legend(chart.series, legend);
  const int height = kTop + kPlotHeight + 46 + legend_rows * 18 + 6;
  std::ostringstream o;
  o << "<svg class=\"chart\" width=\"" << kChartWidth << "\" height=\"" << height << "\" viewBox=\"0 0 " << kChartWidth
    << ' ' << height << "\" role=\"img\" aria-label=\"" << html_escape(chart.title) << "\">\n";
  o << "<text class=\"title\" x=\"" << kLeft << "\" y=\"22\">" << html_escape(chart.title) << "</text>\n";

  // Bytes are plotted in the unit that fits the largest value.
  double y_scale = 1;
  std::string y_label = chart.y_label;
  double xlo, xhi, ylo, yhi;
  extent(chart.series, true, xlo, xhi);
  extent(chart.series, false, ylo, yhi);
  widen_for_marks(chart.marks, xlo, xhi);
  if (chart.y_format == YFormat::bytes && std::isfinite(yhi)) {
    static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (std::max(std::fabs(ylo), std::fabs(yhi)) / y_scale >= 1024 && u < 4) {
      y_scale *= 1024;
      ++u;
    }
    y_label += std::string(" (") + units[u] + ")";
    ylo /= y_scale;
    yhi /= y_scale;
  }
  const int plot_bottom = kTop + kPlotHeight, plot_right = kLeft + kPlotWidth;
  // The frame goes on last, over lines that touch the plot's edges (a data-wait of 0); one device pixel
  // wide in its exact colour however the page scales the chart (the rendering test finds frames by it).
  std::ostringstream frame;
  frame << "<rect class=\"frame\" x=\"" << kLeft - 0.5 << "\" y=\"" << kTop - 0.5 << "\" width=\"" << kPlotWidth + 1
        << "\" height=\"" << kPlotHeight + 1 << "\" fill=\"none\" stroke=\"" << kFrameColour
        << "\" shape-rendering=\"crispEdges\" vector-effect=\"non-scaling-stroke\"/>\n";
  o << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << kPlotWidth << "\" height=\"" << kPlotHeight
    << "\" fill=\"#ffffff\"/>\n";
  if (!std::isfinite(xlo)) {
    o << "<text class=\"nodata\" x=\"" << kLeft + kPlotWidth / 2 << "\" y=\"" << kTop + kPlotHeight / 2
      << "\" text-anchor=\"middle\">no data</text>\n"
      << frame.str() << "</svg>";
    return o.str();
  }
  if (chart.y_from_zero) {
    ylo = std::min(ylo, 0.0);
    yhi = std::max(yhi, 0.0);
  }
  std::vector<double> yt = nice_ticks(ylo, yhi, 5);
  ylo = yt.front();
  yhi = yt.back();
  double yspacing = yt.size() > 1 ? yt[1] - yt[0] : 1;
  if (xhi <= xlo) {
    xlo -= 1;
    xhi += 1;
  }
  std::vector<double> xt = nice_ticks(xlo, xhi, 6);
  double xspacing = xt.size() > 1 ? xt[1] - xt[0] : 1;
  if (xspacing < 1) {  // steps are integers: no fractional ticks
    xt = nice_ticks(std::floor(xlo), std::ceil(xhi), static_cast<int>(std::ceil(xhi) - std::floor(xlo)));
    xspacing = 1;
  }
  // x keeps the data's own range (ticks inside it) so the lines reach both edges.
  // Halved before subtracting so that ranges as wide as double's do not overflow.
  auto frac = [](double v, double lo, double hi) { return (v / 2 - lo / 2) / (hi / 2 - lo / 2); };
  auto px = [&](double x) { return kLeft + frac(x, xlo, xhi) * kPlotWidth; };
  auto py = [&](double y) { return plot_bottom - frac(y / y_scale, ylo, yhi) * kPlotHeight; };
  auto pyt = [&](double t) { return plot_bottom - frac(t, ylo, yhi) * kPlotHeight; };

  for (double t : yt) {
    double y = std::round(pyt(t)) + 0.5;
    if (!std::isfinite(y)) continue;
    if (t != yt.front() && t != yt.back())
      o << "<line class=\"grid\" stroke=\"#eceff3\" x1=\"" << kLeft << "\" x2=\"" << plot_right << "\" y1=\"" << y
        << "\" y2=\"" << y << "\"/>";
    o << "<text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
      << format_tick(t, yspacing, chart.y_format) << "</text>\n";
  }
  for (double t : xt) {
    if (t < xlo - 1e-9 * (xhi - xlo) || t > xhi + 1e-9 * (xhi - xlo)) continue;
    double x = std::round(px(t)) + 0.5;
    o << "<line class=\"grid\" stroke=\"#eceff3\" x1=\"" << x << "\" x2=\"" << x << "\" y1=\"" << kTop << "\" y2=\""
      << plot_bottom << "\"/><line class=\"axis\" stroke=\"" << kFrameColour << "\" x1=\"" << x << "\" x2=\"" << x
      << "\" y1=\"" << plot_bottom << "\" y2=\"" << plot_bottom + 4 << "\"/>";
    o << "<text class=\"tick\" x=\"" << x << "\" y=\"" << plot_bottom + 17 << "\" text-anchor=\"middle\">"
      << format_tick(t, xspacing, YFormat::number) << "</text>\n";
  }
  o << "<text class=\"label\" x=\"" << kLeft + kPlotWidth / 2 << "\" y=\"" << plot_bottom + 35
    << "\" text-anchor=\"middle\">" << html_escape(chart.x_label) << "</text>\n";
  o << "<text class=\"label\" transform=\"translate(16 " << kTop + kPlotHeight / 2
    << ") rotate(-90)\" text-anchor=\"middle\">" << html_escape(y_label) << "</text>\n";

  std::vector<double> dx, dy;
  for (const Series& s : chart.series) {
    downsample(s.x, s.y, kMaxPoints, dx, dy);
    for (size_t k = 0; k < dx.size(); ++k)  // never a "nan" coordinate in the SVG
      if (!std::isfinite(px(dx[k])) || !std::isfinite(py(dy[k]))) dy[k] = kNaN;
    std::string style = "fill=\"none\" stroke=\"" + s.colour + "\" stroke-width=\"" + fmt("%g", s.width) + "\"" +
                        (s.opacity < 1 ? " stroke-opacity=\"" + fmt("%g", s.opacity) + "\"" : "") +
                        (s.dashed ? " stroke-dasharray=\"6 4\"" : "") + " stroke-linejoin=\"round\"";
    size_t i = 0;
    while (i < dx.size()) {
      while (i < dx.size() && !std::isfinite(dy[i])) ++i;
      size_t j = i;
      while (j < dx.size() && std::isfinite(dy[j])) ++j;
      if (j - i == 1 && !s.markers) {
        o << "<circle cx=\"" << fmt("%.1f", px(dx[i])) << "\" cy=\"" << fmt("%.1f", py(dy[i])) << "\" r=\""
          << std::max(3.0, s.width) << "\" fill=\"" << s.colour << "\"/>\n";
      } else if (j > i) {
        o << "<polyline class=\"series\" data-series=\"" << html_escape(s.name) << "\" " << style << " points=\"";
        for (size_t k = i; k < j; ++k)
          o << (k > i ? " " : "") << fmt("%.1f", px(dx[k])) << ',' << fmt("%.1f", py(dy[k]));
        o << "\"/>\n";
      }
      i = j;
    }
    if (s.markers && dx.size() <= kMaxMarkers) {
      const double r = dx.size() <= 60 ? 3.5 : 2.5;
      for (size_t k = 0; k < dx.size(); ++k) {
        if (!std::isfinite(dy[k])) continue;
        // A tooltip with the exact value: the browser shows <title> on hover, no script needed.
        std::string value = chart.y_format == YFormat::percent ? fmt("%.2f%%", dy[k] * 100)
                            : chart.y_format == YFormat::bytes ? format_bytes(dy[k])
                                                               : fmt("%.4g", dy[k]);
        o << "<circle class=\"marker\" cx=\"" << fmt("%.1f", px(dx[k])) << "\" cy=\"" << fmt("%.1f", py(dy[k]))
          << "\" r=\"" << r << "\" fill=\"" << s.colour << "\" stroke=\"#ffffff\" stroke-width=\"1\"><title>"
          << html_escape(s.name) << " at step " << fmt("%.0f", dx[k]) << ": " << value << "</title></circle>";
      }
      o << '\n';
    }
  }

  for (size_t k = 0; k < chart.series.size(); ++k) {
    const Series& s = chart.series[k];
    double x = legend[k].x, y = plot_bottom + 56 + legend[k].row * 18;
    o << "<g class=\"legend\"><line x1=\"" << x << "\" x2=\"" << x + 22 << "\" y1=\"" << y - 4 << "\" y2=\"" << y - 4
      << "\" stroke=\"" << s.colour << "\" stroke-width=\"3\"" << (s.dashed ? " stroke-dasharray=\"6 4\"" : "")
      << (s.opacity < 1 ? " stroke-opacity=\"" + fmt("%g", s.opacity) + "\"" : "") << "/>";
    if (s.markers)
      o << "<circle cx=\"" << x + 11 << "\" cy=\"" << y - 4 << "\" r=\"3.5\" fill=\"" << s.colour << "\"/>";
    o << "<text x=\"" << x + 28 << "\" y=\"" << y << "\">" << html_escape(s.name) << "</text></g>\n";
  }
  o << frame.str();
  // Marks over the lines and the frame (a NaN at the last step sits on its edge), their labels at the
  // top of the plot, on the other side when crowded.
  double last_label_x = -1e9;
  for (const Mark& m : chart.marks) {
    const double x = std::round(px(m.x)) + 0.5;
    if (!std::isfinite(x)) continue;
    o << "<g class=\"mark\"><line x1=\"" << x << "\" x2=\"" << x << "\" y1=\"" << kTop + 1 << "\" y2=\""
      << plot_bottom - 1 << "\" stroke=\"" << m.colour << "\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"/>";
    const bool left = x > plot_right - 90 || x - last_label_x < 90;
    o << "<text class=\"mark-label\" x=\"" << (left ? x - 4 : x + 4) << "\" y=\"" << kTop + 12 << "\" text-anchor=\""
      << (left ? "end" : "start") << "\" style=\"fill:" << m.colour << "\">" << html_escape(m.label) << "</text><title>"
      << html_escape(m.label) << " at step " << fmt("%.0f", m.x) << "</title></g>\n";
    last_label_x = x;
  }

  o << "</svg>";
  return o.str();
}

}  // namespace kiln::cli::report_detail
