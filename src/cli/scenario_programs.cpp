// The program scenarios of the gallery (cli/scenario.h): each makes one classic
// mistake in a few lines against the library, as a user's loop would, and
// returns what kiln said about it: the error, the warning, or (for failures
// that raise nothing) the doctor's findings on the run it logged.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "cli/config.h"
#include "cli/doctor.h"
#include "cli/health_log.h"
#include "cli/scenario.h"
#include "cli/step_skew.h"
#include "kiln/amp/grad_scaler.h"
#include "kiln/autograd/anomaly.h"
#include "kiln/core/allocator.h"
#include "kiln/core/autocast.h"
#include "kiln/core/memory_history.h"
#include "kiln/data/loader.h"
#include "kiln/data/sampler.h"
#include "kiln/dist/ddp.h"
#include "kiln/kiln.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/health.h"
#include "kiln/train/leak_watch.h"

namespace kiln::cli {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

/// What the library wrote to std::cerr (its warnings) while `fn` ran, plus fn's own text.
template <typename Fn>
std::string with_cerr(Fn&& fn) {
  std::ostringstream captured;
  std::streambuf* old = std::cerr.rdbuf(captured.rdbuf());
  std::string said;
  try {
    said = fn();
  } catch (...) {
    std::cerr.rdbuf(old);
    throw;
  }
  std::cerr.rdbuf(old);
  return captured.str() + said;
}

std::string error_text(const std::exception& e) { return std::string("kiln: error: ") + e.what() + "\n"; }

// ---- a small logged training loop, for the failures that raise nothing ----

/// A two-layer classifier on 16 features, 4 classes, labels from a fixed teacher (learnable).
class Classifier : public nn::Module {
 public:
  explicit Classifier(bool detach_head = false) : Module("Classifier"), detach_head_(detach_head) {
    body =
        register_module("body", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 32}));
    relu = register_module("relu", std::make_shared<nn::ReLU>());
    head =
        register_module("head", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 32, .out_features = 4}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*relu)((*body)(x));
    // The bug of detached_branch: the features are cut off the graph before the head.
    return (*head)(detach_head_ ? h.detach() : h);
  }
  std::shared_ptr<nn::Linear> body, head;
  std::shared_ptr<nn::ReLU> relu;

 private:
  bool detach_head_;
};

/// Classifier's shape with BatchNorm and Dropout: the layers that behave differently in training.
class NormClassifier : public nn::Module {
 public:
  NormClassifier() : Module("NormClassifier") {
    body =
        register_module("body", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 32}));
    norm = register_module("norm", std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = 32}));
    relu = register_module("relu", std::make_shared<nn::ReLU>());
    drop = register_module("drop", std::make_shared<nn::Dropout>(0.3));
    head =
        register_module("head", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 32, .out_features = 4}));
  }
  Tensor forward(const Tensor& x) override { return (*head)((*drop)((*relu)((*norm)((*body)(x))))); }
  std::shared_ptr<nn::Linear> body, head;
  std::shared_ptr<nn::BatchNorm1d> norm;
  std::shared_ptr<nn::ReLU> relu;
  std::shared_ptr<nn::Dropout> drop;
};

struct Batch {
  Tensor x, y;
};

/// Batch `i` of the teacher's task (inputs randn, label = argmax of a fixed projection);
/// with `shuffled`, the labels are a random permutation's (they no longer belong to their inputs).
Batch make_batch(int64_t i, bool shuffled = false, int64_t n = 64) {
  Generator g(1000 + static_cast<uint64_t>(i));
  Generator teacher_g(7);
  Tensor w = randn({16, 4}, {}, &teacher_g);
  Tensor x = randn({n, 16}, {}, &g);
  Tensor y = x.matmul(w).argmax(1);
  if (shuffled) y = randint(0, 4, {n}, TensorOptions(kInt64), &g);
  return {x, y};
}

/// The teacher's task as a dataset whose per-sample transform takes `sample_ms` (a straggler's decode
/// or augmentation): the DataLoader runs it, so the loop's data wait is the loader's.
class SlowTransformDataset : public data::Dataset<data::Example> {
 public:
  SlowTransformDataset(int64_t n, double sample_ms, int64_t seed = 0) : sample_ms_(sample_ms) {
    Batch b = make_batch(seed, false, n);
    x_ = b.x;
    y_ = b.y;
  }
  int64_t size() const override { return x_.size(0); }
  data::Example get(int64_t i) const override {
    if (sample_ms_ > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(sample_ms_));
    return {x_.select(0, i), y_.select(0, i)};
  }

