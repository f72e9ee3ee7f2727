// `[parallel]` (issue 20): `kiln train` with the GPT laid out over dp x tp x
// pp ranks through `kiln launch`. A tp 2 x pp 2 run trains as one process does
// (the same batches: one dp replica reads a single process's); dp 2 x tp 2 x
// pp 2 on 8 ranks (sequence parallel, ZeRO-1 over dp) trains as a 2-rank ddp
// run (the same DistributedSampler shares); a stopped mesh run resumes to the
// straight run's losses bit for bit; its checkpoint is the single-process
// file `kiln eval` reads; bad layouts are refused before any collective; and a
// killed pipeline stage is named by `kiln launch`, with where the others were.
//
// Tolerance: the layouts compute the same float32 operations on slices and
// sum them in another order, so losses, gradient norms and evaluations agree
// within |d| <= 1e-6 + 1e-5 |want| (observed: about 1e-7), not bitwise.
#include <gtest/gtest.h>

#include <cmath>

#include "cli/cli_util.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

// Two layers (so two stages), four heads (so tp 2 or 4), no dropout (so the layouts agree), clipping on.
const std::string kGpt =
    " --set model.n_layer=2 --set model.n_head=4 --set model.dropout=0.0 --set optim.grad_clip=0.5"
    " --set train.steps=8 --set train.eval_every=4 --set train.ckpt_every=4 --set data.batch_size=4";
const std::string kTpPp = " --set parallel.tp=2 --set parallel.pp=2 --set parallel.micro_batches=2";

struct Fixture {
  TempDir dir;
  std::string config;
  Fixture() {
    write_text(dir.path() / "text.txt", tiny_text());
    write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("text.txt")));
    config = dir.file("gpt.toml");
  }
};

void expect_close(const std::vector<nlohmann::json>& got, const std::vector<nlohmann::json>& want,
                  const std::vector<std::string>& keys) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    for (const auto& k : keys) {
      const double g = got[i][k].get<double>(), w = want[i][k].get<double>();
      EXPECT_LE(std::abs(g - w), 1e-6 + 1e-5 * std::abs(w)) << k << " at line " << i << ": " << g << " vs " << w;
    }
}

TEST(CliParallel, TensorAndPipelineParallelTrainAsOneProcess) {
  Fixture f;
  const fs::path one = f.dir.path() / "one", mesh = f.dir.path() / "mesh";
  auto a = kiln_cli("train " + f.config + " --out " + one.string() + kGpt);
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = launch(4, "train " + f.config + " --out " + mesh.string() + kGpt + kTpPp);
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("dp 1 x tp 2 x pp 2 = 4 ranks"), std::string::npos) << b.output;
  const auto want = metrics_lines(one, "train"), got = metrics_lines(mesh, "train");
  ASSERT_EQ(want.size(), 8u);
  bool clipped = false;
  for (const auto& l : want) clipped = clipped || l["grad_norm"].get<double>() > 0.5;
  EXPECT_TRUE(clipped) << "grad_clip = 0.5 never clipped: the global norm across stages and shards goes untested";
  expect_close(got, want, {"loss", "grad_norm", "lr"});
  expect_close(metrics_lines(mesh, "eval"), metrics_lines(one, "eval"), {"loss", "bits_per_char"});
  // What each step handed to communication (dist::traffic): rank 0's tp all-reduces and pipeline
  // transfers on a mesh run; a single process communicates nothing and logs no such field.
  EXPECT_FALSE(want.back().contains("comm_bytes_per_step")) << want.back().dump();
  ASSERT_TRUE(got.back().contains("comm_bytes_per_step")) << got.back().dump();
  EXPECT_GT(got.back()["comm_bytes_per_step"].get<int64_t>(), 0);
  // The pipeline's bubble on every train line: 1F1B over 2 stages and 2 micro-batches, 1/3 of the slots.
  ASSERT_TRUE(got.back().contains("pipeline")) << got.back().dump();
  EXPECT_NEAR(got.back()["pipeline"]["bubble_slots"].get<double>(), 1.0 / 3.0, 1e-12);
  EXPECT_NEAR(got.back()["pipeline"]["bubble_model"].get<double>(), 1.0 / 3.0, 1e-12);
  // The checkpoint is the whole GPT's: one process evaluates it as it does its own run's.
  auto e1 = kiln_cli("eval " + one.string()), e2 = kiln_cli("eval " + mesh.string());
  ASSERT_EQ(e1.rc, 0) << e1.output;
  ASSERT_EQ(e2.rc, 0) << e2.output;
  const auto loss_of = [](const std::string& out) {
    const auto at = out.find("loss ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 5));
  };
  EXPECT_NEAR(loss_of(e2.output), loss_of(e1.output), 1e-4) << e1.output << e2.output;
}

TEST(CliParallel, StoppedMeshRunResumesToTheStraightRunBitwise) {
  Fixture f;
  const fs::path straight = f.dir.path() / "straight", stopped = f.dir.path() / "stopped";
  auto a = launch(4, "train " + f.config + " --out " + straight.string() + kGpt + kTpPp);
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = launch(4, "train " + f.config + " --out " + stopped.string() + kGpt + kTpPp + " --set train.max_steps=4");
  ASSERT_EQ(b.rc, 0) << b.output;
  auto c = launch(4, "resume " + stopped.string());
  ASSERT_EQ(c.rc, 0) << c.output;
  // The checkpoint holds the merged model and AdamW state; each rank takes its shard again.
  EXPECT_EQ(train_losses(stopped), train_losses(straight));
}

