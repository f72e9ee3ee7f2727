// `kiln eval`, `sample`, `inspect`, --help/--version, and config errors: one
// clear line naming the file, line and key, a non-zero exit, never a crash.
#include <gtest/gtest.h>

#include <cstdio>

#include "cli/cli_util.h"
#include "cli/config.h"
#include "kiln/ops/factory.h"
#include "kiln/io/safetensors.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

/// One tiny classifier run and one tiny GPT run, trained once for the whole suite.
class CliCommands : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    write_text(dir_->path() / "tiny.toml", tiny_mlp_config());
    write_text(dir_->path() / "moby.txt", tiny_text());
    write_text(dir_->path() / "gpt.toml", tiny_gpt_config(dir_->file("moby.txt")));
    auto a = kiln_cli("train " + dir_->file("tiny.toml") + " --out " + dir_->file("mlp"));
    ASSERT_EQ(a.rc, 0) << a.output;
    auto b = kiln_cli("train " + dir_->file("gpt.toml") + " --out " + dir_->file("gpt") +
                      " --set train.steps=60 --set train.eval_every=0");
    ASSERT_EQ(b.rc, 0) << b.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static TempDir* dir_;
};
TempDir* CliCommands::dir_ = nullptr;

std::string percent(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "accuracy %.2f%%", 100 * x);
  return buf;
}

TEST_F(CliCommands, EvalOfARunMatchesItsFinalEvaluation) {
  auto r = kiln_cli("eval " + dir_->file("mlp"));
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto s = read_json(dir_->path() / "mlp" / "summary.json");
  EXPECT_NE(r.output.find(percent(s["final"]["accuracy"].get<double>())), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("test split, 64 samples"), std::string::npos) << r.output;
  // A checkpoint file works too, and the train split is another set.
  auto c = kiln_cli("eval " + (dir_->path() / "mlp" / "checkpoints" / "ckpt-00000020.safetensors").string() +
                    " --split train");
  ASSERT_EQ(c.rc, 0) << c.output;
  EXPECT_NE(c.output.find("(step 20), train split, 256 samples"), std::string::npos) << c.output;
  auto bad = kiln_cli("eval " + dir_->file("mlp") + " --split validation");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_EQ(count_lines(bad.output), 1) << bad.output;
}

