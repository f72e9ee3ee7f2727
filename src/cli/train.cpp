// The training loop behind `kiln train` and `kiln resume`.
//
// Note [Identical future]: everything a step depends on is either rebuilt from
// the resolved config (model architecture, data, optimizer and schedule
// hyperparameters, the schedule's horizon train.steps) or restored from the
// checkpoint (weights, optimizer and scheduler state, the default generator,
// the loader's epoch and position). train.max_steps only says where this
// process stops, so a run stopped early and resumed computes the same losses,
// bit for bit, as one that never stopped.
//
// Note [Data-parallel runs]: under mpirun (or `kiln launch`) every rank runs
// this loop on its DistributedSampler share, with the model wrapped in DDP.
// Rank 0 alone writes the run directory (metrics, checkpoints, report,
// summary), evaluates and prints; the others only train. Whatever decides
// when a rank stops (a signal, a non-finite loss) is agreed by one small
// allreduce per step, taken after forward and before backward, so every rank
// leaves at the same step and none waits in a collective the others skipped.
// A resume loads on every rank the checkpoint rank 0 chose.
//
// Note [Run story]: besides its train and eval lines, metrics.jsonl records
// what happened to the run, for report.html: {"kind":"start"} or
// {"kind":"resume"} when a process begins training (with its step and
// total_steps), {"kind":"nonfinite"} at a NaN/Inf loss (preceded by train lines
// for the steps since the last logged one, so the charts reach the NaN), and
// {"kind":"end","status"} when a process ends (a killed one leaves none).
//
// Note [Profiled steps]: each step's phases are record::Scope ranges, User
// ranges named "forward" and "backward" and an Optimizer range "optimizer"
// (zero_grad, clipping and the update: the optimizer phase, the ops inside it
// included), which the profiler's per-step breakdown reads; with
// [profile] steps (--profile) a ProfileRun (cli/profile_run.h) marks the
// step boundaries, and the step's evaluation and checkpoint, when due, belong
// to it.
#include "cli/train.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "cli/distill.h"
#include "cli/finetune.h"
#include "cli/health_log.h"
#include "cli/powersgd_checkpoint.h"
#include "cli/profile_run.h"
#include "cli/progress.h"
#include "cli/report.h"
#include "cli/step_skew.h"
#include "cli/task.h"
#include "kiln/autograd/anomaly.h"
#include "kiln/core/allocator.h"
#include "kiln/core/format.h"
#include "kiln/core/memory_history.h"
#include "kiln/core/record.h"
#include "kiln/core/threads.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/traffic.h"
#include "kiln/export/compile.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/leak_watch.h"

namespace kiln::cli {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// ---- signals: the first SIGINT/SIGTERM asks for a stop after the current step; a second aborts ----

std::atomic<int> g_signals{0};
std::atomic<bool> g_quiet{false};  // a data-parallel rank other than 0: rank 0 speaks for the job

extern "C" void on_stop_signal(int sig) {
  dist::record_signal(sig);  // `kiln launch` then knows this rank was asked to stop, not that it failed
  if (g_signals.fetch_add(1) == 0) {
    if (g_quiet.load()) return;
    const char msg[] = "\nkiln: stopping after this step and saving a checkpoint (press Ctrl-C again to abort now)\n";
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
  } else {
    const char msg[] = "\nkiln: aborted\n";
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    std::_Exit(128 + sig);
  }
}

class StopSignals {
 public:
  StopSignals() {
    g_signals = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  bool requested() const { return g_signals.load() > 0; }

 private:
  struct sigaction old_int_ {
  }, old_term_{};
};

// ---- metrics.jsonl ----

json memory_json(bool peak) {
  const auto st = memory::stats();
  json m = json::object();
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    const auto& c = st.by_category[static_cast<size_t>(i)];
    m[memory_category_name(static_cast<MemoryCategory>(i))] = peak ? c.peak_bytes : c.live_bytes;
  }
  return m;
}

/// Keeps the lines up to and including `step` (a resumed run rewrites what came after its checkpoint);
/// returns the last kept line's time_s.
double truncate_metrics(const fs::path& path, int64_t step) {
  std::ifstream in(path);
  std::vector<std::string> kept;
  double time_s = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step") || j["step"].get<int64_t>() > step) continue;
    if (j.contains("time_s")) time_s = j["time_s"].get<double>();
    kept.push_back(line);
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  for (const auto& l : kept) out << l << "\n";
  return time_s;
}

void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    if (!out) throw ConfigError(tmp.string() + ": cannot write (is the run directory writable?)");
    out << text;
  }
  fs::rename(tmp, path);
}

std::string eval_line(const EvalResult& r, bool lm) {
  char buf[160];
  if (lm)
    std::snprintf(buf, sizeof buf, "eval loss %.4f  bits/char %.4f", r.loss, r.bits_per_char);
  else
    std::snprintf(buf, sizeof buf, "eval loss %.4f  accuracy %.2f%%", r.loss, 100 * r.accuracy);
  return buf;
}

enum class Status { Completed, Stopped, Interrupted, NonFinite };

const char* status_name(Status s) {
  switch (s) {
    case Status::Completed: return "completed";
    case Status::Stopped: return "stopped";  // train.max_steps reached before train.steps
    case Status::Interrupted: return "interrupted";
    case Status::NonFinite: return "nan";
  }
  return "?";
}

/// What a run's future depends on besides its config and state: the process
/// count (each rank's share of the data) and the thread count per process
/// (DESIGN.md §2: same seed, same thread count, same bits). Saved in every
/// checkpoint as object "run" (metadata state.run.*); `kiln resume` compares.
class RunFacts : public io::Stateful {
 public:
  int64_t world_size = 1, threads = 1;
  io::ObjectState state_dict() const override { return {{}, {{"world_size", world_size}, {"threads", threads}}}; }
  void load_state_dict(const io::ObjectState& s) override {
    world_size = std::get<int64_t>(s.values.at("world_size"));
    threads = std::get<int64_t>(s.values.at("threads"));
  }
};

struct Loop {
  const Config& config;
  fs::path run_dir;
  std::string config_path;
  Task task;
  std::optional<train::CheckpointManager> ckpts;  // rank 0 only
  dist::ProcessGroupPtr group;                    // null: a single process
  int64_t step = 0;
  double time_offset = 0;  // time_s of the run before this process (resume)
  RunFacts facts;
  bool resumed = false;
  // dist.comm_hook = "powersgd" (or a resumed checkpoint that holds its state): the checkpoint object "powersgd".
  std::unique_ptr<PowerSgdCheckpoint> powersgd = nullptr;
};

/// Makes L.powersgd when the run uses PowerSGD or the checkpoint it resumes holds its state.
void make_powersgd_checkpoint(Loop& L, bool checkpoint_has_it) {
  dist::DistributedDataParallel* ddp = L.task.ddp.get();
  std::string why;
  if (ddp == nullptr) {
    why = L.group && L.group->size() > 1
              ? "this run's dist.strategy (\"" + L.config.string("dist.strategy") + "\") runs without DDP"
              : "a single process exchanges no gradients";
  } else if (ddp->options().comm_hook != dist::CommHook::PowerSGD) {
    why = "this run's dist.comm_hook is \"" + L.config.string("dist.comm_hook") + "\"";
    ddp = nullptr;
  }
  if (ddp != nullptr || checkpoint_has_it) L.powersgd = std::make_unique<PowerSgdCheckpoint>(ddp, L.group, why);
}

// A step's own values, kept until a train line is written (Note [Run story]).
struct StepValues {
  int64_t step, epoch;
  double loss, lr, grad_norm, time_s;
};

// The GradScaler (amp = "fp16") and the run's facts travel in the checkpoint's object slot
// (checkpoints written before the facts were recorded load without them).
// A sharded run's checkpoint holds the unsharded optimizer (`full`) and, with
// zero3, the unsharded model (`full_model`); see Consolidated.
train::CheckpointRefs checkpoint_refs(Loop& L, bool with_facts = true, optim::Optimizer* full = nullptr,
                                      nn::Module* full_model = nullptr) {
  Task& t = L.task;
  train::CheckpointRefs refs{full_model ? full_model : t.model.get(), full ? full : t.optimizer, t.scheduler.get()};
  if (t.scaler) refs.objects["scaler"] = t.scaler.get();
  if (with_facts) refs.objects["run"] = &L.facts;
  return refs;
}

/// What a sharded run's checkpoint holds instead of the run's own objects, so
/// that it is the file a ddp run writes (it resumes at any world size and
/// strategy): the unsharded optimizer, and with zero3 the unsharded model.
struct Consolidated {
  std::shared_ptr<nn::Module> model;  // zero3 only
  std::unique_ptr<optim::Optimizer> optimizer;
};

