// Line charts as inline SVG for report.html (internal to kiln_cli), and the
// report's formatting of values and names. Charts have axes with nice tick
// labels, a title, a legend, step on x, and labelled marks at run events.
// Series longer than a bound are downsampled (min and max per bucket, so
// spikes stay visible) to keep the report small for long runs.
#pragma once

#include <string>
#include <vector>

namespace kiln::cli::report_detail {

/// How the y tick labels read.
enum class YFormat { number, percent, bytes };

struct Series {
  std::string name = {};
  std::string colour;                  // "#rrggbb"
  std::vector<double> x = {}, y = {};  // same length; a non-finite y breaks the line
  double width = 2.0;
  double opacity = 1.0;
  bool markers = false;  // circles at the points (drawn when at most kMaxMarkers)
  bool dashed = false;
};

/// A run event at a step (a resume, the NaN stop): a labelled vertical line.
struct Mark {
  double x;
  std::string label;
  std::string colour;
};

struct Chart {
  std::string id;  // the <figure> id, e.g. "chart-loss"
  std::string title;
  std::string y_label;
  std::string x_label = "step";
  YFormat y_format = YFormat::number;
  bool y_from_zero = false;  // include 0 in the y range
  std::vector<Series> series = {};
  std::vector<Mark> marks = {};  // drawn only when some series has data; widen the x range to reach them
};

/// The colour of series i in a categorical palette (tab10).
const char* palette(size_t i);

/// Plot geometry, shared with the tests that look for the frame in a rendering.
inline constexpr int kChartWidth = 560;
inline constexpr int kPlotHeight = 200;
inline constexpr const char* kFrameColour = "#8a94a6";
/// Points per series at most after downsampling.
inline constexpr size_t kMaxPoints = 600;
/// A series with markers shows them up to this many points (eval points stay visible on long runs).
inline constexpr size_t kMaxMarkers = 250;

/// At most max_points points, keeping the first and last and, per bucket, the
/// lowest and highest y in step order; non-finite y stay as line breaks.
void downsample(const std::vector<double>& x, const std::vector<double>& y, size_t max_points,
                std::vector<double>& out_x, std::vector<double>& out_y);

/// About `target` round tick values (1, 2, 5 times a power of ten) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target);

/// A tick label: compact, with as many decimals as the tick spacing needs.
std::string format_tick(double v, double spacing, YFormat format);

/// `v` for a person: 3 significant digits, k/M suffixes for large numbers.
std::string format_value(double v);

/// What a person calls a metrics.jsonl or summary.json key ("lr": "learning
/// rate", "accuracy": "test accuracy"); unknown keys with spaces for '_'.
std::string label(const std::string& key);

/// The chart as an <svg> element: a viewBox of kChartWidth user units, which
/// the page's CSS scales to its column's width (no xmlns needed inline).
std::string render_svg(const Chart& chart);

/// &, <, >, " escaped for HTML text and attributes.
std::string html_escape(const std::string& s);

}  // namespace kiln::cli::report_detail
