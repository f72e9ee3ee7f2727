// `kiln doctor` and `kiln scenario` end to end, and the health lines of `kiln
// train`: every gallery scenario must keep naming its cause, and a healthy
// short run of every shipped config must give no finding above "info".
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "cli/cli_util.h"
#include "cli/health_log.h"
#include "kiln/kiln.h"
#include "kiln/optim/optimizer.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

const std::string kScenarioDir = std::string(KILN_SOURCE_DIR) + "/examples/scenarios";

json doctor_json(const fs::path& run) {
  auto r = kiln_cli("doctor " + run.string() + " --json");
  EXPECT_TRUE(r.rc == 0 || r.rc == 1) << r.output;
  return json::parse(r.output);
}

/// `kiln doctor --json` on a run directory holding these metrics lines and a
/// completed summary of `steps` steps; returns its finding `code` (null when none).
json finding_for(const fs::path& run, const std::string& metrics, int steps, const std::string& code, json* all) {
  write_text(run / "metrics.jsonl", metrics);
  const std::string n = std::to_string(steps);
  write_text(run / "summary.json", R"({"status": "completed", "steps": )" + n + R"(, "total_steps": )" + n + "}");
  *all = doctor_json(run);
  for (const auto& f : (*all)["findings"])
    if (f["code"] == code) return f;
  return nullptr;
}

TEST(CliHealth, TrainWritesHealthLinesEveryLogEvery) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() + " --set train.log_every=5");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto health = metrics_lines(run, "health");
  ASSERT_EQ(health.size(), 8u);  // steps 5, 10, ..., 40
  const json& h = health.back();
  EXPECT_EQ(h["step"].get<int64_t>(), 40);
  ASSERT_EQ(h["modules"].size(), 2u);  // the MLP's two Linear layers
  EXPECT_EQ(h["modules"][0]["name"], "layers.0");
  for (const auto& m : h["modules"]) {
    EXPECT_GT(m["grad_norm"].get<double>(), 0.0) << m.dump();
    EXPECT_GT(m["update_ratio"].get<double>(), 0.0) << m.dump();
    EXPECT_LT(m["update_ratio"].get<double>(), 1.0) << m.dump();
  }
  EXPECT_EQ(h["no_grad_count"].get<int64_t>(), 0);
  EXPECT_EQ(h["trainable"].get<int64_t>(), 4);
  ASSERT_EQ(h["dead"].size(), 1u);  // the ReLU between them
  EXPECT_EQ(h["dead"][0]["units"].get<int64_t>(), 32);
  ASSERT_EQ(h["blocks"].size(), 2u);
  EXPECT_GT(h["blocks"][0]["grad_rms"].get<double>(), 0.0);
  EXPECT_GE(h["cost_ms"].get<double>(), 0.0);
  // AdamW's two moments of every parameter value, none of them subnormal in a healthy run.
  const int64_t params = metrics_lines(run, "start").at(0)["parameters"].get<int64_t>();
  EXPECT_EQ(h["subnormal_state"]["values"].get<int64_t>(), 2 * params) << h["subnormal_state"].dump();
  EXPECT_EQ(h["subnormal_state"]["subnormal"].get<int64_t>(), 0);
  EXPECT_TRUE(h["subnormal_state"]["worst"].empty());
  // The start line counts what trains (kiln doctor's frozen_model): here, everything.
  const json start = metrics_lines(run, "start").at(0);
  EXPECT_GT(start["parameters"].get<int64_t>(), 0);
  EXPECT_EQ(start["trainable_parameters"], start["parameters"]);
}

TEST(CliHealth, TrainHealthFalseWritesNone) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto r = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() + " --set train.health=false");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(metrics_lines(run, "health").empty());
  // The doctor says what it could not check.
  const json d = doctor_json(run);
  ASSERT_EQ(d["findings"].size(), 1u) << d.dump(2);
  EXPECT_EQ(d["findings"][0]["code"], "no_health");
  EXPECT_EQ(d["findings"][0]["severity"], "info");
}