/// A mesh run ([parallel] tp or pp > 1): the whole GPT and its optimizer,
/// merged from every stage and tp shard (and with zero1 every dp shard of the
/// optimizer state). A collective over the world; rank 0 gets them.
Consolidated consolidate_mesh(Loop& L) {
  Task& t = L.task;
  Consolidated out;
  const nn::NamedTensors weights = t.mesh_gpt->full_state_dict();
  std::map<std::string, optim::ParamState> local;
  bool plane = true;  // this rank takes part in merging the optimizer state
  if (t.zero) {
    local = t.zero->consolidate_state_dict(0).state;  // on dp rank 0 only
    plane = t.mesh->coordinate("dp") == 0;
  } else {
    local = t.optimizer->state_dict().state;
  }
  std::map<std::string, optim::ParamState> merged;
  if (plane) merged = t.mesh_gpt->full_optim_state(local);
  if (L.group->rank() != 0) return out;
  out.model = make_unsharded_model(L.config, t);
  out.model->load_state_dict(weights);
  out.optimizer = make_optimizer(L.config, *out.model);
  optim::OptimizerStateDict sd = out.optimizer->state_dict();
  sd.state = std::move(merged);
  // The run's hyperparameters (the scheduler's lr): the stage's groups are the GPT's (decay, no decay).
  const auto& groups = t.optimizer->param_groups();
  KILN_ASSERT(groups.size() == sd.param_groups.size());
  for (size_t g = 0; g < groups.size(); ++g) sd.param_groups[g].options = groups[g].options;
  out.optimizer->load_state_dict(sd);
  return out;
}

/// dist.strategy zero1|zero2|zero3 on more than one rank: the unsharded
/// optimizer (and with zero3 model), its state gathered from every rank's
/// shard. A collective: every rank calls it; rank 0 gets them, the others
/// (and runs that shard nothing) nulls.
Consolidated consolidate(Loop& L) {
  Task& t = L.task;
  Consolidated out;
  if (t.mesh_gpt) return consolidate_mesh(L);
  if (t.fsdp) {
    const nn::NamedTensors weights = t.fsdp->full_state_dict();
    const optim::OptimizerStateDict sd = t.fsdp->full_optim_state_dict(*t.optimizer);
    if (L.group->rank() != 0) return out;
    out.model = make_unsharded_model(L.config, t);
    out.model->load_state_dict(weights);
    out.optimizer = make_optimizer(L.config, *out.model);
    out.optimizer->load_state_dict(sd);
    return out;
  }
  if (!t.zero) return out;
  const optim::OptimizerStateDict sd = t.zero->consolidate_state_dict(0);
  if (L.group->rank() != 0) return out;
  out.optimizer = make_optimizer(L.config, *t.model);
  out.optimizer->load_state_dict(sd);
  return out;
}

void save_checkpoint(Loop& L, const Consolidated& full = {}) {
  train::CheckpointRefs refs = checkpoint_refs(L, true, full.optimizer.get(), full.model.get());
  if (L.powersgd && L.powersgd->active()) refs.objects["powersgd"] = L.powersgd.get();  // gathered by every rank
  L.ckpts->save(refs, {.step = L.step, .loader = L.task.train_loader->state(), .config = L.config.to_toml()});
  // The report of a run in progress, so a long run can be looked at while it trains (a few ms).
  write_report(L.run_dir);
}

/// Anomaly mode's report names the module (its path in the model, "layers.2")
/// rather than the library line of the op inside it. Forward hooks keep the
/// stack of modules whose forward is running (an op that throws leaves it as
/// it was); a hook on each module's output gradient marks the module whose
/// backward is running. Hooks turn off some fusions, so they are only set in
/// anomaly mode, a debugging mode anyway.
class ModuleTrail {
 public:
  explicit ModuleTrail(nn::Module& root) {
    for (auto& entry : root.named_modules()) {
      // A copy, not a structured binding: lambdas capture it (clang 14 cannot capture bindings).
      const std::string name = entry.first;
      const auto& m = entry.second;
      if (name.empty()) continue;
      m->register_forward_pre_hook([this, name](nn::Module&, const Tensor&) {
        forward_.push_back(name);
        return Tensor();
      });
      m->register_forward_hook([this, name](nn::Module&, const Tensor&, const Tensor& out) {
        if (!forward_.empty()) forward_.pop_back();
        if (out.requires_grad())
          out.register_hook([this, name](const Tensor&) {
            // A parent whose output is its last child's keeps the child's (deeper) name.
            if (backward_.rfind(name + ".", 0) != 0) backward_ = name;
            return Tensor();
          });
        return Tensor();
      });
    }
  }
  void start_step() {
    forward_.clear();
    backward_.clear();
  }
  /// The innermost module running when the error was thrown ("" if none).
  std::string module(bool in_backward) const {
    if (in_backward) return backward_;
    return forward_.empty() ? std::string() : forward_.back();
  }

 private:
  std::vector<std::string> forward_;
  std::string backward_;
};

/// The type of the module at `path` ("Linear"), or "" if there is none.
std::string type_of(nn::Module& root, const std::string& path) {
  for (auto& [name, m] : root.named_modules())
    if (name == path) return m->type_name();
  return {};
}

/// "the last checkpoint (step 20) is left as it was" or why there is none.
std::string checkpoint_left(Loop& L) {
  const auto latest = L.ckpts ? L.ckpts->latest() : std::nullopt;
  if (!latest) {
    const int64_t every = L.config.integer("train.ckpt_every");
    return "no checkpoint was saved before it (train.ckpt_every = " + std::to_string(every) +
           (every > 0 ? ": the first is at step " + std::to_string(every) : std::string(": only at the end")) + ")";
  }
  return "the last checkpoint, " + latest->filename().string() + ", is left as it was";
}

std::string resume_command(const Loop& L);

/// After an anomaly stop: what is left and how to go on once the cause is fixed.
std::string next_step_hint(Loop& L, bool lead) {
  if (!lead) return "rank 0 says what is left of the run";
  const bool any = L.ckpts && L.ckpts->latest();
  return checkpoint_left(L) + (any ? "; once the cause is fixed, continue from it with " + resume_command(L)
                                   : std::string("; once the cause is fixed, start again with kiln train"));
}

/// The command that continues this run: with `kiln launch -n N --` for a data-parallel run.
std::string resume_command(const Loop& L) {
  const int world = L.group ? L.group->size() : 1;
  std::string cmd = world > 1 ? "kiln launch -n " + std::to_string(world) + " -- kiln resume " : "kiln resume ";
  return cmd + L.run_dir.string();
}

// ---- train.keep_best: checkpoints/best.safetensors, the checkpoint of the best evaluation so far ----

/// The metric and value a best checkpoint was kept for, saved in it as the
/// object "best" (checksummed with the rest), so a resumed run compares
/// against what is on disk rather than forgetting it.
class BestMark : public io::Stateful {
 public:
  BestMark(std::string metric, double value, int64_t step) : metric_(std::move(metric)), value_(value), step_(step) {}
  io::ObjectState state_dict() const override {
    return {{}, {{"metric", metric_}, {"value", value_}, {"step", step_}}};
  }
  void load_state_dict(const io::ObjectState&) override {}

 private:
  std::string metric_;
  double value_;
  int64_t step_;
};

class KeepBest {
 public:
  /// Off (nullopt) unless train.keep_best names a metric this run evaluates.
  static std::optional<KeepBest> from(const Config& c, bool lm, const fs::path& dir) {
    const std::string metric = c.string("train.keep_best");
    if (metric == "off") return std::nullopt;
    if (metric == (lm ? "accuracy" : "bits_per_char"))
      throw ConfigError(
          c.source() + ": train.keep_best = \"" + metric + "\" is not a metric of " +
          (lm ? "a language model (it has loss and bits_per_char)" : "a classifier (it has loss and accuracy)"));
    KeepBest k;
    k.metric_ = metric;
    k.path_ = dir / kBestCheckpoint;
    // The value a best checkpoint on disk was kept for, when it was kept for this metric.
    try {
      if (fs::exists(k.path_)) {
        const auto md = io::read_safetensors_header(k.path_.string()).metadata;
        auto m = md.find("state.best.metric"), v = md.find("state.best.value");
        if (m != md.end() && v != md.end() && m->second == "s:" + metric && v->second.rfind("f:", 0) == 0)
          k.best_ = std::strtod(v->second.c_str() + 2, nullptr);
      }
    } catch (const Error&) {
      // Unreadable: the next evaluation replaces it.
    }
    return k;
  }

