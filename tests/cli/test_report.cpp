// report.html from a run directory: the expected elements for a complete run,
// bounded size for long runs, and a report (never a crash) for broken runs.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "cli/report.h"
#include "cli/report_chart.h"
#include "kiln/core/error.h"
#include "support/test_util.h"
#include "test_report_fixture.h"

namespace kiln::test {
namespace {

namespace fs = std::filesystem;
using cli::write_report;
namespace rd = cli::report_detail;

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + what.size())) ++n;
  return n;
}

// The <figure> with this id, up to its </figure>; empty when absent.
std::string figure(const std::string& html, const std::string& id) {
  size_t b = html.find("<figure class=\"chart\" id=\"" + id + "\"");
  if (b == std::string::npos) b = html.find("<figure class=\"chart missing\" id=\"" + id + "\"");
  if (b == std::string::npos) return "";
  return html.substr(b, html.find("</figure>", b) - b);
}

// The points of every <polyline> in `svg`, as (x, y) lists.
std::vector<std::vector<std::pair<double, double>>> polylines(const std::string& svg) {
  std::vector<std::vector<std::pair<double, double>>> out;
  static const std::regex points_re("<polyline[^>]* points=\"([^\"]*)\"");
  static const std::regex pair_re("(-?[0-9.]+),(-?[0-9.]+)");
  for (std::sregex_iterator it(svg.begin(), svg.end(), points_re), end; it != end; ++it) {
    std::string pts = (*it)[1];
    out.emplace_back();
    for (std::sregex_iterator p(pts.begin(), pts.end(), pair_re); p != end; ++p)
      out.back().push_back({std::stod((*p)[1]), std::stod((*p)[2])});
  }
  return out;
}

std::string report_of(const fs::path& dir) {
  write_report(dir);
  return read_file((dir / "report.html").string());
}

const char* const kChartIds[] = {"chart-loss",      "chart-eval",      "chart-lr",    "chart-throughput",
                                 "chart-data-wait", "chart-grad-norm", "chart-memory"};

