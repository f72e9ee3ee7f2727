// Mixed precision through the command line (issue 9): `amp = "bf16"|"fp16"` in a
// config or `--set amp=...`. fp16 runs carry a GradScaler whose state is in the
// checkpoint, so an interrupted fp16 run resumes bitwise; its telemetry is in
// metrics.jsonl. bf16 needs no scaler and logs none.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

#include "cli/cli_util.h"
#include "kiln/ops/autocast.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

namespace fs = std::filesystem;


TEST(CliAmp, Fp16RunLogsTheScalerAndResumesBitwise) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const fs::path straight = dir.path() / "straight", split = dir.path() / "split";
  auto a = kiln_cli("train " + dir.file("gpt.toml") + " --out " + straight.string() + " --set amp=fp16");
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file("gpt.toml") + " --out " + split.string() +
                         " --set amp=fp16 --set train.max_steps=13");
  ASSERT_EQ(b.rc, 0) << b.output;
  auto c = kiln_cli("resume " + split.string());
  ASSERT_EQ(c.rc, 0) << c.output;

  const auto train = metrics_lines(straight, "train");
  ASSERT_FALSE(train.empty());
  for (const auto& j : train) {
    ASSERT_TRUE(j.contains("amp_scale")) << j.dump();
    EXPECT_GT(j["amp_scale"].get<double>(), 0);
    EXPECT_TRUE(j.contains("amp_skipped_steps")) << j.dump();
  }
  const auto la = train_losses(straight), lb = train_losses(split);
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  const auto sa = metrics_lines(straight, "train").back(), sb = metrics_lines(split, "train").back();
  EXPECT_EQ(sa["amp_scale"], sb["amp_scale"]);
  EXPECT_NE(read_file((split / "config.toml").string()).find("amp = 'fp16'"), std::string::npos);
}

TEST(CliAmp, Bf16RunTrainsWithoutAScaler) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path f32 = dir.path() / "f32", bf16 = dir.path() / "bf16";
  auto a = kiln_cli("train " + dir.file("tiny.toml") + " --out " + f32.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file("tiny.toml") + " --out " + bf16.string() + " --set amp=bf16");
  ASSERT_EQ(b.rc, 0) << b.output;
  const auto lf = train_losses(f32), lb = train_losses(bf16);
  ASSERT_EQ(lf.size(), lb.size());
  ASSERT_FALSE(lb.empty());
  // bf16 keeps 8 bits of mantissa in the matmuls: the same trajectory to ~2% here, not bitwise.
  EXPECT_NE(lf.back(), lb.back());
  EXPECT_NEAR(lb.back(), lf.back(), 0.05 * std::abs(lf.back()) + 0.02);
  for (const auto& j : metrics_lines(bf16, "train")) EXPECT_FALSE(j.contains("amp_scale")) << j.dump();
}

// A bf16 run on a CPU where bf16 products compute in float32 (Note [bf16 products where bf16 is
// slow]) says so when it starts, naming the measured rate; where they run natively it says nothing.
TEST(CliAmp, Bf16RunSaysWhenItsProductsComputeInFloat32) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const std::string train = "train " + dir.file("tiny.toml") + " --set amp=bf16 --set train.max_steps=2 --out ";
  const std::string said = "amp = \"bf16\": bf16 products compute in float32";
  CliResult forced;
  forced.rc = run_command("KILN_ONEDNN_BF16=0 OMP_NUM_THREADS=2 " + std::string(KILN_CLI_BINARY) + " " + train +
                              dir.file("forced"),
                          forced.output);
  ASSERT_EQ(forced.rc, 0) << forced.output;
  EXPECT_NE(forced.output.find(said + " and round once to bf16: KILN_ONEDNN_BF16=0 asks for that"),
            std::string::npos)
      << forced.output;
  // The run's start line keeps it, so `kiln doctor` can say it later, on any machine.
  const auto start = metrics_lines(dir.path() / "forced", "start");
  ASSERT_EQ(start.size(), 1u);
  ASSERT_TRUE(start[0].contains("bf16_products")) << start[0].dump();
  EXPECT_FALSE(start[0]["bf16_products"]["native"].get<bool>());
  auto doctor = kiln_cli("doctor " + dir.file("forced"));
  EXPECT_NE(doctor.output.find("[bf16_through_float32]"), std::string::npos) << doctor.output;
  EXPECT_NE(doctor.output.find("KILN_ONEDNN_BF16=0 asks for that"), std::string::npos) << doctor.output;

  auto plain = kiln_cli(train + dir.file("plain"));
  ASSERT_EQ(plain.rc, 0) << plain.output;
  const Bf16ProductPath here = bf16_product_path();
  std::cout << "[ this CPU ] " << here.describe() << "\n";
  // The child decides by its own timing: judged where this one is far from the line the rule draws.
  if (here.amx || here.dot_vs_fma == 0 || std::abs(here.dot_vs_fma - here.native_from) > 0.3 * here.native_from) {
    EXPECT_EQ(plain.output.find(said) != std::string::npos, !here.native) << plain.output;
    if (!here.native && here.dot_vs_fma > 0) {
      EXPECT_NE(plain.output.find("vdpbf16ps) does "), std::string::npos) << plain.output;
    }
  }
  // float32 runs say nothing of bf16.
  auto f32 = kiln_cli("train " + dir.file("tiny.toml") + " --set train.max_steps=2 --out " + dir.file("f32"));
  ASSERT_EQ(f32.rc, 0) << f32.output;
  EXPECT_EQ(f32.output.find("bf16"), std::string::npos) << f32.output;
  EXPECT_FALSE(metrics_lines(dir.path() / "f32", "start").at(0).contains("bf16_products"));
  doctor = kiln_cli("doctor " + dir.file("f32"));
  EXPECT_EQ(doctor.output.find("bf16_through_float32"), std::string::npos) << doctor.output;
}

TEST(CliAmp, UnknownModeIsAConfigError) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + dir.file("run") + " --set amp=fp8");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("amp"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bf16"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kiln::test