TEST(CliDoctor, RefusesADirectoryWithoutARun) {
  TempDir dir;
  auto r = kiln_cli("doctor " + dir.path().string());
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("no metrics.jsonl (expected a run directory written by kiln train)"), std::string::npos)
      << r.output;
}

TEST(CliDoctor, NanRunIsAnErrorWithItsStepAndExitOne) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto t = kiln_cli("train " + dir.file("tiny.toml") + " --out " + run.string() +
                    " --set optim.name=sgd optim.lr=1e30 schedule.warmup_steps=0");
  ASSERT_EQ(t.rc, 3) << t.output;
  auto r = kiln_cli("doctor " + run.string());
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("error   [nan] the loss became non-finite at step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train.anomaly=true"), std::string::npos) << r.output;
}

// A healthy short run of each shipped config: nothing above "info". The warm-up is cut with the
// run (a warm-up longer than the run is a real finding, warmup_too_long).
struct Healthy {
  const char* config;
  const char* sets;
};

class CliDoctorHealthy : public ::testing::TestWithParam<Healthy> {};

TEST_P(CliDoctorHealthy, NoFindingAboveInfo) {
  TempDir dir;
  const fs::path run = dir.path() / "run";
  auto t = kiln_cli("train " + std::string(KILN_SOURCE_DIR) + "/configs/" + GetParam().config + ".toml --out " +
                    run.string() + " --set " + GetParam().sets);
  ASSERT_EQ(t.rc, 0) << t.output;
  ASSERT_FALSE(metrics_lines(run, "health").empty());
  const json d = doctor_json(run);
  for (const auto& f : d["findings"]) EXPECT_EQ(f["severity"], "info") << f.dump(2);
}

INSTANTIATE_TEST_SUITE_P(
    ShippedConfigs, CliDoctorHealthy,
    ::testing::Values(
        Healthy{"mnist_mlp",
                "train.steps=150 schedule.warmup_steps=15 train.log_every=10 train.eval_every=50 train.ckpt_every=0"},
        Healthy{"fashion_cnn", "train.steps=100 train.log_every=10 train.eval_every=50 train.ckpt_every=0 "
                               "data.eval_size=2000"},
        Healthy{"resnet_fashion", "train.steps=80 schedule.warmup_steps=8 train.log_every=10 train.eval_every=40 "
                                  "train.ckpt_every=0 data.eval_size=1000"},
        Healthy{"vit_fashion", "train.steps=100 schedule.warmup_steps=10 train.log_every=10 train.eval_every=50 "
                               "train.ckpt_every=0 data.eval_size=1000"},
        Healthy{"gpt_mobydick", "train.steps=24 schedule.warmup_steps=3 train.log_every=4 train.eval_every=0 "
                                "train.eval_batches=2 train.ckpt_every=0"}),
    [](const auto& info) { return std::string(info.param.config); });

// ---- data-parallel step-time skew ----

TEST(CliDoctor, HealthyTwoRankRunLogsPerRankStepTimesAndNoSkewFinding) {
  TempDir dir;
  write_text(dir.path() / "tiny.toml", tiny_mlp_config());
  const fs::path run = dir.path() / "run";
  auto r = launch2("train " + dir.file("tiny.toml") + " --out " + run.string() +
                   " --set train.steps=40 train.log_every=5 train.ckpt_every=0");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto train = metrics_lines(run, "train");
  ASSERT_EQ(train.size(), 8u);
  for (const json& t : train) {
    ASSERT_TRUE(t.contains("ranks")) << t.dump();
    for (const char* k : {"step_ms", "busy_ms", "wait_ms", "data_ms"}) ASSERT_EQ(t["ranks"][k].size(), 2u) << k;
    for (int rank = 0; rank < 2; ++rank) {
      const double step = t["ranks"]["step_ms"][rank].get<double>(), busy = t["ranks"]["busy_ms"][rank].get<double>(),
                   wait = t["ranks"]["wait_ms"][rank].get<double>();
      EXPECT_GT(step, 0.0);
      EXPECT_GE(wait, 0.0);
      EXPECT_NEAR(busy, std::max(0.0, step - wait), 1e-3 * step + 1e-3);
    }
  }
  const json d = doctor_json(run);
  for (const auto& f : d["findings"]) {
    EXPECT_EQ(f["severity"], "info") << f.dump(2);
    EXPECT_NE(f["code"], "rank_skew") << f.dump(2);
  }
  // report.html draws them: one line per rank.
  const std::string html = read_file((run / "report.html").string());
  EXPECT_NE(html.find("id=\"chart-rank-busy\""), std::string::npos);
}

