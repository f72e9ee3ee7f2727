// Training parity with PyTorch (issue 4, "Parity with PyTorch"): the workloads
// of bench/WORKLOADS.md that are in the zoo (mlp, cnn, resnet, tiny) and each
// optimizer + scheduler on the tiny MLP are trained for the same steps on the
// same data by kiln and by the PyTorch twin (tests/parity/training_twins.py,
// which imports the twin classes of models_twins.py). kiln writes the initial
// state_dict, the data (inputs + int64 labels, one batch per step) and an eval
// input to safetensors; the twin loads the state dict strictly, trains, and
// answers with its per-step losses and learning rates, its state_dict after
// training (BatchNorm running statistics included) and its eval() output.
//
// Tolerances (float32 throughout; measured worst cases in the comments of each test):
//   per-step loss:  |kiln - torch| <= 1e-4 * |torch|  (relative 1e-4, every step)
//   learning rate:  |kiln - torch| <= 1e-12 * |torch| (schedulers compute in double)
//   final state and eval output: |kiln - torch| <= 1e-5 + 1e-4 * |torch| elementwise; where a test
//   sets float64_reference, an element may instead be no further from torch's float64 run than
//   torch's float32 run is, plus that tolerance (runs whose ReLU or pooling decisions flip with
//   rounding; the test says what was measured).
// The one exception is the resnet workload at its lr 0.1, whose training is chaotic in float32 (its
// test gives PyTorch's own float32 vs float64 drift): later steps' losses are held to 1e-2 and its
// final state is compared on an lr 0.001 run instead. Each test prints its measured differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/cnn.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/functional.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

constexpr double kLossRtol = 1e-4, kLrRtol = 1e-12, kRtol = 1e-4;

// Empty when a and b (torch) agree within atol + kRtol * |b|; otherwise the worst element.
// Like mismatch, but an element also passes when |kiln - torch64| is within
// |torch32 - torch64| + atol + kRtol * |torch64|.
std::string mismatch_or_float64(const Tensor& a, const Tensor& b, const Tensor& b64, double atol) {
  if (a.sizes() != b.sizes() || a.sizes() != b64.sizes()) return "shape " + a.shape_string() + " vs torch " + b.shape_string();
  auto x = test::to_doubles(a), y = test::to_doubles(b), z = test::to_doubles(b64);
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::abs(x[i] - y[i]) <= atol + kRtol * std::abs(y[i])) continue;
    if (std::abs(x[i] - z[i]) <= std::abs(y[i] - z[i]) + atol + kRtol * std::abs(z[i])) continue;
    std::ostringstream s;
    s << "element " << i << " of " << x.size() << ": kiln " << x[i] << " vs torch " << y[i] << " (float64 " << z[i]
      << ")";
    return s.str();
  }
  return "";
}

std::string mismatch(const Tensor& a, const Tensor& b, double atol) {
  if (a.sizes() != b.sizes()) return "shape " + a.shape_string() + " vs torch " + b.shape_string();
  auto x = test::to_doubles(a), y = test::to_doubles(b);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double excess = std::abs(x[i] - y[i]) - (atol + kRtol * std::abs(y[i]));
    if (!(excess <= worst)) {
      worst = std::isnan(excess) ? INFINITY : excess;
      at = i;
    }
  }
  if (worst <= 0) return "";
  std::ostringstream s;
  s << "element " << at << " of " << x.size() << ": kiln " << x[at] << " vs torch " << y[at];
  return s.str();
}

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(optim::NamedParams)>;
using MakeScheduler = std::function<std::unique_ptr<optim::LRScheduler>(optim::Optimizer&)>;

struct TrainRun {
  std::string model = "", config = "";  // as models_twins.py
  std::string optimizer = "";  // JSON for the twin, the same as make_optimizer builds
  std::string scheduler = "null";
  int64_t steps = 20, batch = 8;
  MakeOptimizer make_optimizer = nullptr;
  MakeScheduler make_scheduler = nullptr;
  double atol = 1e-5;  // for the final state and the eval output
  // Steps from strict_steps on are held to late_loss_rtol (chaotic runs only; the test says why).
  int64_t strict_steps = 1 << 30;
  double late_loss_rtol = kLossRtol;
  bool compare_state = true;  // final state_dict and eval output
  // The twin also trains in float64; a state element off torch's float32 value
  // still passes when kiln is no further from the float64 result than torch's
  // float32 is (plus the tolerance): Adam runs whose few noise-level
  // gradients decide some weights (see training_twins.py).
  bool float64_reference = false;
};

