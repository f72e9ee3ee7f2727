// train.activation_checkpointing: a tiny GPT trains the same with and without
// per-block checkpointing (bitwise: the same losses step by step, dropout on),
// and bad values are config errors that say what is allowed.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "cli/config.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

TEST(CliCheckpointing, BlocksTrainsBitwiseLikeNone) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const std::string common = " --set model.n_layer=3 --set train.steps=6 --set train.eval_every=0";
  auto a = kiln_cli("train " + dir.file("gpt.toml") + " --out " + (dir.path() / "plain").string() + common);
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file("gpt.toml") + " --out " + (dir.path() / "ckpt").string() + common +
                    " --set train.activation_checkpointing=blocks");
  ASSERT_EQ(b.rc, 0) << b.output;
  auto c = kiln_cli("train " + dir.file("gpt.toml") + " --out " + (dir.path() / "k2").string() + common +
                    " --set train.activation_checkpointing=2");
  ASSERT_EQ(c.rc, 0) << c.output;
  const auto la = train_losses(dir.path() / "plain"), lb = train_losses(dir.path() / "ckpt"),
             lc = train_losses(dir.path() / "k2");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  ASSERT_EQ(lc.size(), 6u);
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
    EXPECT_EQ(la[i], lc[i]) << "step " << i + 1;
  }
  EXPECT_EQ(cli::Config::from_file(dir.path() / "ckpt" / "config.toml").string("train.activation_checkpointing"),
            "blocks");
  EXPECT_EQ(cli::Config::from_file(dir.path() / "k2" / "config.toml").integer("train.activation_checkpointing"), 2);
}

TEST(CliCheckpointing, BadValuesAreExplained) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  const std::string gpt = tiny_gpt_config(dir.file("moby.txt"));
  auto error_of = [](const std::string& text, const std::string& set) -> std::string {
    try {
      cli::Config::from_string(text, "t.toml", {set});
    } catch (const cli::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of(gpt, "train.activation_checkpointing=0").find("out of range (expects an integer >= 1)"),
            std::string::npos)
      << error_of(gpt, "train.activation_checkpointing=0");
  EXPECT_NE(error_of(gpt, "train.activation_checkpointing=all").find("expects one of none|blocks or an integer"),
            std::string::npos)
      << error_of(gpt, "train.activation_checkpointing=all");
  EXPECT_NE(error_of(gpt, "train.activation_checkpointing=1.5").find("expects an integer or one of none|blocks"),
            std::string::npos)
      << error_of(gpt, "train.activation_checkpointing=1.5");
  EXPECT_NE(error_of(tiny_mlp_config(), "train.activation_checkpointing=blocks")
                .find("applies only when model.type is one of gpt|vit|resnet"),
            std::string::npos);
  EXPECT_EQ(error_of(gpt, "train.activation_checkpointing=3"), "");
  EXPECT_EQ(error_of(gpt, "train.activation_checkpointing=none"), "");
}

}  // namespace
}  // namespace kiln::test
