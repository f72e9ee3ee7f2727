// Autograd behaviours with real ops (their backward formulas beside their
// forwards): higher-order gradients of a small MLP against PyTorch,
// accumulation, retain_graph, no_grad, hooks, diamonds, a 10,000-node chain,
// the in-place error, anomaly mode and inference tensors. test_engine.cpp
// checks the same engine paths through custom Functions.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "kiln/autograd/anomaly.h"
#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "support/compare.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

Tensor randn64(IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, kFloat64, &g);
}

// A 3 -> 5 -> 2 MLP on 4 samples, float64: linear, tanh, linear.
struct Mlp {
  Tensor x = randn64({4, 3}, 1), w1 = randn64({5, 3}, 2), b1 = randn64({5}, 3), w2 = randn64({2, 5}, 4),
         b2 = randn64({2}, 5);
  Tensor forward(const Tensor& in) const { return linear(linear(in, w1, b1).tanh(), w2, b2); }
  TensorList params() const { return {w1, b1, w2, b2}; }
  void require_grad() {
    for (Tensor* t : {&x, &w1, &b1, &w2, &b2}) t->requires_grad_();
  }
};

// The torch spelling of Mlp::forward over x0 (input) and x1..x4 (w1, b1, w2, b2).
constexpr const char* kTorchMlp = "F.linear(torch.tanh(F.linear(x, W1, b1)), W2, b2)";

// Undefined on one side matches an all-zero tensor (or undefined) on the other.
void expect_grads_match(const TensorList& got, const std::vector<Tensor>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    if (!got[k].defined() || !want[k].defined()) {
      const Tensor& d = got[k].defined() ? got[k] : want[k];
      if (d.defined()) {
        EXPECT_TRUE(d.eq(0).all().item<bool>()) << what << " " << k << ": undefined on one side, nonzero on the other";
      }
      continue;
    }
    const auto c = test::compare_tensors(got[k], want[k], 1e-9, 1e-11);
    EXPECT_TRUE(c.ok) << what << " gradient " << k << ": " << c.message;
  }
}

std::string file_line(int line) { return "test_real_ops.cpp:" + std::to_string(line); }

}  // namespace

// Gradient penalty (WGAN-GP style): d/dθ ||d out/d x||², through create_graph=true.
TEST(RealOps, GradientPenaltyMatchesTorch) {
  Mlp m;
  m.require_grad();
  Tensor out = m.forward(m.x).sum();
  Tensor gx = autograd::grad({out}, {m.x}, {}, std::nullopt, /*create_graph=*/true)[0];
  ASSERT_TRUE(gx.requires_grad()) << "create_graph=true must give a differentiable gradient";
  Tensor penalty = (gx * gx).sum();
  TensorList got = autograd::grad({penalty}, m.params(), {}, std::nullopt, false, /*allow_unused=*/true);
  EXPECT_FALSE(got[3].defined() && got[3].ne(0).any().item<bool>()) << "the penalty does not depend on b2";

  const test::OracleOutcome want = test::torch_eval(
      std::string("(lambda x, W1, b1, W2, b2: (lambda gx: torch.autograd.grad((gx * gx).sum(), [W1, b1, W2, b2], "
                  "allow_unused=True))(torch.autograd.grad(") +
          kTorchMlp +
          ".sum(), x, create_graph=True)[0]))(x0.requires_grad_(), x1.requires_grad_(), x2.requires_grad_(), "
          "x3.requires_grad_(), x4.requires_grad_())",
      {m.x.detach(), m.w1.detach(), m.b1.detach(), m.w2.detach(), m.b2.detach()});
  ASSERT_TRUE(want.ok) << want.error;
  expect_grads_match(got, want.outputs, "gradient penalty");
}

// Hessian-vector product of a squared-output loss w.r.t. all parameters.
TEST(RealOps, HessianVectorProductMatchesTorch) {
  Mlp m;
  m.require_grad();
  const TensorList v = {randn64({5, 3}, 6), randn64({5}, 7), randn64({2, 5}, 8), randn64({2}, 9)};
  Tensor y = m.forward(m.x.detach());
  Tensor loss = (y * y).sum();
  TensorList g = autograd::grad({loss}, m.params(), {}, std::nullopt, /*create_graph=*/true);
  Tensor gv = (g[0] * v[0]).sum() + (g[1] * v[1]).sum() + (g[2] * v[2]).sum() + (g[3] * v[3]).sum();
  TensorList hv = autograd::grad({gv}, m.params());

  const test::OracleOutcome want = test::torch_eval(
      std::string("(lambda W1, b1, W2, b2, v: (lambda p: torch.autograd.grad(sum((g * u).sum() for g, u in zip("
                  "torch.autograd.grad(((lambda x: ") +
          kTorchMlp +
          ")(x0) ** 2).sum(), p, create_graph=True), v)), p))([W1, b1, W2, b2]))(x1.requires_grad_(), "
          "x2.requires_grad_(), x3.requires_grad_(), x4.requires_grad_(), [x5, x6, x7, x8])",
      {m.x.detach(), m.w1.detach(), m.b1.detach(), m.w2.detach(), m.b2.detach(), v[0], v[1], v[2], v[3]});
  ASSERT_TRUE(want.ok) << want.error;
  expect_grads_match(hv, want.outputs, "Hessian-vector product");
}

