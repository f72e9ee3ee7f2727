// Optimizers: 50-step parameter trajectories of SGD, Adam, AdamW and RMSprop
// against torch 1.13 (tests/parity/optim_trajectories.py, same deterministic
// gradients), param groups, non-contiguous parameters, state_dict round trips
// that continue bitwise, zero_grad, memory accounting and validation errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <sstream>

#include "kiln/core/allocator.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

const std::map<std::string, std::vector<double>>& torch_results() {
  static std::map<std::string, std::vector<double>> cache;
  if (!cache.empty()) return cache;
  std::string out;
  const int rc = test::run_command(test::shell_quote(test::python()) + " " + test::shell_quote(test::source_dir() + "/tests/parity/optim_trajectories.py"), out);
  if (rc != 0) throw std::runtime_error("optim_trajectories.py failed: " + out);
  std::istringstream is(out);
  std::string line;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string name;
    ls >> name;
    double v;
    while (ls >> v) cache[name].push_back(v);
  }
  return cache;
}

template <typename T>
Tensor vec(const std::vector<double>& v) {
  std::vector<T> t(v.begin(), v.end());
  return tensor<T>(t, {static_cast<int64_t>(v.size())});
}

struct Consts {
  std::vector<double> c, t, p0;
};
Consts consts(int n, double salt) {
  Consts k;
  for (int i = 0; i < n; ++i) {
    k.c.push_back(0.5 + 0.25 * (1 + std::cos(1.1 * i + salt)));
    k.t.push_back(std::sin(0.3 * i + salt));
    k.p0.push_back(std::cos(0.9 * i + 2 * salt));
  }
  return k;
}

// The quadratic of optim_trajectories.py; w is a non-contiguous (column-major) 3x4 leaf.
struct Problem {
  Tensor w, b;
  Consts kw = consts(12, 0.0), kb = consts(4, 1.0);
  DType dt;
  explicit Problem(DType dtype) : dt(dtype) {
    w = empty_strided({3, 4}, {1, 3}, TensorOptions(dt));
    b = empty({4}, TensorOptions(dt));
    {
      NoGradGuard ng;
      w.copy_(dt == kFloat32 ? vec<float>(kw.p0).view({3, 4}) : vec<double>(kw.p0).view({3, 4}));
      b.copy_(dt == kFloat32 ? vec<float>(kb.p0) : vec<double>(kb.p0));
    }
    w.requires_grad_(true);
    b.requires_grad_(true);
  }
  NamedParams named() { return {{"w", w}, {"b", b}}; }

  template <typename T>
  Tensor grad_of(const Tensor& p, const Consts& k, int step) {
    std::vector<double> pv = test::to_doubles(p);
    std::vector<T> g(pv.size());
    for (size_t i = 0; i < pv.size(); ++i) {
      const T noise = static_cast<T>(0.1 * std::sin(0.7 * i + 1.3 * step));
      g[i] = static_cast<T>(k.c[i]) * (static_cast<T>(pv[i]) - static_cast<T>(k.t[i])) + noise;
    }
    return tensor<T>(g, p.sizes());
  }
  void set_grads(int step) {
    if (dt == kFloat32) {
      w.mutable_grad() = grad_of<float>(w, kw, step);
      b.mutable_grad() = grad_of<float>(b, kb, step);
    } else {
      w.mutable_grad() = grad_of<double>(w, kw, step);
      b.mutable_grad() = grad_of<double>(b, kb, step);
    }
  }
  std::vector<double> values() const {
    auto v = test::to_doubles(w);
    auto bv = test::to_doubles(b);
    v.insert(v.end(), bv.begin(), bv.end());
    return v;
  }
};

using Make = std::function<std::unique_ptr<Optimizer>(Problem&)>;