// The doctor's reading of the per-rank figures, on a hand-written run of four ranks whose rank 2
// does twice the others' work from step 20 on (and not in the first, start-up window).
TEST(CliDoctor, RankSkewNamesTheSlowRankItsRatioAndTheSteps) {
  TempDir dir;
  const fs::path run = dir.path() / "run";
  fs::create_directories(run);
  std::string lines = json{{"kind", "start"}, {"step", 0}, {"total_steps", 60}, {"world_size", 4}}.dump() + "\n";
  for (int step = 10; step <= 60; step += 10) {
    const bool slow = step >= 20;
    const double own = slow ? 20.0 : 10.0;  // rank 2's work per step; the others do 10 ms
    json ranks = {{"step_ms", {own, own, own, own}},
                  {"busy_ms", {10.0, 10.5, own, 9.5}},
                  {"wait_ms", {own - 10.0, own - 10.5, 0.0, own - 9.5}},
                  {"data_ms", {0.1, 0.1, slow ? 10.1 : 0.1, 0.1}}};
    lines += json{{"kind", "train"}, {"step", step}, {"loss", 1.0 - step * 0.01}, {"lr", 0.1}, {"grad_norm", 1.0},
                  {"data_wait", 0.0}, {"time_s", step * 0.02}, {"ranks", ranks}}
                 .dump() +
             "\n";
  }
  json d;
  const json skew = finding_for(run, lines, 60, "rank_skew", &d);
  ASSERT_FALSE(skew.is_null()) << d.dump(2);
  EXPECT_EQ(skew["severity"], "warning");
  EXPECT_EQ(skew["title"].get<std::string>().rfind("rank 2 is 2x slower than the median over steps 20-60", 0), 0u)
      << skew.dump(2);
  EXPECT_NE(skew["evidence"].get<std::string>().find("20 ms per step against a median of 10 ms"), std::string::npos)
      << skew.dump(2);
  EXPECT_NE(skew["fix"].get<std::string>().find("straggler transform"), std::string::npos) << skew.dump(2);
}

// Note [Subnormal optimizer state] in src/cli/health_log.cpp: the count
// over an optimizer's state, planted values at the float32 and float64
// boundaries.
TEST(CliHealth, SubnormalStateCountsEveryStateTensorsSubnormalValues) {
  auto w = kiln::zeros({4, 8}).requires_grad_(), b = kiln::zeros({8}).requires_grad_();
  kiln::optim::AdamW opt(kiln::optim::NamedParams{{"w", w}, {"b", b}}, {.lr = 1e-3});
  (kiln::ones({2, 4}).mm(w) + b).sum().backward();
  opt.step();  // creates exp_avg and exp_avg_sq for both
  kiln::optim::OptimizerStateDict sd = opt.state_dict();
  const float tiny = std::numeric_limits<float>::denorm_min(), least = std::numeric_limits<float>::min();
  // w's exp_avg_sq: 5 subnormals (both ends of the range, negative ones too), the smallest normal
  // (not counted) and a zero; b's exp_avg: 1.
  float* v = sd.state.at("w").tensors.at("exp_avg_sq").data_ptr<float>();
  v[0] = tiny;
  v[1] = -tiny;
  v[2] = std::nextafter(least, 0.f);
  v[3] = least / 2;
  v[4] = -std::nextafter(least, 0.f);
  v[5] = least;
  v[6] = 0.f;
  sd.state.at("b").tensors.at("exp_avg").data_ptr<float>()[7] = tiny;
  opt.load_state_dict(sd);
  const kiln::cli::SubnormalState s = kiln::cli::subnormal_state(opt);
  EXPECT_EQ(s.values, 2 * (32 + 8));
  EXPECT_EQ(s.subnormal, 6);
  ASSERT_EQ(s.worst.size(), 2u);
  EXPECT_EQ(s.worst[0].param, "w");
  EXPECT_EQ(s.worst[0].state, "exp_avg_sq");
  EXPECT_EQ(s.worst[0].subnormal, 5);
  EXPECT_EQ(s.worst[0].values, 32);
  EXPECT_EQ(s.worst[1].param, "b");
  EXPECT_EQ(s.worst[1].state, "exp_avg");
  EXPECT_EQ(s.worst[1].subnormal, 1);
}

