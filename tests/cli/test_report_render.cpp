// report.html as a browser draws it: headless Chromium renders the report of a
// synthetic run to a PNG, which is decoded here (zlib; the 8-bit RGB/RGBA,
// non-interlaced PNGs Chromium writes) to check that every chart's plot frame
// is on the page, in a grid as wide as the page, and holds its lines, in their
// colours, with a title and tick labels beside it; and it dumps the DOM after
// the page's script ran, to check that the script raised nothing and that the
// run's status is shown.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/report.h"
#include "cli/report_chart.h"
#include "cli/report_profile.h"
#include "support/test_util.h"
#include "test_report_fixture.h"

namespace kiln::test {
namespace {

namespace fs = std::filesystem;
namespace rd = cli::report_detail;

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // 3 bytes a pixel, rows top to bottom
  const uint8_t* at(int x, int y) const { return &rgb[(static_cast<size_t>(y) * width + x) * 3]; }
};

uint32_t be32(const std::string& s, size_t p) {
  return (uint32_t(uint8_t(s[p])) << 24) | (uint32_t(uint8_t(s[p + 1])) << 16) | (uint32_t(uint8_t(s[p + 2])) << 8) |
         uint32_t(uint8_t(s[p + 3]));
}

int paeth(int a, int b, int c) {
  int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  return pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
}

Image decode_png(const std::string& png) {
  if (png.size() < 8 || png.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) throw std::runtime_error("not a PNG");
  Image img;
  int colour_type = -1, channels = 0;
  std::string idat;
  for (size_t p = 8; p + 12 <= png.size();) {
    uint32_t len = be32(png, p);
    std::string type = png.substr(p + 4, 4);
    if (p + 12 + len > png.size()) throw std::runtime_error("PNG chunk " + type + " runs past the end");
    if (type == "IHDR") {
      img.width = static_cast<int>(be32(png, p + 8));
      img.height = static_cast<int>(be32(png, p + 12));
      int depth = uint8_t(png[p + 16]), interlace = uint8_t(png[p + 20]);
      colour_type = uint8_t(png[p + 17]);
      channels = colour_type == 2 ? 3 : colour_type == 6 ? 4 : 0;
      if (depth != 8 || channels == 0 || interlace != 0)
        throw std::runtime_error("PNG is not 8-bit RGB/RGBA non-interlaced: depth " + std::to_string(depth) +
                                 ", colour type " + std::to_string(colour_type));
    } else if (type == "IDAT") {
      idat.append(png, p + 8, len);
    } else if (type == "IEND") {
      break;
    }
    p += 12 + len;
  }
  if (channels == 0 || img.width <= 0 || img.height <= 0) throw std::runtime_error("PNG without IHDR");
  const size_t stride = static_cast<size_t>(img.width) * channels;
  std::vector<uint8_t> raw(img.height * (stride + 1));
  uLongf raw_len = raw.size();
  if (uncompress(raw.data(), &raw_len, reinterpret_cast<const Bytef*>(idat.data()), idat.size()) != Z_OK ||
      raw_len != raw.size())
    throw std::runtime_error("PNG image data does not inflate to " + std::to_string(raw.size()) + " bytes");
  std::vector<uint8_t> cur(stride), prev(stride, 0);
  img.rgb.resize(static_cast<size_t>(img.width) * img.height * 3);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t* line = &raw[y * (stride + 1)];
    int filter = line[0];
    for (size_t i = 0; i < stride; ++i) {
      int a = i >= size_t(channels) ? cur[i - channels] : 0, b = prev[i],
          c = i >= size_t(channels) ? prev[i - channels] : 0;
      int pred = filter == 0   ? 0
                 : filter == 1 ? a
                 : filter == 2 ? b
                 : filter == 3 ? (a + b) / 2
                 : filter == 4 ? paeth(a, b, c)
                               : -1;
      if (pred < 0) throw std::runtime_error("PNG row " + std::to_string(y) + " has filter " + std::to_string(filter));
      cur[i] = static_cast<uint8_t>(line[1 + i] + pred);
    }
    for (int x = 0; x < img.width; ++x)
      for (int k = 0; k < 3; ++k) img.rgb[(static_cast<size_t>(y) * img.width + x) * 3 + k] = cur[x * channels + k];
    std::swap(cur, prev);
  }
  return img;
}