void run_case(const std::string& name, DType dt, const Make& make) {
  SCOPED_TRACE(name);
  const auto& expected = torch_results().at(name);
  Problem pr(dt);
  auto opt = make(pr);
  for (int s = 0; s < 50; ++s) {
    opt->zero_grad();
    pr.set_grads(s);
    opt->step();
  }
  const auto got = pr.values();
  ASSERT_EQ(got.size(), expected.size());
  // float32: 4e-6 relative + 1e-6 absolute (observed worst: 4.2e-7 absolute, AdamW); float64: 1e-12
  // (observed 2e-16). The orders of operations match torch; FMA contraction and ATen's vectorised
  // scalar ops round differently.
  const double rtol = dt == kFloat32 ? 4e-6 : 1e-12, atol = dt == kFloat32 ? 1e-6 : 1e-12;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], expected[i], atol + rtol * std::abs(expected[i])) << "element " << i;
}

}  // namespace

TEST(Optimizers, TrajectoriesMatchTorch) {
  run_case("sgd", kFloat32, [](Problem& p) { return std::make_unique<SGD>(p.named(), SGDOptions{.lr = 0.1}); });
  run_case("sgd_momentum", kFloat32, [](Problem& p) {
    return std::make_unique<SGD>(p.named(), SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01});
  });
  run_case("sgd_nesterov", kFloat32, [](Problem& p) {
    return std::make_unique<SGD>(p.named(), SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
  });
  run_case("adam", kFloat32, [](Problem& p) { return std::make_unique<Adam>(p.named(), AdamOptions{.lr = 0.01}); });
  run_case("adam_l2_amsgrad", kFloat32, [](Problem& p) {
    return std::make_unique<Adam>(p.named(), AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true});
  });
  run_case("adamw", kFloat32, [](Problem& p) {
    return std::make_unique<AdamW>(p.named(), AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
  });
  run_case("adamw_amsgrad", kFloat32, [](Problem& p) {
    return std::make_unique<AdamW>(
        p.named(), AdamWOptions{.lr = 0.02, .beta1 = 0.8, .beta2 = 0.99, .weight_decay = 0.1, .amsgrad = true});
  });
  run_case("rmsprop", kFloat32, [](Problem& p) { return std::make_unique<RMSprop>(p.named(), RMSpropOptions{.lr = 0.01}); });
  run_case("rmsprop_full", kFloat32, [](Problem& p) {
    return std::make_unique<RMSprop>(
        p.named(), RMSpropOptions{.lr = 0.01, .alpha = 0.9, .weight_decay = 0.01, .momentum = 0.5, .centered = true});
  });
  run_case("adam_f64", kFloat64, [](Problem& p) {
    return std::make_unique<Adam>(p.named(), AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true});
  });
  run_case("rmsprop_f64", kFloat64, [](Problem& p) {
    return std::make_unique<RMSprop>(p.named(), RMSpropOptions{.lr = 0.01, .momentum = 0.5, .centered = true});
  });
  run_case("sgd_f64", kFloat64, [](Problem& p) {
    return std::make_unique<SGD>(p.named(), SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
  });
}

