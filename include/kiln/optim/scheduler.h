// Learning-rate schedulers (torch.optim.lr_scheduler, 1.13 semantics): each
// step() sets every param group's "lr" by torch's chainable recurrence (its
// closed form where torch uses one), so lr trajectories match torch's doubles.
//
//   optim::AdamW opt(params, {.lr = 1e-3});
//   auto warmup = std::make_shared<optim::LinearLR>(opt, optim::LinearLROptions{.start_factor = 0.1, .total_iters =
//   10}); auto cosine = std::make_shared<optim::CosineAnnealingLR>(opt, optim::CosineAnnealingLROptions{.T_max = 90});
//   optim::SequentialLR sched(opt, {warmup, cosine}, {10});
//   for (...) { ...; opt.step(); sched.step(); }
//
// Calling scheduler.step() before the first optimizer.step() prints torch's
// warning to stderr (once: it is only checked on a scheduler's first step).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/optim/optimizer.h"

namespace kiln::optim {

/// A scheduler's counters and learning rates, and the settings that define its
/// schedule. The configuration itself comes from the constructor: load_state_dict
/// refuses a state whose type or settings differ from the scheduler's, naming the
/// setting and both values.
struct SchedulerState {
  int64_t last_epoch = 0;
  int64_t step_count = 0;
  std::vector<double> base_lrs;
  std::vector<double> last_lr;
  HyperParams extra;                     // ReduceLROnPlateau: best, num_bad_epochs, cooldown_counter
  std::vector<SchedulerState> children;  // SequentialLR: its schedulers
  /// "CosineAnnealingLR", ...; empty in states saved before kiln recorded it (then not checked).
  std::string type;
  /// The options that shape the schedule by torch's names (T_max, eta_min, total_iters,
  /// milestones as "milestones.<i>" plus their count, strings as an index: anneal_strategy
  /// cos=0 linear=1). Empty in older states: then nothing is checked.
  HyperParams settings;
};

/// Every difference between the type and settings `saved` was made with and
/// `now`'s, recursively through chained schedulers ("<what>: T_max is 100 in the
/// saved state, 50 in this scheduler"); empty when they agree or `saved` has none.
std::vector<std::string> schedule_mismatches(const SchedulerState& saved, const SchedulerState& now,
                                             const std::string& what);

/// Lifetime: a scheduler refers to its optimizer (it does not own it); the
/// optimizer must outlive the scheduler and must not be moved after the
/// scheduler is built.
class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  virtual void step();
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  Optimizer& optimizer() const { return opt_; }

  virtual SchedulerState state_dict() const;
  /// Throws ValueError when the group count, the type or a schedule setting
  /// (see SchedulerState::settings) differs from this scheduler's.
  virtual void load_state_dict(const SchedulerState& s);
  /// "StepLR", "CosineAnnealingLR", ... (what state_dict() records as its type).
  virtual const char* type_name() const { return "LRScheduler"; }

 protected:
  /// The options that define the schedule (none by default: LambdaLR's lambdas cannot be compared).
  virtual HyperParams settings() const { return {}; }
  /// Throws ValueError naming every mismatch of schedule_mismatches(s, state_dict()).
  void check_schedule(const SchedulerState& s) const;
  /// Sets each group's "initial_lr" (if absent) and base_lrs from it.
  explicit LRScheduler(Optimizer& opt);
  /// torch's _initial_step: resets the step counters and steps once. Derived constructors call it last.
  void initial_step();
  /// torch's step(epoch): sets last_epoch and applies the closed form (SequentialLR's milestones).
  void step_to(int64_t epoch);
  virtual std::vector<double> get_lr() = 0;
  virtual bool has_closed_form() const { return false; }
  virtual std::vector<double> closed_form_lr() { return get_lr(); }
  std::vector<double> group_lrs() const;
  void apply(const std::vector<double>& lrs);
  void count_step_and_warn();

  Optimizer& opt_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;
  int64_t opt_steps_at_init_ = 0;

  friend class SequentialLR;
};

struct StepLROptions {
  int64_t step_size = 1;
  double gamma = 0.1;
};
/// lr = base_lr * gamma^(epoch / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, StepLROptions o);
  const char* type_name() const override { return "StepLR"; }

 protected:
  std::vector<double> get_lr() override;
  bool has_closed_form() const override { return true; }
  std::vector<double> closed_form_lr() override;
  HyperParams settings() const override;
  StepLROptions o_;
};

struct MultiStepLROptions {
  std::vector<int64_t> milestones;
  double gamma = 0.1;
};
/// lr = base_lr * gamma^(number of milestones <= epoch) (repeated milestones count repeatedly).
class MultiStepLR : public LRScheduler {
 public:
  MultiStepLR(Optimizer& opt, MultiStepLROptions o);
  const char* type_name() const override { return "MultiStepLR"; }

 protected:
  std::vector<double> get_lr() override;
  bool has_closed_form() const override { return true; }
  std::vector<double> closed_form_lr() override;
  HyperParams settings() const override;
  MultiStepLROptions o_;
};

