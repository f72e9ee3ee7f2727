// report.html from a run directory: the expected elements for a complete run,
// the run's status (completed, paused, interrupted, resumed, stopped on NaN,
// unfinished), bounded size for long runs, and a report (never a crash) for
// broken runs.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "cli/cli_util.h"
#include "cli/report.h"
#include "cli/report_chart.h"
#include "kiln/core/error.h"
#include "kiln/core/format.h"
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

// <div id="status" data-status="..."> of the page.
std::string status_of(const std::string& html) {
  static const std::regex re("id=\"status\" data-status=\"([a-z]+)\"");
  std::smatch m;
  return std::regex_search(html, m, re) ? m[1].str() : "(no status)";
}

// The text of the status block (its headline and details, tags dropped).
std::string status_text(const std::string& html) {
  size_t b = html.find("id=\"status\"");
  if (b == std::string::npos) return "";
  size_t e = html.find("<div class=\"sub\"", b);
  std::string text;
  bool tag = false;
  for (char c : html.substr(b, e - b)) {
    if (c == '<') tag = true;
    if (!tag) text += c;
    if (c == '>') {
      tag = false;
      text += ' ';
    }
  }
  return text;
}

// The summary block's (label, value) cards.
std::vector<std::pair<std::string, std::string>> summary_cards(const std::string& html) {
  std::vector<std::pair<std::string, std::string>> out;
  static const std::regex re("<div class=\"card\"><div class=\"v\">([^<]*)</div><div class=\"k\">([^<]*)</div>");
  for (std::sregex_iterator it(html.begin(), html.end(), re), end; it != end; ++it) out.push_back({(*it)[2], (*it)[1]});
  return out;
}

const char* const kChartIds[] = {"chart-loss",      "chart-eval",      "chart-lr",    "chart-throughput",
                                 "chart-data-wait", "chart-grad-norm", "chart-memory"};