// chromium or chromium-browser on PATH (Debian names it chromium); empty if neither.
std::string find_chromium() {
  std::string path = std::getenv("PATH") ? std::getenv("PATH") : "/usr/bin:/bin";
  std::istringstream dirs(path);
  for (std::string dir; std::getline(dirs, dir, ':');)
    for (const char* name : {"chromium", "chromium-browser"}) {
      fs::path p = fs::path(dir) / name;
      if (!dir.empty() && ::access(p.c_str(), X_OK) == 0) return p.string();
    }
  return "";
}

struct Rgb {
  int r, g, b;
};
Rgb hex(const std::string& s) {
  return {std::stoi(s.substr(1, 2), nullptr, 16), std::stoi(s.substr(3, 2), nullptr, 16),
          std::stoi(s.substr(5, 2), nullptr, 16)};
}

struct Box {
  int x0, y0, x1, y1;  // the frame's outer pixels
};

bool is_colour(const uint8_t* p, Rgb c) { return p[0] == c.r && p[1] == c.g && p[2] == c.b; }

// Plot frames: exact-colour horizontal runs (the frame is drawn with crisp
// edges at any scale), paired top and bottom by a frame-coloured left edge.
std::vector<Box> find_frames(const Image& img) {
  const Rgb f = hex(rd::kFrameColour);
  struct Run {
    int y, x0, x1;
  };
  std::vector<Run> runs;
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width;) {
      int x0 = x;
      while (x < img.width && is_colour(img.at(x, y), f)) ++x;
      if (x - x0 >= 300) runs.push_back({y, x0, x - 1});
      x = std::max(x, x0 + 1);
    }
  }
  std::vector<Box> boxes;
  std::vector<bool> used(runs.size(), false);
  for (size_t a = 0; a < runs.size(); ++a) {
    if (used[a]) continue;
    for (size_t b = a + 1; b < runs.size(); ++b) {
      if (used[b] || runs[b].y < runs[a].y + 100 || std::abs(runs[b].x0 - runs[a].x0) > 1 ||
          std::abs(runs[b].x1 - runs[a].x1) > 1)
        continue;
      bool edge = true;
      for (int y = runs[a].y; y <= runs[b].y && edge; ++y) edge = is_colour(img.at(runs[a].x0, y), f);
      if (!edge) continue;
      boxes.push_back({runs[a].x0, runs[a].y, runs[a].x1, runs[b].y});
      used[a] = used[b] = true;
      break;
    }
  }
  std::sort(boxes.begin(), boxes.end(),
            [](const Box& a, const Box& b) { return std::tie(a.y0, a.x0) < std::tie(b.y0, b.x0); });
  return boxes;
}

int count_pixels(const Image& img, int x0, int y0, int x1, int y1, auto pred) {
  int n = 0;
  for (int y = std::max(0, y0); y <= std::min(img.height - 1, y1); ++y)
    for (int x = std::max(0, x0); x <= std::min(img.width - 1, x1); ++x) n += pred(img.at(x, y)) ? 1 : 0;
  return n;
}

std::string tail(const std::string& s) { return s.substr(s.size() > 4000 ? s.size() - 4000 : 0); }

// Headless Chromium on a report: a screenshot, or the DOM after the page's
// script ran with the console's messages (--enable-logging=stderr prints each
// as a ":CONSOLE" line, an uncaught exception as "Uncaught ...").
class Browser {
 public:
  explicit Browser(const TempDir& tmp) : tmp_(tmp), chromium_(find_chromium()) {}
  bool found() const { return !chromium_.empty(); }

  Image screenshot(const fs::path& html, int width, int height) {
    const std::string png = tmp_.file("shot-" + std::to_string(++runs_) + ".png");
    const std::string cmd = base() + " --hide-scrollbars --screenshot=" + shell_quote(png) +
                            " --window-size=" + std::to_string(width) + "," + std::to_string(height) + " " + url(html);
    std::string out;
    const int rc = run_command(cmd, out);
    if (rc != 0 || !fs::exists(png))
      throw std::runtime_error(cmd + " failed (rc " + std::to_string(rc) + "):\n" + tail(out));
    return decode_png(read_file(png));
  }