  /// After an evaluation: keeps the state as the best checkpoint when `eval` improves on the best so far.
  void update(Loop& L, const json& eval, Progress& progress) {
    const double v = eval[metric_].get<double>();
    const bool better = !best_ || (metric_ == "accuracy" ? v > *best_ : v < *best_);
    if (!better || !std::isfinite(v)) return;
    BestMark mark(metric_, v, L.step);
    train::CheckpointRefs refs = checkpoint_refs(L);
    refs.objects["best"] = &mark;
    train::save_checkpoint(path_.string(), refs,
                           {.step = L.step, .loader = L.task.train_loader->state(), .config = L.config.to_toml()});
    char was[64] = "";
    if (best_) std::snprintf(was, sizeof was, " (was %.6g)", *best_);
    char buf[200];
    std::snprintf(buf, sizeof buf, "step %lld  best %s so far: %.6g%s, kept as checkpoints/%s",
                  static_cast<long long>(L.step), metric_.c_str(), v, was, kBestCheckpoint);
    progress.message(buf);
    best_ = v;
  }

 private:
  std::string metric_;
  fs::path path_;
  std::optional<double> best_;
};

/// One process's training loop, from the first line it prints to the summary:
/// the state it keeps across steps, and one member function per concern.
///   run                      the epochs and their batches
///   train_step               one step: forward, agreement, backward and update, logging, eval and checkpoint
///   agree                    data-parallel: the ranks agree on a non-finite loss, a stop and the global loss
///   stop_nonfinite           a NaN/Inf loss: the message, the unlogged steps and the "nonfinite" line
///   backward_and_update      backward (scaled under amp), clipping and the optimizer step
///   log_step                 the train line every train.log_every steps, the data-stall warning, the progress bar
///   eval_and_checkpoint      the periodic evaluation and checkpoint, kept out of the throughput window
///   finish                   the last evaluation, the "end" line, summary.json, the report and the last lines printed
class TrainLoop {
 public:
  explicit TrainLoop(Loop& L)
      : L_(L),
        c_(L.config),
        t_(L.task),
        lm_(t_.gpt != nullptr || t_.mesh_gpt != nullptr),
        total_(t_.total_steps),
        stop_at_(c_.integer("train.max_steps") > 0 ? std::min(c_.integer("train.max_steps"), total_) : total_),
        log_every_(std::max<int64_t>(1, c_.integer("train.log_every"))),
        eval_every_(c_.integer("train.eval_every")),
        ckpt_every_(c_.integer("train.ckpt_every")),
        eval_batches_(c_.integer("train.eval_batches")),
        clip_(c_.number("optim.grad_clip")),
        params_(t_.model->named_parameters()),
        world_(L.group ? L.group->size() : 1),
        replicas_(t_.mesh ? t_.mesh->size("dp") : world_),
        lead_(!L.group || L.group->rank() == 0),  // Note [Data-parallel runs]
        metrics_(open_metrics(lead_, L.run_dir)),
        // mpirun gives ranks a pseudo-terminal even when its own output goes to a
        // file, so a data-parallel run prints plain lines.
        progress_(world_ == 1 && ::isatty(STDOUT_FILENO) != 0, log_every_, !lead_) {
    if (c_.boolean("train.anomaly")) {
      anomaly_.emplace(true);
      trail_.emplace(*t_.model);
    }
    // Training health (cli/health_log.h), every log_every steps; a sharded model's pieces are not modules' tensors.
    if (c_.boolean("train.health") && !t_.zero && !t_.fsdp && !t_.mesh_gpt) {
      health_every_ = log_every_;
      if (lead_) health_.emplace(*t_.model, log_every_);
    }
    // Per-rank step times (cli/step_skew.h) where the ranks do the same work: tensor- and pipeline-parallel
    // ranks differ by design (stages, the head on the last one).
    if (world_ > 1 && !t_.mesh_gpt) skew_.emplace(L.group);
    if (c_.boolean("train.compile")) setup_compile();
  }
  TrainLoop(const TrainLoop&) = delete;  // ModuleTrail's hooks hold its address
  TrainLoop& operator=(const TrainLoop&) = delete;

  int run() {
    if (lead_ && t_.amp.dtype == kBFloat16) bf16_path_ = bf16_product_path();
    announce();
    t_start_ = Clock::now();
    window_start_ = Clock::now();
    memory::reset_peak_stats();
    keep_best_ = lead_ ? KeepBest::from(c_, lm_, L_.run_dir / "checkpoints") : std::nullopt;
    if (L_.step >= stop_at_) {
      progress_.message("nothing to do: the run is at step " + std::to_string(L_.step) + " of " +
                        std::to_string(stop_at_) + " (to train longer, start a new run with a larger train.steps)");
      return 0;
    }
    record_start();
    if (auto w = parse_profile_steps(c_.string("profile.steps"), c_.origin("profile.steps")))
      profile_.emplace(*w, L_.step, L_.run_dir, L_.group);
    say_profile();
    while (L_.step < stop_at_ && status_ == Status::Completed) {
      // The epoch begin() starts (a finished epoch's last batch moves the state on).
      const int64_t epoch = t_.train_loader->state().epoch;
      if (t_.sampler) t_.sampler->set_epoch(epoch);
      auto prev_end = Clock::now();
      for (auto& batch : *t_.train_loader) {
        window_wait_ += std::chrono::duration<double>(Clock::now() - prev_end).count();
        if (!train_step(batch, epoch)) break;
        prev_end = Clock::now();
      }
      if (status_ == Status::Completed && L_.step < stop_at_) epoch_done(epoch);
    }
    return finish();
  }

 private:
  static std::ofstream open_metrics(bool lead, const fs::path& run_dir) {
    std::ofstream metrics;
    if (lead) metrics.open(run_dir / "metrics.jsonl", std::ios::app);
    return metrics;
  }

  double elapsed() const { return L_.time_offset + std::chrono::duration<double>(Clock::now() - t_start_).count(); }

  void announce() {
    progress_.message(std::string("training ") + c_.name() + ": " + std::to_string(t_.num_parameters) +
                      " parameters, " + std::to_string(t_.train_loader->size()) + " batches of " +
                      std::to_string(c_.integer("data.batch_size")) +
                      (t_.mesh ? " per dp replica on " + mesh_text() + " (global batch " +
                                     std::to_string(replicas_ * c_.integer("data.batch_size")) + ")"
                       : world_ > 1 ? " per rank on " + std::to_string(world_) + " ranks (global batch " +
                                          std::to_string(world_ * c_.integer("data.batch_size")) + ")"
                                    : std::string()) +
                      " per epoch, steps " + std::to_string(L_.step) + " -> " + std::to_string(stop_at_) + " of " +
                      std::to_string(total_) + ", run directory " + L_.run_dir.string() +
                      (accum_ > 1 ? ", " + std::to_string(accum_) + " batches per step" : std::string()));
    // Where bf16 autocast cannot be faster than float32 (its products compute in float32 here),
    // the run says so before the user wonders why its throughput did not move.
    if (bf16_path_ && !bf16_path_->native) progress_.message("amp = \"bf16\": " + bf16_path_->describe());
    if (!t_.finetune_note.empty()) progress_.message(t_.finetune_note);
    if (t_.distill) progress_.message(distill_note(*t_.distill, t_, c_));
    if (t_.mesh_gpt) progress_.message("rank 0: " + t_.mesh_gpt->describe());
  }

  std::string mesh_text() const {
    std::string s;
    for (const auto& d : t_.mesh->dims()) s += (s.empty() ? "" : " x ") + d.name + " " + std::to_string(d.size);
    return s + " = " + std::to_string(world_) + " ranks";
  }

  /// The model's trainable elements (kiln doctor's frozen_model); a sharded model's pieces are counted as
  /// the whole (they are not the model's parameters).
  int64_t trainable_parameters() const {
    return t_.fsdp || t_.mesh_gpt ? t_.num_parameters : t_.model->num_parameters(/*trainable_only=*/true);
  }

  void record_start() {
    if (!lead_) return;
    json start = {{"kind", L_.resumed ? "resume" : "start"},  // Note [Run story]
                  {"step", L_.step},
                  {"total_steps", total_},
                  {"world_size", world_},
                  {"parameters", t_.num_parameters},
                  {"trainable_parameters", trainable_parameters()},
                  {"time_s", L_.time_offset}};
    // Where this process's bf16 products ran, for `kiln doctor` on any machine later.
    if (bf16_path_)
      start["bf16_products"] = {{"native", bf16_path_->native},
                                {"dot_vs_fma", bf16_path_->dot_vs_fma},
                                {"native_from", bf16_path_->native_from},
                                {"why", bf16_path_->describe()}};
    // DDP's bucket caps and the buckets they made (registration order: they are
    // laid out again in ready order after the first synced backward).
    if (t_.ddp) {
      const dist::DDPOptions& o = t_.ddp->options();
      start["ddp"] = {{"bucket_cap_mb", o.bucket_cap_mb},
                      {"first_bucket_cap_mb", o.first_bucket_cap_mb},
                      {"last_bucket_cap_mb", o.last_bucket_cap_mb},
                      {"buckets", t_.ddp->buckets().size()},
                      {"comm_hook", dist::comm_hook_name(o.comm_hook)}};
    }
    metrics_ << start.dump() << "\n" << std::flush;
  }

