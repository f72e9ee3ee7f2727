// Learning-rate schedulers with torch 1.13's recurrences and closed forms
// (torch/optim/lr_scheduler.py), operation for operation so the doubles agree.
#include "kiln/optim/scheduler.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iostream>
#include <numbers>

#include "kiln/core/error.h"

namespace kiln::optim {

namespace {
constexpr double kPi = std::numbers::pi;
int64_t py_mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }
int64_t py_floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
// Shortest text that reads back as `v`: 0.1 stays "0.1", 100 prints as "100".
std::string shortest(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
void put_list(HyperParams& s, const std::string& name, const std::vector<int64_t>& v) {
  s[name] = static_cast<double>(v.size());
  for (size_t i = 0; i < v.size(); ++i) s[name + "." + std::to_string(i)] = static_cast<double>(v[i]);
}
}  // namespace

std::vector<std::string> schedule_mismatches(const SchedulerState& saved, const SchedulerState& now,
                                             const std::string& what) {
  std::vector<std::string> out;
  if (!saved.type.empty() && !now.type.empty() && saved.type != now.type) {
    out.push_back(what + ": the saved state is of a " + saved.type + ", this scheduler is a " + now.type);
    return out;  // another scheduler's settings would only add noise
  }
  // A key only one side has is a mismatch too (e.g. a different milestone count).
  auto show = [](const HyperParams& s, const std::string& k) {
    auto it = s.find(k);
    return it == s.end() ? std::string("absent") : shortest(it->second);
  };
  if (!saved.settings.empty()) {
    std::vector<std::string> keys;
    for (const auto& [k, v] : saved.settings) keys.push_back(k);
    for (const auto& [k, v] : now.settings)
      if (!saved.settings.count(k)) keys.push_back(k);
    for (const auto& k : keys) {
      auto a = saved.settings.find(k), b = now.settings.find(k);
      if (a != saved.settings.end() && b != now.settings.end() && a->second == b->second) continue;
      out.push_back(what + ": " + k + " is " + show(saved.settings, k) + " in the saved state, " +
                    show(now.settings, k) + " in this scheduler");
    }
  }
  if (saved.children.size() == now.children.size())
    for (size_t i = 0; i < saved.children.size(); ++i)
      for (auto& m : schedule_mismatches(saved.children[i], now.children[i], what + " " + std::to_string(i)))
        out.push_back(std::move(m));
  return out;
}

// ---- base ----

LRScheduler::LRScheduler(Optimizer& opt) : opt_(opt) {
  for (auto& g : opt_.param_groups()) {
    g.options.emplace("initial_lr", g.options.at("lr"));
    base_lrs_.push_back(g.options.at("initial_lr"));
  }
}

void LRScheduler::initial_step() {
  opt_steps_at_init_ = opt_.step_count();
  step_count_ = 0;
  step();
}

std::vector<double> LRScheduler::group_lrs() const {
  std::vector<double> v;
  for (const auto& g : opt_.param_groups()) v.push_back(g.options.at("lr"));
  return v;
}

void LRScheduler::apply(const std::vector<double>& lrs) {
  auto& groups = opt_.param_groups();
  KILN_CHECK(lrs.size() == groups.size(), ValueError, "LR scheduler: expected ", groups.size(),
             " param groups (as when the scheduler was made), got ", lrs.size());
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options["lr"] = lrs[i];
  last_lr_ = group_lrs();
}

void LRScheduler::count_step_and_warn() {
  if (step_count_ == 1 && opt_.step_count() - opt_steps_at_init_ < 1) {
    std::cerr << "kiln warning: Detected call of `lr_scheduler.step()` before `optimizer.step()`. "
                 "In PyTorch 1.1.0 and later, you should call them in the opposite order: `optimizer.step()` "
                 "before `lr_scheduler.step()`.  Failure to do this will result in PyTorch skipping the first "
                 "value of the learning rate schedule.\n";
  }
  ++step_count_;
}

void LRScheduler::step() {
  count_step_and_warn();
  last_epoch_ += 1;
  apply(get_lr());
}

void LRScheduler::step_to(int64_t epoch) {
  count_step_and_warn();
  last_epoch_ = epoch;
  apply(has_closed_form() ? closed_form_lr() : get_lr());
}

SchedulerState LRScheduler::state_dict() const {
  SchedulerState s;
  s.last_epoch = last_epoch_;
  s.step_count = step_count_;
  s.base_lrs = base_lrs_;
  s.last_lr = last_lr_;
  s.type = type_name();
  s.settings = settings();
  return s;
}

void LRScheduler::check_schedule(const SchedulerState& s) const {
  const auto problems = schedule_mismatches(s, state_dict(), type_name());
  std::string msg;
  for (const auto& p : problems) msg += "\n  " + p;
  KILN_CHECK(problems.empty(), ValueError, type_name(),
             " load_state_dict: the state was saved by a scheduler with other settings (nothing was changed):", msg,
             "\n  hint: build the scheduler with the settings of the run that saved it");
}

void LRScheduler::load_state_dict(const SchedulerState& s) {
  KILN_CHECK(s.base_lrs.size() == base_lrs_.size(), ValueError, "LR scheduler load_state_dict: expected ",
             base_lrs_.size(), " base_lrs (one per param group), got ", s.base_lrs.size());
  check_schedule(s);
  last_epoch_ = s.last_epoch;
  step_count_ = s.step_count;
  base_lrs_ = s.base_lrs;
  last_lr_ = s.last_lr;
}

// ---- StepLR / MultiStepLR / ExponentialLR ----

StepLR::StepLR(Optimizer& opt, StepLROptions o) : LRScheduler(opt), o_(o) {
  KILN_CHECK(o.step_size > 0, ValueError, "StepLR: expected step_size > 0, got ", o.step_size);
  initial_step();
}
std::vector<double> StepLR::get_lr() {
  auto lrs = group_lrs();
  if (last_epoch_ == 0 || py_mod(last_epoch_, o_.step_size) != 0) return lrs;
  for (auto& lr : lrs) lr = lr * o_.gamma;
  return lrs;
}
HyperParams StepLR::settings() const { return {{"step_size", static_cast<double>(o_.step_size)}, {"gamma", o_.gamma}}; }
std::vector<double> StepLR::closed_form_lr() {
  std::vector<double> v;
  for (double b : base_lrs_)
    v.push_back(b * std::pow(o_.gamma, static_cast<double>(py_floordiv(last_epoch_, o_.step_size))));
  return v;
}

MultiStepLR::MultiStepLR(Optimizer& opt, MultiStepLROptions o) : LRScheduler(opt), o_(std::move(o)) {
  std::sort(o_.milestones.begin(), o_.milestones.end());
  initial_step();
}
std::vector<double> MultiStepLR::get_lr() {
  auto lrs = group_lrs();
  const auto n = std::count(o_.milestones.begin(), o_.milestones.end(), last_epoch_);
  if (n == 0) return lrs;
  for (auto& lr : lrs) lr = lr * std::pow(o_.gamma, static_cast<double>(n));
  return lrs;
}
HyperParams MultiStepLR::settings() const {
  HyperParams s{{"gamma", o_.gamma}};
  put_list(s, "milestones", o_.milestones);
  return s;
}
std::vector<double> MultiStepLR::closed_form_lr() {
  const auto n = std::upper_bound(o_.milestones.begin(), o_.milestones.end(), last_epoch_) - o_.milestones.begin();
  std::vector<double> v;
  for (double b : base_lrs_) v.push_back(b * std::pow(o_.gamma, static_cast<double>(n)));
  return v;
}

ExponentialLR::ExponentialLR(Optimizer& opt, ExponentialLROptions o) : LRScheduler(opt), o_(o) { initial_step(); }
std::vector<double> ExponentialLR::get_lr() {
  auto lrs = group_lrs();
  if (last_epoch_ == 0) return lrs;
  for (auto& lr : lrs) lr = lr * o_.gamma;
  return lrs;
}
HyperParams ExponentialLR::settings() const { return {{"gamma", o_.gamma}}; }
std::vector<double> ExponentialLR::closed_form_lr() {
  std::vector<double> v;
  for (double b : base_lrs_) v.push_back(b * std::pow(o_.gamma, static_cast<double>(last_epoch_)));
  return v;
}

// ---- CosineAnnealingLR ----

CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, CosineAnnealingLROptions o) : LRScheduler(opt), o_(o) {
  KILN_CHECK(o.T_max > 0, ValueError, "CosineAnnealingLR: expected T_max > 0, got ", o.T_max);
  initial_step();
}
std::vector<double> CosineAnnealingLR::get_lr() {
  auto lrs = group_lrs();
  const double T = static_cast<double>(o_.T_max), e = static_cast<double>(last_epoch_), m = o_.eta_min;
  if (last_epoch_ == 0) return lrs;
  if (step_count_ == 1 && last_epoch_ > 0) {
    for (size_t i = 0; i < lrs.size(); ++i) lrs[i] = m + (base_lrs_[i] - m) * (1 + std::cos(e * kPi / T)) / 2;
    return lrs;
  }
  if (py_mod(last_epoch_ - 1 - o_.T_max, 2 * o_.T_max) == 0) {
    for (size_t i = 0; i < lrs.size(); ++i) lrs[i] = lrs[i] + (base_lrs_[i] - m) * (1 - std::cos(kPi / T)) / 2;
    return lrs;
  }
  for (auto& lr : lrs) lr = (1 + std::cos(kPi * e / T)) / (1 + std::cos(kPi * (e - 1) / T)) * (lr - m) + m;
  return lrs;
}
HyperParams CosineAnnealingLR::settings() const {
  return {{"T_max", static_cast<double>(o_.T_max)}, {"eta_min", o_.eta_min}};
}
std::vector<double> CosineAnnealingLR::closed_form_lr() {
  const double T = static_cast<double>(o_.T_max), e = static_cast<double>(last_epoch_), m = o_.eta_min;
  std::vector<double> v;
  for (double b : base_lrs_) v.push_back(m + (b - m) * (1 + std::cos(kPi * e / T)) / 2);
  return v;
}