  // The serialized DOM; `console` gets the page's console lines.
  std::string dom(const fs::path& html, std::string& console) {
    const std::string dom = tmp_.file("dom-" + std::to_string(++runs_) + ".html");
    // The DOM to a file, stderr (run_command's 2>&1 applies to the group) to `log`.
    const std::string cmd =
        "{ " + base() + " --enable-logging=stderr --v=0 --dump-dom " + url(html) + " >" + shell_quote(dom) + "; }";
    std::string log;  // chromium's stderr
    const int rc = run_command(cmd, log);
    if (rc != 0) throw std::runtime_error(cmd + " failed (rc " + std::to_string(rc) + "):\n" + tail(log));
    console.clear();
    last_log_ = log;
    std::istringstream lines(log);
    for (std::string line; std::getline(lines, line);)
      if (line.find(":CONSOLE") != std::string::npos || line.find("Uncaught") != std::string::npos)
        console += line + "\n";
    return read_file(dom);
  }

 private:
  // A fresh profile each time: one still held by a previous run's lingering
  // processes would hand the page to that browser instead.
  std::string base() const {
    return "timeout 120 " + shell_quote(chromium_) +
           " --headless --no-sandbox --disable-gpu --disable-background-networking --force-device-scale-factor=1"
           " --no-first-run --user-data-dir=" +
           shell_quote(tmp_.file("profile-" + std::to_string(runs_)));
  }
  static std::string url(const fs::path& html) { return shell_quote("file://" + fs::absolute(html).string()); }

  const TempDir& tmp_;

 public:
  std::string last_log_;  // chromium's stderr of the last dom()

 private:
  std::string chromium_;
  int runs_ = 0;
};

#define ASSERT_CHROMIUM(browser)                                                                                     \
  ASSERT_TRUE((browser).found()) << "chromium not found on PATH (as chromium or chromium-browser): the report test " \
                                    "renders report.html in headless Chromium; run scripts/setup.sh to install it"

// Every chart's frame holds its lines in their colours, with a title, tick
// labels and a legend beside it; `scale` is the page's scale of the SVGs.
void expect_charts_drawn(const Image& img, const std::vector<Box>& boxes) {
  const std::vector<std::vector<std::string>> colours = {
      {rd::palette(0), rd::palette(1)},                                                             // loss: train, eval
      {rd::palette(3)},                                                                             // test accuracy
      {rd::palette(2)},                                                                             // learning rate
      {rd::palette(4)},                                                                             // throughput
      {rd::palette(5)},                                                                             // data wait
      {rd::palette(7)},                                                                             // grad norm
      {rd::palette(0), rd::palette(1), rd::palette(2), rd::palette(3), rd::palette(4), "#111827"},  // memory
  };
  const char* names[] = {"loss", "test accuracy", "learning rate", "throughput", "data wait", "grad norm", "memory"};
  ASSERT_EQ(boxes.size(), 7u);
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Box& b = boxes[i];
    SCOPED_TRACE(std::string("chart ") + names[i] + " at (" + std::to_string(b.x0) + ", " + std::to_string(b.y0) + ")");
    // The SVG scales as a whole: the frame keeps the plot's aspect ratio.
    const double scale = (b.x1 - b.x0) / (rd::kChartWidth - 72.0 - 18.0 + 1);
    EXPECT_NEAR((b.y1 - b.y0) / scale, rd::kPlotHeight + 1, 3.0);
    auto s = [&](double px) { return static_cast<int>(px * scale); };
    const int inside = (b.x1 - b.x0 - 1) * (b.y1 - b.y0 - 1);
    const int ink = count_pixels(img, b.x0 + 1, b.y0 + 1, b.x1 - 1, b.y1 - 1, [](const uint8_t* p) {
      return std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}) >= 60;
    });
    EXPECT_GE(ink, 300) << "too few coloured pixels: the lines were not drawn";
    EXPECT_LE(ink, inside / 2) << "the plot is mostly colour: not a line chart";
    for (const std::string& c : colours[i]) {
      const Rgb want = hex(c);
      int n = count_pixels(img, b.x0 + 1, b.y0 + 1, b.x1 - 1, b.y1 - 1, [&](const uint8_t* p) {
        return std::abs(p[0] - want.r) <= 16 && std::abs(p[1] - want.g) <= 16 && std::abs(p[2] - want.b) <= 16;
      });
      EXPECT_GE(n, 40) << "series colour " << c << " barely present";
    }
    auto dark = [](const uint8_t* p) { return std::max({p[0], p[1], p[2]}) < 140; };
    EXPECT_GE(count_pixels(img, b.x0, b.y0 - s(30), b.x0 + s(200), b.y0 - s(6), dark), 30) << "no title above the plot";
    EXPECT_GE(count_pixels(img, b.x0 - s(50), b.y0, b.x0 - s(4), b.y1, dark), 60) << "no y tick labels";
    EXPECT_GE(count_pixels(img, b.x0, b.y1 + s(4), b.x1, b.y1 + s(22), dark), 60) << "no x tick labels";
    EXPECT_GE(count_pixels(img, b.x0, b.y1 + s(40), b.x1, b.y1 + s(64), dark), 10) << "no legend";
  }
}