TEST_F(CliCommands, EvalOfALanguageModelGivesBitsPerChar) {
  auto r = kiln_cli("eval " + dir_->file("gpt"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("bits/char"), std::string::npos) << r.output;
  const auto s = read_json(dir_->path() / "gpt" / "summary.json");
  char buf[64];
  std::snprintf(buf, sizeof buf, "bits/char %.4f", s["final"]["bits_per_char"].get<double>());
  EXPECT_NE(r.output.find(buf), std::string::npos) << r.output;
}

TEST_F(CliCommands, SampleContinuesThePromptReproducibly) {
  const std::string args = "sample " + dir_->file("gpt") + " --prompt 'Call me' --tokens 40 --temperature 0.8 --top-k 10";
  auto a = kiln_cli(args + " --seed 7");
  auto b = kiln_cli(args + " --seed 7");
  ASSERT_EQ(a.rc, 0) << a.output;
  EXPECT_EQ(a.output, b.output);
  ASSERT_EQ(a.output.rfind("Call me", 0), 0u) << a.output;
  EXPECT_EQ(a.output.size(), std::string("Call me").size() + 40 + 1);  // prompt, 40 bytes, newline
  // The key/value cache changes the speed, not the text (the test GPT's context, 32, slides after 25 bytes).
  auto n = kiln_cli(args + " --seed 7 --no-kv-cache");
  ASSERT_EQ(n.rc, 0) << n.output;
  EXPECT_EQ(n.output, a.output);
  auto t = kiln_cli(args + " --seed 7 --timing");
  EXPECT_NE(t.output.find("40 tokens in "), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("tokens/s (kv cache on)"), std::string::npos) << t.output;
  // Greedy decoding of a model trained on one repeated paragraph reproduces some of its words.
  auto g = kiln_cli("sample " + dir_->file("gpt") + " --prompt 'Call me' --tokens 40 --temperature 0");
  ASSERT_EQ(g.rc, 0) << g.output;
  EXPECT_EQ(g.output.size(), std::string("Call me").size() + 40 + 1);
  // A classifier cannot sample.
  auto c = kiln_cli("sample " + dir_->file("mlp") + " --tokens 5");
  EXPECT_EQ(c.rc, 2);
  EXPECT_NE(c.output.find("needs a language model"), std::string::npos) << c.output;
}

TEST_F(CliCommands, InspectShowsTensorsMetadataAndRuns) {
  auto r = kiln_cli("inspect " + (dir_->path() / "mlp" / "checkpoints" / "ckpt-00000040.safetensors").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const char* s : {"kiln training checkpoint", "model.layers.0.weight", "float32", "[32, 64]", "step = 40",
                        "optim.", "config:", "type = 'mlp'"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;

  // A plain safetensors file: statistics of a known tensor.
  io::save_safetensors(dir_->file("plain.safetensors"), io::NamedTensors{{"w", tensor(std::vector<float>{1, 2, 3, 4}, {2, 2})}},
                       {{"author", "test"}});
  auto p = kiln_cli("inspect " + dir_->file("plain.safetensors"));
  ASSERT_EQ(p.rc, 0) << p.output;
  for (const char* s : {"safetensors file, 1 tensors", "[2, 2]", "2.5", "author = test"})
    EXPECT_NE(p.output.find(s), std::string::npos) << s << "\n" << p.output;

  auto d = kiln_cli("inspect " + dir_->file("mlp"));
  ASSERT_EQ(d.rc, 0) << d.output;
  for (const char* s : {"run ", "status   completed at step 40 of 40", "accuracy", "ckpt-00000040.safetensors"})
    EXPECT_NE(d.output.find(s), std::string::npos) << s << "\n" << d.output;

  write_text(dir_->path() / "junk.safetensors", "this is not a safetensors file at all");
  auto j = kiln_cli("inspect " + dir_->file("junk.safetensors"));
  EXPECT_EQ(j.rc, 1) << j.output;
  EXPECT_EQ(j.output.rfind("kiln: error: ", 0), 0u) << j.output;
}

TEST(CliErrors, ConfigProblemsAreOneLineNamingFileLineAndKey) {
  TempDir dir;
  struct Case {
    std::string name, text, expect;
  };
  const std::string base = tiny_mlp_config();
  const std::vector<Case> cases = {
      {"unknown.toml", "[model]\ntype = \"mlp\"\nhiden = [8]\n[data]\ndataset = \"synthetic\"\n",
       "unknown.toml:3: unknown key 'model.hiden' (known in [model]:"},
      {"type.toml", "[model]\ntype = \"mlp\"\n[data]\ndataset = \"synthetic\"\n[optim]\nlr = \"fast\"\n",
       "type.toml:6: 'optim.lr' expects a number, got \"fast\""},
      {"intkey.toml", "[model]\ntype = \"mlp\"\n[data]\ndataset = \"synthetic\"\nbatch_size = 1.5\n",
       "intkey.toml:5: 'data.batch_size' expects an integer, got 1.5"},
      {"choice.toml", "[model]\ntype = \"transformer\"\n[data]\ndataset = \"synthetic\"\n",
       "choice.toml:2: 'model.type' expects one of mlp|cnn|resnet|vit|gpt, got \"transformer\""},
      {"applies.toml", "[model]\ntype = \"cnn\"\nn_head = 4\n[data]\ndataset = \"synthetic\"\n",
       "applies.toml:3: 'model.n_head' applies only when model.type is one of gpt"},
      {"section.toml", "[modle]\ntype = \"mlp\"\n", "section.toml:1: unknown section [modle]"},
      {"missing_key.toml", "[model]\ntype = \"mlp\"\n", "missing required key 'data.dataset'"},
      {"syntax.toml", "[model\ntype = \"mlp\"\n", "syntax.toml:1: invalid TOML"},
  };
  for (const auto& c : cases) {
    write_text(dir.path() / c.name, c.text);
    auto r = kiln_cli("train " + dir.file(c.name) + " --out " + dir.file("never"));
    EXPECT_EQ(r.rc, 2) << c.name << ": " << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << c.name << ": " << r.output;
    EXPECT_EQ(r.output.rfind("kiln: error: ", 0), 0u) << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.name << ": " << r.output;
  }
  EXPECT_FALSE(fs::exists(dir.path() / "never"));

  auto missing = kiln_cli("train " + dir.file("nope.toml"));
  EXPECT_EQ(missing.rc, 2);
  EXPECT_EQ(count_lines(missing.output), 1) << missing.output;
  EXPECT_NE(missing.output.find("nope.toml: cannot read the config file"), std::string::npos) << missing.output;

  write_text(dir.path() / "ok.toml", base);
  auto set = kiln_cli("train " + dir.file("ok.toml") + " --out " + dir.file("never") + " --set optim.lrr=1");
  EXPECT_EQ(set.rc, 2);
  EXPECT_EQ(count_lines(set.output), 1) << set.output;
  EXPECT_NE(set.output.find("--set optim.lrr=1: unknown key 'optim.lrr'"), std::string::npos) << set.output;
  auto set_type = kiln_cli("train " + dir.file("ok.toml") + " --out " + dir.file("never") + " --set train.steps=many");
  EXPECT_EQ(set_type.rc, 2);
  EXPECT_NE(set_type.output.find("'train.steps' expects an integer, got \"many\""), std::string::npos) << set_type.output;

  auto resume = kiln_cli("resume " + dir.file("no_run"));
  EXPECT_EQ(resume.rc, 2);
  EXPECT_EQ(count_lines(resume.output), 1) << resume.output;
  auto eval = kiln_cli("eval " + dir.file("no_run"));
  EXPECT_EQ(eval.rc, 2);
  EXPECT_EQ(count_lines(eval.output), 1) << eval.output;
}

TEST(CliErrors, HelpVersionAndUsage) {
  auto v = kiln_cli("--version");
  EXPECT_EQ(v.rc, 0);
  EXPECT_NE(v.output.find("kiln 0."), std::string::npos) << v.output;
  auto h = kiln_cli("--help");
  EXPECT_EQ(h.rc, 0);
  for (const char* s : {"train", "resume", "eval", "sample", "inspect"}) EXPECT_NE(h.output.find(s), std::string::npos) << s;
  auto th = kiln_cli("train --help");
  EXPECT_EQ(th.rc, 0);
  EXPECT_NE(th.output.find("--set"), std::string::npos) << th.output;
  auto sh = kiln_cli("sample --help");
  EXPECT_EQ(sh.rc, 0);
  EXPECT_NE(sh.output.find("--top-k"), std::string::npos) << sh.output;
  // `kiln` alone prints the help, as --help does (issue 15).
  auto bare = kiln_cli("");
  EXPECT_EQ(bare.rc, 0) << bare.output;
  EXPECT_EQ(bare.output, h.output);
  for (const char* args : {"fly", "train", "train a.toml b.toml", "sample run --tokens many"}) {
    auto r = kiln_cli(args);
    EXPECT_EQ(r.rc, 2) << args << ": " << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << args << ": " << r.output;
    EXPECT_EQ(r.output.rfind("kiln: error: ", 0), 0u) << args << ": " << r.output;
  }
}

// Issue 15: values out of range are reported together when the config is read,
// each with where it came from (the file's line or the --set), and nothing is created.
TEST(CliErrors, OutOfRangeValuesAreReportedTogetherWithTheirOrigin) {
  TempDir dir;
  std::string text = tiny_mlp_config();
  text.replace(text.find("steps = 40"), 10, "steps = -5");
  text.replace(text.find("log_every = 1"), 13, "log_every = -1");
  write_text(dir.path() / "bad.toml", text);
  auto r = kiln_cli("train " + dir.file("bad.toml") + " --out " + dir.file("never") +
                    " --set optim.lr=-0.1 --set optim.beta1=1 --set schedule.warmup_steps=-2"
                    " --set data.num_workers=-1 --set data.batch_size=0");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_EQ(r.output.rfind("kiln: error: 7 config values are out of range:", 0), 0u) << r.output;
  for (const std::string s : {"bad.toml:26: 'train.steps' = -5, out of range (expects an integer >= 0)",
                              "bad.toml:29: 'train.log_every' = -1, out of range (expects an integer >= 1)",
                              "--set optim.lr=-0.1: 'optim.lr' = -0.1, out of range",
                              "--set optim.beta1=1: 'optim.beta1' = 1.0, out of range (expects a number in [0, 1))",
                              "--set schedule.warmup_steps=-2: 'schedule.warmup_steps'",
                              "--set data.num_workers=-1: 'data.num_workers'",
                              "--set data.batch_size=0: 'data.batch_size' = 0, out of range (expects an integer >= 1)"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  EXPECT_FALSE(fs::exists(dir.path() / "never"));
  // A --set can repair the file's value: only the final config is checked.
  auto fixed = kiln_cli("train " + dir.file("bad.toml") + " --out " + dir.file("fixed") +
                        " --set train.steps=2 --set train.log_every=1");
  EXPECT_EQ(fixed.rc, 0) << fixed.output;

  // Too large for the type: out of range, not "expects an integer".
  write_text(dir.path() / "ok.toml", tiny_mlp_config());
  for (const std::string& set : {std::string("train.steps=99999999999999999999"), std::string("threads=3000000000")}) {
    auto big = kiln_cli("train " + dir.file("ok.toml") + " --out " + dir.file("never") + " --set " + set);
    EXPECT_EQ(big.rc, 2) << big.output;
    EXPECT_EQ(count_lines(big.output), 1) << big.output;
    EXPECT_NE(big.output.find("--set " + set + ": "), std::string::npos) << big.output;
    EXPECT_NE(big.output.find("out of range"), std::string::npos) << big.output;
    EXPECT_EQ(big.output.find("expects an integer,"), std::string::npos) << big.output;
  }
  text = tiny_mlp_config();
  text.replace(text.find("steps = 40"), 10, "steps = 99999999999999999999");
  write_text(dir.path() / "big.toml", text);
  auto file_big = kiln_cli("train " + dir.file("big.toml") + " --out " + dir.file("never"));
  EXPECT_EQ(file_big.rc, 2) << file_big.output;
  EXPECT_NE(file_big.output.find("big.toml:26: an integer out of range"), std::string::npos) << file_big.output;
  EXPECT_FALSE(fs::exists(dir.path() / "never"));
}

// Issue 15: a data.root the user chose is blamed, not the installation (scripts/setup.sh installs elsewhere).
TEST(CliErrors, MissingUserDataRootNamesTheSettingNotSetup) {
  TempDir dir;
  write_text(dir.path() / "m.toml", "[model]\ntype = \"mlp\"\n[data]\ndataset = \"mnist\"\nroot = \"" +
                                        dir.file("nowhere") + "\"\n");
  auto r = kiln_cli("train " + dir.file("m.toml") + " --out " + dir.file("run"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("m.toml:5: data.root = \"" + dir.file("nowhere") + "\": MNIST: neither"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("run scripts/setup.sh"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir.path() / "run"));  // no run directory left behind
}

// Issue 15: `kiln inspect` of a file that is not safetensors says so first.
TEST(CliErrors, InspectOfATextFileSaysItIsNotSafetensors) {
  TempDir dir;
  write_text(dir.path() / "README.md", "# kiln\n\nA C++20 deep-learning training framework.\n");
  auto r = kiln_cli("inspect " + dir.file("README.md"));
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("README.md': not a safetensors file"), std::string::npos) << r.output;
}

// Issue 15: the README's commands say `kiln ...`; scripts/link_kiln.sh (run by demo.sh and
// test.sh) links the built executable into a writable bin directory, or prints the PATH line.
TEST(CliScripts, LinkKilnLinksTheExecutableOrPrintsThePathLine) {
  TempDir dir;
  const std::string script = std::string(KILN_SOURCE_DIR) + "/scripts/link_kiln.sh";
  const std::string env = std::string("KILN_BIN=") + KILN_CLI_BINARY + " ";
  fs::create_directories(dir.path() / "bin");
  std::string out;
  ASSERT_EQ(run_command(env + "KILN_LINK_DIR=" + dir.file("bin") + " " + script, out), 0) << out;
  ASSERT_TRUE(fs::is_symlink(dir.path() / "bin" / "kiln")) << out;
  std::string version;
  EXPECT_EQ(run_command("PATH=" + dir.file("bin") + ":/usr/bin:/bin kiln --version", version), 0) << version;
  EXPECT_NE(version.find("kiln 0."), std::string::npos) << version;
  ASSERT_EQ(run_command(env + "KILN_LINK_DIR=" + dir.file("missing") + " " + script, out), 0) << out;
  EXPECT_NE(out.find(std::string("export PATH=\"") + fs::path(KILN_CLI_BINARY).parent_path().string() + ":$PATH\""),
            std::string::npos)
      << out;
}

TEST(CliConfig, SetOverridesAndResolvedTextRoundTrips) {
  auto c = cli::Config::from_string(tiny_mlp_config(), "tiny");
  c.set("optim.lr=0.5");
  c.set("train.steps=7");
  c.set("name=renamed");  // a bare word is a string
  EXPECT_EQ(c.number("optim.lr"), 0.5);
  EXPECT_EQ(c.integer("train.steps"), 7);
  EXPECT_EQ(c.name(), "renamed");
  c.set("optim.lr=1");  // an integer where a number is expected is fine
  EXPECT_EQ(c.number("optim.lr"), 1.0);
  const auto back = cli::Config::from_string(c.to_toml(), "resolved");
  EXPECT_EQ(back.to_toml(), c.to_toml());
  // Switching the optimizer: the defaults follow the new choice; a key of the old one is an error.
  c.set("optim.name=sgd");
  EXPECT_EQ(c.number("optim.momentum"), 0.0);
  EXPECT_THROW(c.set("optim.beta1=0.5"), cli::ConfigError);
}

// Found by fuzz_config: a bare-word value that is not UTF-8 was taken as a string and
// written to config.toml as different text. It is refused; valid UTF-8 round-trips.
TEST(CliConfig, SetRefusesInvalidUtf8AndKeepsUnicode) {
  auto c = cli::Config::from_string(tiny_mlp_config(), "tiny");
  for (const std::string bad : {"name=\xC5\xDC", "name=a\xFF", "name=\xED\xA0\x80", "name=\xC0\xAF", "name=\xE2\x82"}) {
    try {
      c.set(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const cli::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(c.name(), "tiny");  // unchanged by the refused assignments
  c.set("name=caf\xC3\xA9-\xF0\x9F\x94\xA5");
  EXPECT_EQ(c.name(), "caf\xC3\xA9-\xF0\x9F\x94\xA5");
  EXPECT_EQ(cli::Config::from_string(c.to_toml(), "resolved").to_toml(), c.to_toml());
}

}  // namespace
}  // namespace kiln::test