TEST(Report, CompleteRunHasEveryChartTheSummaryAndTheConfig) {
  TempDir tmp;
  write_synthetic_run(tmp.path());
  const std::string html = report_of(tmp.path());

  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(count(html, "http://") + count(html, "https://"), 0u) << "the report must not reference the network";
  EXPECT_EQ(count(html, "<script"), 0u);
  EXPECT_EQ(count(html, "<svg"), 7u);
  EXPECT_EQ(count(html, "</svg>"), 7u);
  for (const char* title : {">Loss<", ">Eval accuracy<", ">Learning rate<", ">Throughput<", ">Data-wait fraction<",
                            ">Gradient norm<", ">Memory by category<"})
    EXPECT_NE(html.find(title), std::string::npos) << title;
  for (const char* id : kChartIds) {
    std::string fig = figure(html, id);
    ASSERT_FALSE(fig.empty()) << id;
    EXPECT_NE(fig.find("<svg"), std::string::npos) << id;
    auto lines = polylines(fig);
    ASSERT_FALSE(lines.empty()) << id << " has no polyline";
    size_t points = 0;
    for (auto& l : lines) {
      points += l.size();
      for (auto [x, y] : l) {  // inside the plot frame (72..542 x 36..236 in the SVG's pixels)
        EXPECT_GE(x, 71.5) << id;
        EXPECT_LE(x, 542.5) << id;
        EXPECT_GE(y, 35.5) << id;
        EXPECT_LE(y, 236.5) << id;
      }
    }
    EXPECT_GE(points, 10u) << id;
    EXPECT_GE(count(fig, "class=\"tick\""), 6u) << id << ": axes need tick labels";
    EXPECT_GE(count(fig, "class=\"legend\""), 1u) << id;
  }
  // The loss chart: raw and smoothed train loss, eval loss with markers at its 10 points.
  auto loss = polylines(figure(html, "chart-loss"));
  ASSERT_EQ(loss.size(), 3u);
  EXPECT_EQ(loss[0].size(), 300u);
  EXPECT_EQ(loss[2].size(), 10u);
  EXPECT_GE(count(figure(html, "chart-loss"), "<circle"), 10u);
  // Memory: five categories and their total, bytes shown in MiB.
  std::string mem = figure(html, "chart-memory");
  EXPECT_EQ(polylines(mem).size(), 6u);
  for (const char* c : {">activation<", ">optimizer_state<", ">parameter<", ">gradient<", ">data<", ">total<"})
    EXPECT_NE(mem.find(c), std::string::npos) << c;
  EXPECT_NE(mem.find("bytes (MiB)"), std::string::npos);
  EXPECT_NE(figure(html, "chart-data-wait").find("%</text>"), std::string::npos);

  // Header: final metrics, steps, wall time, throughput; the config verbatim (escaped).
  EXPECT_NE(html.find("kiln run: fashion_cnn"), std::string::npos);
  EXPECT_NE(html.find("91.23%"), std::string::npos);
  EXPECT_NE(html.find("test_loss"), std::string::npos);
  EXPECT_NE(html.find(">300<"), std::string::npos);
  EXPECT_NE(html.find("28.7 s"), std::string::npos);  // wall_s = 300 * 0.085 + 3.2
  EXPECT_NE(html.find("samples/s"), std::string::npos);
  EXPECT_NE(html.find(rd::html_escape(kSyntheticConfig)), std::string::npos);
  EXPECT_NE(html.find("configs/fashion_cnn.toml"), std::string::npos);
  EXPECT_EQ(html.find("id=\"notes\""), std::string::npos) << "a complete run has nothing to note";

  // Atomic: the only file added is report.html.
  size_t files = 0;
  for (auto& e : fs::directory_iterator(tmp.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 4u);
}

TEST(Report, LongRunsAreDownsampledAndStaySmall) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 30000, .eval_every = 1000});
  const std::string html = report_of(tmp.path());
  EXPECT_LT(html.size(), 400u * 1024) << "report.html of a 30000-step run is " << html.size() << " bytes";
  EXPECT_EQ(count(html, "<svg"), 7u);
  for (const char* id : kChartIds)
    for (auto& l : polylines(figure(html, id))) EXPECT_LE(l.size(), rd::kMaxPoints) << id;
}

TEST(Report, DownsampleKeepsEndsSpikesAndGaps) {
  std::vector<double> x, y;
  for (int i = 0; i < 10000; ++i) {
    x.push_back(i);
    y.push_back(i == 4321 ? 50.0 : i == 7000 ? std::nan("") : 1.0 + 0.001 * (i % 7));
  }
  std::vector<double> ox, oy;
  rd::downsample(x, y, 600, ox, oy);
  ASSERT_LE(ox.size(), 600u);
  ASSERT_GE(ox.size(), 350u);
  EXPECT_EQ(ox.front(), 0);
  EXPECT_EQ(ox.back(), 9999);
  EXPECT_NE(std::find(oy.begin(), oy.end(), 50.0), oy.end()) << "the spike at step 4321 was lost";
  EXPECT_EQ(std::count_if(oy.begin(), oy.end(), [](double v) { return std::isnan(v); }), 1);
  EXPECT_TRUE(std::is_sorted(ox.begin(), ox.end()));
  rd::downsample({1, 2, 3}, {4, 5, 6}, 600, ox, oy);
  EXPECT_EQ(oy, (std::vector<double>{4, 5, 6}));
}