struct Measured {
  double max_loss_rel = 0;  // max over steps of |kiln - torch| / |torch|
  double first_loss = 0, last_loss = 0;
};

// Trains `model` as described at the top of this file and compares with the twin.
Measured train_against_twin(nn::Module& model, const TrainRun& r, const Tensor& inputs, const Tensor& labels,
                            const Tensor& eval_x) {
  Measured m;
  EXPECT_EQ(test::python_problem(), "");
  if (!test::python_problem().empty()) return m;
  test::TempDir dir;
  auto sd = model.state_dict();
  sd.emplace_back("__inputs__", inputs);
  sd.emplace_back("__labels__", labels);
  sd.emplace_back("__eval_input__", eval_x);
  io::save_safetensors(dir.file("in.safetensors"), sd,
                       {{"model", r.model},
                        {"config", r.config},
                        {"optimizer", r.optimizer},
                        {"scheduler", r.scheduler},
                        {"steps", std::to_string(r.steps)},
                        {"batch", std::to_string(r.batch)},
                        {"reference64", r.float64_reference ? "1" : "0"}});
  std::string out;
  int rc = test::run_command(test::shell_quote(test::python()) + " " +
                                 test::shell_quote(test::source_dir() + "/tests/parity/training_twins.py") + " " +
                                 test::shell_quote(dir.file("in.safetensors")) + " " +
                                 test::shell_quote(dir.file("out.safetensors")),
                             out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
  if (rc != 0) return m;
  auto ref = io::load_safetensors(dir.file("out.safetensors"));
  auto torch_losses = test::to_doubles(ref.at("losses"));
  auto torch_lrs = test::to_doubles(ref.at("lrs"));
  EXPECT_EQ(static_cast<int64_t>(torch_losses.size()), r.steps);
  EXPECT_EQ(static_cast<int64_t>(torch_lrs.size()), r.steps);
  if (static_cast<int64_t>(torch_losses.size()) != r.steps || static_cast<int64_t>(torch_lrs.size()) != r.steps)
    return m;

  auto opt = r.make_optimizer(model.named_parameters());
  std::unique_ptr<optim::LRScheduler> sched = r.make_scheduler ? r.make_scheduler(*opt) : nullptr;
  model.train();
  for (int64_t i = 0; i < r.steps; ++i) {
    Tensor x = inputs.narrow(0, i * r.batch, r.batch), y = labels.narrow(0, i * r.batch, r.batch);
    opt->zero_grad();
    Tensor loss = nn::functional::cross_entropy(model(x), y);
    loss.backward();
    double lr = opt->param_groups()[0].lr();
    opt->step();
    if (sched) sched->step();
    double l = loss.item<float>(), t = torch_losses[i];
    double rel = std::abs(l - t) / std::abs(t);
    m.max_loss_rel = std::max(m.max_loss_rel, rel);
    EXPECT_LE(rel, i < r.strict_steps ? kLossRtol : r.late_loss_rtol) << "loss at step " << i << ": kiln " << l << " vs torch " << t;
    EXPECT_LE(std::abs(lr - torch_lrs[i]), kLrRtol * std::abs(torch_lrs[i]))
        << "lr at step " << i << ": kiln " << lr << " vs torch " << torch_lrs[i];
  }
  m.first_loss = torch_losses.front();
  m.last_loss = torch_losses.back();
  double state_diff = 0;
  for (auto& [n, t] : model.state_dict()) {
    auto a = test::to_doubles(t), b = test::to_doubles(ref.at("state." + n));
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) state_diff = std::max(state_diff, std::abs(a[i] - b[i]));
    if (r.compare_state && r.float64_reference) {
      EXPECT_EQ(mismatch_or_float64(t, ref.at("state." + n), ref.at("state64." + n), r.atol), "") << "state " << n;
    } else if (r.compare_state) {
      EXPECT_EQ(mismatch(t, ref.at("state." + n), r.atol), "") << "state " << n;
    }
  }
  double eval_diff = 0;
  model.eval();
  {
    NoGradGuard g;
    Tensor e = model(eval_x);
    auto a = test::to_doubles(e), b = test::to_doubles(ref.at("eval_out"));
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) eval_diff = std::max(eval_diff, std::abs(a[i] - b[i]));
    if (r.compare_state && r.float64_reference) {
      EXPECT_EQ(mismatch_or_float64(e, ref.at("eval_out"), ref.at("eval_out64"), r.atol), "") << "eval output";
    } else if (r.compare_state) {
      EXPECT_EQ(mismatch(e, ref.at("eval_out"), r.atol), "") << "eval output";
    }
  }
  std::cout << "[ measured ] " << ::testing::UnitTest::GetInstance()->current_test_info()->name()
            << ": max relative loss difference " << m.max_loss_rel << " over " << r.steps << " steps (loss "
            << m.first_loss << " -> " << m.last_loss << "); max |state difference| " << state_diff
            << ", max |eval output difference| " << eval_diff << "\n";
  return m;
}

