// train.keep_best: checkpoints/best.safetensors holds the state of the best
// evaluation so far (by the metrics.jsonl eval lines), `kiln eval --checkpoint
// best` reads it, a resumed run keeps comparing against the best on disk, and
// a metric the run does not evaluate is refused.
#include <gtest/gtest.h>

#include <cstdlib>

#include "cli/cli_util.h"
#include "kiln/io/safetensors.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

struct Best {
  int64_t step = -1;
  double value = 0;
};

/// The step and value metrics.jsonl says the best eval was (first of equals).
Best best_in_metrics(const fs::path& run, const std::string& metric) {
  Best b;
  for (const auto& e : metrics_lines(run, "eval")) {
    const double v = e[metric].get<double>();
    if (b.step < 0 || (metric == "accuracy" ? v > b.value : v < b.value)) b = {e["step"].get<int64_t>(), v};
  }
  return b;
}

/// The step and value best.safetensors was kept for.
Best best_on_disk(const fs::path& run) {
  const auto md = io::read_safetensors_header((run / "checkpoints" / "best.safetensors").string()).metadata;
  return {std::stoll(md.at("step")), std::strtod(md.at("state.best.value").c_str() + 2, nullptr)};
}

TEST(CliKeepBest, KeepsTheBestEvaluationsCheckpointAndEvalReadsIt) {
  TempDir dir;
  // Synthetic labels are noise: the held-out loss falls, then rises as the MLP memorises.
  write_text(dir.path() / "tiny.toml", tiny_mlp_config("keep_best = \"loss\"\n"));
  const fs::path run = dir.path() / "run";
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() + " --set optim.lr=0.03");
  ASSERT_EQ(r.rc, 0) << r.output;
  const Best want = best_in_metrics(run, "loss");
  ASSERT_GT(want.step, 0);
  const Best got = best_on_disk(run);
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.value, want.value) << "the exact eval loss, saved bit for bit";
  EXPECT_NE(r.output.find("best loss so far"), std::string::npos) << r.output;
  // Beside the latest, which keep_last's pruning never touches; no temporary files left.
  for (const auto& e : fs::directory_iterator(run / "checkpoints")) {
    const std::string n = e.path().filename().string();
    EXPECT_TRUE(n == "best.safetensors" || n == "latest" || n.rfind("ckpt-", 0) == 0) << n;
  }
  r = kiln_cli("eval " + run.string() + " --checkpoint best");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("best.safetensors (step " + std::to_string(want.step) + "), test split"), std::string::npos)
      << r.output;
  char loss[32];
  std::snprintf(loss, sizeof loss, "loss %.4f", want.value);
  EXPECT_NE(r.output.find(loss), std::string::npos) << "eval of the best checkpoint reproduces its loss: " << r.output;
}

TEST(CliKeepBest, AResumedRunComparesAgainstTheBestOnDisk) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config("keep_best = \"loss\"\n"));
  const fs::path whole = dir.path() / "whole", split = dir.path() / "split";
  ASSERT_EQ(kiln_cli("train " + dir.file("tiny.toml") + " --out " + whole.string() + " --set optim.lr=0.03").rc, 0);
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + split.string() +
                    " --set optim.lr=0.03 --set train.max_steps=20");
  ASSERT_EQ(r.rc, 0) << r.output;
  r = kiln_cli("resume " + split.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  // Stopping and resuming changes nothing: the same best, at the same step.
  const Best a = best_on_disk(whole), b = best_on_disk(split);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.value, b.value);
  EXPECT_EQ(b.step, best_in_metrics(split, "loss").step);
}

TEST(CliKeepBest, AMetricTheRunDoesNotEvaluateIsRefused) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config("keep_best = \"bits_per_char\"\n"));
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + dir.file("run"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("train.keep_best = \"bits_per_char\" is not a metric of a classifier"), std::string::npos)
      << r.output;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config("keep_best = \"f1\"\n"));
  r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + dir.file("run2"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("'train.keep_best' expects one of off|accuracy|loss|bits_per_char"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace kiln::test