TEST(Report, TicksAreRoundAndLabelsReadable) {
  EXPECT_EQ(rd::nice_ticks(0, 0.93, 5), (std::vector<double>{0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0}));
  auto t = rd::nice_ticks(1, 300, 6);
  EXPECT_EQ(t.front(), 0);
  EXPECT_EQ(t.back(), 300);
  EXPECT_EQ(t[1] - t[0], 50);
  EXPECT_EQ(rd::format_tick(0.0006, 0.0002, rd::YFormat::number), "0.0006");
  EXPECT_EQ(rd::format_tick(2.5e-5, 5e-6, rd::YFormat::number), "2.5e-05");
  EXPECT_EQ(rd::format_tick(1.5, 0.5, rd::YFormat::number), "1.5");
  EXPECT_EQ(rd::format_tick(250, 50, rd::YFormat::number), "250");
  EXPECT_EQ(rd::format_tick(25000, 5000, rd::YFormat::number), "25k");
  EXPECT_EQ(rd::format_tick(0.25, 0.05, rd::YFormat::percent), "25%");
  EXPECT_EQ(rd::format_tick(0.025, 0.005, rd::YFormat::percent), "2.5%");
  EXPECT_EQ(rd::format_tick(0, 0.2, rd::YFormat::number), "0");
  EXPECT_EQ(rd::format_bytes(1.5 * 1024 * 1024), "1.5 MiB");
  EXPECT_EQ(rd::format_bytes(512), "512 B");
  EXPECT_EQ(rd::format_value(1523.4), "1523");
  EXPECT_EQ(rd::format_value(0.91234), "0.912");
}

// ---- broken and unfinished runs: always a report, saying what is missing ----

void append(const fs::path& file, const std::string& text) { std::ofstream(file, std::ios::app) << text; }

TEST(Report, PartialLastLineIsIgnoredAndNoted) {
  TempDir tmp;
  write_synthetic_run(tmp.path());
  append(tmp.path() / "metrics.jsonl", "{\"kind\":\"train\",\"step\":301,\"loss\":0.3");  // killed mid-write
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("the last line (311) is incomplete"), std::string::npos);
  EXPECT_EQ(count(html, "<svg"), 7u);
  EXPECT_EQ(polylines(figure(html, "chart-loss"))[0].size(), 300u);
}

TEST(Report, MalformedLinesAreSkippedWithTheirLineNumbers) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 40, .eval_every = 20});
  append(tmp.path() / "metrics.jsonl",
         "not json at all\n[1, 2, 3]\n{\"kind\":\"train\",\"loss\":1}\n{\"kind\":\"profile\",\"step\":3}\n"
         "{\"kind\":\"train\",\"step\":41,\"loss\":\"high\",\"lr\":0.001}\n\n" +
             train_line({}, 42) + "\n");
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("2 malformed line(s) skipped (not a JSON object): line 43, 44."), std::string::npos) << html;
  EXPECT_NE(html.find("without a numeric &quot;step&quot; skipped: line 45."), std::string::npos);
  EXPECT_NE(html.find("of kind &quot;profile&quot; not charted"), std::string::npos);
  EXPECT_NE(html.find("&quot;loss (not a number)&quot; missing from 1 of 42 train records (first at step 41)."), std::string::npos);
  EXPECT_EQ(count(html, "<svg"), 7u);
  // Step 41's loss is a gap: the train line stops at step 40 (step 42 is a dot after the gap).
  auto lines = polylines(figure(html, "chart-loss"));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].size(), 40u);
  EXPECT_EQ(lines[1].size(), 2u);  // eval
}

TEST(Report, NoEvalLinesStillGiveTheTrainCharts) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.eval_every = 0, .with_summary = false});
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("no eval records: the run has not been evaluated."), std::string::npos);
  EXPECT_NE(html.find("summary.json not found"), std::string::npos);
  EXPECT_NE(figure(html, "chart-eval").find("class=\"chart missing\""), std::string::npos);
  EXPECT_EQ(count(html, "<svg"), 6u);
  EXPECT_EQ(polylines(figure(html, "chart-loss")).size(), 2u);  // raw and smoothed train loss
  // Without a summary the header comes from the metrics: the last step and time_s.
  EXPECT_NE(html.find(">300<"), std::string::npos);
  EXPECT_NE(html.find("25.5 s"), std::string::npos);
}