TEST(RealOps, GradientsAccumulateOverTwoBackwards) {
  Tensor x = tensor<float>({1, 2, 3}).requires_grad_();
  Tensor w = tensor<float>({4, 5, 6});
  (x * w).sum().backward();
  (x * w).sum().backward();
  EXPECT_TRUE(x.grad().allclose(tensor<float>({8, 10, 12})));
  EXPECT_EQ(x.grad().storage()->category(), MemoryCategory::Gradient);
}

TEST(RealOps, SecondBackwardNeedsRetainGraph) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  Tensor s = x.exp().sum();
  s.backward();
  // torch: "Trying to backward through the graph a second time (or directly access saved tensors
  // after they have already been freed). ... Specify retain_graph=True if you need to backward
  // through the graph a second time ..."
  try {
    s.backward();
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("ExpBackward0 a second time"), std::string::npos) << m;
    EXPECT_NE(m.find("retain_graph=true"), std::string::npos) << m;
  }
  x.mutable_grad() = Tensor();
  Tensor t = x.exp().sum();
  t.backward({}, /*retain_graph=*/true);
  t.backward();
  EXPECT_TRUE(x.grad().allclose(x.detach().exp() * 2));
}

TEST(RealOps, NoGradBlocksRecording) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  {
    NoGradGuard ng;
    Tensor y = (x * 2).exp().sum();
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    {
      EnableGradGuard eg;
      EXPECT_NE((x * 2).grad_fn(), nullptr);
    }
  }
  Tensor z = x * 2;
  ASSERT_NE(z.grad_fn(), nullptr);
  EXPECT_STREQ(z.grad_fn()->name(), "MulBackward0");
}

TEST(RealOps, HooksFireInOrderAndCanBeRemoved) {
  Tensor x = tensor<double>({1.0, 2.0}).requires_grad_();
  Tensor y = x * 3;
  std::vector<int> order;
  auto h1 = y.register_hook([&](const Tensor& g) {
    order.push_back(1);
    return g * 10;
  });
  auto h2 = y.register_hook([&](const Tensor& g) {
    order.push_back(2);
    EXPECT_TRUE(g.allclose(tensor<double>({10.0, 10.0}))) << "the second hook sees the first one's result";
    return Tensor();
  });
  auto hx = x.register_hook([&](const Tensor& g) {
    order.push_back(3);
    return g;
  });
  y.sum().backward({}, /*retain_graph=*/true);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(x.grad().allclose(tensor<double>({30.0, 30.0})));
  h1.remove();
  h2.remove();
  hx.remove();
  order.clear();
  x.mutable_grad() = Tensor();
  y.sum().backward();
  EXPECT_TRUE(order.empty());
  EXPECT_TRUE(x.grad().allclose(tensor<double>({3.0, 3.0})));
}

TEST(RealOps, DiamondGraphSumsBothPaths) {
  Tensor x = tensor<double>({0.5, -1.0}).requires_grad_();
  Tensor a = x * 3, b = x.exp();
  (a * b).sum().backward();  // d(3x e^x)/dx = 3 e^x (1 + x)
  Tensor e = x.detach().exp();
  EXPECT_TRUE(x.grad().allclose(e * 3 * (x.detach() + 1)));
}

TEST(RealOps, TenThousandNodeChain) {
  Tensor x = tensor<double>({2.0}).requires_grad_();
  Tensor y = x;
  for (int i = 0; i < 10000; ++i) y = y * 1.0001;
  y.sum().backward();
  EXPECT_NEAR(x.grad().item<double>(), std::pow(1.0001, 10000), 1e-9);
  y = Tensor();
}