// ---- LinearLR / LambdaLR ----

LinearLR::LinearLR(Optimizer& opt, LinearLROptions o) : LRScheduler(opt), o_(o) {
  KILN_CHECK(o.start_factor >= 0 && o.start_factor <= 1, ValueError, "LinearLR: expected start_factor in [0, 1], got ",
             o.start_factor);
  KILN_CHECK(o.end_factor >= 0 && o.end_factor <= 1, ValueError, "LinearLR: expected end_factor in [0, 1], got ",
             o.end_factor);
  KILN_CHECK(o.total_iters > 0, ValueError, "LinearLR: expected total_iters > 0, got ", o.total_iters);
  initial_step();
}
std::vector<double> LinearLR::get_lr() {
  auto lrs = group_lrs();
  const double s = o_.start_factor, f = o_.end_factor;
  if (last_epoch_ == 0) {
    for (auto& lr : lrs) lr = lr * s;
    return lrs;
  }
  if (last_epoch_ > o_.total_iters) return lrs;
  for (auto& lr : lrs)
    lr = lr *
         (1. + (f - s) / (static_cast<double>(o_.total_iters) * s + static_cast<double>(last_epoch_ - 1) * (f - s)));
  return lrs;
}
HyperParams LinearLR::settings() const {
  return {{"start_factor", o_.start_factor},
          {"end_factor", o_.end_factor},
          {"total_iters", static_cast<double>(o_.total_iters)}};
}
std::vector<double> LinearLR::closed_form_lr() {
  const double s = o_.start_factor, f = o_.end_factor;
  std::vector<double> v;
  for (double b : base_lrs_)
    v.push_back(b * (s + (f - s) * static_cast<double>(std::min(o_.total_iters, last_epoch_)) /
                             static_cast<double>(o_.total_iters)));
  return v;
}