TEST(Report, MissingOptionalFieldsAreNamed) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.with_lr = false, .with_memory = false, .with_grad_norm = false});
  const std::string html = report_of(tmp.path());
  for (const char* field : {"lr", "memory", "grad_norm"})
    EXPECT_NE(html.find(std::string("&quot;") + field + "&quot; missing from 300 of 300 train records."),
              std::string::npos)
        << field;
  for (const char* id : {"chart-lr", "chart-memory", "chart-grad-norm"})
    EXPECT_NE(figure(html, id).find("no data: no train record has"), std::string::npos) << id;
  EXPECT_EQ(count(html, "<svg"), 4u);
}

TEST(Report, LanguageModelRunsChartBitsPerChar) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.bits_per_char = true});
  const std::string html = report_of(tmp.path());
  EXPECT_NE(figure(html, "chart-eval").find(">Eval bits per character<"), std::string::npos);
  EXPECT_EQ(polylines(figure(html, "chart-eval")).at(0).size(), 10u);
  EXPECT_EQ(html.find("accuracy&quot; missing"), std::string::npos);
}

TEST(Report, AccuracyLoggedInPercentIsNotScaledAgain) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 10, .eval_every = 0});
  append(tmp.path() / "metrics.jsonl", "{\"kind\":\"eval\",\"step\":5,\"loss\":0.5,\"accuracy\":85.5}\n"
                                       "{\"kind\":\"eval\",\"step\":10,\"loss\":0.4,\"accuracy\":91.25}\n");
  const std::string eval = figure(report_of(tmp.path()), "chart-eval");
  EXPECT_EQ(eval.find("%</text>"), std::string::npos);
  EXPECT_NE(eval.find(">90</text>"), std::string::npos);
}

TEST(Report, NonFiniteLossBreaksTheLineAndIsNoted) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 20, .eval_every = 0});
  append(tmp.path() / "metrics.jsonl",
         "{\"kind\":\"train\",\"step\":21,\"loss\":null}\n" + train_line({}, 22) + "\n" + train_line({}, 23) + "\n");
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("&quot;loss (null: not finite when written)&quot; missing from 1 of 23 train records (first at step 21)."), std::string::npos);
  auto lines = polylines(figure(html, "chart-loss"));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].size(), 20u);
  EXPECT_EQ(lines[1].size(), 2u);
}

TEST(Report, RepeatedStepsOfAResumedRunShowTheLaterRecord) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 30, .eval_every = 0});
  append(tmp.path() / "metrics.jsonl", train_line({}, 29) + "\n" + train_line({}, 30) + "\n" + train_line({}, 31) + "\n");
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("2 step(s) logged more than once"), std::string::npos);
  EXPECT_EQ(polylines(figure(html, "chart-lr")).at(0).size(), 31u);
}

TEST(Report, EmptyRunDirectoryGivesAReportOfWhatIsMissing) {
  TempDir tmp;
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("config.toml not found"), std::string::npos);
  EXPECT_NE(html.find("summary.json not found"), std::string::npos);
  EXPECT_NE(html.find("metrics.jsonl not found"), std::string::npos);
  EXPECT_EQ(count(html, "<svg"), 0u);
  EXPECT_EQ(count(html, "class=\"chart missing\""), 7u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
}

TEST(Report, MalformedSummaryAndHostileTextAreHandled) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 10, .eval_every = 5});
  std::ofstream(tmp.path() / "summary.json") << "{\"name\": \"trunc";
  std::ofstream(tmp.path() / "config.toml") << "name = \"</pre><script>alert(1)</script>\"\n";
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("summary.json is not a JSON object"), std::string::npos);
  EXPECT_EQ(count(html, "<script"), 0u);
  EXPECT_NE(html.find("&lt;/pre&gt;&lt;script&gt;"), std::string::npos);
  // The header falls back to the last eval record.
  EXPECT_NE(html.find("last eval accuracy"), std::string::npos);
}

TEST(Report, RewritesAnExistingReportAndRefusesAMissingDirectory) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 10, .eval_every = 5});
  std::ofstream(tmp.path() / "report.html") << "old";
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html, "old");
  for (auto& e : fs::directory_iterator(tmp.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  try {
    write_report(tmp.path() / "no-such-run");
    FAIL() << "expected IOError";
  } catch (const IOError& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-run"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::test