TEST(CliParallel, EightRanksOfDpTpPpTrainAsTwoRankDdp) {
  Fixture f;
  const fs::path ddp = f.dir.path() / "ddp", mesh = f.dir.path() / "mesh";
  auto a = launch(2, "train " + f.config + " --out " + ddp.string() + kGpt);
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = launch(8, "train " + f.config + " --out " + mesh.string() + kGpt + kTpPp +
                         " --set parallel.sequence_parallel=true --set dist.strategy=zero1 --set parallel.schedule=gpipe");
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("dp 2 x tp 2 x pp 2 = 8 ranks (global batch 8)"), std::string::npos) << b.output;
  expect_close(metrics_lines(mesh, "train"), metrics_lines(ddp, "train"), {"loss", "grad_norm", "lr"});
  expect_close(metrics_lines(mesh, "eval"), metrics_lines(ddp, "eval"), {"loss"});
}

TEST(CliParallel, RefusesLayoutsThatDoNotFit) {
  Fixture f;
  // The process count: every rank says so before any collective.
  auto a = launch(2, "train " + f.config + " --out " + f.dir.file("a") + kGpt + kTpPp);
  EXPECT_NE(a.rc, 0);
  EXPECT_NE(a.output.find("[parallel] dp x tp x pp = ? x 2 x 2 needs a multiple of 4 processes, this run has 2"),
            std::string::npos)
      << a.output;
  // What the model must divide into, listed together.
  auto b = launch(2, "train " + f.config + " --out " + f.dir.file("b") + kGpt +
                         " --set parallel.tp=1 --set parallel.pp=2 --set parallel.micro_batches=3 --set "
                         "model.n_layer=1");
  EXPECT_NE(b.rc, 0);
  EXPECT_NE(b.output.find("model.n_layer = 1 gives fewer layers than parallel.pp = 2 stages"), std::string::npos)
      << b.output;
  EXPECT_NE(b.output.find("data.batch_size = 4 (per dp replica) must divide into parallel.micro_batches = 3"),
            std::string::npos)
      << b.output;
  auto c = kiln_cli("train " + f.config + " --out " + f.dir.file("c") + kGpt +
                    " --set parallel.tp=3 --set train.grad_accum_steps=2 --set dist.bucket_cap_mb=4");
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("model.n_head = 4 must divide by parallel.tp = 3"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("needs a multiple of 3 processes, this run has 1"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("train.grad_accum_steps > 1 is not supported with tp or pp"), std::string::npos)
      << c.output;
  EXPECT_NE(c.output.find("dist.bucket_cap_mb = 4 is not supported with tp or pp"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(f.dir.path() / "a") || fs::exists(f.dir.path() / "b") || fs::exists(f.dir.path() / "c"));
}

// A pipeline stage killed mid-run (rank 1: dp 0, tp 0, stage 1 of the dp x tp x pp layout, pp fastest):
// `kiln launch` names it and says where each other rank was.
TEST(CliParallel, AKilledPipelineStageIsNamedWithWhereTheOthersWere) {
  Fixture f;
  const fs::path run = f.dir.path() / "run";
  BackgroundLaunch job(4,
                      "train " + f.config + " --out " + run.string() + kGpt + kTpPp +
                          " --set train.steps=200000 --set train.ckpt_every=0 --set train.eval_every=0",
                      f.dir.file("log.txt"));
  ASSERT_TRUE(job.started());
  ASSERT_TRUE(job.wait_for_lines(run / "metrics.jsonl", 5)) << job.log();
  const pid_t stage1 = job.rank(1);
  ASSERT_GT(stage1, 0) << "no rank 1 below kiln launch";
  ASSERT_EQ(::kill(stage1, SIGKILL), 0);
  int status = 0;
  const bool ended = job.wait(&status);
  const std::string text = job.log();
  ASSERT_TRUE(ended) << "the job did not end after a stage was killed:\n" << text;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << text;
  EXPECT_NE(text.find("because rank 1 (pid " + std::to_string(stage1) + ") died without a word — killed by SIGKILL"),
            std::string::npos)
      << text;
  // Every other rank is named with the collective it was in when the job ended; where the kill lands
  // is timing (a pipeline transfer, a tp all-reduce, the norm or the step's agreement), but each of the
  // mesh's own collectives says what it is. (tests/dist/test_jobs.cpp kills a stage at a fixed point.)
  for (int r : {0, 2, 3}) {
    const auto at = text.find("rank " + std::to_string(r) + " (pid");
    ASSERT_NE(at, std::string::npos) << "rank " << r << " is not named:\n" << text;
    const std::string line = text.substr(at, text.find('\n', at) - at);
    EXPECT_NE(line.find(" at step "), std::string::npos) << line;
    EXPECT_TRUE(line.find(" in #") != std::string::npos || line.find("computing after #") != std::string::npos) << line;
  }
  const bool labelled = text.find("(pipeline stage ") != std::string::npos ||
                        text.find("(tensor parallel '") != std::string::npos ||
                        text.find("(mesh GPT: ") != std::string::npos;
  EXPECT_TRUE(labelled || text.find("src/cli/train.cpp") != std::string::npos) << text;
}

}  // namespace
}  // namespace kiln::test