TEST(Report, CompleteRunHasEveryChartTheSummaryAndTheConfig) {
  TempDir tmp;
  write_synthetic_run(tmp.path());
  const std::string html = report_of(tmp.path());

  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(count(html, "http://") + count(html, "https://"), 0u) << "the report must not reference the network";
  EXPECT_EQ(count(html, "<script"), 1u) << "the page's own script only";
  EXPECT_EQ(count(html, "<svg"), 7u);
  EXPECT_EQ(count(html, "</svg>"), 7u);
  for (const char* title : {">Loss<", ">Test accuracy<", ">Learning rate<", ">Throughput<", ">Data wait<",
                            ">Gradient norm<", ">Memory by category (peak per window)<"})
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
  // The loss chart: raw and smoothed train loss, eval loss with a marker at each of its 10 points.
  auto loss = polylines(figure(html, "chart-loss"));
  ASSERT_EQ(loss.size(), 3u);
  EXPECT_EQ(loss[0].size(), 300u);
  EXPECT_EQ(loss[2].size(), 10u);
  EXPECT_EQ(count(figure(html, "chart-loss"), "class=\"marker\""), 10u);
  EXPECT_EQ(count(figure(html, "chart-eval"), "class=\"marker\""), 10u);
  EXPECT_NE(figure(html, "chart-eval").find("<title>test accuracy (eval) at step 300: 91.13%</title>"),
            std::string::npos);
  // Human labels, not the metrics' keys.
  for (const char* key : {"samples_per_s", "data_wait", "grad_norm", "eval_loss", "optimizer_state", ">lr<"})
    EXPECT_EQ(html.find(key), std::string::npos) << key;
  for (const char* name :
       {">train loss<", ">test loss (eval)<", ">learning rate<", ">gradient norm<", ">samples/s<", ">data wait<"})
    EXPECT_NE(html.find(name), std::string::npos) << name;
  // Memory: five categories and their total, bytes shown in MiB.
  std::string mem = figure(html, "chart-memory");
  EXPECT_EQ(polylines(mem).size(), 6u);
  for (const char* c : {">activation<", ">optimizer state<", ">parameter<", ">gradient<", ">data<", ">total<"})
    EXPECT_NE(mem.find(c), std::string::npos) << c;
  EXPECT_NE(mem.find("bytes (MiB)"), std::string::npos);
  EXPECT_NE(figure(html, "chart-data-wait").find("%</text>"), std::string::npos);

  // Status, then the summary block: test figures (and their step), the last
  // train loss, steps, wall time, one throughput and one data-wait figure.
  EXPECT_NE(html.find("kiln run: fashion_cnn"), std::string::npos);
  EXPECT_EQ(status_of(html), "completed");
  EXPECT_NE(html.find(">Completed: 300 of 300 steps<"), std::string::npos);
  const std::vector<std::pair<std::string, std::string>> cards = summary_cards(html);
  auto card = [&](const std::string& label) {
    for (auto& [l, v] : cards)
      if (l == label) return v;
    return std::string("(no card \"" + label + "\")");
  };
  EXPECT_EQ(card("test accuracy"), "91.23%");
  EXPECT_EQ(card("test loss"), "0.2841");
  EXPECT_EQ(card("steps"), "300");
  EXPECT_EQ(card("wall time"), "28.7 s");             // wall_s = 300 * 0.085 + 3.2
  EXPECT_EQ(card("throughput (samples/s)"), "1512");  // the median of 1500 + 120 sin(t / 9) over t = 1..300
  EXPECT_EQ(card("data wait"), "3.3%");               // of 0.03 + 0.025 sin(t / 17)
  size_t throughput = 0, wait = 0;
  for (auto& [l, v] : cards) {
    throughput += l.find("throughput") != std::string::npos || l.find("samples") != std::string::npos;
    wait += l.find("wait") != std::string::npos;
  }
  EXPECT_EQ(throughput, 1u);
  EXPECT_EQ(wait, 1u);
  EXPECT_NE(html.find("at step 300"), std::string::npos) << "the test figures say which step they are from";
  EXPECT_NE(html.find(rd::html_escape(kSyntheticConfig)), std::string::npos);
  EXPECT_NE(html.find("configs/fashion_cnn.toml"), std::string::npos);
  EXPECT_EQ(html.find("id=\"notes\""), std::string::npos) << "a complete run has nothing to note";
  EXPECT_EQ(count(html, "class=\"mark\""), 0u) << "no resume, no NaN: nothing to mark";
  // The charts fill the page in a grid of as many columns as fit; SVGs scale to their column.
  EXPECT_NE(html.find(".charts{display:grid;grid-template-columns:repeat(auto-fill"), std::string::npos);
  EXPECT_NE(html.find("svg.chart{display:block;width:100%;height:auto}"), std::string::npos);

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
  EXPECT_EQ(format_bytes(1.5 * 1024 * 1024), "1.5 MiB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(rd::format_value(1523.4), "1523");
  EXPECT_EQ(rd::format_value(0.91234), "0.912");
  EXPECT_EQ(format_duration(28.74), "28.7 s");
  EXPECT_EQ(format_duration(185), "3 min 05 s");
  EXPECT_EQ(rd::label("lr"), "learning rate");
  EXPECT_EQ(rd::label("samples_per_s"), "samples/s");
  EXPECT_EQ(rd::label("accuracy"), "test accuracy");
  EXPECT_EQ(rd::label("optimizer_state"), "optimizer state");
  EXPECT_EQ(rd::label("some_new_key"), "some new key");
}

// ---- broken and unfinished runs: always a report, saying what is missing ----

void append(const fs::path& file, const std::string& text) { std::ofstream(file, std::ios::app) << text; }

TEST(Report, PartialLastLineIsIgnoredAndNoted) {
  TempDir tmp;
  write_synthetic_run(tmp.path());
  append(tmp.path() / "metrics.jsonl", "{\"kind\":\"train\",\"step\":301,\"loss\":0.3");  // killed mid-write
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("the last line (313) is incomplete"), std::string::npos);
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
  EXPECT_NE(html.find("2 malformed line(s) skipped (not a JSON object): line 45, 46."), std::string::npos) << html;
  EXPECT_NE(html.find("without a numeric &quot;step&quot; skipped: line 47."), std::string::npos);
  EXPECT_NE(html.find("of kind &quot;profile&quot; not shown"), std::string::npos);
  EXPECT_NE(html.find("&quot;loss (not a number)&quot; missing from 1 of 42 train records (first at step 41)."),
            std::string::npos);
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
  EXPECT_NE(figure(html, "chart-eval").find(">Test bits per character<"), std::string::npos);
  EXPECT_EQ(polylines(figure(html, "chart-eval")).at(0).size(), 10u);
  EXPECT_EQ(html.find("accuracy&quot; missing"), std::string::npos);
}

