// LR schedulers: lr trajectories (and OneCycleLR's cycled momentum) against
// torch 1.13 (tests/parity/lr_schedules.py) to 1e-12, state_dict round trips
// that continue identically, the step-order warning, validation errors.
#include "kiln/optim/scheduler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>

#include "kiln/ops/factory.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

const std::map<std::string, std::vector<double>>& torch_lrs() {
  static const auto table = test::run_python_table("lr_schedules.py");
  return table;
}

// Two groups (lr 0.1 and 0.05), as in lr_schedules.py; each parameter has a zero gradient so step() runs.
struct TwoGroups {
  Tensor a = zeros({2}).requires_grad_(), b = zeros({2}).requires_grad_();
  std::unique_ptr<Optimizer> opt;
  explicit TwoGroups(bool adam = false) {
    a.mutable_grad() = zeros({2});
    b.mutable_grad() = zeros({2});
    std::vector<ParamGroup> groups{{{{"a", a}}, {}}, {{{"b", b}}, {{"lr", 0.05}}}};
    if (adam) opt = std::make_unique<Adam>(groups, AdamOptions{.lr = 0.1});
    else opt = std::make_unique<SGD>(groups, SGDOptions{.lr = 0.1, .momentum = 0.9});
  }
  double momentum() const {
    const auto& o = opt->param_groups()[0].options;
    return o.count("beta1") ? o.at("beta1") : o.at("momentum");
  }
};

void expect_close(const std::string& name, const std::vector<double>& got) {
  SCOPED_TRACE(name);
  const auto& exp = torch_lrs().at(name);
  ASSERT_EQ(got.size(), exp.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], exp[i], 1e-12) << "entry " << i;
}

template <typename Make>
void run_case(const std::string& name, int steps, Make make, bool adam = false) {
  TwoGroups s(adam);
  auto sched = make(*s.opt);
  std::vector<double> lrs = sched->get_last_lr(), moms;
  for (int i = 0; i < steps; ++i) {
    s.opt->step();
    sched->step();
    for (double lr : sched->get_last_lr()) lrs.push_back(lr);
    moms.push_back(s.momentum());
  }
  expect_close(name, lrs);
  if (torch_lrs().count(name + "_mom")) expect_close(name + "_mom", moms);
}

double plateau_metric(int i) { return i < 15 ? 1.0 - 0.02 * i : 0.7 + 0.001 * std::sin(i); }

void run_plateau(const std::string& name, ReduceLROnPlateauOptions o, const std::function<double(int)>& metric) {
  TwoGroups s;
  ReduceLROnPlateau sched(*s.opt, o);
  std::vector<double> lrs = sched.get_last_lr();
  for (int i = 0; i < 60; ++i) {
    s.opt->step();
    sched.step(metric(i));
    for (double lr : sched.get_last_lr()) lrs.push_back(lr);
  }
  expect_close(name, lrs);
}

}  // namespace