LambdaLR::LambdaLR(Optimizer& opt, Lambda lr_lambda)
    : LambdaLR(opt, std::vector<Lambda>(opt.param_groups().size(), lr_lambda)) {}
LambdaLR::LambdaLR(Optimizer& opt, std::vector<Lambda> lr_lambdas) : LRScheduler(opt), lambdas_(std::move(lr_lambdas)) {
  KILN_CHECK(lambdas_.size() == opt.param_groups().size(), ValueError, "LambdaLR: expected ", opt.param_groups().size(),
             " lr_lambdas (one per param group), got ", lambdas_.size());
  initial_step();
}
std::vector<double> LambdaLR::get_lr() {
  std::vector<double> v;
  for (size_t i = 0; i < base_lrs_.size(); ++i) v.push_back(base_lrs_[i] * lambdas_[i](last_epoch_));
  return v;
}

// ---- SequentialLR ----

SequentialLR::SequentialLR(Optimizer& opt, std::vector<std::shared_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones)
    : LRScheduler(opt), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  KILN_CHECK(!schedulers_.empty(), ValueError, "SequentialLR: expected at least one scheduler, got none");
  for (size_t i = 0; i < schedulers_.size(); ++i)
    KILN_CHECK(schedulers_[i] && &schedulers_[i]->opt_ == &opt_, ValueError,
               "SequentialLR: expected every scheduler to belong to the same optimizer, but the scheduler at index ", i,
               " does not");
  KILN_CHECK(milestones_.size() + 1 == schedulers_.size(), ValueError,
             "SequentialLR: expected one milestone fewer than schedulers, got ", schedulers_.size(), " schedulers and ",
             milestones_.size(), " milestones");
  last_epoch_ = 0;
  for (auto& g : opt_.param_groups()) g.options["lr"] = g.options.at("initial_lr");
  for (auto& s : schedulers_) s->last_epoch_ -= 1;
  schedulers_[0]->initial_step();
  last_lr_ = schedulers_[0]->get_last_lr();
}