TEST(Report, AccuracyLoggedInPercentIsNotScaledAgain) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 10, .eval_every = 0});
  append(tmp.path() / "metrics.jsonl",
         "{\"kind\":\"eval\",\"step\":5,\"loss\":0.5,\"accuracy\":85.5}\n"
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
  EXPECT_NE(
      html.find(
          "&quot;loss (null: not finite when written)&quot; missing from 1 of 23 train records (first at step 21)."),
      std::string::npos);
  auto lines = polylines(figure(html, "chart-loss"));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].size(), 20u);
  EXPECT_EQ(lines[1].size(), 2u);
}

TEST(Report, RepeatedStepsOfAResumedRunShowTheLaterRecord) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 30, .eval_every = 0});
  append(tmp.path() / "metrics.jsonl",
         train_line({}, 29) + "\n" + train_line({}, 30) + "\n" + train_line({}, 31) + "\n");
  const std::string html = report_of(tmp.path());
  EXPECT_NE(html.find("2 step(s) logged more than once"), std::string::npos);
  EXPECT_EQ(polylines(figure(html, "chart-lr")).at(0).size(), 31u);
}

TEST(Report, ExtremeValuesDoNotBreakTheCharts) {
  TempDir tmp;
  std::ofstream(tmp.path() / "metrics.jsonl")
      << "{\"kind\":\"train\",\"step\":0,\"loss\":1e308,\"lr\":1e-310,\"grad_norm\":-1e308,\"samples_per_s\":5,"
         "\"data_wait\":0,\"memory\":{\"x\":0}}\n"
      << "{\"kind\":\"train\",\"step\":1e15,\"loss\":-1e308,\"lr\":0,\"grad_norm\":1e308,\"samples_per_s\":5,"
         "\"data_wait\":0,\"memory\":{\"x\":1e300}}\n"
      << "{\"kind\":\"eval\",\"step\":-3,\"loss\":7,\"accuracy\":0.5}\n";
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(count(html, "<svg"), 7u);
  EXPECT_EQ(count(html, "</html>"), 1u);
  for (const char* id : {"chart-lr", "chart-throughput", "chart-data-wait"})
    EXPECT_FALSE(polylines(figure(html, id)).empty()) << id;
  const size_t charts = html.find("<div class=\"charts\">");
  ASSERT_NE(charts, std::string::npos);
  const std::string svgs = html.substr(charts, html.find("<h2>Config", charts) - charts);
  EXPECT_EQ(count(svgs, "nan") + count(svgs, "inf"), 0u) << "non-finite SVG coordinates";
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
  EXPECT_EQ(count(html, "<script"), 1u) << "the page's own script only";
  EXPECT_EQ(count(html, "<script>alert"), 0u);
  EXPECT_NE(html.find("&lt;/pre&gt;&lt;script&gt;"), std::string::npos);
  // The header falls back to the last eval record.
  EXPECT_EQ(summary_cards(html).at(0).first, "test accuracy");
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

// ---- the run's status: how it ended, where it was resumed ----

TEST(ReportStatus, InterruptedRunSaysWhereAndHowToContinue) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 120, .end = "interrupted", .total_steps = 300});
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "interrupted");
  const std::string text = status_text(html);
  EXPECT_NE(text.find("Interrupted at step 120 of 300 (Ctrl-C or SIGTERM)"), std::string::npos) << text;
  EXPECT_NE(text.find("kiln resume " + tmp.path().string()), std::string::npos) << text;
  EXPECT_EQ(text.find("Resumed"), std::string::npos) << text;
  EXPECT_NE(html.find("<title>kiln run fashion_cnn: Interrupted at step 120 of 300"), std::string::npos);
}

