// `kiln train` and `kiln resume` end to end: the run directory, the metrics
// contract, resume continuity (stopped by train.max_steps and by SIGINT), and
// the NaN stop.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "cli/cli_util.h"
#include "cli/config.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

TEST(CliTrain, RunDirectoryHoldsConfigMetricsCheckpointsAndSummary) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("completed at step 40 of 40"), std::string::npos) << r.output;
  for (const char* f : {"config.toml", "metrics.jsonl", "summary.json", "report.html", "checkpoints/latest",
                        "checkpoints/ckpt-00000020.safetensors", "checkpoints/ckpt-00000040.safetensors"})
    EXPECT_TRUE(fs::exists(run / f)) << f;

  // The resolved config reads back to the same config, defaults included.
  const auto resolved = cli::Config::from_file(run / "config.toml");
  EXPECT_EQ(resolved.to_toml(), read_file((run / "config.toml").string()));
  EXPECT_EQ(resolved.string("optim.name"), "adamw");
  EXPECT_EQ(resolved.integer("data.eval_batch_size"), 500);  // a default, written out

  const auto train = metrics_lines(run, "train");
  ASSERT_EQ(train.size(), 40u);
  for (size_t i = 0; i < train.size(); ++i) {
    const auto& j = train[i];
    EXPECT_EQ(j["step"].get<int64_t>(), static_cast<int64_t>(i + 1));
    for (const char* k : {"epoch", "loss", "lr", "grad_norm", "samples_per_s", "data_wait", "memory", "time_s"})
      ASSERT_TRUE(j.contains(k)) << k << " missing in " << j.dump();
    EXPECT_GE(j["data_wait"].get<double>(), 0.0);
    EXPECT_LE(j["data_wait"].get<double>(), 1.0);
    EXPECT_GT(j["grad_norm"].get<double>(), 0.0);
    EXPECT_GT(j["samples_per_s"].get<double>(), 0.0);
    EXPECT_GT(j["memory"]["parameter"].get<int64_t>(), 0);
    EXPECT_GT(j["memory"]["optimizer_state"].get<int64_t>(), 0);
  }
  EXPECT_EQ(train[0]["epoch"].get<int64_t>(), 0);
  EXPECT_EQ(train[39]["epoch"].get<int64_t>(), 2);  // 16 batches per epoch
  // Warmup: the lr rises over the first 4 steps, then the cosine decays it.
  EXPECT_LT(train[0]["lr"].get<double>(), train[4]["lr"].get<double>());
  EXPECT_GT(train[4]["lr"].get<double>(), train[39]["lr"].get<double>());

  const auto eval = metrics_lines(run, "eval");
  ASSERT_EQ(eval.size(), 4u);  // steps 10, 20, 30 and the end
  EXPECT_EQ(eval.back()["step"].get<int64_t>(), 40);
  for (const auto& e : eval) {
    EXPECT_GE(e["accuracy"].get<double>(), 0.0);
    EXPECT_LE(e["accuracy"].get<double>(), 1.0);
    EXPECT_TRUE(e.contains("loss"));
  }

  const auto s = read_json(run / "summary.json");
  EXPECT_EQ(s["name"], "tiny");
  EXPECT_EQ(s["config_path"], dir.file("tiny.toml"));
  EXPECT_EQ(s["steps"].get<int64_t>(), 40);
  EXPECT_EQ(s["status"], "completed");
  EXPECT_GT(s["wall_s"].get<double>(), 0.0);
  EXPECT_EQ(s["final"]["loss"], train.back()["loss"]);
  EXPECT_EQ(s["final"]["accuracy"], eval.back()["accuracy"]);
  EXPECT_EQ(s["flush_denormal"], false);  // subnormals kept, as torch keeps them by default

  // A second train into the same directory is refused, pointing at resume.
  auto again = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string());
  EXPECT_EQ(again.rc, 2);
  EXPECT_NE(again.output.find("kiln resume"), std::string::npos) << again.output;
}


// flush_denormal = true is torch.set_flush_denormal(True) for the run: in
// effect for its math, written to its resolved config, and read back from the
// process into summary.json.
TEST(CliTrain, FlushDenormalIsInEffectForTheRunWhenAsked) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() +
                    " --set flush_denormal=true --set train.steps=6 --set train.eval_every=3");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(cli::Config::from_file(run / "config.toml").boolean("flush_denormal"));
  const auto s = read_json(run / "summary.json");
  EXPECT_EQ(s["status"], "completed");
#if defined(__x86_64__)
  EXPECT_EQ(s["flush_denormal"], true) << r.output;
#else
  EXPECT_NE(r.output.find("cannot flush subnormals"), std::string::npos) << r.output;
#endif
}