  // Note [Compiled steps]
  // train.compile runs each batch's forward and backward through kiln::compile
  // (docs/compile.md): the first batch of a shape captures, the others replay.
  // Everything that reads values on the host stays eager between replays, as a
  // torch.compile'd model with the loop around it: the loss check, clipping
  // (it returns the norm), GradScaler's unscale and skip, the optimizer step.
  // The steps whose forward must run host code run eagerly: a health-sampled
  // step (its hooks) and every step of a profiled run (the profiler times ops,
  // which a replay does not dispatch). Eager and replayed steps interleave
  // freely: a replay reads the parameters where they are, and the gradients'
  // state at a call chooses its record (docs/compile.md, "Gradient
  // accumulation"). In a data-parallel run DDP's gradient hooks and its
  // collectives are graph breaks, so the batches run split there (the hooks
  // run on every call, and an accumulating micro-batch's run under no_sync
  // as eagerly): the same losses, no replay's saving. The one difference
  // from eager: a replay has run backward when the loss is checked, so a
  // non-finite loss stops the run after its backward instead of before; the
  // update is skipped either way.
  void setup_compile() {
    std::vector<std::string> bad;
    if (t_.mesh_gpt) bad.push_back("tp or pp (the pipeline interleaves forward and backward)");
    if (t_.zero || t_.fsdp) bad.push_back("dist.strategy zero1/zero2/zero3");
    if (anomaly_) bad.push_back("train.anomaly (anomaly mode checks every op as it runs)");
    if (!bad.empty()) {
      std::string list;
      for (const std::string& b : bad) list += (list.empty() ? "" : "; ") + b;
      throw ConfigError("train.compile = true is not supported with " + list + ": set train.compile = false");
    }
    compiled_.emplace(
        [this](const std::vector<Tensor>& in) {
          // As the eager step: a micro-batch's loss is divided by the batches per step.
          return std::vector<Tensor>{micro_batch_backward(t_, data::Example{in[0], in[1]}, accum_).detach()};
        },
        CompileOptions{.name = "train_step", .modules = {t_.model.get()}});
  }

  /// Whether step `step`'s forward and backward replay (Note [Compiled steps]).
  // Every rank decides alike (health samples on rank 0 alone): a data-parallel
  // step's collectives come in another order compiled (forward, backward's
  // allreduces, then the loss agreement) than eagerly (the agreement before backward).
  bool compiled_step(int64_t step) const {
    return compiled_ && !profile_ && !(health_every_ > 0 && step % health_every_ == 0);
  }

  /// A micro-batch that only accumulates, through the compiled function: a
  /// data-parallel run's under DDP's no_sync, as accumulate_micro_batch runs it
  /// (its hooks run in the split call and see it).
  double compiled_accumulating(const data::Example& batch) {
    std::optional<dist::DistributedDataParallel::NoSync> no_sync;
    if (t_.ddp) no_sync.emplace(*t_.ddp);
    return (*compiled_)({batch.data, batch.target})[0].item<double>();
  }

  /// One step on `batch`; false when the loop stops after it (or instead of it).
  bool train_step(const data::Example& batch, int64_t epoch) {
    dist::set_step(L_.step + 1);  // for `kiln launch`'s report if this rank dies now
    const int64_t bytes_before = dist::traffic().bytes;
    const double lr = t_.optimizer->param_groups()[0].lr();
    if (micro_ == 0) {
      if (profile_) profile_->before_step(L_.step + 1);
      record::Scope phase(record::Kind::Optimizer, "optimizer");  // Note [Profiled steps]
      if (t_.zero)
        t_.zero->zero_grad();
      else
        t_.optimizer->zero_grad();
    }
    // train.grad_accum_steps: all but a step's last micro-batch only add their gradients (finetune.h).
    const bool replay = compiled_step(L_.step + 1);
    if (micro_ < accum_ - 1) {
      try {
        micro_loss_ += replay ? compiled_accumulating(batch) : accumulate_micro_batch(t_, batch, accum_);
      } catch (const autograd::AnomalyError& e) {
        // As in backward_and_update: a data-parallel rank is inside DDP's collectives here.
        if (world_ > 1) throw;
        report_anomaly(e, /*in_backward=*/false, epoch);
        status_ = Status::NonFinite;
        return false;
      }
      ++micro_;
      return true;
    }
    if (trail_) trail_->start_step();
    if (health_) health_->begin(L_.step + 1);
    Tensor loss;
    bool anomalous = false;
    double loss_v = 0;
    if (replay) {
      record::Scope phase(record::Kind::User, "forward and backward (compiled)");
      loss_v = (*compiled_)({batch.data, batch.target})[0].item<double>();
    } else if (t_.mesh_gpt) {
      // Forward and backward together: the pipeline interleaves them over micro-batches.
      pipeline_ = t_.mesh_gpt->forward_backward(batch.data, batch.target);
      loss_v = pipeline_.loss;
    } else {
      try {
        record::Scope phase(record::Kind::User, "forward");
        loss = batch_loss(t_, batch);
        loss_v = loss.item<double>();
      } catch (const autograd::AnomalyError& e) {
        report_anomaly(e, /*in_backward=*/false, epoch);
        anomalous = true;  // data-parallel: the other ranks learn of it through the agreement below
      }
    }
    // The step's loss is the mean over its micro-batches, as one batch of all of them would give
    // (a mesh run takes one: grad_accum_steps is refused with tp or pp).
    const double step_loss = anomalous ? std::nan("") : (micro_loss_ + loss_v) / static_cast<double>(accum_);
    if (accum_ > 1 && !anomalous && !replay) loss = loss.div(static_cast<double>(accum_));
    micro_ = 0;
    micro_loss_ = 0;
    Agreement a{.nonfinite = false, .stop_requested = false, .loss = step_loss};
    a.nonfinite = !std::isfinite(a.loss);
    if (world_ > 1) agree(a);
    if (a.nonfinite) {
      stop_nonfinite(a.loss, lr, epoch, anomalous);
      return false;
    }
    const std::optional<double> gnorm = backward_and_update(loss, epoch, /*backward_done=*/replay);
    if (!gnorm) return false;
    window_comm_bytes_ += dist::traffic().bytes - bytes_before;  // the step's own (not eval's or checkpoints')
    ++window_steps_;
    if (t_.scheduler) t_.scheduler->step();
    ++L_.step;
    if (health_) health_->end(metrics_, t_.optimizer);
    unlogged_.push_back({L_.step, t_.train_loader->state().epoch, a.loss, lr, *gnorm, elapsed()});
    if (world_ == 1) a.stop_requested = signals_.requested();
    log_step(batch.target.size(0) * replicas_ * accum_, a.loss, lr, *gnorm, epoch);
    if (const train::LeakReport* r = leak_.step()) warn_leak(*r);
    const bool stop_now = a.stop_requested || L_.step >= stop_at_;
    eval_and_checkpoint(a.stop_requested, stop_now);
    if (profile_) {
      profile_->after_step();
      say_profile();
    }
    if (a.stop_requested) status_ = Status::Interrupted;
    return !stop_now;
  }

  // What the ranks agree on after forward (data-parallel: acted on after this step).
  struct Agreement {
    bool nonfinite, stop_requested;
    double loss;
  };

  /// Data-parallel: one allreduce, before backward, whose collectives a rank that stops here would skip.
  void agree(Agreement& a) {
    Tensor flags =
        tensor<float>({a.nonfinite ? 1.f : 0.f, signals_.requested() ? 1.f : 0.f, static_cast<float>(a.loss)});
    const auto wait_start = Clock::now();
    L_.group->allreduce(flags, dist::ReduceOp::Sum)->wait();
    if (skew_) skew_->waited(std::chrono::duration<double>(Clock::now() - wait_start).count());
    const float* f = flags.data_ptr<float>();
    a.nonfinite = f[0] > 0;
    a.stop_requested = f[1] > 0;
    a.loss = static_cast<double>(f[2]) / world_;  // the global batch's loss: the mean of the ranks'
    if (a.stop_requested && !signals_.requested())
      progress_.message(
          "kiln: another rank was asked to stop (SIGINT/SIGTERM): every rank stops after this "
          "step and a checkpoint is saved");
  }

  // Anomaly mode found a NaN/Inf: the same stop as a non-finite loss (exit 3, status "nan").
  void report_anomaly(const autograd::AnomalyError& e, bool in_backward, int64_t epoch) {
    progress_.finish();
    const std::string module = trail_ ? trail_->module(in_backward) : std::string();
    const std::string who = world_ > 1 ? "rank " + std::to_string(L_.group->rank()) + ": " : std::string();
    std::fprintf(stderr,
                 "kiln: error: %sanomaly mode stopped the run at step %lld (epoch %lld) in the %s of %s%s:\n%s\n"
                 "%s\n",
                 who.c_str(), static_cast<long long>(L_.step + 1), static_cast<long long>(epoch),
                 in_backward ? "backward" : "forward", module.empty() ? "the loss" : ("module " + module).c_str(),
                 module.empty() ? "" : (" (" + type_of(*t_.model, module) + ")").c_str(), e.what(),
                 next_step_hint(L_, lead_).c_str());
  }

