// `kiln resume --set`: every accepted setting takes effect from the resume step
// (optim.lr as a new base rate of the recomputed schedule, optimizer
// hyperparameters in every param group), every other one is refused naming the
// key; and the messages of a resume that cannot happen (issue 15, items 2 and 10).
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/io/safetensors.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

std::vector<double> train_values(const fs::path& run, const char* key) {
  std::vector<double> out;
  for (const auto& j : metrics_lines(run, "train")) out.push_back(j[key].get<double>());
  return out;
}

/// The metadata of a run's latest checkpoint.
io::Metadata latest_metadata(const fs::path& run) {
  const std::string name = read_file((run / "checkpoints" / "latest").string());
  return io::read_safetensors_header((run / "checkpoints" / name.substr(0, name.find('\n'))).string()).metadata;
}

class CliResume : public ::testing::Test {
 protected:
  /// The tiny MLP (cosine schedule with warmup) stopped at step 10 of 20.
  void SetUp() override {
    write_text(dir_.path() / "tiny.toml", tiny_mlp_config());
    auto r = kiln_cli("train " + dir_.file("tiny.toml") + " --out " + dir_.file("run") +
                      " --set train.steps=20 --set train.max_steps=10");
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  fs::path run() const { return dir_.path() / "run"; }
  TempDir dir_;
};

TEST_F(CliResume, NewLearningRateIsTheBaseOfTheScheduleFromTheResumeStep) {
  const auto before = train_values(run(), "lr");
  auto r = kiln_cli("resume " + run().string() + " --set optim.lr=0.01");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("changed on resume: optim.lr 0.003 -> 0.01"), std::string::npos) << r.output;
  // A run started with optim.lr = 0.01 uses these rates at steps 11..20, bit for bit.
  auto s = kiln_cli("train " + dir_.file("tiny.toml") + " --out " + dir_.file("straight") +
                    " --set train.steps=20 --set optim.lr=0.01");
  ASSERT_EQ(s.rc, 0) << s.output;
  const auto resumed = train_values(run(), "lr"), straight = train_values(dir_.path() / "straight", "lr");
  ASSERT_EQ(resumed.size(), 20u);
  ASSERT_EQ(straight.size(), 20u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed[i], before[i]) << "step " << i + 1;  // the first part stays
  for (size_t i = 10; i < 20; ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i + 1;
  EXPECT_GT(resumed[10], 2 * before[9]);  // 0.01 against 0.003: not the old rate
  // What is recorded is what was applied.
  EXPECT_NE(latest_metadata(run())["config"].find("lr = 0.01"), std::string::npos);
  EXPECT_NE(read_file((run() / "config.toml").string()).find("lr = 0.01"), std::string::npos);
  EXPECT_EQ(std::stod(latest_metadata(run()).at("optim.group.0.option.initial_lr")), 0.01);
}

TEST_F(CliResume, NewWeightDecayReachesTheOptimizer) {
  fs::copy(run(), dir_.path() / "twin", fs::copy_options::recursive);
  auto same = kiln_cli("resume " + (dir_.path() / "twin").string() + " --set optim.weight_decay=0.1");  // unchanged
  ASSERT_EQ(same.rc, 0) << same.output;
  EXPECT_EQ(same.output.find("changed on resume"), std::string::npos) << same.output;
  auto r = kiln_cli("resume " + run().string() + " --set optim.weight_decay=30");
  ASSERT_EQ(r.rc, 0) << r.output;
  // AdamW decays the weight matrices (group 0) only.
  const auto md = latest_metadata(run());
  EXPECT_EQ(std::stod(md.at("optim.group.0.option.weight_decay")), 30.0);
  EXPECT_EQ(std::stod(md.at("optim.group.1.option.weight_decay")), 0.0);
  const auto a = train_losses(dir_.path() / "twin"), b = train_losses(run());
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  EXPECT_EQ(a[10], b[10]);  // step 11's loss comes before its update
  EXPECT_NE(a[12], b[12]);  // after a decayed update the losses part
}

TEST_F(CliResume, KeysThatCannotChangeAreRefusedByName) {
  const std::string before = read_file((run() / "metrics.jsonl").string());
  auto one = kiln_cli("resume " + run().string() + " --set optim.name=sgd");
  EXPECT_EQ(one.rc, 2) << one.output;
  EXPECT_NE(one.output.find("--set optim.name=sgd: 'optim.name' cannot change when a run resumes"), std::string::npos)
      << one.output;
  auto many = kiln_cli("resume " + run().string() + " --set seed=9 --set data.batch_size=8 --set model.hidden=[16]");
  EXPECT_EQ(many.rc, 2) << many.output;
  for (const char* k : {"3 settings cannot change", "'seed'", "'data.batch_size'", "'model.hidden'"})
    EXPECT_NE(many.output.find(k), std::string::npos) << k << "\n" << many.output;
  // Setting a refused key to the value it has is no change.
  auto same = kiln_cli("resume " + run().string() + " --set seed=3 --set train.max_steps=11");
  EXPECT_EQ(same.rc, 0) << same.output;
  EXPECT_EQ(train_losses(run()).size(), 11u);
  EXPECT_NE(read_file((run() / "metrics.jsonl").string()), before);
}

TEST_F(CliResume, OnlyCheckpointTruncatedIsNamedWithWhy) {
  const fs::path ckpt = run() / "checkpoints" / "ckpt-00000010.safetensors";
  fs::resize_file(ckpt, fs::file_size(ckpt) - 64);
  auto r = kiln_cli("resume " + run().string());
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("no usable checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ckpt-00000010.safetensors: truncated"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("nothing to resume from"), std::string::npos) << r.output;
  auto in = kiln_cli("inspect " + run().string());
  EXPECT_EQ(in.rc, 0) << in.output;
  EXPECT_NE(in.output.find("ckpt-00000010.safetensors (UNUSABLE)"), std::string::npos) << in.output;
}

TEST_F(CliResume, EvalSaysWhenItFallsBackToAnOlderCheckpoint) {
  auto r = kiln_cli("resume " + run().string());  // checkpoints at 10 (the stop) and 20
  ASSERT_EQ(r.rc, 0) << r.output;
  const fs::path newest = run() / "checkpoints" / "ckpt-00000020.safetensors";
  fs::resize_file(newest, fs::file_size(newest) - 64);
  auto e = kiln_cli("eval " + run().string());
  ASSERT_EQ(e.rc, 0) << e.output;
  EXPECT_NE(e.output.find("ckpt-00000020.safetensors is unusable (truncated"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("using the older ckpt-00000010.safetensors"), std::string::npos) << e.output;
}

TEST_F(CliResume, AnotherThreadCountIsRecordedAndNoted) {
  EXPECT_EQ(latest_metadata(run()).at("state.run.threads"), "i:2");  // kiln_cli runs with OMP_NUM_THREADS=2
  EXPECT_EQ(latest_metadata(run()).at("state.run.world_size"), "i:1");
  CliResult r;
  r.rc = run_command(std::string("OMP_NUM_THREADS=1 ") + KILN_CLI_BINARY + " resume " + run().string(), r.output);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("trained with 2 thread(s) per process, this resume uses 1"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kiln::test