TEST(CliTrain, ResumeAfterMaxStepsContinuesBitwise) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const fs::path straight = dir.path() / "straight", split = dir.path() / "split";
  auto a = kiln_cli("train " + dir.file("gpt.toml") + " --out " + straight.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file("gpt.toml") + " --out " + split.string() + " --set train.max_steps=13");
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_EQ(read_json(split / "summary.json")["status"], "stopped");
  EXPECT_EQ(train_losses(split).size(), 13u);
  // The stop quotes the last evaluation, from step 10, and says so (issue 15).
  EXPECT_NE(b.output.find("bits/char (at step 10)"), std::string::npos) << b.output;
  auto c = kiln_cli("resume " + split.string());
  ASSERT_EQ(c.rc, 0) << c.output;
  EXPECT_NE(c.output.find("resuming"), std::string::npos);

  const auto la = train_losses(straight), lb = train_losses(split);
  ASSERT_EQ(la.size(), 30u);
  ASSERT_EQ(lb.size(), 30u);
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;  // bitwise: same doubles
  const auto ea = metrics_lines(straight, "eval"), eb = metrics_lines(split, "eval");
  ASSERT_EQ(ea.size(), eb.size());
  for (size_t i = 0; i < ea.size(); ++i) {
    EXPECT_EQ(ea[i]["loss"], eb[i]["loss"]);
    EXPECT_EQ(ea[i]["bits_per_char"], eb[i]["bits_per_char"]);
  }
  EXPECT_EQ(read_json(split / "summary.json")["status"], "completed");

  // Resuming a finished run changes nothing.
  const std::string before = read_file((split / "metrics.jsonl").string());
  auto d = kiln_cli("resume " + split.string());
  EXPECT_EQ(d.rc, 0) << d.output;
  EXPECT_NE(d.output.find("nothing to do"), std::string::npos) << d.output;
  EXPECT_EQ(read_file((split / "metrics.jsonl").string()), before);
}

/// Starts `kiln args...` with its output in `log`; returns the pid.
pid_t spawn_kiln(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    ::setenv("OMP_NUM_THREADS", "2", 1);  // as kiln_cli's resumes
    std::vector<char*> argv{const_cast<char*>(KILN_CLI_BINARY)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(KILN_CLI_BINARY, argv.data());
    ::_exit(127);
  }
  return pid;
}

TEST(CliTrain, SigintFinishesTheStepSavesAndResumesIdentically) {
  TempDir dir;
  // Long enough that the signal lands mid-run.
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  const pid_t pid = spawn_kiln({"train", dir.file("tiny.toml"), "--out", run.string(), "--set", "train.steps=200000",
                                "--set", "train.ckpt_every=0"},
                               dir.file("log.txt"));
  ASSERT_GT(pid, 0);
  // Wait until a few steps are logged (complete lines only: the run is writing the file).
  auto logged = [&] {
    std::ifstream in(run / "metrics.jsonl");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return count_lines(text);
  };
  for (int i = 0; i < 6000 && logged() < 5; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GE(logged(), 5) << read_file(dir.file("log.txt"));
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const std::string log = read_file(dir.file("log.txt"));
  ASSERT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 0) << log;
  EXPECT_NE(log.find("stopping after this step"), std::string::npos) << log;
  const auto summary = read_json(run / "summary.json");
  EXPECT_EQ(summary["status"], "interrupted");
  const int64_t k = summary["steps"].get<int64_t>();
  ASSERT_GT(k, 0);
  ASSERT_LT(k, 200000);
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%08lld.safetensors", static_cast<long long>(k));
  EXPECT_TRUE(fs::exists(run / "checkpoints" / name)) << name;

  // Resume 7 more steps; a straight run to the same step computes the same losses.
  const std::string until = "train.max_steps=" + std::to_string(k + 7);
  auto r = kiln_cli("resume " + run.string() + " --set " + until);
  ASSERT_EQ(r.rc, 0) << r.output;
  const fs::path straight = dir.path() / "straight";
  auto s = kiln_cli("train " + dir.file("tiny.toml") + " --out " + straight.string() +
                    " --set train.steps=200000 --set train.ckpt_every=0 --set " + until);
  ASSERT_EQ(s.rc, 0) << s.output;
  const auto la = train_losses(straight), lb = train_losses(run);
  ASSERT_EQ(la.size(), static_cast<size_t>(k + 7));
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
}

TEST(CliTrain, NonFiniteLossStopsNamingTheStepAndAnomalyMode) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + dir.file("run") +
                    " --set optim.name=sgd --set optim.lr=1e30 --set schedule.warmup_steps=0");
  EXPECT_EQ(r.rc, 3) << r.output;
  EXPECT_NE(r.output.find("the loss became"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--set train.anomaly=true"), std::string::npos) << r.output;
  // No checkpoint exists yet (the first is at step 20): none is claimed (issue 15).
  EXPECT_EQ(r.output.find("left as it was"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("no checkpoint was saved before it"), std::string::npos) << r.output;
  EXPECT_EQ(read_json(dir.path() / "run" / "summary.json")["status"], "nan");
}

// Issue 15: anomaly mode names the module (its path in the model), and stops like a NaN loss: exit 3, status nan.
TEST(CliTrain, AnomalyModeNamesTheModuleAndStopsLikeANonFiniteLoss) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + dir.file("run") +
                    " --set optim.name=sgd --set optim.lr=1e30 --set schedule.warmup_steps=0 --set train.anomaly=true");
  EXPECT_EQ(r.rc, 3) << r.output;
  EXPECT_NE(r.output.find("anomaly mode stopped the run at step 2 (epoch 0) in the forward of module layers.2 (Linear)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("start again with kiln train"), std::string::npos) << r.output;
  EXPECT_EQ(read_json(dir.path() / "run" / "summary.json")["status"], "nan");
}

}  // namespace
}  // namespace kiln::test