  void stop_nonfinite(double loss_v, double lr, int64_t epoch, bool anomalous) {
    progress_.finish();
    if (lead_ && !anomalous)
      std::fprintf(stderr,
                   "kiln: error: the loss became %s at step %lld (epoch %lld, lr %.3g); the run stops here and "
                   "%s.\nhint: rerun with --set train.anomaly=true to find the op that first produced a NaN/Inf "
                   "(kiln names it and its module, with its inputs' statistics); a lower optim.lr or "
                   "optim.grad_clip often cures it\n",
                   std::isnan(loss_v) ? "NaN" : "Inf", static_cast<long long>(L_.step + 1),
                   static_cast<long long>(epoch), lr, checkpoint_left(L_).c_str());
    if (lead_) {  // Note [Run story]: the unlogged steps, averaged over the window like a train line
      const double window_s = std::chrono::duration<double>(Clock::now() - window_start_).count();
      for (const StepValues& v : unlogged_)
        metrics_ << json{{"kind", "train"},
                         {"step", v.step},
                         {"epoch", v.epoch},
                         {"loss", v.loss},
                         {"lr", v.lr},
                         {"grad_norm", v.grad_norm},
                         {"samples_per_s", window_s > 0 ? static_cast<double>(window_samples_) / window_s : 0.0},
                         {"data_wait", window_s > 0 ? std::min(1.0, window_wait_ / window_s) : 0.0},
                         {"memory", memory_json(true)},
                         {"time_s", v.time_s}}
                        .dump()
                 << "\n";
      metrics_ << json{{"kind", "nonfinite"},
                       {"step", L_.step + 1},
                       {"epoch", epoch},
                       {"lr", lr},
                       {"loss", std::isnan(loss_v) ? "NaN"
                                : loss_v > 0       ? "Inf"
                                                   : "-Inf"}}
                      .dump()
               << "\n"
               << std::flush;
    }
    status_ = Status::NonFinite;
  }

  /// Backward, clipping and the optimizer step; the gradient norm, or nullopt when anomaly mode stopped the
  /// run in backward (status "nan").
  std::optional<double> backward_and_update(Tensor& loss, int64_t epoch, bool backward_done) {
    double gnorm = 0;
    if (t_.mesh_gpt) {
      // Backward ran with the forward; the replicas' mean, then one norm over every stage and shard.
      t_.mesh_gpt->allreduce_gradients();
      gnorm = t_.mesh_gpt->clip_grad_norm_(clip_ > 0 ? clip_ : optim::kInfNorm);
      if (t_.zero)
        t_.zero->step();
      else
        t_.optimizer->step();
    } else if (t_.scaler) {
      // Unscale before clipping so the clip sees true gradients; a step whose
      // gradients overflowed is skipped and the scale backs off.
      if (!backward_done) {
        record::Scope phase(record::Kind::User, "backward");
        t_.scaler->scale(loss).backward();
      }
      record::Scope phase(record::Kind::Optimizer, "optimizer");
      t_.scaler->unscale_(*t_.optimizer);
      gnorm = optim::clip_grad_norm_(params_, clip_ > 0 ? clip_ : optim::kInfNorm);
      t_.scaler->step(*t_.optimizer);
      t_.scaler->update();
    } else {
      try {
        record::Scope phase(record::Kind::User, "backward");
        if (!backward_done) loss.backward();
      } catch (const autograd::AnomalyError& e) {
        // Data-parallel ranks are inside DDP's collectives here: the error ends the job (run_or_abort).
        if (world_ > 1) throw;
        report_anomaly(e, /*in_backward=*/true, epoch);
        status_ = Status::NonFinite;
        return std::nullopt;
      }
      record::Scope phase(record::Kind::Optimizer, "optimizer");
      if (t_.zero) {
        // The global norm over every rank's shard (stage 2 reduce-scatters the gradients first).
        gnorm = t_.zero->clip_grad_norm_(clip_ > 0 ? clip_ : optim::kInfNorm);
        t_.zero->step();
      } else if (t_.fsdp) {
        // Backward left each parameter's .grad its piece of the reduced gradient shard.
        gnorm = t_.fsdp->clip_grad_norm_(clip_ > 0 ? clip_ : optim::kInfNorm);
        t_.optimizer->step();
      } else {
        gnorm = optim::clip_grad_norm_(params_, clip_ > 0 ? clip_ : optim::kInfNorm);
        t_.optimizer->step();
      }
    }
    return gnorm;
  }

  /// After a step: the throughput window, the train line when one is due, and the progress bar.
  void log_step(int64_t global_batch, double loss_v, double lr, double gnorm, int64_t epoch) {
    window_samples_ += global_batch;
    const auto now = Clock::now();
    const double window_s = std::chrono::duration<double>(now - window_start_).count();
    const double sps = window_s > 0 ? static_cast<double>(window_samples_) / window_s : 0;
    if (L_.step % log_every_ == 0 || L_.step == stop_at_) {
      const double wait_frac = window_s > 0 ? std::min(1.0, window_wait_ / window_s) : 0;
      steps_per_s_ =
          window_s > 0 ? static_cast<double>(window_samples_) / static_cast<double>(global_batch) / window_s : 0;
      // Every rank logs at the same steps: the per-rank figures are gathered here.
      ranks_ = skew_ ? skew_->window(window_steps_, window_s, window_wait_) : json();
      write_train_line(loss_v, lr, gnorm, sps, wait_frac);
      if (wait_frac > 0.25 && window_s > 1.0 && !stall_warned_) warn_stall(wait_frac, window_s);
      window_start_ = now;
      window_wait_ = 0;
      window_samples_ = 0;
      window_steps_ = 0;
      window_comm_bytes_ = 0;
      memory::reset_peak_stats();
    }
    const double rate = steps_per_s_ > 0 ? steps_per_s_ : (window_s > 0 ? sps / static_cast<double>(global_batch) : 0);
    progress_.update({.step = L_.step,
                      .total = stop_at_,
                      .epoch = epoch,
                      .loss = loss_v,
                      .lr = lr,
                      .samples_per_s = sps,
                      .eta_s = rate > 0 ? static_cast<double>(stop_at_ - L_.step) / rate : -1,
                      .memory_bytes = memory::stats().peak_bytes});
  }

  void write_train_line(double loss_v, double lr, double gnorm, double sps, double wait_frac) {
    json j = {{"kind", "train"},
              {"step", L_.step},
              {"epoch", t_.train_loader->state().epoch},
              {"loss", loss_v},
              {"lr", lr},
              {"grad_norm", gnorm},
              {"samples_per_s", sps},
              {"data_wait", wait_frac},
              {"memory", memory_json(true)},
              {"time_s", elapsed()}};
    if (t_.scaler)
      for (const auto& [k, v] : t_.scaler->metrics()) j[k] = v;
    // This rank's payload handed to collectives and send/recv per step (dist/traffic.h).
    if (world_ > 1 && window_steps_ > 0) j["comm_bytes_per_step"] = window_comm_bytes_ / window_steps_;
    if (!ranks_.is_null()) j["ranks"] = ranks_;
    if (t_.mesh_gpt && t_.mesh->size("pp") > 1)  // the last step's pipeline bubble (docs/pipeline.md)
      j["pipeline"] = {{"bubble_model", pipeline_.model_bubble},
                       {"bubble_slots", pipeline_.slot_bubble},
                       {"bubble_wall", pipeline_.wall_bubble}};
    metrics_ << j.dump() << "\n" << std::flush;
    last_train_ = j;
    unlogged_.clear();
  }

