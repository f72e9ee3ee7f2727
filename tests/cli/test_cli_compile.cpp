// kiln train with train.compile = true (Note [Compiled steps] in src/cli/train.cpp): each
// batch's forward and backward replay through kiln::compile while the loss check, clipping,
// GradScaler and the optimizer step run eagerly between replays; the run's losses are the
// eager run's bit for bit, with dropout, gradient accumulation, fp16 loss scaling and the
// health monitor's eager steps in between.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

namespace fs = std::filesystem;

/// Trains `config` eagerly and compiled with the same extra settings; both runs' train
/// losses and last evaluation must be equal; returns the compiled run's compile line.
nlohmann::json same_run(const TempDir& dir, const std::string& config, const std::string& sets) {
  const fs::path eager = dir.path() / "eager", compiled = dir.path() / "compiled";
  fs::remove_all(eager);
  fs::remove_all(compiled);
  auto a = kiln_cli("train " + dir.file(config) + " --out " + eager.string() + sets);
  EXPECT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file(config) + " --out " + compiled.string() + sets + " --set train.compile=true");
  EXPECT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("compile: forward and backward of"), std::string::npos) << b.output;
  const auto le = train_losses(eager), lc = train_losses(compiled);
  EXPECT_EQ(le.size(), lc.size());
  EXPECT_FALSE(lc.empty());
  for (size_t i = 0; i < le.size() && i < lc.size(); ++i) EXPECT_EQ(le[i], lc[i]) << "train line " << i + 1;
  const auto ee = metrics_lines(eager, "eval"), ec = metrics_lines(compiled, "eval");
  EXPECT_FALSE(ec.empty());
  if (!ee.empty() && !ec.empty()) {
    EXPECT_EQ(ee.back()["loss"], ec.back()["loss"]);
  }
  const auto lines = metrics_lines(compiled, "compile");
  EXPECT_EQ(lines.size(), 1u);
  return lines.empty() ? nlohmann::json() : lines.back();
}

TEST(CliCompile, GptWithDropoutAndClippingMatchesEagerBitwise) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const auto c = same_run(dir, "gpt.toml", " --set train.health=false");
  // 30 steps: the first captures, the others replay (the text loader's batches are all full).
  EXPECT_EQ(c["captures"], 1) << c.dump();
  EXPECT_EQ(c["replays"], 29) << c.dump();
  EXPECT_EQ(c["eager_calls"], 0) << c.dump();
  EXPECT_TRUE(c["graph_breaks"].empty()) << c.dump();
}

TEST(CliCompile, AccumulationFp16AndHealthStepsMatchEagerBitwise) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  // Two micro-batches a step (a record that sets .grad and one that adds to it), GradScaler's
  // unscale and skip between replays, and every 5th step eager for the health monitor's hooks.
  const auto c = same_run(dir, "gpt.toml",
                          " --set train.grad_accum_steps=2 --set amp=fp16 --set train.log_every=5 --set train.steps=20");
  EXPECT_EQ(c["captures"], 2) << c.dump();
  EXPECT_EQ(c["replays"], 2 * 20 - 2 * 4 - 2) << c.dump();  // 4 sampled steps run eagerly
}

TEST(CliCompile, AnInterruptedCompiledRunResumesAsTheEagerRun) {
  TempDir dir;
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  const fs::path eager = dir.path() / "eager", split = dir.path() / "split";
  const std::string sets = " --set train.health=false";
  auto a = kiln_cli("train " + dir.file("mlp.toml") + " --out " + eager.string() + sets);
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file("mlp.toml") + " --out " + split.string() + sets +
                    " --set train.compile=true --set train.max_steps=13");
  ASSERT_EQ(b.rc, 0) << b.output;
  auto c = kiln_cli("resume " + split.string());  // the run's config.toml keeps train.compile
  ASSERT_EQ(c.rc, 0) << c.output;
  EXPECT_NE(c.output.find("compile: forward and backward of 26 batches replayed, 1 captured"), std::string::npos)
      << c.output;
  const auto le = train_losses(eager), ls = train_losses(split);
  ASSERT_EQ(le.size(), ls.size());
  for (size_t i = 0; i < le.size(); ++i) EXPECT_EQ(le[i], ls[i]) << "step " << i + 1;
  EXPECT_EQ(metrics_lines(eager, "eval").back()["accuracy"], metrics_lines(split, "eval").back()["accuracy"]);
}

TEST(CliCompile, AnomalyModeIsRefusedWithAMessage) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + dir.file("run") +
                    " --set train.compile=true --set train.anomaly=true");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("train.compile = true is not supported with train.anomaly"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace kiln::test