TEST(RealOps, InPlaceChangeOfASavedOutputNamesBothSites) {
  Tensor x = tensor<float>({1, 2, 3, 4}).requires_grad_();
  Tensor y = x.exp(); const int exp_line = __LINE__;
  y.add_(1); const int add_line = __LINE__;
  // PyTorch, for the same program:
  //   RuntimeError: one of the variables needed for gradient computation has been modified by an
  //   inplace operation: [torch.FloatTensor [4]], which is output 0 of ExpBackward0, is at version 1;
  //   expected version 0 instead. Hint: enable anomaly detection to find the operation that failed
  //   to compute its gradient, with torch.autograd.set_detect_anomaly(True).
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("output 0 of ExpBackward0 [4] float32"), std::string::npos) << m;
    EXPECT_NE(m.find("saved by:    ExpBackward0 (forward at "), std::string::npos) << m;
    EXPECT_NE(m.find(file_line(exp_line)), std::string::npos) << m;
    EXPECT_NE(m.find("modified by: add_ at "), std::string::npos) << m;
    EXPECT_NE(m.find(file_line(add_line)), std::string::npos) << m;
    EXPECT_NE(m.find("saved at version 0, now at version 1"), std::string::npos) << m;
  }
}

TEST(RealOps, InPlaceOnALeafThatRequiresGradIsAnError) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  // torch: "a leaf Variable that requires grad is being used in an in-place operation."
  EXPECT_THROW(x.add_(1), ValueError);
  NoGradGuard ng;
  x.add_(1);
  EXPECT_TRUE(x.detach().allclose(tensor<float>({2, 3})));
}

TEST(RealOps, AnomalyModeNamesTheForwardOpThatMadeANaN) {
  autograd::AnomalyModeGuard anomaly;
  Tensor x = tensor<double>({-1.0, 4.0}).requires_grad_();
  const int line = __LINE__ + 2;
  try {
    (void)x.log();
    FAIL() << "expected an anomaly";
  } catch (const autograd::AnomalyError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the forward of LogBackward0 produced 1 NaN"), std::string::npos) << m;
    EXPECT_NE(m.find(file_line(line)), std::string::npos) << m;
    EXPECT_NE(m.find("input 0 [2]: min -1, max 4, 0 NaN, 0 Inf of 2 elements"), std::string::npos) << m;
  }
}

TEST(RealOps, AnomalyModeNamesTheBackwardOpThatMadeAnInf) {
  autograd::AnomalyModeGuard anomaly;
  Tensor x = tensor<double>({0.0, 4.0}).requires_grad_();
  Tensor s = x.sqrt().sum(); const int line = __LINE__;  // finite; d sqrt(x)/dx = 1 / (2 sqrt(x)) is inf at 0
  try {
    s.backward();
    FAIL() << "expected an anomaly";
  } catch (const autograd::AnomalyError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the backward of SqrtBackward0 returned"), std::string::npos) << m;
    EXPECT_NE(m.find("1 Inf"), std::string::npos) << m;
    EXPECT_NE(m.find("(forward at "), std::string::npos) << m;
    EXPECT_NE(m.find(file_line(line)), std::string::npos) << m;
  }
}

// With KILN_DETECT_ANOMALY=1 the same forward NaN is reported without a guard (checked in a child
// process, since the variable is read once per process); without it, nothing is checked.
TEST(RealOpsAnomalyEnv, DefaultFollowsTheEnvironment) {
  const char* env = std::getenv("KILN_DETECT_ANOMALY");
  const bool on = env && *env && std::string(env) != "0";
  Tensor x = tensor<double>({-1.0, 4.0}).requires_grad_();
  if (!on) {
    EXPECT_NO_THROW((void)x.log());
    return;
  }
  try {
    (void)x.log();
    ADD_FAILURE() << "expected an anomaly";
  } catch (const autograd::AnomalyError& e) {
    std::cout << "child saw: " << e.what() << "\n";
  }
}

TEST(RealOpsAnomalyEnv, VariableTurnsItOn) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string out;
  const int rc = test::run_command("KILN_DETECT_ANOMALY=1 " + test::shell_quote(self) +
                                       " --gtest_filter=RealOpsAnomalyEnv.DefaultFollowsTheEnvironment",
                                   out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("child saw: anomaly mode: the forward of LogBackward0 produced 1 NaN"), std::string::npos)
      << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
}

TEST(RealOps, InferenceTensorsCannotBeSavedForBackward) {
  Tensor w;
  {
    InferenceModeGuard inference;
    w = tensor<float>({1, 2});
    EXPECT_EQ((w * 2).grad_fn(), nullptr);
  }
  Tensor x = tensor<float>({3, 4}).requires_grad_();
  // torch: "Inference tensors cannot be saved for backward. To work around you can make a clone to
  // get a normal tensor and use it in autograd."
  try {
    (void)(x * w);  // MulBackward0 saves w
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("inference tensors cannot be saved for backward"), std::string::npos)
        << e.what();
  }
  (x * w.clone()).sum().backward();
  EXPECT_TRUE(x.grad().allclose(tensor<float>({1, 2})));
}