void SequentialLR::step() {
  last_epoch_ += 1;
  const size_t idx = std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  auto& s = schedulers_[idx];
  if (idx > 0 && milestones_[idx - 1] == last_epoch_)
    s->step_to(0);
  else
    s->step();
  last_lr_ = s->get_last_lr();
}

SchedulerState SequentialLR::state_dict() const {
  SchedulerState st = LRScheduler::state_dict();
  for (const auto& s : schedulers_) st.children.push_back(s->state_dict());
  return st;
}

HyperParams SequentialLR::settings() const {
  HyperParams s;
  put_list(s, "milestones", milestones_);
  return s;
}

void SequentialLR::load_state_dict(const SchedulerState& st) {
  KILN_CHECK(st.children.size() == schedulers_.size(), ValueError, "SequentialLR load_state_dict: expected ",
             schedulers_.size(), " scheduler states, got ", st.children.size());
  check_schedule(st);  // the chained schedulers too, before any of them changes
  LRScheduler::load_state_dict(st);
  for (size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(st.children[i]);
}

// ---- OneCycleLR ----

OneCycleLR::OneCycleLR(Optimizer& opt, OneCycleLROptions o) : LRScheduler(opt), o_(std::move(o)) {
  if (o_.total_steps == 0) {
    KILN_CHECK(o_.epochs > 0 && o_.steps_per_epoch > 0, ValueError,
               "OneCycleLR: expected total_steps > 0 or epochs > 0 and steps_per_epoch > 0, got total_steps=",
               o_.total_steps, ", epochs=", o_.epochs, ", steps_per_epoch=", o_.steps_per_epoch);
    o_.total_steps = o_.epochs * o_.steps_per_epoch;
  }
  KILN_CHECK(o_.total_steps > 0, ValueError, "OneCycleLR: expected total_steps > 0, got ", o_.total_steps);
  KILN_CHECK(o_.pct_start >= 0 && o_.pct_start <= 1, ValueError, "OneCycleLR: expected pct_start in [0, 1], got ",
             o_.pct_start);
  KILN_CHECK(o_.anneal_strategy == "cos" || o_.anneal_strategy == "linear", ValueError,
             "OneCycleLR: expected anneal_strategy 'cos' or 'linear', got '", o_.anneal_strategy, "'");
  const double total = static_cast<double>(o_.total_steps);
  if (o_.three_phase) {
    phases_ = {{o_.pct_start * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
               {2 * o_.pct_start * total - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"},
               {total - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"}};
  } else {
    phases_ = {{o_.pct_start * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
               {total - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"}};
  }
  if (o_.cycle_momentum) {
    const auto& d = opt_.defaults();
    KILN_CHECK(d.count("beta1") || d.count("momentum"), ValueError,
               "OneCycleLR: cycle_momentum needs an optimizer with momentum or betas; set cycle_momentum=false");
    momentum_key_ = d.count("beta1") ? "beta1" : "momentum";
  }
  base_lrs_.clear();
  for (auto& g : opt_.param_groups()) {
    g.options["initial_lr"] = o_.max_lr / o_.div_factor;
    g.options["max_lr"] = o_.max_lr;
    g.options["min_lr"] = g.options["initial_lr"] / o_.final_div_factor;
    base_lrs_.push_back(g.options["initial_lr"]);
    if (o_.cycle_momentum) {
      g.options[momentum_key_] = o_.max_momentum;
      g.options["max_momentum"] = o_.max_momentum;
      g.options["base_momentum"] = o_.base_momentum;
    }
  }
  initial_step();
}

HyperParams OneCycleLR::settings() const {
  return {{"max_lr", o_.max_lr},
          {"total_steps", static_cast<double>(o_.total_steps)},
          {"pct_start", o_.pct_start},
          {"anneal_strategy", o_.anneal_strategy == "cos" ? 0.0 : 1.0},
          {"cycle_momentum", o_.cycle_momentum ? 1.0 : 0.0},
          {"base_momentum", o_.base_momentum},
          {"max_momentum", o_.max_momentum},
          {"div_factor", o_.div_factor},
          {"final_div_factor", o_.final_div_factor},
          {"three_phase", o_.three_phase ? 1.0 : 0.0}};
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (o_.anneal_strategy == "cos") {
    const double cos_out = std::cos(kPi * pct) + 1;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

std::vector<double> OneCycleLR::get_lr() {
  const int64_t step_num = last_epoch_;
  KILN_CHECK(step_num <= o_.total_steps, ValueError, "OneCycleLR: tried to step ", step_num + 1,
             " times; expected at most total_steps = ", o_.total_steps);
  std::vector<double> lrs;
  for (auto& g : opt_.param_groups()) {
    double start_step = 0, lr = 0, mom = 0;
    for (size_t i = 0; i < phases_.size(); ++i) {
      const Phase& ph = phases_[i];
      if (static_cast<double>(step_num) <= ph.end_step || i == phases_.size() - 1) {
        const double pct = (static_cast<double>(step_num) - start_step) / (ph.end_step - start_step);
        lr = anneal(g.options.at(ph.start_lr), g.options.at(ph.end_lr), pct);
        if (o_.cycle_momentum) mom = anneal(g.options.at(ph.start_momentum), g.options.at(ph.end_momentum), pct);
        break;
      }
      start_step = ph.end_step;
    }
    lrs.push_back(lr);
    if (o_.cycle_momentum) g.options[momentum_key_] = mom;
  }
  return lrs;
}

// ---- ReduceLROnPlateau ----

ReduceLROnPlateau::ReduceLROnPlateau(Optimizer& opt, ReduceLROnPlateauOptions o) : opt_(opt), o_(std::move(o)) {
  KILN_CHECK(o_.factor < 1.0, ValueError, "ReduceLROnPlateau: expected factor < 1.0, got ", o_.factor);
  KILN_CHECK(o_.mode == "min" || o_.mode == "max", ValueError, "ReduceLROnPlateau: expected mode 'min' or 'max', got '",
             o_.mode, "'");
  KILN_CHECK(o_.threshold_mode == "rel" || o_.threshold_mode == "abs", ValueError,
             "ReduceLROnPlateau: expected threshold_mode 'rel' or 'abs', got '", o_.threshold_mode, "'");
  best_ = o_.mode == "min" ? INFINITY : -INFINITY;
  for (const auto& g : opt_.param_groups()) last_lr_.push_back(g.options.at("lr"));
}

bool ReduceLROnPlateau::is_better(double a, double best) const {
  if (o_.mode == "min" && o_.threshold_mode == "rel") return a < best * (1. - o_.threshold);
  if (o_.mode == "min") return a < best - o_.threshold;
  if (o_.threshold_mode == "rel") return a > best * (o_.threshold + 1.);
  return a > best + o_.threshold;
}

void ReduceLROnPlateau::step(double metric) {
  last_epoch_ += 1;
  if (is_better(metric, best_)) {
    best_ = metric;
    num_bad_epochs_ = 0;
  } else {
    num_bad_epochs_ += 1;
  }
  if (cooldown_counter_ > 0) {
    cooldown_counter_ -= 1;
    num_bad_epochs_ = 0;
  }
  if (num_bad_epochs_ > o_.patience) {
    for (auto& g : opt_.param_groups()) {
      const double old_lr = g.options.at("lr");
      const double new_lr = std::max(old_lr * o_.factor, o_.min_lr);
      if (old_lr - new_lr > o_.eps) g.options["lr"] = new_lr;
    }
    cooldown_counter_ = o_.cooldown;
    num_bad_epochs_ = 0;
  }
  last_lr_.clear();
  for (const auto& g : opt_.param_groups()) last_lr_.push_back(g.options.at("lr"));
}

HyperParams ReduceLROnPlateau::settings() const {
  return {{"mode", o_.mode == "min" ? 0.0 : 1.0},
          {"factor", o_.factor},
          {"patience", static_cast<double>(o_.patience)},
          {"threshold", o_.threshold},
          {"threshold_mode", o_.threshold_mode == "rel" ? 0.0 : 1.0},
          {"cooldown", static_cast<double>(o_.cooldown)},
          {"min_lr", o_.min_lr},
          {"eps", o_.eps}};
}

SchedulerState ReduceLROnPlateau::state_dict() const {
  SchedulerState s;
  s.type = "ReduceLROnPlateau";
  s.settings = settings();
  s.last_epoch = last_epoch_;
  s.last_lr = last_lr_;
  s.extra = {{"best", best_},
             {"num_bad_epochs", static_cast<double>(num_bad_epochs_)},
             {"cooldown_counter", static_cast<double>(cooldown_counter_)}};
  return s;
}

void ReduceLROnPlateau::load_state_dict(const SchedulerState& s) {
  for (const char* k : {"best", "num_bad_epochs", "cooldown_counter"})
    KILN_CHECK(s.extra.count(k), ValueError, "ReduceLROnPlateau load_state_dict: expected key '", k,
               "' in extra, got a state without it");
  const auto problems = schedule_mismatches(s, state_dict(), "ReduceLROnPlateau");
  std::string msg;
  for (const auto& p : problems) msg += "\n  " + p;
  KILN_CHECK(problems.empty(), ValueError,
             "ReduceLROnPlateau load_state_dict: the state was saved by a scheduler with other settings (nothing was "
             "changed):",
             msg, "\n  hint: build the scheduler with the settings of the run that saved it");
  last_epoch_ = s.last_epoch;
  last_lr_ = s.last_lr;
  best_ = s.extra.at("best");
  num_bad_epochs_ = static_cast<int64_t>(s.extra.at("num_bad_epochs"));
  cooldown_counter_ = static_cast<int64_t>(s.extra.at("cooldown_counter"));
}

}  // namespace kiln::optim