TEST(ReportRender, HeadlessChromiumDrawsEveryChartInAGridAsWideAsThePage) {
  TempDir tmp;
  Browser browser(tmp);
  ASSERT_CHROMIUM(browser);
  const fs::path run = tmp.path() / "run";
  write_synthetic_run(run);
  cli::write_report(run);

  // 1200 px: two columns.
  const Image narrow = browser.screenshot(run / "report.html", 1200, 2400);
  ASSERT_EQ(narrow.width, 1200);
  ASSERT_EQ(narrow.height, 2400);
  const std::vector<Box> boxes = find_frames(narrow);
  ASSERT_EQ(boxes.size(), 7u) << "plot frames found in the rendering";
  std::vector<int> columns;
  for (const Box& b : boxes) columns.push_back(b.x0);
  std::sort(columns.begin(), columns.end());
  EXPECT_EQ(std::unique(columns.begin(), columns.end()) - columns.begin(), 2)
      << "expected a two-column layout at 1200 px";
  expect_charts_drawn(narrow, boxes);

  // 1700 px: three columns reaching the right of the page (charts of a fixed
  // width left its right third empty).
  const Image wide = browser.screenshot(run / "report.html", 1700, 3000);
  const std::vector<Box> wide_boxes = find_frames(wide);
  ASSERT_EQ(wide_boxes.size(), 7u) << "plot frames found in the rendering at 1700 px";
  columns.clear();
  int right = 0;
  for (const Box& b : wide_boxes) {
    columns.push_back(b.x0);
    right = std::max(right, b.x1);
  }
  std::sort(columns.begin(), columns.end());
  EXPECT_EQ(std::unique(columns.begin(), columns.end()) - columns.begin(), 3) << "expected three columns at 1700 px";
  EXPECT_GT(right, wide.width * 9 / 10) << "the charts end at x = " << right << " of " << wide.width;
  expect_charts_drawn(wide, wide_boxes);
}

TEST(ReportRender, ScriptRunsWithoutErrorsAndTheStatusShows) {
  TempDir tmp;
  Browser browser(tmp);
  ASSERT_CHROMIUM(browser);
  const fs::path run = tmp.path() / "run";
  write_synthetic_run(run, {.train_lines = 137, .eval_every = 30, .nan_after = true, .total_steps = 300});
  cli::write_report(run);

  std::string console;
  const std::string dom = browser.dom(run / "report.html", console);
  EXPECT_EQ(console, "") << "the page logged to the console";
  EXPECT_NE(dom.find("data-script=\"ran\""), std::string::npos) << "the page's script did not run to its end:\n"
                                                                << dom.substr(0, 400);
  EXPECT_NE(dom.find("data-refresh=\"off\""), std::string::npos) << "a finished run's report must not reload itself";
  EXPECT_NE(dom.find("id=\"status\" data-status=\"nan\""), std::string::npos);
  EXPECT_NE(dom.find(">Stopped on NaN at step 138 of 300<"), std::string::npos);

  // The report of a run in progress reloads itself.
  const fs::path live = tmp.path() / "live";
  write_synthetic_run(live, {.train_lines = 50, .end = ""});
  cli::write_report(live);
  const std::string live_dom = browser.dom(live / "report.html", console);
  EXPECT_EQ(console, "");
  EXPECT_NE(live_dom.find("data-refresh=\"on\""), std::string::npos);
  EXPECT_NE(live_dom.find("data-status=\"unfinished\""), std::string::npos);

  // The check sees a script error when there is one.
  std::string broken = read_file((run / "report.html").string());
  broken.replace(broken.find("<script>"), 8, "<script>no_such_function();</script><script>");
  std::ofstream(tmp.path() / "broken.html") << broken;
  browser.dom(tmp.path() / "broken.html", console);
  EXPECT_NE(console.find("Uncaught ReferenceError: no_such_function is not defined"), std::string::npos)
      << "chromium's log:\n"
      << tail(browser.last_log_);

  // Drawn: the status banner in its red above the charts, and the NaN marked on every chart.
  const Image img = browser.screenshot(run / "report.html", 1200, 2400);
  const std::vector<Box> boxes = find_frames(img);
  ASSERT_EQ(boxes.size(), 7u);
  const Rgb red = hex("#dc2626");
  auto is_red = [&](const uint8_t* p) {
    return std::abs(p[0] - red.r) <= 20 && std::abs(p[1] - red.g) <= 20 && std::abs(p[2] - red.b) <= 20;
  };
  EXPECT_GE(count_pixels(img, 0, 0, img.width - 1, boxes[0].y0 - 40, is_red), 200) << "no red status banner";
  for (const Box& b : boxes)
    EXPECT_GE(count_pixels(img, b.x1 - 3, b.y0, b.x1 + 1, b.y1, is_red), (b.y1 - b.y0) / 3)
        << "no NaN mark at the right edge of the chart at (" << b.x0 << ", " << b.y0 << ")";
}