TEST(Schedulers, TrajectoriesMatchTorch) {
  run_case("step", 60, [](Optimizer& o) { return std::make_unique<StepLR>(o, StepLROptions{.step_size = 7, .gamma = 0.5}); });
  run_case("multistep", 60, [](Optimizer& o) {
    return std::make_unique<MultiStepLR>(o, MultiStepLROptions{.milestones = {10, 25, 25, 40}, .gamma = 0.3});
  });
  run_case("exponential", 60, [](Optimizer& o) { return std::make_unique<ExponentialLR>(o, ExponentialLROptions{.gamma = 0.95}); });
  run_case("cosine", 70, [](Optimizer& o) {
    return std::make_unique<CosineAnnealingLR>(o, CosineAnnealingLROptions{.T_max = 20, .eta_min = 0.001});
  });
  run_case("linear", 30, [](Optimizer& o) {
    return std::make_unique<LinearLR>(o, LinearLROptions{.start_factor = 0.1, .end_factor = 1.0, .total_iters = 15});
  });
  run_case("lambda", 50, [](Optimizer& o) {
    return std::make_unique<LambdaLR>(o, [](int64_t e) { return std::pow(0.97, static_cast<double>(e)) * static_cast<double>(1 + e % 5); });
  });
  run_case("lambda_groups", 50, [](Optimizer& o) {
    return std::make_unique<LambdaLR>(o, std::vector<LambdaLR::Lambda>{
                                             [](int64_t e) { return 1.0 / static_cast<double>(1 + e); },
                                             [](int64_t e) { return std::pow(0.9, static_cast<double>(e)); }});
  });
  run_case("sequential", 70, [](Optimizer& o) {
    auto warmup = std::make_shared<LinearLR>(o, LinearLROptions{.start_factor = 0.1, .total_iters = 10});
    auto cosine = std::make_shared<CosineAnnealingLR>(o, CosineAnnealingLROptions{.T_max = 50, .eta_min = 1e-4});
    return std::make_unique<SequentialLR>(o, std::vector<std::shared_ptr<LRScheduler>>{warmup, cosine},
                                          std::vector<int64_t>{10});
  });
  run_case("sequential3", 60, [](Optimizer& o) {
    std::vector<std::shared_ptr<LRScheduler>> s{std::make_shared<ExponentialLR>(o, ExponentialLROptions{.gamma = 0.9}),
                                                std::make_shared<StepLR>(o, StepLROptions{.step_size = 4, .gamma = 0.5}),
                                                std::make_shared<CosineAnnealingLR>(o, CosineAnnealingLROptions{.T_max = 10})};
    return std::make_unique<SequentialLR>(o, s, std::vector<int64_t>{8, 20});
  });
  run_case("onecycle", 79, [](Optimizer& o) {
    return std::make_unique<OneCycleLR>(o, OneCycleLROptions{.max_lr = 0.5, .total_steps = 80});
  });
  run_case(
      "onecycle_adam", 59,
      [](Optimizer& o) {
        return std::make_unique<OneCycleLR>(o, OneCycleLROptions{.max_lr = 0.01, .total_steps = 60, .pct_start = 0.25,
                                                                 .anneal_strategy = "linear", .base_momentum = 0.8,
                                                                 .max_momentum = 0.9, .three_phase = true});
      },
      true);
  run_plateau("plateau", {.factor = 0.5, .patience = 3, .threshold = 1e-3, .cooldown = 2, .min_lr = 0.01}, plateau_metric);
  run_plateau("plateau_max_abs", {.mode = "max", .factor = 0.3, .patience = 2, .threshold = 0.05, .threshold_mode = "abs"},
              [](int i) { return plateau_metric(59 - i); });
}

TEST(Schedulers, StateDictRoundTripContinuesIdentically) {
  auto make_seq = [](Optimizer& o) {
    auto warmup = std::make_shared<LinearLR>(o, LinearLROptions{.start_factor = 0.1, .total_iters = 10});
    auto cosine = std::make_shared<CosineAnnealingLR>(o, CosineAnnealingLROptions{.T_max = 50, .eta_min = 1e-4});
    return std::make_unique<SequentialLR>(o, std::vector<std::shared_ptr<LRScheduler>>{warmup, cosine},
                                          std::vector<int64_t>{10});
  };
  TwoGroups a, b;
  auto sa = make_seq(*a.opt);
  for (int i = 0; i < 25; ++i) { a.opt->step(); sa->step(); }
  const SchedulerState st = sa->state_dict();
  const OptimizerStateDict ost = a.opt->state_dict();
  auto sb = make_seq(*b.opt);
  b.opt->load_state_dict(ost);  // restores the groups' lr and initial_lr
  sb->load_state_dict(st);
  EXPECT_EQ(sb->get_last_lr(), sa->get_last_lr());
  for (int i = 0; i < 40; ++i) {
    a.opt->step(); sa->step();
    b.opt->step(); sb->step();
    EXPECT_EQ(sb->get_last_lr(), sa->get_last_lr()) << "step " << i;
  }

  TwoGroups c, d;
  ReduceLROnPlateau pc(*c.opt, {.factor = 0.5, .patience = 3}), pd(*d.opt, {.factor = 0.5, .patience = 3});
  for (int i = 0; i < 20; ++i) pc.step(plateau_metric(i));
  d.opt->load_state_dict(c.opt->state_dict());
  pd.load_state_dict(pc.state_dict());
  for (int i = 20; i < 60; ++i) {
    pc.step(plateau_metric(i));
    pd.step(plateau_metric(i));
    EXPECT_EQ(pd.get_last_lr(), pc.get_last_lr());
  }
  EXPECT_EQ(pd.best(), pc.best());
}