struct ExponentialLROptions {
  double gamma = 0.1;
};
class ExponentialLR : public LRScheduler {
 public:
  ExponentialLR(Optimizer& opt, ExponentialLROptions o);
  const char* type_name() const override { return "ExponentialLR"; }

 protected:
  std::vector<double> get_lr() override;
  bool has_closed_form() const override { return true; }
  std::vector<double> closed_form_lr() override;
  HyperParams settings() const override;
  ExponentialLROptions o_;
};

struct CosineAnnealingLROptions {
  int64_t T_max = 1;
  double eta_min = 0;
};
/// SGDR without restarts: eta_min + (base_lr - eta_min)(1 + cos(pi t / T_max)) / 2, by torch's recurrence.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, CosineAnnealingLROptions o);
  const char* type_name() const override { return "CosineAnnealingLR"; }

 protected:
  std::vector<double> get_lr() override;
  bool has_closed_form() const override { return true; }
  std::vector<double> closed_form_lr() override;
  HyperParams settings() const override;
  CosineAnnealingLROptions o_;
};

struct LinearLROptions {
  double start_factor = 1.0 / 3;
  double end_factor = 1.0;
  int64_t total_iters = 5;
};
/// Multiplies lr by a factor going linearly from start_factor to end_factor over total_iters steps.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, LinearLROptions o);
  const char* type_name() const override { return "LinearLR"; }

 protected:
  std::vector<double> get_lr() override;
  bool has_closed_form() const override { return true; }
  std::vector<double> closed_form_lr() override;
  HyperParams settings() const override;
  LinearLROptions o_;
};

/// lr = base_lr * lambda(epoch), one lambda for all groups or one per group.
class LambdaLR : public LRScheduler {
 public:
  using Lambda = std::function<double(int64_t)>;
  LambdaLR(Optimizer& opt, Lambda lr_lambda);
  LambdaLR(Optimizer& opt, std::vector<Lambda> lr_lambdas);
  const char* type_name() const override { return "LambdaLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::vector<Lambda> lambdas_;
};

/// Runs schedulers[i] from milestones[i-1] on (e.g. LinearLR warmup then CosineAnnealingLR);
/// at a milestone the next scheduler restarts from its epoch 0 (closed form).
class SequentialLR : public LRScheduler {
 public:
  SequentialLR(Optimizer& opt, std::vector<std::shared_ptr<LRScheduler>> schedulers, std::vector<int64_t> milestones);
  void step() override;
  SchedulerState state_dict() const override;
  void load_state_dict(const SchedulerState& s) override;
  const char* type_name() const override { return "SequentialLR"; }

 protected:
  std::vector<double> get_lr() override { return group_lrs(); }
  HyperParams settings() const override;
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

struct OneCycleLROptions {
  double max_lr = 0;
  int64_t total_steps = 0;  // or epochs * steps_per_epoch
  int64_t epochs = 0;
  int64_t steps_per_epoch = 0;
  double pct_start = 0.3;
  std::string anneal_strategy = "cos";  // or "linear"
  bool cycle_momentum = true;           // cycles "momentum" (SGD, RMSprop) or "beta1" (Adam, AdamW)
  double base_momentum = 0.85;
  double max_momentum = 0.95;
  double div_factor = 25;
  double final_div_factor = 1e4;
  bool three_phase = false;
};
/// The 1cycle policy; stepping past total_steps throws ValueError as torch does.
class OneCycleLR : public LRScheduler {
 public:
  OneCycleLR(Optimizer& opt, OneCycleLROptions o);
  const char* type_name() const override { return "OneCycleLR"; }

 protected:
  std::vector<double> get_lr() override;
  HyperParams settings() const override;
  double anneal(double start, double end, double pct) const;
  struct Phase {
    double end_step;
    const char *start_lr, *end_lr, *start_momentum, *end_momentum;
  };
  OneCycleLROptions o_;
  std::vector<Phase> phases_;
  std::string momentum_key_;
};

struct ReduceLROnPlateauOptions {
  std::string mode = "min";  // or "max"
  double factor = 0.1;
  int64_t patience = 10;
  double threshold = 1e-4;
  std::string threshold_mode = "rel";  // or "abs"
  int64_t cooldown = 0;
  double min_lr = 0;
  double eps = 1e-8;
};
/// Multiplies lr by `factor` when the metric passed to step() stops improving for `patience` steps.
class ReduceLROnPlateau {
 public:
  ReduceLROnPlateau(Optimizer& opt, ReduceLROnPlateauOptions o = {});
  void step(double metric);
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  double best() const { return best_; }
  int64_t num_bad_epochs() const { return num_bad_epochs_; }
  SchedulerState state_dict() const;
  void load_state_dict(const SchedulerState& s);

 private:
  bool is_better(double a, double best) const;
  HyperParams settings() const;
  Optimizer& opt_;
  ReduceLROnPlateauOptions o_;
  double best_;
  int64_t num_bad_epochs_ = 0;
  int64_t cooldown_counter_ = 0;
  int64_t last_epoch_ = 0;
  std::vector<double> last_lr_;
};

}  // namespace kiln::optim