 private:
  Tensor x_, y_;
  double sample_ms_;
};

struct MiniRunOptions {
  int64_t steps = 60;
  bool zero_grad = true;
  bool shuffled_labels = false;
  double input_scale = 1;  // raw-pixel-like inputs: x * input_scale + input_scale
  int64_t batches = 16;    // distinct training batches, cycled
  /// Batches from this loader (cycled) instead of the prepared ones; the data wait is the loader's.
  data::DataLoader<>* loader = nullptr;
  bool eval_mode = true;
  /// Stepped after each optimizer step.
  optim::LRScheduler* scheduler = nullptr;
  /// > 1: a resumed process continues the run from this step (metrics.jsonl is appended to, after a
  /// "resume" line); o.steps is still the last step.
  int64_t first_step = 1;  // model.eval() around the evaluation (false: the bug of eval_without_eval_mode)
};

/// Trains `model` with `opt` and writes the run directory kiln train would (metrics.jsonl with train,
/// health and eval lines, summary.json); returns `kiln doctor`'s report on it.
std::string mini_run(const fs::path& dir, nn::Module& model, optim::Optimizer& opt, const MiniRunOptions& o,
                     amp::GradScaler* scaler = nullptr) {
  fs::create_directories(dir);
  std::ofstream metrics(dir / "metrics.jsonl", o.first_step > 1 ? std::ios::app : std::ios::trunc);
  metrics << json{{"kind", o.first_step > 1 ? "resume" : "start"},
                  {"step", o.first_step - 1},
                  {"total_steps", o.steps},
                  {"parameters", model.num_parameters()},
                  {"trainable_parameters", model.num_parameters(/*trainable_only=*/true)},
                  {"time_s", 0.0}}
                 .dump()
          << "\n";
  HealthLog health(model, 5);
  // The batches are made up front, as a loader's workers would (with o.loader, they come from it instead).
  std::vector<Batch> data;
  for (int64_t i = 0; i < o.batches; ++i) {
    data.push_back(make_batch(i, o.shuffled_labels));
    if (o.input_scale != 1) data.back().x = data.back().x * o.input_scale + o.input_scale;
  }
  const auto start = Clock::now();
  double wait = 0;
  auto window = Clock::now();
  std::optional<decltype(o.loader->begin())> it;
  double loader_wait = 0;  // the loader's wait_s of the epoch in progress, as last read
  for (int64_t step = o.first_step; step <= o.steps; ++step) {
    Batch b = data[static_cast<size_t>(step % o.batches)];
    if (o.loader) {
      if (it) ++*it;  // begin() and ++ wait for the batch: this step's data wait
      if (!it || *it == o.loader->end()) {
        it.reset();  // one epoch at a time: the last one's iterator goes first
        it.emplace(o.loader->begin());
        loader_wait = 0;
      }
      b = {(**it).data, (**it).target};
      const double w = o.loader->stats().wait_s;
      wait += w - loader_wait;
      loader_wait = w;
    }
    double loss_v = 0, gsq = 0;
    try {
      health.begin(step);
      if (o.zero_grad) opt.zero_grad();
      if (scaler) {
        Tensor loss;
        {
          AutocastGuard ac(kFloat16);
          loss = nn::functional::cross_entropy(model(b.x), b.y);
        }
        loss_v = loss.item<double>();
        scaler->scale(loss).backward();
        scaler->step(opt);
        scaler->update();
      } else {
        Tensor loss = nn::functional::cross_entropy(model(b.x), b.y);
        loss_v = loss.item<double>();
        loss.backward();
        opt.step();
      }
      if (o.scheduler) o.scheduler->step();
      for (const Tensor& p : model.parameters())
        if (p.grad().defined()) gsq += std::pow(train::l2_norm(p.grad()), 2);
    } catch (const Error& e) {
      // As a user's loop dies on it: the error, then the run directory as it was left.
      metrics << json{{"kind", "error"}, {"step", step}, {"message", e.what()}}.dump() << "\n";
      metrics.close();
      std::ofstream(dir / "summary.json")
          << json{{"status", "failed"}, {"steps", step - 1}, {"total_steps", o.steps}}.dump();
      return error_text(e) + "\n$ kiln doctor " + dir.string() + "\n" + format_findings(diagnose(dir));
    }
    health.end(metrics);
    const double window_s = std::chrono::duration<double>(Clock::now() - window).count();
    json line = {{"kind", "train"},
                 {"step", step},
                 {"loss", loss_v},
                 {"lr", opt.param_groups()[0].lr()},
                 {"grad_norm", std::sqrt(gsq)},
                 {"data_wait", window_s > 0 ? std::min(1.0, wait / window_s) : 0.0},
                 {"time_s", std::chrono::duration<double>(Clock::now() - start).count()}};
    if (scaler)
      for (const auto& [k, v] : scaler->metrics()) line[k] = v;
    metrics << line.dump() << "\n";
    wait = 0;
    window = Clock::now();
    if (step % 20 == 0 || step == o.steps) {
      if (o.eval_mode) model.eval();
      train::EvalCheck check = health.check_evaluation();
      NoGradGuard ng;
      int64_t right = 0, total = 0;
      for (int64_t i = 100; i < 104; ++i) {
        Batch e = make_batch(i, false);  // held out, correctly labelled, prepared as the training batches
        if (o.input_scale != 1) e.x = e.x * o.input_scale + o.input_scale;
        right += model(e.x).argmax(1).eq(e.y).sum().item<int64_t>();
        total += e.y.size(0);
      }
      log_eval_check(check, step, metrics);  // a {"what":"eval_train_mode"} warning when it ran in training mode
      model.train();
      metrics << json{{"kind", "eval"},
                      {"step", step},
                      {"loss", 0.0},
                      {"accuracy", static_cast<double>(right) / total},
                      {"num_classes", 4}}
                     .dump()
              << "\n";
    }
  }
  metrics.close();
  std::ofstream(dir / "summary.json") << json{
      {"status", "completed"},
      {"steps", o.steps},
      {"total_steps", o.steps}}.dump();
  return "$ kiln doctor " + dir.string() + "\n" + format_findings(diagnose(dir));
}