TEST(ReportStatus, PausedByMaxStepsSaysSo) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 150, .end = "stopped", .total_steps = 300});
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "stopped");
  EXPECT_NE(status_text(html).find("Paused at step 150 of 300 (train.max_steps)"), std::string::npos);
}

TEST(ReportStatus, ResumedRunNamesEveryResumeAndMarksThemOnTheCharts) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.resumes = {100, 240}});
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "completed");
  const std::string text = status_text(html);
  EXPECT_NE(text.find("Completed: 300 of 300 steps"), std::string::npos) << text;
  EXPECT_NE(text.find("Resumed 2 times, at steps 100 and 240."), std::string::npos) << text;
  for (const char* id : kChartIds) {
    const std::string fig = figure(html, id);
    EXPECT_EQ(count(fig, "class=\"mark\""), 2u) << id;
    EXPECT_NE(fig.find("<title>resumed at step 100</title>"), std::string::npos) << id;
    EXPECT_NE(fig.find("<title>resumed at step 240</title>"), std::string::npos) << id;
  }
  // The mark sits at step 100 of the 1..300 x axis (72..542 in the SVG's pixels).
  static const std::regex line_re("<g class=\"mark\"><line x1=\"([0-9.]+)\"");
  std::smatch m;
  const std::string lr = figure(html, "chart-lr");
  ASSERT_TRUE(std::regex_search(lr, m, line_re));
  EXPECT_NEAR(std::stod(m[1]), 72 + 470.0 * 99 / 299, 1.0);

  write_synthetic_run(tmp.path(), {.resumes = {200}});
  EXPECT_NE(status_text(report_of(tmp.path())).find("Resumed at step 200."), std::string::npos);
}

TEST(ReportStatus, NaNStopShowsTheChartsUpToTheNaNAndItsDetails) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 137, .eval_every = 30, .nan_after = true, .total_steps = 300});
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "nan");
  const std::string text = status_text(html);
  EXPECT_NE(text.find("Stopped on NaN at step 138 of 300"), std::string::npos) << text;
  EXPECT_NE(text.find("The loss became NaN at step 138 (epoch 1, learning rate 0.003)"), std::string::npos) << text;
  EXPECT_NE(text.find("--set train.anomaly=true"), std::string::npos) << text;
  EXPECT_EQ(html.find("no data"), std::string::npos) << "a NaN run charts what came before the NaN";
  EXPECT_EQ(count(html, "<svg"), 7u);
  auto loss = polylines(figure(html, "chart-loss"));
  ASSERT_FALSE(loss.empty());
  EXPECT_EQ(loss[0].size(), 137u);
  for (const char* id : kChartIds) {
    const std::string fig = figure(html, id);
    EXPECT_NE(fig.find("<title>loss NaN at step 138</title>"), std::string::npos) << id;
    // The x axis reaches the NaN's step: its mark is at the plot's right edge.
    static const std::regex line_re("<g class=\"mark\"><line x1=\"([0-9.]+)\"");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(fig, m, line_re)) << id;
    EXPECT_NEAR(std::stod(m[1]), 542.5, 1.0) << id;
  }
}

TEST(ReportStatus, NaNAtTheFirstStepSaysWhyThereIsNoData) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.train_lines = 0, .eval_every = 0, .nan_after = true, .total_steps = 300});
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "nan");
  EXPECT_NE(status_text(html).find("Stopped on NaN at step 1 of 300"), std::string::npos);
  EXPECT_NE(figure(html, "chart-loss").find("the loss was not finite at step 1, before any step was logged"),
            std::string::npos);
}