// A run trained with --profile: below the charts, the Profile section's stacked bars in the same
// frame, each breakdown category in its colour, and the op table.
TEST(ReportRender, ProfileSectionDrawsStackedBarsAndTheOpTable) {
  TempDir tmp;
  Browser browser(tmp);
  ASSERT_CHROMIUM(browser);
  const fs::path run = tmp.path() / "run";
  write_synthetic_run(run);
  write_synthetic_profile(run);
  cli::write_report(run);

  const Image img = browser.screenshot(run / "report.html", 1200, 3200);
  std::vector<Box> boxes = find_frames(img);
  ASSERT_EQ(boxes.size(), 8u) << "the run's 7 charts and the per-step breakdown";
  const Box bars = boxes.back();  // the section comes after the charts
  boxes.pop_back();
  expect_charts_drawn(img, boxes);
  EXPECT_GT(bars.y0, boxes.back().y1) << "the Profile section sits below the charts";
  // The bars fill much of the plot (stacked up to the tallest step): coloured, but not a line chart.
  const int inside = (bars.x1 - bars.x0 - 1) * (bars.y1 - bars.y0 - 1);
  const int ink = count_pixels(img, bars.x0 + 1, bars.y0 + 1, bars.x1 - 1, bars.y1 - 1, [](const uint8_t* p) {
    return std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}) >= 60;
  });
  EXPECT_GE(ink, inside / 5) << "the bars were not drawn";
  for (int c = 0; c < rd::kStepCategories - 1; ++c) {  // "other" is grey
    const Rgb want = hex(rd::step_category_colour(c));
    const int n = count_pixels(img, bars.x0 + 1, bars.y0 + 1, bars.x1 - 1, bars.y1 - 1, [&](const uint8_t* p) {
      return std::abs(p[0] - want.r) <= 16 && std::abs(p[1] - want.g) <= 16 && std::abs(p[2] - want.b) <= 16;
    });
    EXPECT_GE(n, 100) << rd::step_category_name(c) << " (" << rd::step_category_colour(c) << ") barely present";
  }
  auto dark = [](const uint8_t* p) { return std::max({p[0], p[1], p[2]}) < 140; };
  EXPECT_GE(count_pixels(img, bars.x0, bars.y0 - 30, bars.x0 + 200, bars.y0 - 6, dark), 30) << "no title";
  EXPECT_GE(count_pixels(img, bars.x0, bars.y1 + 4, bars.x1, bars.y1 + 22, dark), 60) << "no step labels";

  std::string console;
  const std::string dom = browser.dom(run / "report.html", console);
  EXPECT_EQ(console, "") << "the page logged to the console";
  EXPECT_NE(dom.find("data-script=\"ran\""), std::string::npos);
  EXPECT_NE(dom.find("Top 15 of 18 ops by self time"), std::string::npos);
  EXPECT_NE(dom.find("<td>op0</td><td>backward</td><td>6</td>"), std::string::npos) << "the top op first";
}

}  // namespace
}  // namespace kiln::test
