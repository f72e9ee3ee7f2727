// report.html as a browser draws it: headless Chromium renders the report of a
// synthetic run to a PNG, which is decoded here (zlib; the 8-bit RGB/RGBA,
// non-interlaced PNGs Chromium writes) to check that every chart's plot frame
// is on the page and holds its lines, in their colours, with a title and
// tick labels beside it.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/report.h"
#include "cli/report_chart.h"
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
      int a = i >= size_t(channels) ? cur[i - channels] : 0, b = prev[i], c = i >= size_t(channels) ? prev[i - channels] : 0;
      int pred = filter == 0 ? 0 : filter == 1 ? a : filter == 2 ? b : filter == 3 ? (a + b) / 2 : filter == 4 ? paeth(a, b, c) : -1;
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
Rgb hex(const std::string& s) { return {std::stoi(s.substr(1, 2), nullptr, 16), std::stoi(s.substr(3, 2), nullptr, 16), std::stoi(s.substr(5, 2), nullptr, 16)}; }

struct Box {
  int x0, y0, x1, y1;  // the frame's outer pixels
};

// Plot frames: exact-colour horizontal runs as wide as a plot, paired top and bottom.
std::vector<Box> find_frames(const Image& img) {
  const Rgb f = hex(rd::kFrameColour);
  std::map<std::pair<int, int>, std::vector<int>> runs;  // (x0, x1) -> rows
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width;) {
      int x0 = x;
      while (x < img.width && img.at(x, y)[0] == f.r && img.at(x, y)[1] == f.g && img.at(x, y)[2] == f.b) ++x;
      if (x - x0 >= 400) runs[{x0, x - 1}].push_back(y);
      x = std::max(x, x0 + 1);
    }
  }
  std::vector<Box> boxes;
  for (auto& [xs, rows] : runs)
    for (int top : rows)
      if (std::count(rows.begin(), rows.end(), top + rd::kPlotHeight + 1)) boxes.push_back({xs.first, top, xs.second, top + rd::kPlotHeight + 1});
  std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) { return std::tie(a.y0, a.x0) < std::tie(b.y0, b.x0); });
  return boxes;
}

int count_pixels(const Image& img, int x0, int y0, int x1, int y1, auto pred) {
  int n = 0;
  for (int y = std::max(0, y0); y <= std::min(img.height - 1, y1); ++y)
    for (int x = std::max(0, x0); x <= std::min(img.width - 1, x1); ++x) n += pred(img.at(x, y)) ? 1 : 0;
  return n;
}

TEST(ReportRender, HeadlessChromiumDrawsEveryChart) {
  const std::string chromium = find_chromium();
  ASSERT_FALSE(chromium.empty()) << "chromium not found on PATH (as chromium or chromium-browser): the report test "
                                    "renders report.html in headless Chromium; run scripts/setup.sh to install it";
  TempDir tmp;
  const fs::path run = tmp.path() / "run";
  write_synthetic_run(run);
  cli::write_report(run);
  const std::string png_path = tmp.file("report.png");
  const std::string cmd = "timeout 120 " + shell_quote(chromium) +
                          " --headless --no-sandbox --disable-gpu --disable-background-networking --hide-scrollbars"
                          " --force-device-scale-factor=1 --no-first-run --user-data-dir=" +
                          shell_quote(tmp.file("profile")) + " --screenshot=" + shell_quote(png_path) +
                          " --window-size=1200,2400 " + shell_quote("file://" + fs::absolute(run / "report.html").string());
  std::string out;
  const int rc = run_command(cmd, out);
  ASSERT_EQ(rc, 0) << cmd << "\n" << out.substr(out.size() > 4000 ? out.size() - 4000 : 0);
  ASSERT_TRUE(fs::exists(png_path)) << "chromium wrote no screenshot:\n" << out.substr(out.size() > 4000 ? out.size() - 4000 : 0);
  const Image img = decode_png(read_file(png_path));
  ASSERT_EQ(img.width, 1200);
  ASSERT_EQ(img.height, 2400);

  // Seven plot frames in two columns, in the report's order.
  const std::vector<Box> boxes = find_frames(img);
  ASSERT_EQ(boxes.size(), 7u) << "plot frames found in the rendering";
  std::vector<int> columns;
  for (const Box& b : boxes) columns.push_back(b.x0);
  std::sort(columns.begin(), columns.end());
  EXPECT_EQ(std::unique(columns.begin(), columns.end()) - columns.begin(), 2) << "expected a two-column layout at 1200 px";

  // Each chart's series colours (palette indices, see report.cpp) drawn inside its frame.
  const std::vector<std::vector<std::string>> colours = {
      {rd::palette(0), rd::palette(1)},  // loss: train, eval
      {rd::palette(3)},                  // eval accuracy
      {rd::palette(2)},                  // learning rate
      {rd::palette(4)},                  // throughput
      {rd::palette(5)},                  // data wait
      {rd::palette(7)},                  // grad norm
      {rd::palette(0), rd::palette(1), rd::palette(2), rd::palette(3), rd::palette(4), "#111827"},  // memory
  };
  const char* names[] = {"loss", "eval accuracy", "learning rate", "throughput", "data wait", "grad norm", "memory"};
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Box& b = boxes[i];
    SCOPED_TRACE(std::string("chart ") + names[i] + " at (" + std::to_string(b.x0) + ", " + std::to_string(b.y0) + ")");
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
    EXPECT_GE(count_pixels(img, b.x0, b.y0 - 30, b.x0 + 200, b.y0 - 6, dark), 30) << "no title above the plot";
    EXPECT_GE(count_pixels(img, b.x0 - 50, b.y0, b.x0 - 4, b.y1, dark), 60) << "no y tick labels";
    EXPECT_GE(count_pixels(img, b.x0, b.y1 + 4, b.x1, b.y1 + 22, dark), 60) << "no x tick labels";
    EXPECT_GE(count_pixels(img, b.x0, b.y1 + 40, b.x1, b.y1 + 64, dark), 10) << "no legend";
  }
}

}  // namespace
}  // namespace kiln::test