  /// Once per process: the loop waited for data more than a quarter of a logging window.
  void warn_stall(double wait_frac, double window_s) {
    stall_warned_ = true;
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "warning: the training loop waited for data %.0f%% of the last %.1f s (data stall): the "
                  "loader's %lld worker thread(s) cannot keep up. Raise data.num_workers, or make the "
                  "per-sample transforms cheaper",
                  100 * wait_frac, window_s, static_cast<long long>(c_.integer("data.num_workers")));
    progress_.message(buf);
  }

  /// What the task's loader can hold at once: the batch in use, one being built per worker
  /// and num_workers × prefetch_factor ready (kiln/data/loader.h).
  static int64_t loader_batches_in_flight(const Config& c) {
    const int64_t workers = c.integer("data.num_workers");
    return 1 + workers * (1 + data::LoaderOptions{}.prefetch_factor);
  }

  /// Once per run: live memory grew at every step (train::LeakWatch says who holds it).
  void warn_leak(const train::LeakReport& r) {
    progress_.message("warning: memory leak: " + r.message);
    if (lead_)
      metrics_ << json{{"kind", "warning"}, {"step", L_.step}, {"what", "memory_leak"}, {"message", r.message}}.dump()
               << "\n"
               << std::flush;
  }

  /// The call sites that held the most at the run's highest live memory, for the report's
  /// "memory at peak" table; written when that peak has moved since the last record.
  void record_memory_peak() {
    if (!lead_) return;
    const memory::Snapshot s = memory::peak_snapshot(12);
    if (!s.history || s.total_bytes == peak_recorded_) return;
    peak_recorded_ = s.total_bytes;
    json sites = json::array();
    for (const memory::SiteUsage& u : s.sites)
      sites.push_back({{"site", u.site},
                       {"op", u.op},
                       {"category", memory_category_name(u.category)},
                       {"bytes", u.bytes},
                       {"tensors", u.tensors}});
    metrics_ << json{{"kind", "memory_peak"}, {"step", L_.step}, {"peak_bytes", s.total_bytes}, {"sites", sites}}.dump()
             << "\n"
             << std::flush;
  }

  void eval_and_checkpoint(bool stop_requested, bool stop_now) {
    const auto pause_start = Clock::now();
    if (eval_every_ > 0 && L_.step % eval_every_ == 0 && L_.step < total_ && !stop_requested) run_eval();
    const bool ckpt_due = (ckpt_every_ > 0 && L_.step % ckpt_every_ == 0) || stop_now;
    if (ckpt_due) {
      // The training steps' peak, before the unsharded copies below add theirs.
      record_memory_peak();
      // Every rank reaches this alike (stop_now is agreed on): a sharded optimizer's state is gathered here.
      const Consolidated full = consolidate(L_);
      if (L_.powersgd) L_.powersgd->gather();  // every rank's error feedback (Note [PowerSGD in checkpoints])
      if (lead_) save_checkpoint(L_, full);
      if (L_.powersgd) L_.powersgd->release();
    }
    if (Clock::now() - pause_start > std::chrono::milliseconds(1)) {
      window_start_ += Clock::now() - pause_start;  // throughput and data wait count training time only
      memory::reset_peak_stats();                   // and memory peaks the training steps' (not eval's)
    }
  }

  void run_eval() {
    // Evaluation is rank 0's, on the whole held-out set; with zero3 every rank
    // runs it alike (FSDP's forward gathers each unit from every rank).
    if (!lead_ && !t_.fsdp && !t_.mesh_gpt) return;
    const EvalResult r = evaluate(t_, c_, "test", eval_batches_);
    json e = {{"kind", "eval"}, {"step", L_.step}, {"loss", r.loss}};
    if (lm_)
      e["bits_per_char"] = r.bits_per_char;
    else
      e["accuracy"] = r.accuracy;
    last_eval_ = e;  // every rank's, so that finish() evaluates on all of them or none
    if (!lead_) return;
    metrics_ << e.dump() << "\n" << std::flush;
    progress_.message("step " + std::to_string(L_.step) + "  " + eval_line(r, lm_));
    if (keep_best_) keep_best_->update(L_, e, progress_);
  }

  /// What the profile has to say (its files were written, or why there are none), once.
  void say_profile() {
    if (!profile_) return;
    const std::string m = profile_->take_message();
    if (!m.empty()) progress_.message(m);
  }

  void epoch_done(int64_t epoch) {
    const auto st = t_.train_loader->stats();
    char buf[160];
    std::snprintf(buf, sizeof buf, "epoch %lld done at step %lld: data wait %.1f%% of the epoch's %.1f s",
                  static_cast<long long>(epoch), static_cast<long long>(L_.step), 100 * st.wait_fraction, st.wall_s);
    progress_.message(buf);
  }

  /// The end of the loop: the exit code (3 after a NaN/Inf).
  int finish() {
    progress_.finish();
    if (profile_) {  // before the report, which shows the profile; every rank alike
      profile_->finish();
      say_profile();
    }
    if (status_ == Status::Completed && L_.step < total_) status_ = Status::Stopped;
    if (status_ == Status::Completed && (last_eval_.is_null() || last_eval_["step"] != L_.step)) run_eval();
    const int rc = status_ == Status::NonFinite ? 3 : 0;
    if (lead_) {
      if (compiled_) say_compile();
      record_memory_peak();
      if (L_.step > 0) save_run_adapter(c_, *t_.model, L_.run_dir / "adapter");
      metrics_ << json{{"kind", "end"},
                       {"status", status_name(status_)},
                       {"step", L_.step},
                       {"total_steps", total_},
                       {"time_s", elapsed()}}
                      .dump()
               << "\n"
               << std::flush;  // Note [Run story]
      print_summary(write_summary());
    }
    // mpirun ends the job when a rank exits non-zero: the others wait here until
    // rank 0 has written the summary and report.
    if (world_ > 1) L_.group->barrier()->wait();
    return rc;
  }

  /// train.compile: what the compiled steps did, printed and as a {"kind":"compile"} line.
  void say_compile() {
    const CompileStats& s = compiled_->stats();
    json breaks = json::array();
    for (const GraphBreak& b : s.graph_breaks) breaks.push_back(b.reason + (b.site.empty() ? "" : " at " + b.site));
    metrics_ << json{{"kind", "compile"},
                     {"replays", s.replays},
                     {"eager_calls", s.eager_calls},
                     {"split_calls", s.split_calls},
                     {"captures", s.captures},
                     {"recompiles", s.recompile_reasons},
                     {"compile_s", s.compile_seconds},
                     {"graph_breaks", breaks}}
                    .dump()
             << "\n";
    std::printf("compile: forward and backward of %lld batches replayed, %lld captured (%.0f ms compiling)",
                static_cast<long long>(s.replays), static_cast<long long>(s.captures), 1e3 * s.compile_seconds);
    if (s.split_calls > 0) std::printf(", %lld run split at graph breaks", static_cast<long long>(s.split_calls));
    if (s.eager_calls > 0) std::printf(", %lld run eagerly", static_cast<long long>(s.eager_calls));
    std::printf("\n");
    for (const std::string& r : s.recompile_reasons) std::printf("  recompiled: %s\n", r.c_str());
    // The same break at several places (DDP's hook on every parameter) is printed once, counted.
    std::vector<std::pair<std::string, int>> seen;
    for (const auto& b : breaks) {
      const std::string what = b.get<std::string>();
      auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& p) { return p.first == what; });
      if (it == seen.end())
        seen.emplace_back(what, 1);
      else
        ++it->second;
    }
    for (const auto& [what, n] : seen)
      std::printf("  graph break (those batches ran split there)%s: %s\n",
                  n > 1 ? (" x" + std::to_string(n)).c_str() : "", what.c_str());
  }

  /// summary.json (what the report and `kiln inspect RUN_DIR` read) and the report; returns its "final".
  json write_summary() {
    json final_metrics = json::object();
    if (!last_train_.is_null())
      for (const char* k : {"loss", "lr", "grad_norm", "samples_per_s", "data_wait"}) final_metrics[k] = last_train_[k];
    if (!last_eval_.is_null()) {
      final_metrics["eval_loss"] = last_eval_["loss"];
      for (const char* k : {"accuracy", "bits_per_char"})
        if (last_eval_.contains(k)) final_metrics[k] = last_eval_[k];
    }
    json summary = {{"name", c_.name()},      {"config_path", L_.config_path},
                    {"steps", L_.step},       {"total_steps", total_},
                    {"wall_s", elapsed()},    {"status", status_name(status_)},
                    {"final", final_metrics}, {"flush_denormal", flush_denormal()}};
    write_text(L_.run_dir / "summary.json", summary.dump(2) + "\n");
    write_report(L_.run_dir);
    return final_metrics;
  }

  void print_summary(const json& final_metrics) {
    std::printf("%s at step %lld of %lld in %s", status_name(status_), static_cast<long long>(L_.step),
                static_cast<long long>(total_), format_duration(elapsed()).c_str());
    // An evaluation from before the last step says which step it is from.
    std::string eval_at;
    if (!last_eval_.is_null() && last_eval_["step"].get<int64_t>() != L_.step)
      eval_at = " (at step " + std::to_string(last_eval_["step"].get<int64_t>()) + ")";
    if (final_metrics.contains("accuracy"))
      std::printf(": test accuracy %.2f%%%s", 100 * final_metrics["accuracy"].get<double>(), eval_at.c_str());
    if (final_metrics.contains("bits_per_char"))
      std::printf(": eval loss %.4f, %.3f bits/char%s", final_metrics["eval_loss"].get<double>(),
                  final_metrics["bits_per_char"].get<double>(), eval_at.c_str());
    std::printf("\nreport: %s\n", (L_.run_dir / "report.html").string().c_str());
    if (status_ == Status::Interrupted || status_ == Status::Stopped)
      std::printf("continue with: %s\n", resume_command(L_).c_str());
    std::fflush(stdout);
  }

  Loop& L_;
  const Config& c_;
  Task& t_;
  const bool lm_;
  const int64_t total_, stop_at_, log_every_, eval_every_, ckpt_every_, eval_batches_;
  const double clip_;
  const nn::NamedTensors params_;
  const int world_;
  const int replicas_;  // data-parallel replicas: world_, or a mesh run's dp
  const bool lead_;
  std::ofstream metrics_;  // rank 0's metrics.jsonl
  Progress progress_;
  StopSignals signals_;
  std::optional<autograd::AnomalyModeGuard> anomaly_;
  std::optional<ModuleTrail> trail_;
  std::optional<HealthLog> health_;
  std::optional<StepSkew> skew_;
  json ranks_;  // the window's per-rank step times, for the train line
  // The throughput window: since the last train line, training time only.
  Clock::time_point t_start_, window_start_;
  double window_wait_ = 0, steps_per_s_ = 0;
  int64_t window_samples_ = 0;
  int64_t window_steps_ = 0, window_comm_bytes_ = 0;  // steps in the window and what they communicated
  bool stall_warned_ = false;
  Status status_ = Status::Completed;
  std::optional<Bf16ProductPath> bf16_path_;  // amp = "bf16" on the lead rank: where its products ran
  json last_train_, last_eval_;
  std::optional<KeepBest> keep_best_;
  std::vector<StepValues> unlogged_;       // the steps since the last train line (Note [Run story])
  parallel::PipelineStepResult pipeline_;  // a mesh run's last step
  // The loader's prefetch queue fills by a batch per step for a while; that is not a leak.
  train::LeakWatch leak_{{.print = false, .data_in_flight = loader_batches_in_flight(c_)}};
  std::optional<ProfileRun> profile_;         // [profile] steps
  std::optional<CompiledFunction> compiled_;  // train.compile: forward and backward (Note [Compiled steps])
  int64_t health_every_ = 0;                  // train.health's sampling period on every rank (0: off)
  int64_t peak_recorded_ = -1;
  // train.grad_accum_steps: batches per optimizer step, and the micro-batches of the current one.
  const int64_t accum_ = c_.integer("train.grad_accum_steps");
  int64_t micro_ = 0;
  double micro_loss_ = 0;
};