// A run whose health lines found a third of the optimizer's state subnormal
// while its throughput fell: the finding names the share, the tensors and the
// fall, and points at flush_denormal; a run with the flush on gets none.
TEST(CliDoctor, SubnormalStateNamesTheTensorsTheSlowdownAndTheFlush) {
  for (const bool flushed : {false, true}) {
    SCOPED_TRACE(flushed ? "flush_denormal on" : "flush_denormal off");
    TempDir dir;
    const fs::path run = dir.path() / "run";
    fs::create_directories(run);
    write_text(run / "config.toml", (flushed ? "flush_denormal = true\n" : "") + tiny_mlp_config());
    std::string lines = json{{"kind", "start"}, {"step", 0}, {"total_steps", 40}}.dump() + "\n";
    for (int step = 1; step <= 40; ++step) {
      lines += json{{"kind", "train"},  {"step", step},    {"loss", 2.0 - step * 0.01}, {"lr", 1e-3},
                    {"grad_norm", 1.0}, {"data_wait", 0.0}, {"samples_per_s", step <= 20 ? 1000.0 : 400.0}}
                   .dump() +
               "\n";
      if (step % 10 == 0) {
        const int64_t sub = step >= 30 ? 3000 : 0;
        json worst = json::array();
        if (sub) worst.push_back({{"param", "layers.0.weight"}, {"state", "exp_avg_sq"}, {"subnormal", sub}, {"values", 4096}});
        lines += json{{"kind", "health"},
                      {"step", step},
                      {"grad_norm", 1.0},
                      {"subnormal_state", {{"subnormal", sub}, {"values", 9000}, {"worst", worst}}}}
                     .dump() +
                 "\n";
      }
    }
    json d;
    const json f = finding_for(run, lines, 40, "subnormal_state", &d);
    if (flushed) {
      EXPECT_TRUE(f.is_null()) << d.dump(2);
      continue;
    }
    ASSERT_FALSE(f.is_null()) << d.dump(2);
    EXPECT_EQ(f["severity"], "warning");
    EXPECT_EQ(f["step"].get<int64_t>(), 30);
    const std::string title = f["title"], evidence = f["evidence"], fix = f["fix"];
    EXPECT_NE(title.find("33.3%"), std::string::npos) << title;
    EXPECT_NE(evidence.find("layers.0.weight's exp_avg_sq (3e+03 of 4.1e+03)"), std::string::npos) << evidence;
    EXPECT_NE(evidence.find("samples/s fell from 1e+03"), std::string::npos) << evidence;
    EXPECT_NE(fix.find("flush_denormal = true"), std::string::npos) << fix;
  }
}

// ---- the gallery ----

TEST(CliScenario, ListHasAtLeastEighteen) {
  auto r = kiln_cli("scenario list --dir " + kScenarioDir);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_GE(count_lines(r.output), 18) << r.output;
  EXPECT_NE(r.output.find("lr_too_high"), std::string::npos);
  EXPECT_NE(r.output.find("inplace_on_saved_tensor"), std::string::npos);
}

TEST(CliScenario, UnknownNameListsTheScenarios) {
  auto r = kiln_cli("scenario run no_such --dir " + kScenarioDir);
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("no scenario \"no_such\" (have: lr_too_high, lr_too_low"), std::string::npos) << r.output;
}

// Each scenario with the words kiln's diagnosis must contain: its cause, named.
struct Expected {
  const char* name;
  std::vector<std::string> said;  // every one must appear
};

class CliScenarioRun : public ::testing::TestWithParam<Expected> {};