// ---- the scenarios ----

std::string inplace_on_saved_tensor(const fs::path&) {
  Tensor x = randn({4, 3}).requires_grad_();
  Tensor y = x.sigmoid();  // sigmoid saves its output for backward
  y.mul_(2);               // the bug: the saved output is modified in place
  try {
    y.sum().backward();
  } catch (const Error& e) {
    return error_text(e);
  }
  return "no error\n";
}

std::string nan_from_log_zero(const fs::path&) {
  autograd::AnomalyModeGuard anomaly(true);
  Tensor w = randn({8, 4}).requires_grad_();
  Tensor probs = zeros({2, 8}).matmul(w).relu();  // all zeros: log(0) = -inf
  try {
    Tensor loss = probs.log().mean();
    loss.backward();
  } catch (const Error& e) {
    return error_text(e);
  }
  return "no error\n";
}

std::string nan_from_division_by_zero(const fs::path&) {
  autograd::AnomalyModeGuard anomaly(true);
  Tensor x = randn({4, 4}).requires_grad_();
  Tensor count = zeros({4, 1});  // an empty group's count
  try {
    Tensor mean = x.sum(1, true) / count;  // 0 / 0 and x / 0
    mean.sum().backward();
  } catch (const Error& e) {
    return error_text(e);
  }
  return "no error\n";
}

std::string oom_under_memory_limit(const fs::path&) {
  const int64_t old = memory::limit();
  const bool history = memory::recording_history();
  memory::record_history(true);  // so that the report names the lines holding the memory
  memory::set_limit(memory::stats().live_bytes + (64ll << 20));
  std::string said;
  try {
    nn::Linear layer({.in_features = 4096, .out_features = 4096});  // 64 MiB of weights
    Tensor activations = randn({4096, 4096});                       // and as much again
    said = "no error\n";
  } catch (const Error& e) {
    said = error_text(e);
  }
  memory::set_limit(old);
  memory::record_history(history);
  return said;
}