TEST(Optimizers, ParamGroupsWithDifferentHyperparameters) {
  run_case("sgd_groups", kFloat32, [](Problem& p) {
    std::vector<ParamGroup> groups{{{{"w", p.w}}, {}}, {{{"b", p.b}}, {{"lr", 0.01}, {"momentum", 0.9}}}};
    return std::make_unique<SGD>(groups, SGDOptions{.lr = 0.1});
  });
  run_case("adamw_groups", kFloat32, [](Problem& p) {
    auto opt = std::make_unique<AdamW>(NamedParams{{"w", p.w}}, AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
    opt->add_param_group({{{"b", p.b}}, {{"lr", 0.001}, {"weight_decay", 0.0}}});
    EXPECT_EQ(opt->param_groups()[1].options.at("beta2"), 0.999);  // defaults fill the rest
    return opt;
  });
}

TEST(Optimizers, SplitDecayGroupsByDim) {
  Tensor w = zeros({3, 4}).requires_grad_(), b = zeros({4}).requires_grad_(), g = ones({4}).requires_grad_();
  AdamW opt(split_decay({{"fc.weight", w}, {"fc.bias", b}, {"ln.weight", g}}, 0.05), {.lr = 1e-3});
  ASSERT_EQ(opt.param_groups().size(), 2u);
  EXPECT_EQ(opt.param_groups()[0].params.size(), 1u);
  EXPECT_EQ(opt.param_groups()[0].params[0].first, "fc.weight");
  EXPECT_EQ(opt.param_groups()[0].options.at("weight_decay"), 0.05);
  EXPECT_EQ(opt.param_groups()[1].params.size(), 2u);
  EXPECT_EQ(opt.param_groups()[1].options.at("weight_decay"), 0.0);
}

TEST(Optimizers, StateDictRoundTripContinuesBitwise) {
  for (int kind = 0; kind < 4; ++kind) {
    SCOPED_TRACE(kind);
    auto make = [kind](Problem& p) -> std::unique_ptr<Optimizer> {
      switch (kind) {
        case 0: return std::make_unique<SGD>(p.named(), SGDOptions{.lr = 0.05, .momentum = 0.9});
        case 1: return std::make_unique<Adam>(p.named(), AdamOptions{.lr = 0.01, .amsgrad = true});
        case 2: return std::make_unique<AdamW>(p.named(), AdamWOptions{.lr = 0.01});
        default: return std::make_unique<RMSprop>(p.named(), RMSpropOptions{.lr = 0.01, .momentum = 0.5, .centered = true});
      }
    };
    Problem a(kFloat32), b(kFloat32);
    auto oa = make(a);
    for (int s = 0; s < 20; ++s) { oa->zero_grad(); a.set_grads(s); oa->step(); }
    OptimizerStateDict sd = oa->state_dict();
    // b starts from a's parameters and a fresh optimizer that loads a's state.
    { NoGradGuard ng; b.w.copy_(a.w); b.b.copy_(a.b); }
    auto ob = make(b);
    ob->load_state_dict(sd);
    EXPECT_EQ(ob->state().at("w").step, 20);
    for (int s = 20; s < 50; ++s) {
      oa->zero_grad(); a.set_grads(s); oa->step();
      ob->zero_grad(); b.set_grads(s); ob->step();
    }
    EXPECT_TRUE(test::bitwise_equal(a.w.contiguous(), b.w.contiguous()));
    EXPECT_TRUE(test::bitwise_equal(a.b, b.b));
    // The saved dict is a deep copy: training on did not change it.
    EXPECT_FALSE(test::bitwise_equal(sd.state.at("b").tensors.begin()->second, oa->state().at("b").tensors.begin()->second));
  }
}

TEST(Optimizers, LoadStateDictReportsEveryMismatch) {
  Problem a(kFloat32);
  Adam opt(a.named(), {.lr = 0.01});
  a.set_grads(0);
  opt.step();
  OptimizerStateDict sd = opt.state_dict();
  sd.state["ghost"] = sd.state.at("b");
  sd.state.at("w").tensors["exp_avg"] = zeros({4, 3});
  sd.param_groups[0].param_names = {"w", "c"};
  try {
    opt.load_state_dict(sd);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("3 mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find("expected parameters [w, b], got [w, c]"), std::string::npos) << m;
    EXPECT_NE(m.find("'ghost'"), std::string::npos) << m;
    EXPECT_NE(m.find("state 'w.exp_avg': expected shape [3, 4] float32, got [4, 3] float32"), std::string::npos) << m;
  }
  // Nothing was loaded: the optimizer still has its own state.
  EXPECT_EQ(opt.state().count("ghost"), 0u);
}

TEST(Optimizers, ZeroGradAndSkipsParamsWithoutGrad) {
  Problem a(kFloat32);
  SGD opt(a.named(), {.lr = 0.1});
  a.set_grads(0);
  opt.zero_grad(false);
  EXPECT_TRUE(a.w.grad().defined());
  for (double v : test::to_doubles(a.w.grad())) EXPECT_EQ(v, 0.0);
  opt.zero_grad();
  EXPECT_FALSE(a.w.grad().defined());
  // A gradient with history (backward with create_graph) is detached, then zeroed.
  Tensor x = ones({4}).requires_grad_();
  a.b.mutable_grad() = x * 2.0;
  ASSERT_TRUE(a.b.grad().grad_fn() != nullptr);
  opt.zero_grad(false);
  EXPECT_EQ(a.b.grad().grad_fn(), nullptr);
  EXPECT_FALSE(a.b.grad().requires_grad());
  EXPECT_EQ(test::to_doubles(a.b.grad()), (std::vector<double>{0, 0, 0, 0}));
  EXPECT_EQ(test::to_doubles(x), (std::vector<double>{1, 1, 1, 1}));
  opt.zero_grad();
  const auto before = a.values();
  opt.step();  // no gradients: nothing moves, no state
  EXPECT_EQ(a.values(), before);
  EXPECT_TRUE(opt.state().empty());
}

TEST(Optimizers, StateIsChargedToOptimizerState) {
  Tensor w = zeros({256, 256}).requires_grad_();
  const auto before = memory::stats()[MemoryCategory::OptimizerState].live_bytes;
  Adam opt({{"w", w}}, {.lr = 0.01});
  w.mutable_grad() = ones({256, 256});
  opt.step();
  const auto after = memory::stats()[MemoryCategory::OptimizerState].live_bytes;
  EXPECT_EQ(after - before, 2 * 256 * 256 * 4);
}

TEST(Optimizers, ValidationErrorsSayExpectedAndGot) {
  Tensor w = zeros({2}).requires_grad_();
  auto expect_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "expected ValueError with " << part;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error([&] { SGD({{"w", w}}, {.lr = -1}); }, "SGD: invalid lr: expected a value in [0, inf], got -1");
  expect_error([&] { SGD({{"w", w}}, {.lr = 0.1, .nesterov = true}); }, "nesterov momentum requires momentum > 0");
  expect_error([&] { Adam({{"w", w}}, {.beta1 = 1.0}); }, "Adam: invalid beta1: expected a value in [0, 1), got 1");
  expect_error([&] { AdamW({{"w", w}}, {.beta2 = -0.1}); }, "AdamW: invalid beta2");
  expect_error([&] { Adam({{"w", w}}, {.eps = -1e-8}); }, "invalid eps");
  expect_error([&] { RMSprop({{"w", w}}, {.alpha = -0.5}); }, "RMSprop: invalid alpha");
  expect_error([&] { SGD({{"w", w}, {"w", w}}); }, "parameter name 'w' appears in more than one place");
  expect_error([&] { SGD({{"w", w}, {"w_again", w}}); }, "parameter 'w_again' is the same tensor as parameter 'w'");
  expect_error([&] { SGD({{"i", zeros({2}, kInt64)}}); }, "expected float32 or float64, got int64");
  expect_error([&] { SGD(std::vector<ParamGroup>{{{{"w", w}}, {{"lrr", 0.1}}}}); }, "unknown hyperparameter 'lrr'");
  expect_error([&] { SGD(std::vector<ParamGroup>{{{{"w", w}}, {{"lr", -0.1}}}}); }, "invalid lr");
}

// Issue 27: a submodule that was never registered leaves the optimizer with
// nothing to train; as torch, an empty parameter list is refused, and when the
// optimizer is built from the module the error names what the module holds.
TEST(Optimizers, AnEmptyParameterListIsRefused) {
  std::string msg = test::error_message<ValueError>([] { AdamW(NamedParams{}, {}); });
  EXPECT_NE(msg.find("AdamW: optimizer got an empty parameter list"), std::string::npos) << msg;
  EXPECT_NE(msg.find("register_module"), std::string::npos) << msg;
  msg = test::error_message<ValueError>([] { SGD(split_decay(NamedParams{}, 0.1), {}); });
  EXPECT_NE(msg.find("SGD: optimizer got an empty parameter list (2 param groups"), std::string::npos) << msg;
  // One empty group next to a non-empty one is fine (split_decay of a model without biases).
  Tensor w = zeros({2, 2}).requires_grad_();
  EXPECT_NO_THROW(SGD(split_decay({{"w", w}}, 0.1), {}));

  struct Block : nn::Module {
    Block() : Module("Block") {
      act = register_module("act", std::make_shared<nn::ReLU>());
      fc = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 2, .out_features = 2});  // never registered
    }
    std::shared_ptr<nn::ReLU> act;
    std::shared_ptr<nn::Linear> fc;
  };
  Block block;
  msg = test::error_message<ValueError>([&] { Adam(block, {}); });
  EXPECT_NE(msg.find("Adam: optimizer got an empty parameter list: the module Block holds no registered parameters"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("(root) Block, 'act' ReLU"), std::string::npos) << msg;
  EXPECT_NE(msg.find("register_parameter"), std::string::npos) << msg;
  block.register_module("fc", block.fc);
  RMSprop ok(block, {});
  EXPECT_EQ(ok.param_groups()[0].params.size(), 2u);
  EXPECT_EQ(ok.param_groups()[0].params[0].first, "fc.weight");
}

// Issue 27: optimizers move (into containers, out of factories) with their state.
TEST(Optimizers, MoveKeepsParametersAndState) {
  Tensor w = ones({3}).requires_grad_();
  std::vector<AdamW> opts;
  opts.push_back(AdamW({{"w", w}}, {.lr = 0.1}));
  w.mutable_grad() = ones({3});
  opts[0].step();
  AdamW moved = std::move(opts[0]);
  EXPECT_EQ(moved.state().at("w").step, 1);
  const Tensor before = w.detach().clone();
  moved.step();
  EXPECT_FALSE(w.equal(before)) << "the moved optimizer still updates the same parameter";
  EXPECT_EQ(moved.state().at("w").step, 2);
}

TEST(Optimizers, StateFileRoundTripContinuesBitwise) {
  test::TempDir dir;
  Problem a(kFloat32), b(kFloat32);
  AdamW oa(split_decay(a.named(), 0.1), {.lr = 0.01, .amsgrad = true});
  for (int s = 0; s < 10; ++s) { oa.zero_grad(); a.set_grads(s); oa.step(); }
  save_optimizer_state(oa.state_dict(), dir.file("opt.safetensors"));
  { NoGradGuard ng; b.w.copy_(a.w); b.b.copy_(a.b); }
  AdamW ob(split_decay(b.named(), 0.5), {.lr = 0.5});  // hyperparameters come from the file
  ob.load_state_dict(load_optimizer_state(dir.file("opt.safetensors")));
  EXPECT_EQ(ob.param_groups()[0].options.at("weight_decay"), 0.1);
  EXPECT_EQ(ob.param_groups()[1].options.at("lr"), 0.01);
  EXPECT_EQ(ob.state().at("b").step, 10);
  for (int s = 10; s < 30; ++s) {
    oa.zero_grad(); a.set_grads(s); oa.step();
    ob.zero_grad(); b.set_grads(s); ob.step();
  }
  EXPECT_TRUE(test::bitwise_equal(a.w.contiguous(), b.w.contiguous()));
  EXPECT_TRUE(test::bitwise_equal(a.b, b.b));
  io::save_safetensors(dir.file("other.safetensors"), io::NamedTensors{{"x", zeros({1})}});
  EXPECT_THROW(load_optimizer_state(dir.file("other.safetensors")), FormatError);
}

TEST(Optimizers, LargeParametersSplitAcrossThreadsGiveTheSameBits) {
  // Above kGrainSize the fused kernels run in chunks on kiln's threads; elementwise
  // updates must not depend on the split.
  auto run = [](int threads) {
    const int saved = get_num_threads();
    set_num_threads(threads);
    manual_seed(3);
    Tensor w = randn({300001}).requires_grad_(), v = randn({300001}).requires_grad_();
    std::vector<std::unique_ptr<Optimizer>> opts;
    opts.push_back(std::make_unique<AdamW>(NamedParams{{"w", w}}, AdamWOptions{.lr = 0.01, .amsgrad = true}));
    opts.push_back(std::make_unique<RMSprop>(NamedParams{{"v", v}}, RMSpropOptions{.lr = 0.01, .momentum = 0.5, .centered = true}));
    for (int s = 0; s < 3; ++s) {
      w.mutable_grad() = randn({300001});
      v.mutable_grad() = randn({300001});
      for (auto& o : opts) o->step();
    }
    set_num_threads(saved);
    return std::make_pair(w, v);
  };
  auto [w1, v1] = run(1);
  auto [w4, v4] = run(4);
  EXPECT_TRUE(test::bitwise_equal(w1, w4));
  EXPECT_TRUE(test::bitwise_equal(v1, v4));
}