int run_loop(Loop& L) { return TrainLoop(L).run(); }

}  // namespace

namespace {

bool is_lead(const dist::ProcessGroupPtr& group) { return !group || group->rank() == 0; }
bool is_parallel(const dist::ProcessGroupPtr& group) { return group && group->size() > 1; }

train::CheckpointManager checkpoint_manager(const fs::path& dir, const Config& config) {
  return train::CheckpointManager(
      dir, {.keep_last = static_cast<int>(std::max<int64_t>(1, config.integer("train.keep_last")))});
}

/// Rank 0's `s` on every rank.
std::string broadcast_string(dist::ProcessGroup& group, const std::string& s) {
  Tensor n = tensor<int64_t>({static_cast<int64_t>(s.size())});
  group.broadcast(n)->wait();
  const int64_t len = n.item<int64_t>();
  if (len == 0) return {};
  std::vector<int64_t> codes(static_cast<size_t>(len), 0);
  if (group.rank() == 0)
    for (size_t i = 0; i < s.size(); ++i) codes[i] = static_cast<unsigned char>(s[i]);
  Tensor chars = tensor<int64_t>(codes);
  group.broadcast(chars)->wait();
  std::string out(static_cast<size_t>(len), '\0');
  const int64_t* p = chars.data_ptr<int64_t>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(p[i]);
  return out;
}

}  // namespace

int train(const Config& config, const fs::path& run_dir, const std::string& config_path, dist::ProcessGroupPtr group) {
  const bool lead = is_lead(group);
  g_quiet = !lead;
  if (lead && (fs::exists(run_dir / "metrics.jsonl") || fs::exists(run_dir / "checkpoints"))) {
    const int world = group ? group->size() : 1;
    const std::string resume =
        world > 1 ? "kiln launch -n " + std::to_string(world) + " -- kiln resume " : "kiln resume ";
    throw ConfigError(run_dir.string() + " already holds a run; continue it with `" + resume + run_dir.string() +
                      "`, or pass another --out DIR");
  }
  // A malformed [profile] steps is refused before anything is built or written.
  parse_profile_steps(config.string("profile.steps"), config.origin("profile.steps"));
  // Memory history from before the model is built, so parameters have their call sites.
  memory::record_history(true);
  // Built before the run directory exists: a config or data problem leaves nothing behind.
  Loop L{config, run_dir, config_path, build_task(config, Purpose::Train, group), std::nullopt, group,
         0,      0,       RunFacts{}};
  L.facts.world_size = group ? group->size() : 1;
  L.facts.threads = get_num_threads();
  make_powersgd_checkpoint(L, false);
  if (lead) {
    fs::create_directories(run_dir);
    write_text(run_dir / "config.toml", config.to_toml());
    L.ckpts.emplace(checkpoint_manager(run_dir / "checkpoints", config));
    std::ofstream(run_dir / "metrics.jsonl", std::ios::trunc).close();
  }
  return run_loop(L);
}

namespace {

/// The checkpoint to resume from, or a ConfigError naming every file there and why it is unusable.
fs::path checkpoint_to_resume(const fs::path& run_dir) {
  if (!fs::is_directory(run_dir)) throw ConfigError(run_dir.string() + ": no such run directory");
  const fs::path ckdir = run_dir / "checkpoints";
  if (!fs::is_directory(ckdir))
    throw ConfigError(run_dir.string() + ": no checkpoints/ directory, nothing to resume from");
  train::CheckpointManager mgr(ckdir);
  if (auto found = mgr.latest()) return *found;
  const auto files = mgr.list();
  if (files.empty())
    throw ConfigError(run_dir.string() +
                      ": no checkpoint under checkpoints/ (the run stopped before its first one), "
                      "nothing to resume from");
  std::string msg = run_dir.string() + ": no usable checkpoint under checkpoints/:";
  for (const auto& f : files) msg += "\n  " + f.filename().string() + ": " + checkpoint_problem(f);
  throw ConfigError(msg +
                    "\nhint: a file cut short by a full disk or a copy cannot be repaired; start again with "
                    "`kiln train`");
}

/// The facts (world size, threads) a checkpoint recorded, if it recorded them.
std::optional<RunFacts> facts_of(const io::Metadata& md) {
  auto w = md.find("state.run.world_size"), th = md.find("state.run.threads");
  if (w == md.end() || th == md.end()) return std::nullopt;
  RunFacts f;
  try {
    // Stateful integers are stored as "i:<value>" (checkpoint.cpp's encoding); accept a bare number too.
    auto num = [](const std::string& v) { return std::stoll(v.rfind("i:", 0) == 0 ? v.substr(2) : v); };
    f.world_size = num(w->second);
    f.threads = num(th->second);
  } catch (const std::exception&) {
    return std::nullopt;  // load_checkpoint reports a malformed value
  }
  return f;
}

/// Refuses (or, when allowed, warns about) a resume whose process count differs
/// from the checkpoint's: the future would not be the uninterrupted run's.
void check_facts(const RunFacts& then, const RunFacts& now, const fs::path& run_dir, const fs::path& ckpt,
                 const ResumeOptions& o) {
  const std::string run = run_dir.string();
  if (then.world_size != now.world_size) {
    const std::string same = then.world_size > 1
                                 ? "kiln launch -n " + std::to_string(then.world_size) + " -- kiln resume " + run
                                 : "kiln resume " + run + " (one process, without kiln launch or mpirun)";
    const std::string what = run + " was trained on " + std::to_string(then.world_size) + " process(es) (" +
                             ckpt.filename().string() + "); resuming on " + std::to_string(now.world_size) +
                             " would change its future: each rank's share of the data and the batches' "
                             "composition depend on the process count";
    if (!o.allow_world_size_change)
      throw ConfigError(what + ". Resume with `" + same +
                        "` for the identical future, or pass "
                        "--allow-world-size-change to continue on " +
                        std::to_string(now.world_size) + " anyway");
    std::fprintf(stderr,
                 "kiln: warning: %s; continuing (--allow-world-size-change): the run no longer reproduces "
                 "an uninterrupted one\n",
                 what.c_str());
  }
  // Not refused: kiln's parallel loops and reductions are meant to give the same bits at any
  // thread count in practice (measured: MLP, ResNet and GPT runs at 1, 2, 5 and 7 threads agree
  // bit for bit), but only the same count is guaranteed (DESIGN.md §2), so it is said.
  if (then.threads != now.threads)
    std::fprintf(stderr,
                 "kiln: note: %s was trained with %lld thread(s) per process, this resume uses %lld; bitwise "
                 "reproduction of an uninterrupted run is guaranteed only with the same count (OMP_NUM_THREADS=%lld "
                 "or --set threads=%lld)\n",
                 run.c_str(), static_cast<long long>(then.threads), static_cast<long long>(now.threads),
                 static_cast<long long>(then.threads), static_cast<long long>(then.threads));
}

std::string refusal(const std::string& origin, const std::string& key, const std::string& why,
                    const std::string& saved_value, const fs::path& ckpt) {
  return origin + ": '" + key + "' cannot change when a run resumes (" + why + "; it is " +
         (saved_value.empty() ? std::string("not set") : saved_value) + " in " + ckpt.filename().string() + ")";
}

void throw_if_refused(const std::vector<std::string>& refused) {
  if (refused.size() == 1) throw ConfigError(refused[0] + "; start a new run with `kiln train` to use it");
  if (refused.empty()) return;
  std::string msg = std::to_string(refused.size()) + " settings cannot change when a run resumes:";
  for (const auto& r : refused) msg += "\n  " + r;
  throw ConfigError(msg + "\nstart a new run with `kiln train` to use them");
}

struct Changes {
  std::vector<std::string> lines;  // "optim.lr 0.003 -> 0.5"
  bool replay = false;             // an optimizer hyperparameter or the schedule changed
};

/// Compares the checkpoint's config with the one resumed with: every changed
/// key either takes effect (Config::on_resume) or is refused, all refusals in one message.
Changes compare_configs(const Config& then, const Config& now, const fs::path& ckpt) {
  std::vector<std::string> keys = then.keys();
  for (const auto& k : now.keys())
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  Changes ch;
  std::vector<std::string> refused;
  for (const auto& k : keys) {
    if (k == "train.max_steps") continue;  // cleared on every resume: where this process stops
    const std::string a = then.value_text(k), b = now.value_text(k);
    if (a == b) continue;
    std::string why;
    const OnResume rule = Config::on_resume(k, &why);
    if (rule == OnResume::Refused) {
      refused.push_back(refusal(now.origin(k), k, why, a, ckpt));
      continue;
    }
    ch.replay = ch.replay || rule == OnResume::Optimizer || rule == OnResume::Schedule;
    ch.lines.push_back(k + " " + (a.empty() ? "(unset)" : a) + " -> " + (b.empty() ? "(unset)" : b));
  }
  throw_if_refused(refused);
  return ch;
}

}  // namespace