std::string loss_kept_with_graph(const fs::path&) {
  manual_seed(0);
  Classifier model;
  optim::SGD opt(model, {.lr = 0.01});
  train::LeakWatch watch({.print = false});
  Tensor total = zeros({});
  for (int64_t step = 0; step < 30; ++step) {
    opt.zero_grad();
    Batch b = make_batch(step);
    Tensor loss = nn::functional::cross_entropy(model(b.x), b.y);
    loss.backward();
    opt.step();
    total += loss;  // the bug: total keeps every step's graph (total += loss.item() does not)
    if (const train::LeakReport* r = watch.step()) return "kiln warning: memory leak: " + r->message + "\n";
  }
  return "no warning\n";
}

std::string scheduler_before_optimizer(const fs::path&) {
  return with_cerr([] {
    manual_seed(0);
    Classifier model;
    optim::SGD opt(model, {.lr = 0.1});
    optim::StepLR sched(opt, {.step_size = 10, .gamma = 0.5});
    for (int64_t step = 0; step < 3; ++step) {
      Batch b = make_batch(step);
      opt.zero_grad();
      nn::functional::cross_entropy(model(b.x), b.y).backward();
      sched.step();  // the bug: before opt.step(), so the first lr is skipped
      opt.step();
    }
    return std::string();
  });
}

std::string forgot_set_epoch(const fs::path&) {
  return with_cerr([] {
    data::DistributedSampler sampler(100, {.num_replicas = 2, .rank = 0, .shuffle = true, .seed = 1});
    std::vector<int64_t> first, second;
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      // the bug: no sampler.set_epoch(epoch) here
      (epoch == 0 ? first : second) = sampler.indices();
    }
    return std::string(first == second ? "(both epochs read the same order)\n" : "");
  });
}

std::string batchnorm_batch_of_one(const fs::path&) {
  nn::BatchNorm1d bn({.num_features = 8});
  try {
    bn(randn({1, 8}));  // training mode, one sample: no variance to normalise by
  } catch (const Error& e) {
    return error_text(e);
  }
  return "no error\n";
}

std::string detached_branch(const fs::path& dir) {
  manual_seed(0);
  Classifier model(/*detach_head=*/true);
  optim::Adam opt(model, {.lr = 1e-2});
  return mini_run(dir / "run", model, opt, {.steps = 40});
}

std::string frozen_model(const fs::path& dir) {
  manual_seed(0);
  Classifier model;
  optim::SGD opt(model, {.lr = 0.1});
  for (auto& [name, p] : model.named_parameters()) p.requires_grad_(false);  // the bug: frozen after the optimizer
  return mini_run(dir / "run", model, opt, {.steps = 40});
}

std::string forgot_zero_grad(const fs::path& dir) {
  manual_seed(0);
  Classifier model;
  optim::SGD opt(model, {.lr = 0.01});
  return mini_run(dir / "run", model, opt, {.steps = 40, .zero_grad = false});
}

std::string shuffled_labels(const fs::path& dir) {
  manual_seed(0);
  Classifier model;
  optim::Adam opt(model, {.lr = 3e-3});
  return mini_run(dir / "run", model, opt, {.steps = 200, .shuffled_labels = true, .batches = 2});
}

std::string unnormalised_inputs(const fs::path& dir) {
  manual_seed(0);
  Classifier model;
  optim::SGD opt(model, {.lr = 0.01});
  return mini_run(dir / "run", model, opt, {.steps = 60, .input_scale = 255});  // raw 0-255 pixels
}

std::string slow_transform(const fs::path& dir) {
  manual_seed(0);
  Classifier model;
  optim::Adam opt(model, {.lr = 1e-3});
  // the bug: a per-sample transform that takes ~0.8 ms (50 ms a batch of 64), one loader worker
  constexpr int64_t kSteps = 30, kBatch = 64;
  auto slow = std::make_shared<SlowTransformDataset>(kSteps * kBatch, 50.0 / kBatch);
  data::DataLoader<> loader(slow, {.batch_size = kBatch, .num_workers = 1, .seed = 0});
  return mini_run(dir / "run", model, opt, {.steps = kSteps, .loader = &loader});
}

std::string eval_without_eval_mode(const fs::path& dir) {
  manual_seed(0);
  NormClassifier model;
  optim::Adam opt(model, {.lr = 3e-3});
  // the bug: the loop evaluates under NoGradGuard but never calls model.eval()
  return mini_run(dir / "run", model, opt, {.steps = 40, .eval_mode = false});
}