TEST_P(CliScenarioRun, NamesTheCause) {
  TempDir dir;
  auto r = kiln_cli("scenario run " + std::string(GetParam().name) + " --dir " + kScenarioDir + " --out " +
                    (dir.path() / "work").string());
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("kiln names the cause"), std::string::npos) << r.output;
  for (const auto& s : GetParam().said) EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Gallery, CliScenarioRun,
    ::testing::Values(
        Expected{"lr_too_high", {"[loss_spike]", "[dead_relu]", "lower optim.lr"}},
        Expected{"lr_too_low", {"[flat_loss] the loss does not move", "[update_ratio_low]"}},
        Expected{"overfitting", {"[overfitting] overfitting: the eval loss rises while the train loss falls"}},
        Expected{"step_schedule_per_batch", {"[schedule_too_fast]", "schedule.step_size = 3 steps"}},
        Expected{"vanishing_gradients", {"[vanishing_gradients] gradients vanish with depth", "layers.0"}},
        Expected{"warmup_longer_than_run", {"[warmup_too_long]", "schedule.warmup_steps = 500, the run has 60 steps"}},
        Expected{"inplace_on_saved_tensor",
                 {"a tensor saved for backward was modified in place", "saved by:    SigmoidBackward0",
                  "modified by: mul_ at src/cli/scenario_programs.cpp"}},
        Expected{"nan_from_log_zero", {"anomaly mode: the forward of LogBackward0 produced", "scenario_programs.cpp"}},
        Expected{"nan_from_division_by_zero", {"anomaly mode: the forward of DivBackward0 produced", "input 1 [4, 1]: min 0, max 0"}},
        Expected{"oom_under_memory_limit", {"out of memory: cannot allocate", "refused by the memory limit", "largest [4096, 4096] float32"}},
        Expected{"loss_kept_with_graph", {"memory leak", "total += loss"}},
        Expected{"scheduler_before_optimizer", {"kiln warning: Detected call of `lr_scheduler.step()` before"}},
        Expected{"forgot_set_epoch", {"a new epoch started without set_epoch()"}},
        Expected{"batchnorm_batch_of_one", {"BatchNorm1d: expected more than 1 value per channel when training"}},
        Expected{"detached_branch", {"[no_grad] 2 of 4 trainable parameters never received a gradient", "body.bias, body.weight"}},
        Expected{"frozen_model",
                 {"does not require grad", "error   [frozen_model] no parameter is trainable",
                  "0 of 676 parameters require a gradient", "the run stopped at step 1"}},
        Expected{"forgot_zero_grad", {"[grad_accumulation]", "zero_grad()"}},
        Expected{"shuffled_labels", {"[chance_accuracy]", "labels do not belong to their inputs"}},
        Expected{"unnormalised_inputs", {"[input_scale]", "input mean 253, standard deviation 255"}},
        Expected{"slow_transform", {"[data_stall] the input pipeline is the bottleneck"}},
        Expected{"subnormal_slowdown",
                 {"[subnormal_state] optimizer state in the subnormals", "layers.0.weight's momentum_buffer",
                  "flush_denormal = true"}},
        Expected{"eval_without_eval_mode",
                 {"[eval_train_mode] the evaluation ran in training mode: BatchNorm statistics changed and dropout was "
                  "active during evaluation",
                  "norm (BatchNorm1d): num_batches_tracked 44 -> 48", "drop (Dropout): dropout p=0.3 active in 4",
                  "call model.eval() before evaluating"}},
        Expected{"resume_without_optimizer_state",
                 {"[lr_jump_on_resume]", "lr 0.001 at step 30 -> 0.1 at step 31 (resumed at step 30)"}},
        Expected{"ddp_unused_parameter",
                 {"got no gradient in this backward pass", "'unused.weight', 'unused.bias'",
                  "find_unused_parameters = true"}},
        Expected{"ranks_with_different_shapes",
                 {"the ranks called different collectives", "float32[5] at src/cli/scenario_programs.cpp",
                  "<-- differs from rank 0"}},
        Expected{"rank_skew",
                 {"[rank_skew] rank 1 is", "waiting for data", "a straggler transform", "every other rank waits"}},
        Expected{"fp16_overflow", {"[amp_scale_collapse]"}}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kiln::test