// Issue 27: a state saved by a scheduler with other settings is refused, the
// setting named with both values, and nothing changes; a state without
// recorded settings (saved before they were) still loads.
TEST(Schedulers, LoadingAStateOfOtherSettingsNamesTheSetting) {
  auto error_of = [](const std::function<void()>& f) { return test::error_message<ValueError>(f); };
  TwoGroups a, b;
  CosineAnnealingLR long_run(*a.opt, {.T_max = 100});
  for (int i = 0; i < 7; ++i) { a.opt->step(); long_run.step(); }
  const SchedulerState saved = long_run.state_dict();
  EXPECT_EQ(saved.type, "CosineAnnealingLR");
  EXPECT_EQ(saved.settings.at("T_max"), 100.0);
  CosineAnnealingLR short_run(*b.opt, {.T_max = 50});
  std::string msg = error_of([&] { short_run.load_state_dict(saved); });
  EXPECT_NE(msg.find("CosineAnnealingLR load_state_dict"), std::string::npos) << msg;
  EXPECT_NE(msg.find("T_max is 100 in the saved state, 50 in this scheduler"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("eta_min"), std::string::npos) << "only differing settings are listed: " << msg;
  EXPECT_EQ(short_run.last_epoch(), 0) << "nothing may change on a mismatch";

  StepLR step(*b.opt, {.step_size = 3});
  msg = error_of([&] { step.load_state_dict(saved); });
  EXPECT_NE(msg.find("the saved state is of a CosineAnnealingLR, this scheduler is a StepLR"), std::string::npos) << msg;

  // A milestone list of another length names the extra entry.
  MultiStepLR m2(*b.opt, {.milestones = {10, 20}});
  MultiStepLR m3(*b.opt, {.milestones = {10, 20, 30}});
  msg = error_of([&] { m3.load_state_dict(m2.state_dict()); });
  EXPECT_NE(msg.find("milestones is 2 in the saved state, 3 in this scheduler"), std::string::npos) << msg;
  EXPECT_NE(msg.find("milestones.2 is absent in the saved state, 30 in this scheduler"), std::string::npos) << msg;

  // Warm-up + cosine: a chained scheduler's setting is named with its index, before any part loads.
  auto make_seq = [](Optimizer& o, int64_t warmup, int64_t t_max) {
    auto w = std::make_shared<LinearLR>(o, LinearLROptions{.start_factor = 0.1, .total_iters = warmup});
    auto c = std::make_shared<CosineAnnealingLR>(o, CosineAnnealingLROptions{.T_max = t_max});
    return std::make_unique<SequentialLR>(o, std::vector<std::shared_ptr<LRScheduler>>{w, c},
                                          std::vector<int64_t>{warmup});
  };
  TwoGroups c, d;
  auto sc = make_seq(*c.opt, 5, 100);
  for (int i = 0; i < 9; ++i) { c.opt->step(); sc->step(); }
  auto sd = make_seq(*d.opt, 5, 60);
  msg = error_of([&] { sd->load_state_dict(sc->state_dict()); });
  EXPECT_NE(msg.find("SequentialLR 1: T_max is 100 in the saved state, 60 in this scheduler"), std::string::npos) << msg;
  EXPECT_EQ(sd->last_epoch(), 0);
  auto se = make_seq(*d.opt, 8, 100);
  msg = error_of([&] { se->load_state_dict(sc->state_dict()); });
  EXPECT_NE(msg.find("SequentialLR: milestones.0 is 5 in the saved state, 8 in this scheduler"), std::string::npos) << msg;
  EXPECT_NE(msg.find("SequentialLR 0: total_iters is 5 in the saved state, 8 in this scheduler"), std::string::npos) << msg;

  // A state saved before settings were recorded loads as it always did.
  SchedulerState old = saved;
  old.type.clear();
  old.settings.clear();
  short_run.load_state_dict(old);
  EXPECT_EQ(short_run.last_epoch(), 7);

  TwoGroups p;
  ReduceLROnPlateau patient(*p.opt, {.patience = 3}), impatient(*p.opt, {.patience = 1});
  msg = error_of([&] { impatient.load_state_dict(patient.state_dict()); });
  EXPECT_NE(msg.find("patience is 3 in the saved state, 1 in this scheduler"), std::string::npos) << msg;
}

TEST(Schedulers, WarnsWhenSteppedBeforeOptimizer) {
  const std::string text = "Detected call of `lr_scheduler.step()` before `optimizer.step()`";
  {
    TwoGroups s;
    StepLR sched(*s.opt, {.step_size = 2});
    testing::internal::CaptureStderr();
    sched.step();  // wrong order
    sched.step();
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(text), std::string::npos) << err;
    EXPECT_EQ(err.find(text), err.rfind(text)) << "warned more than once: " << err;
  }
  {
    TwoGroups s;
    CosineAnnealingLR sched(*s.opt, {.T_max = 5});
    testing::internal::CaptureStderr();
    for (int i = 0; i < 3; ++i) { s.opt->step(); sched.step(); }
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  }
}