std::string resume_without_optimizer_state(const fs::path& dir) {
  const fs::path run = dir / "run";
  train::CheckpointManager checkpoints(run / "checkpoints");
  // the bug: the loop saves and restores the model's weights only (torch.save(model.state_dict())): no
  // .optimizer, no .scheduler. (With the optimizer restored, its lr comes back with it and torch 1.13's
  // recurrent schedulers continue from there: a lost scheduler state alone shifts the schedule, no jump.)
  auto refs = [](nn::Module& m) { return train::CheckpointRefs{.model = &m}; };
  // A step schedule, x0.1 every 15 steps, over 50 steps; the first process stops after step 30.
  {
    manual_seed(0);
    Classifier model;
    optim::SGD opt(model, {.lr = 0.1});
    optim::StepLR sched(opt, {.step_size = 15, .gamma = 0.1});
    mini_run(run, model, opt, {.steps = 30, .scheduler = &sched});
    checkpoints.save(refs(model), {.step = 30});
  }
  // A new process resumes from the checkpoint, with a scheduler built afresh.
  manual_seed(1);
  Classifier model;
  optim::SGD opt(model, {.lr = 0.1});
  optim::StepLR sched(opt, {.step_size = 15, .gamma = 0.1});
  const train::CheckpointInfo info = checkpoints.load_latest(refs(model));
  return mini_run(run, model, opt, {.steps = 50, .scheduler = &sched, .first_step = info.step + 1});
}

std::string fp16_overflow(const fs::path& dir) {
  manual_seed(0);
  Classifier model;
  // the bug: an lr far too high under fp16: the weights grow until forward's activations pass float16's 65504,
  // and from then on every step overflows, is skipped, and halves the loss scale
  optim::SGD opt(model, {.lr = 200});
  amp::GradScaler scaler;
  return mini_run(dir / "run", model, opt, {.steps = 40}, &scaler);
}

// ---- data-parallel scenarios: two ranks under `kiln launch`, each running `kiln scenario rank NAME` ----

/// Runs `kiln launch -n 2 -- kiln scenario rank NAME` (this executable) and returns what the job printed;
/// `env` ("K=V ...") goes to the ranks' environment.
std::string two_rank_job(const std::string& name, const std::string& env = "") {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "cannot find this executable (/proc/self/exe) to launch the ranks\n";
  // The signature check names a collective mismatch; the watchdog bounds a hang; timeout bounds the rest.
  const std::string cmd = env + " KILN_DIST_DEBUG=1 KILN_DIST_TIMEOUT=30 OMP_NUM_THREADS=1 timeout -s KILL 120 " +
                          self.string() + " launch -n 2 -- " + self.string() + " scenario rank " + name + " 2>&1";
  std::string out = "$ kiln launch -n 2 -- kiln scenario rank " + name + "\n";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return out + "cannot start kiln launch\n";
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  ::pclose(pipe);
  return out;
}

std::string ddp_unused_parameter(const fs::path&) { return two_rank_job("ddp_unused_parameter"); }

/// Two data-parallel ranks, one of them a straggler (KILN_SCENARIO_SLOW_RANK, default 1; its transform
/// takes KILN_SCENARIO_SLOW_MS per batch, default 40): rank 0 logs the run into `dir`/run, the doctor reads it.
std::string rank_skew(const fs::path& dir) {
  const fs::path run = dir / "run";
  std::string said = two_rank_job("rank_skew", "KILN_SCENARIO_OUT=" + run.string());
  if (!fs::exists(run / "metrics.jsonl")) return said + "(the job wrote no metrics.jsonl)\n";
  return said + "$ kiln doctor " + run.string() + "\n" + format_findings(diagnose(run));
}
std::string ranks_with_different_shapes(const fs::path&) { return two_rank_job("ranks_with_different_shapes"); }

double env_number(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtod(v, nullptr) : fallback;
}