Tensor labels_for(int64_t n, int64_t classes) { return randint(0, classes, {n}, TensorOptions(kInt64)); }

}  // namespace

// ---- The workloads of bench/WORKLOADS.md ----

// The final state and eval() output are held to torch's float32 run or its float64 one
// (mismatch_or_float64). A ReLU input within rounding of zero flips one way or the other with
// the product kernel's order of sums, and the run that flips drifts from float64 by 1e-5 in 20
// steps: torch alone, float32 against float64, on 3 seeds of this model (2026-12-07, an Intel Xeon
// with AVX-512): 1.8e-5, 2.1e-8, 2.3e-8. On that machine this seed's torch float32 run flipped
// (2.3e-5 from float64) while kiln's stayed within 2.1e-8 of float64; on the AMD machines
// before it both stayed close.
TEST(TrainingParity, MLPWorkloadSGDMomentum) {
  manual_seed(101);
  models::MLP m({.in_features = 784, .hidden = {512, 512}, .out_features = 10});
  TrainRun r{.model = "mlp",
        .config = R"({"in_features": 784, "hidden": [512, 512], "out_features": 10})",
        .optimizer = R"({"name": "sgd", "lr": 0.01, "momentum": 0.9})",
        .steps = 20,
        .batch = 128,
        .make_optimizer = [](optim::NamedParams p) {
          return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
        }};
  r.float64_reference = true;
  Tensor x = randn({r.steps * r.batch, 1, 28, 28});
  train_against_twin(m, r, x, labels_for(r.steps * r.batch, 10), randn({16, 1, 28, 28}));
}

TEST(TrainingParity, CNNWorkloadAdam) {
  manual_seed(102);
  models::CNN m;
  TrainRun r{.model = "cnn",
        .config = "{}",
        .optimizer = R"({"name": "adam", "lr": 0.001})",
        .steps = 20,
        .batch = 64,
        .make_optimizer = [](optim::NamedParams p) {
          return std::make_unique<optim::Adam>(std::move(p), optim::AdamOptions{.lr = 1e-3});
        }};
  // The loss of every step is held to torch's; the final state is not (the
  // ResNet workload's reason, below): Adam moves a weight by about lr whatever
  // its gradient's size, so where a ReLU input or a pool's two largest values
  // sit within rounding of each other, or a gradient is a cancellation near
  // zero (fc1.weight element 75712: -1.3e-9 in torch float32, -1.8e-9 in
  // float64, then Adam makes it 0.011640 or 0.011761), implementations that
  // round differently end lr apart. Until stop 65 this check passed for this
  // seed at 2 threads only (not for seeds 103, 105-107, nor at 1 thread), while
  // kiln ran the same oneDNN kernels as torch; since conv1's weight gradient
  // runs kiln's direct sum (Note [Few-channel weight gradient]), 50 times
  // closer to float64 than oneDNN's (max error 6e-5 against 3e-3 at this
  // shape), the two runs end up to 4e-3 apart in a few elements.
  // CNNSGDLowLRState holds the state.
  r.compare_state = false;
  Tensor x = randn({r.steps * r.batch, 1, 28, 28});
  train_against_twin(m, r, x, labels_for(r.steps * r.batch, 10), randn({16, 1, 28, 28}));
}