TEST(Schedulers, ValidationErrors) {
  TwoGroups s;
  auto expect_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "expected ValueError with " << part;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  Optimizer& o = *s.opt;
  expect_error([&] { StepLR(o, {.step_size = 0}); }, "StepLR: expected step_size > 0, got 0");
  expect_error([&] { LinearLR(o, {.start_factor = 1.5}); }, "expected start_factor in [0, 1], got 1.5");
  expect_error([&] { LambdaLR(o, std::vector<LambdaLR::Lambda>{[](int64_t) { return 1.0; }}); },
               "LambdaLR: expected 2 lr_lambdas (one per param group), got 1");
  expect_error([&] { ReduceLROnPlateau(o, {.factor = 1.0}); }, "expected factor < 1.0, got 1");
  expect_error([&] { ReduceLROnPlateau(o, {.mode = "maxx"}); }, "expected mode 'min' or 'max', got 'maxx'");
  expect_error([&] { OneCycleLR(o, {.max_lr = 0.1}); }, "OneCycleLR: expected total_steps > 0 or epochs > 0");
  expect_error([&] { OneCycleLR(o, {.max_lr = 0.1, .total_steps = 10, .anneal_strategy = "exp"}); },
               "expected anneal_strategy 'cos' or 'linear', got 'exp'");
  expect_error(
      [&] {
        auto a = std::make_shared<ExponentialLR>(o, ExponentialLROptions{.gamma = 0.9});
        SequentialLR(o, {a, a}, {});
      },
      "expected one milestone fewer than schedulers, got 2 schedulers and 0 milestones");
  {
    TwoGroups t;
    OneCycleLR sched(*t.opt, {.max_lr = 0.1, .total_steps = 3});
    for (int i = 0; i < 3; ++i) { t.opt->step(); sched.step(); }
    expect_error([&] { t.opt->step(); sched.step(); }, "OneCycleLR: tried to step 5 times; expected at most total_steps = 3");
  }
}