/// rank_skew's ranks: a data-parallel loop as a user writes it (DDP, DistributedSampler, DataLoader), logging
/// as kiln train does: per-rank step times each window (cli/step_skew.h), rank 0's train lines.
int rank_skew_rank(const dist::ProcessGroupPtr& group) {
  const char* out = std::getenv("KILN_SCENARIO_OUT");
  if (!out || !*out) throw ConfigError("kiln scenario rank rank_skew: set KILN_SCENARIO_OUT to the run directory");
  const int slow_rank = static_cast<int>(env_number("KILN_SCENARIO_SLOW_RANK", 1));
  const double slow_ms = env_number("KILN_SCENARIO_SLOW_MS", 40);
  constexpr int64_t kBatch = 16, kSteps = 40, kLogEvery = 5;
  manual_seed(0);
  auto model = std::make_shared<Classifier>();
  dist::DistributedDataParallel ddp(model, group);
  optim::SGD opt(*model, {.lr = 0.05});
  const bool slow = group->rank() == slow_rank;
  auto dataset = std::make_shared<SlowTransformDataset>(kBatch * kSteps * group->size(), slow ? slow_ms / kBatch : 0);
  auto sampler = std::make_shared<data::DistributedSampler>(
      dataset->size(),
      data::DistributedSamplerOptions{.num_replicas = group->size(), .rank = group->rank(), .shuffle = false});
  data::DataLoader<> loader(dataset, {.batch_size = kBatch, .sampler = sampler, .seed = 0, .rank = group->rank()});
  const bool lead = group->rank() == 0;
  std::ofstream metrics;
  if (lead) {
    fs::create_directories(out);
    metrics.open(fs::path(out) / "metrics.jsonl", std::ios::trunc);
    metrics << json{{"kind", "start"}, {"step", 0}, {"total_steps", kSteps}, {"world_size", group->size()}}.dump()
            << "\n";
  }
  StepSkew skew(group);
  const auto start = Clock::now();
  auto window = Clock::now(), prev_end = Clock::now();
  double data_s = 0;
  int64_t step = 0, in_window = 0;
  for (auto& b : loader) {
    data_s += std::chrono::duration<double>(Clock::now() - prev_end).count();
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy(ddp(b.data), b.target);
    // The loss averaged over the ranks, for the log: the collective where a fast rank waits for a slow one.
    Tensor mean_loss = loss.detach().clone();
    const auto wait_start = Clock::now();
    group->allreduce(mean_loss, dist::ReduceOp::Avg)->wait();
    skew.waited(std::chrono::duration<double>(Clock::now() - wait_start).count());
    loss.backward();
    double gsq = 0;
    for (const Tensor& p : model->parameters())
      if (p.grad().defined()) gsq += std::pow(train::l2_norm(p.grad()), 2);
    opt.step();
    ++step;
    ++in_window;
    if (step % kLogEvery == 0) {
      const double window_s = std::chrono::duration<double>(Clock::now() - window).count();
      const json ranks = skew.window(in_window, window_s, data_s);
      if (lead)
        metrics << json{{"kind", "train"},
                        {"step", step},
                        {"loss", mean_loss.item<double>()},
                        {"lr", opt.param_groups()[0].lr()},
                        {"grad_norm", std::sqrt(gsq)},
                        {"data_wait", window_s > 0 ? std::min(1.0, data_s / window_s) : 0.0},
                        {"time_s", std::chrono::duration<double>(Clock::now() - start).count()},
                        {"ranks", ranks}}
                       .dump()
                << "\n";
      window = Clock::now();
      data_s = 0;
      in_window = 0;
    }
    prev_end = Clock::now();
  }
  if (lead)
    std::ofstream(fs::path(out) / "summary.json")
        << json{{"status", "completed"}, {"steps", step}, {"total_steps", kSteps}}.dump();
  return 0;
}

/// A classifier with a layer forward never calls (the bug of ddp_unused_parameter).
class WithUnused : public Classifier {
 public:
  WithUnused() {
    unused = register_module("unused",
                             std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 4}));
  }
  std::shared_ptr<nn::Linear> unused;
};

}  // namespace