int resume(const fs::path& run_dir, const ResumeOptions& o, dist::ProcessGroupPtr group) {
  const bool lead = is_lead(group);
  g_quiet = !lead;
  const fs::path ckdir = run_dir / "checkpoints";
  // Rank 0 chooses the checkpoint (every rank reads the run directory: for a
  // multi-machine job it lies on a shared file system).
  std::string latest;
  if (lead) latest = checkpoint_to_resume(run_dir).string();
  if (is_parallel(group)) latest = broadcast_string(*group, latest);
  // The checkpoint's own config, so the rebuilt objects are the ones it was saved from.
  const auto header = io::read_safetensors_header(latest);
  auto it = header.metadata.find("config");
  const Config saved = it != header.metadata.end() && !it->second.empty()
                           ? Config::from_string(it->second, latest + " (its config)")
                           : Config::from_file(run_dir / "config.toml");
  // A refused key is named before its value is applied: applying it may itself fail
  // (--set optim.name=sgd meets the checkpoint's Adam keys) with a less useful message.
  std::vector<std::string> refused;
  for (const auto& a : o.sets) {
    const std::string key = a.substr(0, a.find('='));
    std::string why;
    if (Config::on_resume(key, &why) != OnResume::Refused) continue;
    bool same = false;
    try {
      Config probe = saved;
      probe.set(a);
      same = probe.value_text(key) == saved.value_text(key);
    } catch (const ConfigError&) {
    }
    if (!same) refused.push_back(refusal("--set " + a, key, why, saved.value_text(key), latest));
  }
  throw_if_refused(refused);
  Config config = saved;
  std::vector<std::string> sets{"train.max_steps=0"};
  sets.insert(sets.end(), o.sets.begin(), o.sets.end());
  config.set_all(sets);
  const Changes changes = compare_configs(saved, config, latest);
  const auto then = facts_of(header.metadata);
  RunFacts now;
  now.world_size = group ? group->size() : 1;
  now.threads = config.integer("threads") > 0 ? config.integer("threads") : get_num_threads();
  if (lead && then) check_facts(*then, now, run_dir, latest, o);

  std::string config_path = (run_dir / "config.toml").string();
  if (auto in = std::ifstream(run_dir / "summary.json")) {
    json s = json::parse(in, nullptr, false);
    if (!s.is_discarded() && s.contains("config_path")) config_path = s["config_path"].get<std::string>();
  }
  memory::record_history(true);  // as in train()
  Loop L{config, run_dir, config_path, build_task(config, Purpose::Train, group), std::nullopt, group,
         0,      0,       RunFacts{}};
  L.facts = now;
  RunFacts loaded;  // what the file holds; `now` is what later checkpoints record
  // A sharded run loads the checkpoint's unsharded optimizer state (and with
  // zero3 model), then takes its shard of it.
  std::shared_ptr<nn::Module> full_model =
      L.task.fsdp || L.task.mesh_gpt ? make_unsharded_model(config, L.task) : nullptr;
  std::unique_ptr<optim::Optimizer> full = L.task.zero || L.task.fsdp || L.task.mesh_gpt
                                               ? make_optimizer(config, full_model ? *full_model : *L.task.model)
                                               : nullptr;
  train::CheckpointRefs refs = checkpoint_refs(L, /*with_facts=*/false, full.get(), full_model.get());
  if (then) refs.objects["run"] = &loaded;
  // The object's scalars sit in the metadata, as the run facts' do (facts_of): "iter" is always among them.
  const bool has_powersgd = header.metadata.count("state.powersgd.iter") > 0;
  make_powersgd_checkpoint(L, has_powersgd);
  if (has_powersgd) refs.objects["powersgd"] = L.powersgd.get();
  // A changed schedule is recomputed (replay_schedule), so the file's scheduler state is not loaded.
  if (changes.replay) refs.scheduler = nullptr;
  train::CheckpointInfo info;
  if (lead) {
    L.ckpts.emplace(checkpoint_manager(ckdir, config));
    info = L.ckpts->load_latest(refs);  // verified, or the newest that verifies (it says so)
  }
  if (is_parallel(group)) {
    // The step rank 0 loaded names the file every other rank loads.
    Tensor step = tensor<int64_t>({info.step});
    group->broadcast(step)->wait();
    if (!lead) {
      char name[64];
      std::snprintf(name, sizeof name, "ckpt-%08lld.safetensors", static_cast<long long>(step.item<int64_t>()));
      info = train::load_checkpoint((ckdir / name).string(), refs);
    }
  }
  if (L.task.mesh_gpt) {
    // This rank's stage and tp shard of the whole GPT and of its optimizer state.
    L.task.mesh_gpt->load_full_state_dict(full_model->state_dict());
    const optim::OptimizerStateDict whole = full->state_dict();
    if (L.task.zero) {
      load_optimizer_shard(L.task, {whole.param_groups, L.task.mesh_gpt->local_optim_state(whole.state)});
    } else {
      optim::OptimizerStateDict sd = L.task.optimizer->state_dict();
      sd.state = L.task.mesh_gpt->local_optim_state(whole.state);
      KILN_ASSERT(sd.param_groups.size() == whole.param_groups.size());
      for (size_t g = 0; g < sd.param_groups.size(); ++g) sd.param_groups[g].options = whole.param_groups[g].options;
      L.task.optimizer->load_state_dict(sd);
    }
  } else if (L.task.fsdp) {
    L.task.fsdp->load_full_state_dict(full_model->state_dict());
    L.task.fsdp->load_full_optim_state_dict(*L.task.optimizer, full->state_dict());
  } else if (full) {
    load_optimizer_shard(L.task, full->state_dict());
  }
  L.step = info.step;
  L.resumed = true;
  const std::string powersgd_said = L.powersgd ? L.powersgd->apply() : "";
  if (info.loader) L.task.train_loader->load_state(*info.loader);
  if (changes.replay) replay_schedule(L.task, config, L.step);
  if (lead) {
    L.time_offset = truncate_metrics(run_dir / "metrics.jsonl", L.step);
    std::printf("resuming %s from step %lld\n", run_dir.string().c_str(), static_cast<long long>(L.step));
    if (!powersgd_said.empty()) std::printf("%s\n", powersgd_said.c_str());
    if (!changes.lines.empty()) {
      std::string list;
      for (const auto& l : changes.lines) list += (list.empty() ? "" : ", ") + l;
      std::printf("changed on resume: %s%s\n", list.c_str(),
                  changes.replay ? " (the optimizer's hyperparameters and the learning-rate schedule are those of a "
                                   "run started with these settings, from this step on)"
                                 : "");
      write_text(run_dir / "config.toml", config.to_toml());  // the config the next checkpoints carry
    }
  }
  return run_loop(L);
}

}  // namespace kiln::cli