TEST(ReportStatus, RunWithoutAnEndRecordIsInProgressOrKilled) {
  TempDir tmp;
  // Resumed at 100, then killed (or still training) at 180: summary.json is the first process's.
  write_synthetic_run(tmp.path(), {.train_lines = 180, .resumes = {100}, .end = "", .total_steps = 300});
  const std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "unfinished");
  const std::string text = status_text(html);
  EXPECT_NE(text.find("In progress, or ended without a word (killed): last logged step 180 of 300"), std::string::npos)
      << text;
  EXPECT_NE(text.find("Resumed at step 100."), std::string::npos) << text;
  EXPECT_NE(html.find("summary.json is from an earlier process of this run"), std::string::npos);
  // The summary block does not quote the earlier process's figures.
  for (auto& [label, value] : summary_cards(html)) {
    if (label == "steps") EXPECT_EQ(value, "180");
    if (label == "wall time") EXPECT_EQ(value, "15.3 s");  // time_s of step 180, not the old summary's wall_s
  }
  EXPECT_EQ(count(html, "<svg"), 7u);
}

TEST(ReportStatus, RunsWithoutTheRecordsFallBackToTheSummary) {
  TempDir tmp;
  write_synthetic_run(tmp.path(), {.with_events = false, .end = "interrupted", .total_steps = 300});
  std::string html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "interrupted");
  EXPECT_NE(status_text(html).find("Interrupted at step 300 of 300"), std::string::npos);
  write_synthetic_run(tmp.path(), {.with_events = false, .nan_after = true, .total_steps = 400});
  html = report_of(tmp.path());
  EXPECT_EQ(status_of(html), "nan");
  EXPECT_NE(status_text(html).find("Stopped on NaN at step 301 of 400"), std::string::npos) << status_text(html);
  fs::remove(tmp.path() / "summary.json");
  EXPECT_EQ(status_of(report_of(tmp.path())), "unfinished");
}

// ---- the records come from a real `kiln train` and `kiln resume` ----

TEST(ReportOfARealRun, NaNStopChartsTheStepsBeforeIt) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  // Diverges after a dozen steps, before the first train line (log_every 50).
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() +
                    " --set optim.name=sgd --set optim.lr=100 --set schedule.warmup_steps=0 --set train.log_every=50");
  ASSERT_EQ(r.rc, 3) << r.output;
  const auto nonfinite = metrics_lines(run, "nonfinite");
  ASSERT_EQ(nonfinite.size(), 1u);
  const int64_t nan_step = nonfinite[0]["step"].get<int64_t>();
  ASSERT_GT(nan_step, 2);
  EXPECT_NE(r.output.find("the loss became NaN at step " + std::to_string(nan_step)), std::string::npos) << r.output;
  EXPECT_EQ(metrics_lines(run, "train").size(), static_cast<size_t>(nan_step - 1)) << "every step before the NaN";
  const std::string html = read_file((run / "report.html").string());
  EXPECT_EQ(status_of(html), "nan");
  EXPECT_NE(status_text(html).find("Stopped on NaN at step " + std::to_string(nan_step) + " of 40"), std::string::npos)
      << status_text(html);
  auto loss = polylines(figure(html, "chart-loss"));
  ASSERT_FALSE(loss.empty()) << "the loss chart shows no data";
  EXPECT_EQ(loss[0].size(), static_cast<size_t>(nan_step - 1));
}

TEST(ReportOfARealRun, PausedThenResumedRunTellsItsStory) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto a = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() + " --set train.max_steps=15");
  ASSERT_EQ(a.rc, 0) << a.output;
  std::string html = read_file((run / "report.html").string());
  EXPECT_EQ(status_of(html), "stopped");
  EXPECT_NE(status_text(html).find("Paused at step 15 of 40"), std::string::npos) << status_text(html);
  auto b = kiln_cli("resume " + run.string());
  ASSERT_EQ(b.rc, 0) << b.output;
  html = read_file((run / "report.html").string());
  EXPECT_EQ(status_of(html), "completed");
  EXPECT_NE(status_text(html).find("Completed: 40 of 40 steps"), std::string::npos) << status_text(html);
  EXPECT_NE(status_text(html).find("Resumed at step 15."), std::string::npos) << status_text(html);
  EXPECT_EQ(polylines(figure(html, "chart-loss")).at(0).size(), 40u);
  const auto resumes = metrics_lines(run, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"], 15);
  EXPECT_EQ(metrics_lines(run, "end").size(), 2u);
}

}  // namespace
}  // namespace kiln::test