int scenario_rank(const std::string& name, dist::ProcessGroupPtr group) {
  if (!group)
    throw ConfigError("kiln scenario rank " + name + ": run under kiln launch -n 2 (it is one rank of a job)");
  if (name == "ddp_unused_parameter") {
    manual_seed(0);
    auto model = std::make_shared<WithUnused>();
    dist::DistributedDataParallel ddp(model, group);
    optim::SGD opt(*model, {.lr = 0.1});
    Batch b = make_batch(group->rank());
    opt.zero_grad();
    nn::functional::cross_entropy(ddp(b.x), b.y).backward();  // DDP finds 'unused' without a gradient here
    opt.step();
    return 0;
  }
  if (name == "rank_skew") return rank_skew_rank(group);
  if (name == "ranks_with_different_shapes") {
    // Each rank's last batch holds a different number of samples, and the per-sample losses are summed
    // across ranks as they are: rank 0 sends 4 values, rank 1 sends 5.
    Tensor per_sample = ones({4 + group->rank()});
    group->allreduce(per_sample)->wait();
    return 0;
  }
  throw ConfigError("kiln scenario rank: no data-parallel scenario \"" + name + "\"");
}

std::vector<Scenario> program_scenarios() {
  auto p = [](std::string name, std::string symptom, std::vector<std::string> expect,
              std::function<std::string(const fs::path&)> fn) {
    return Scenario{std::move(name), "program", std::move(symptom), std::move(expect), {}, std::move(fn)};
  };
  return {
      p("inplace_on_saved_tensor", "backward fails after an in-place op on a tensor autograd saved",
        {"modified in place"}, inplace_on_saved_tensor),
      p("nan_from_log_zero", "the loss is NaN/-inf: log of exact zeros", {"LogBackward0 produced"}, nan_from_log_zero),
      p("nan_from_division_by_zero", "NaN/Inf from dividing by a zero count", {"DivBackward0 produced"},
        nan_from_division_by_zero),
      p("oom_under_memory_limit", "out of memory under a memory limit", {"refused by the memory limit"},
        oom_under_memory_limit),
      p("loss_kept_with_graph", "memory grows every step: total += loss keeps each step's graph", {"total += loss"},
        loss_kept_with_graph),
      p("scheduler_before_optimizer", "lr_scheduler.step() called before optimizer.step()",
        {"before `optimizer.step()`"}, scheduler_before_optimizer),
      p("forgot_set_epoch", "every epoch reads the data in the same order (DistributedSampler)",
        {"without set_epoch()"}, forgot_set_epoch),
      p("batchnorm_batch_of_one", "BatchNorm in training mode on a batch of one sample",
        {"more than 1 value per channel"}, batchnorm_batch_of_one),
      p("detached_branch", "part of the model never learns: a .detach() cuts it off the loss", {"[no_grad]"},
        detached_branch),
      p("frozen_model", "nothing trains, backward fails: every parameter is frozen", {"[frozen_model]"}, frozen_model),
      p("forgot_zero_grad", "gradients grow step after step: zero_grad() is never called", {"[grad_accumulation]"},
        forgot_zero_grad),
      p("shuffled_labels", "train loss falls, test accuracy stays at chance: labels do not match inputs",
        {"[chance_accuracy]"}, shuffled_labels),
      p("unnormalised_inputs", "the loss jumps about or stalls: inputs fed as raw 0-255 values", {"[input_scale]"},
        unnormalised_inputs),
      p("slow_transform", "the loop waits for data: a slow per-sample transform", {"[data_stall]"}, slow_transform),
      p("eval_without_eval_mode", "eval scores are noisy and BatchNorm drifts: the evaluation runs in training mode",
        {"[eval_train_mode]"}, eval_without_eval_mode),
      p("resume_without_optimizer_state",
        "after a resume the lr jumps back up: only the weights were restored, not the optimizer and scheduler",
        {"[lr_jump_on_resume]"}, resume_without_optimizer_state),
      p("ddp_unused_parameter", "data-parallel backward fails: a parameter takes no part in the loss",
        {"got no gradient in this backward pass"}, ddp_unused_parameter),
      p("ranks_with_different_shapes", "data-parallel ranks hand a collective tensors of different shapes",
        {"the ranks called different collectives"}, ranks_with_different_shapes),
      p("rank_skew", "data-parallel ranks wait for one straggler every step (a slow transform on rank 1)",
        {"[rank_skew] rank 1 is"}, rank_skew),
      p("fp16_overflow", "under fp16 autocast every step overflows and the loss scale collapses",
        {"[amp_scale_collapse]"}, fp16_overflow),
  };
}

}  // namespace kiln::cli