// The cnn with plain SGD at lr 0.001, where a step moves each weight in
// proportion to its gradient: the final parameters and eval() output against
// torch's float32 run, or its float64 run, at the default tolerance. Measured
// 7.5e-9 (state) and 1.1e-7 (eval output) with kiln's direct kernels for conv1
// and with oneDNN's alike; seeds 103, 105 and 107 within 2.4e-7 and 6.3e-7.
// (With momentum 0.9 at lr 0.01 the run is as chaotic as the ResNet
// workload's: 8e-5 apart with either kernels.)
TEST(TrainingParity, CNNSGDLowLRState) {
  manual_seed(102);
  models::CNN m;
  TrainRun r{.model = "cnn",
        .config = "{}",
        .optimizer = R"({"name": "sgd", "lr": 0.001})",
        .steps = 20,
        .batch = 64,
        .make_optimizer = [](optim::NamedParams p) {
          return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{.lr = 0.001});
        }};
  r.float64_reference = true;
  Tensor x = randn({r.steps * r.batch, 1, 28, 28});
  train_against_twin(m, r, x, labels_for(r.steps * r.batch, 10), randn({16, 1, 28, 28}));
}

namespace {

TrainRun resnet_run(double lr) {
  std::ostringstream o;
  o << R"({"name": "sgd", "lr": )" << lr << R"(, "momentum": 0.9, "weight_decay": 0.0005})";
  return {.model = "resnet",
          .config = "{}",
          .optimizer = o.str(),
          .steps = 20,
          .batch = 32,
          .make_optimizer = [lr](optim::NamedParams p) {
            return std::make_unique<optim::SGD>(std::move(p),
                                                optim::SGDOptions{.lr = lr, .momentum = 0.9, .weight_decay = 5e-4});
          }};
}

}  // namespace

// The workload's hyperparameters (lr 0.1) on random labels make training chaotic: float32 rounding
// differences grow by orders of magnitude per step. Measured for PyTorch alone (the same 20 steps in
// float32 vs float64, three seeds): relative loss difference below 1e-5 for the first 6 steps, then
// up to 2.8e-3 by step 20, and eval outputs differing by up to 0.09. So: relative 1e-4 for steps
// 0-5, 1e-2 (3.5x the measured float32 drift) after, and the final state is compared on the lr 0.01
// run below. Measured kiln vs torch: max 1.7e-3 (1.05e-3 before the forward convolutions took
// oneDNN's direct kernel, Note [Forward convolution kernel]), inside torch's own float32 drift.
TEST(TrainingParity, ResNetWorkloadSGDWeightDecay) {
  manual_seed(103);
  models::ResNet m;
  TrainRun r = resnet_run(0.1);
  r.strict_steps = 6;
  r.late_loss_rtol = 1e-2;
  r.compare_state = false;
  Tensor x = randn({r.steps * r.batch, 3, 32, 32});
  train_against_twin(m, r, x, labels_for(r.steps * r.batch, 10), randn({8, 3, 32, 32}));
}

// The same with lr 0.001, where the drift stays small enough to compare the final parameters, the
// BatchNorm running statistics and the eval() output at the default tolerance. (At lr 0.01 the loss
// still agrees to 6.2e-5 relative, but the final state differs by up to 5e-4 and eval outputs by
// 7.7e-4, as much as PyTorch's own float32 vs float64 runs: eval outputs up to 9e-4 apart.)
// Measured kiln vs torch: loss 6.3e-7 relative, state 1.3e-5, eval output 1.7e-5 (absolute).
// The state is also held against torch's float64 run, as the cnn's is: since
// the forward convolutions run oneDNN's direct kernel (Note [Forward
// convolution kernel]) a running mean can sit 1.1e-5 from torch float32's,
// which is the size of torch float32's own distance from float64.
TEST(TrainingParity, ResNetSGDWeightDecayLowLRStateAndRunningStats) {
  manual_seed(105);
  models::ResNet m;
  TrainRun r = resnet_run(0.001);
  r.atol = 1e-5;
  r.float64_reference = true;
  Tensor x = randn({r.steps * r.batch, 3, 32, 32});
  train_against_twin(m, r, x, labels_for(r.steps * r.batch, 10), randn({8, 3, 32, 32}));
}

TEST(TrainingParity, TinyWorkloadSGD) {
  manual_seed(104);
  models::MLP m({.in_features = 32, .hidden = {64, 64}, .out_features = 10});
  TrainRun r{.model = "mlp",
        .config = R"({"in_features": 32, "hidden": [64, 64], "out_features": 10})",
        .optimizer = R"({"name": "sgd", "lr": 0.01})",
        .steps = 50,
        .batch = 8,
        .make_optimizer = [](optim::NamedParams p) {
          return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{.lr = 0.01});
        }};
  train_against_twin(m, r, randn({r.steps * r.batch, 32}), labels_for(r.steps * r.batch, 10), randn({16, 32}));
}

