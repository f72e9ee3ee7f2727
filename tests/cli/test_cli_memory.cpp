// Memory forensics in `kiln train` (issue 18 §2): the run records the call
// sites that held the most at its peak (metrics.jsonl "memory_peak", the
// report's "memory at peak" table beside the category chart), its leak watch
// raises no false alarm on a healthy run, and an out-of-memory run names the
// lines that hold the memory and the lever to pull.
#include <gtest/gtest.h>

#include "cli/cli_util.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;

std::vector<json> records(const fs::path& run, const std::string& kind) {
  std::vector<json> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("kind", "") == kind) out.push_back(j);
  }
  return out;
}

TEST(CliMemory, PeakTableNamesCallSitesAndAHealthyRunHasNoLeakWarning) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const fs::path run = dir.path() / "run";
  auto r = kiln_cli("train " + dir.file("gpt.toml") + " --out " + run.string() +
                    " --set train.steps=16 --set train.eval_every=0");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find("memory leak"), std::string::npos) << r.output;
  EXPECT_TRUE(records(run, "warning").empty());

  const auto peaks = records(run, "memory_peak");
  ASSERT_FALSE(peaks.empty());
  const json& p = peaks.back();
  ASSERT_TRUE(p["sites"].is_array());
  ASSERT_FALSE(p["sites"].empty());
  int64_t sum = 0;
  bool activation_from_model = false;
  for (const json& s : p["sites"]) {
    sum += s["bytes"].get<int64_t>();
    const std::string site = s["site"], category = s["category"];
    EXPECT_EQ(site.find("src/ops/"), std::string::npos) << "ops-internal site: " << site;
    if (category == "activation" && (site.find("src/nn/") != std::string::npos ||
                                     site.find("src/models/") != std::string::npos))
      activation_from_model = true;
  }
  EXPECT_TRUE(activation_from_model) << p.dump(1);
  EXPECT_LE(sum, p["peak_bytes"].get<int64_t>());

  std::ifstream html(run / "report.html");
  const std::string page((std::istreambuf_iterator<char>(html)), std::istreambuf_iterator<char>());
  const auto at = page.find("id=\"memory-at-peak\"");
  ASSERT_NE(at, std::string::npos);
  EXPECT_NE(page.find("<table class=\"peak\">", at), std::string::npos);
  EXPECT_NE(page.find(p["sites"][0]["site"].get<std::string>(), at), std::string::npos);
  EXPECT_LT(page.find("id=\"chart-memory\""), at) << "the table sits right after the category chart";
}

TEST(CliMemory, OutOfMemoryNamesSitesAndLever) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const std::string args = " --set train.steps=3 --set train.eval_every=0 --set data.batch_size=32";
  auto r = kiln_cli("train " + dir.file("gpt.toml") + " --out " + (dir.path() / "run").string() + args);
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto peaks = records(dir.path() / "run", "memory_peak");
  ASSERT_FALSE(peaks.empty());
  // A limit of 70% of what the run needed at its peak: the first step cannot finish.
  const auto limit = static_cast<int64_t>(0.7 * static_cast<double>(peaks.back()["peak_bytes"].get<int64_t>()));
  CliResult oom;
  oom.rc = run_command("KILN_MEMORY_LIMIT=" + std::to_string(limit) + " OMP_NUM_THREADS=2 " + KILN_CLI_BINARY +
                           " train " + dir.file("gpt.toml") + " --out " + (dir.path() / "oom").string() + args,
                       oom.output);
  EXPECT_NE(oom.rc, 0);
  for (const char* part : {"out of memory", "memory by category", "largest live memory by call site", "src/",
                           "hint: ", "KILN_MEMORY_LIMIT"})
    EXPECT_NE(oom.output.find(part), std::string::npos) << "missing '" << part << "' in:\n" << oom.output;
  EXPECT_EQ(oom.output.find("src/ops/"), std::string::npos) << oom.output;
}

}  // namespace
}  // namespace kiln::test