// ---- Each optimizer with a scheduler on the tiny MLP, 50 steps ----

namespace {

void train_tiny(uint64_t seed, TrainRun r) {
  manual_seed(seed);
  models::MLP m({.in_features = 32, .hidden = {64, 64}, .out_features = 10});
  r.model = "mlp";
  r.config = R"({"in_features": 32, "hidden": [64, 64], "out_features": 10})";
  r.steps = 50;
  r.batch = 8;
  train_against_twin(m, r, randn({r.steps * r.batch, 32}), labels_for(r.steps * r.batch, 10), randn({16, 32}));
}

}  // namespace

TEST(TrainingParity, SGDNesterovWithStepLR) {
  train_tiny(201, {.optimizer = R"({"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0001,
                                   "nesterov": true})",
                   .scheduler = R"({"name": "step", "step_size": 10, "gamma": 0.5})",
                   .make_optimizer =
                       [](optim::NamedParams p) {
                         return std::make_unique<optim::SGD>(
                             std::move(p),
                             optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4, .nesterov = true});
                       },
                   .make_scheduler = [](optim::Optimizer& o) -> std::unique_ptr<optim::LRScheduler> {
                     return std::make_unique<optim::StepLR>(o, optim::StepLROptions{.step_size = 10, .gamma = 0.5});
                   }});
}

TEST(TrainingParity, AdamWithLinearWarmupThenCosine) {
  train_tiny(202, {.optimizer = R"({"name": "adam", "lr": 0.01})",
                   .scheduler = R"({"name": "sequential", "milestones": [10], "schedulers": [
                                     {"name": "linear", "start_factor": 0.1, "total_iters": 10},
                                     {"name": "cosine", "T_max": 40}]})",
                   .make_optimizer =
                       [](optim::NamedParams p) {
                         return std::make_unique<optim::Adam>(std::move(p), optim::AdamOptions{.lr = 0.01});
                       },
                   .make_scheduler = [](optim::Optimizer& o) -> std::unique_ptr<optim::LRScheduler> {
                     auto warmup = std::make_shared<optim::LinearLR>(
                         o, optim::LinearLROptions{.start_factor = 0.1, .total_iters = 10});
                     auto cosine =
                         std::make_shared<optim::CosineAnnealingLR>(o, optim::CosineAnnealingLROptions{.T_max = 40});
                     return std::make_unique<optim::SequentialLR>(
                         o, std::vector<std::shared_ptr<optim::LRScheduler>>{warmup, cosine},
                         std::vector<int64_t>{10});
                   }});
}

TEST(TrainingParity, AdamWWithCosine) {
  train_tiny(203, {.optimizer = R"({"name": "adamw", "lr": 0.01, "weight_decay": 0.1})",
                   .scheduler = R"({"name": "cosine", "T_max": 50, "eta_min": 0.0001})",
                   .make_optimizer =
                       [](optim::NamedParams p) {
                         return std::make_unique<optim::AdamW>(std::move(p),
                                                               optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
                       },
                   .make_scheduler = [](optim::Optimizer& o) -> std::unique_ptr<optim::LRScheduler> {
                     return std::make_unique<optim::CosineAnnealingLR>(
                         o, optim::CosineAnnealingLROptions{.T_max = 50, .eta_min = 1e-4});
                   }});
}

TEST(TrainingParity, RMSpropCenteredMomentumWithLinearDecay) {
  train_tiny(204, {.optimizer = R"({"name": "rmsprop", "lr": 0.001, "momentum": 0.5, "centered": true,
                                   "weight_decay": 0.0001})",
                   .scheduler = R"({"name": "linear", "start_factor": 1.0, "end_factor": 0.1, "total_iters": 50})",
                   .make_optimizer =
                       [](optim::NamedParams p) {
                         return std::make_unique<optim::RMSprop>(
                             std::move(p),
                             optim::RMSpropOptions{.lr = 1e-3, .weight_decay = 1e-4, .momentum = 0.5, .centered = true});
                       },
                   .make_scheduler = [](optim::Optimizer& o) -> std::unique_ptr<optim::LRScheduler> {
                     return std::make_unique<optim::LinearLR>(
                         o, optim::LinearLROptions{.start_factor = 1.0, .end_factor = 0.1, .total_iters = 50});
                   }});
}
