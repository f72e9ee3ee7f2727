// Engine behaviours exercised through custom Functions, so they do not
// depend on any built-in op's backward.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "kiln/autograd/anomaly.h"
#include "kiln/autograd/custom_function.h"
#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;
using autograd::AutogradContext;

namespace {

struct Cube : autograd::Function<Cube> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x) {
    ctx.save_for_backward({x});
    return x * x * x;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    Tensor x = ctx.get_saved_variables()[0];
    return {g[0] * 3 * x * x};
  }
};

// y = a * b with both gradients; saves both inputs.
struct Mul2 : autograd::Function<Mul2> {
  static Tensor forward(AutogradContext& ctx, const Tensor& a, const Tensor& b) {
    ctx.save_for_backward({a, b});
    return a * b;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    auto s = ctx.get_saved_variables();
    return {g[0] * s[1], g[0] * s[0]};
  }
};

// Identity whose backward scales by a constant (to chain many nodes cheaply).
struct Scale : autograd::Function<Scale> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, double k) {
    ctx.saved_data["k"] = k;
    return x * k;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    return {g[0] * std::any_cast<double>(ctx.saved_data["k"])};
  }
};

// Sum to a scalar (so tests need no reduction backward).
struct Sum : autograd::Function<Sum> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x) {
    ctx.saved_data["shape"] = x.sizes().vec();
    Tensor c = x.contiguous().to(kFloat64);
    double s = 0;
    for (int64_t i = 0; i < c.numel(); ++i) s += c.data_ptr<double>()[i];
    return scalar_tensor(s, x.dtype());
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    auto shape = std::any_cast<std::vector<int64_t>>(ctx.saved_data["shape"]);
    return {g[0].expand(shape)};
  }
};

// sqrt with its true derivative 0.5 / sqrt(x): infinite at 0.
struct Sqrt : autograd::Function<Sqrt> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x) {
    Tensor y = x.sqrt();
    ctx.save_for_backward({y});
    return y;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    return {g[0] * 0.5 / ctx.get_saved_variables()[0]};
  }
};

// log with derivative 1 / x (NaN forward for x < 0).
struct Log : autograd::Function<Log> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x) {
    ctx.save_for_backward({x});
    return x.log();
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) { return {g[0] / ctx.get_saved_variables()[0]}; }
};

}  // namespace

TEST(Engine, LeafFlagsAndGradFn) {
  Tensor x = tensor<float>({1, 2, 3}).requires_grad_();
  EXPECT_TRUE(x.is_leaf());
  EXPECT_EQ(x.grad_fn(), nullptr);
  Tensor y = Cube::apply(x);
  EXPECT_FALSE(y.is_leaf());
  EXPECT_TRUE(y.requires_grad());
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "CubeBackward");
  EXPECT_THROW(arange(3).requires_grad_(), DTypeError);
}

TEST(Engine, CustomFunctionGradientAndAccumulation) {
  Tensor x = tensor<float>({1, 2, 3}).requires_grad_();
  Sum::apply(Cube::apply(x)).backward();
  EXPECT_TRUE(x.grad().allclose(tensor<float>({3, 12, 27})));
  Sum::apply(Cube::apply(x)).backward();  // gradients accumulate across backward calls
  EXPECT_TRUE(x.grad().allclose(tensor<float>({6, 24, 54})));
  EXPECT_EQ(x.grad().storage()->category(), MemoryCategory::Gradient);
}

TEST(Engine, DiamondGraphSumsBothPaths) {
  Tensor x = tensor<double>({2.0}).requires_grad_();
  Tensor a = Scale::apply(x, 3.0), b = Scale::apply(x, 5.0);
  Sum::apply(Mul2::apply(a, b)).backward();  // d(15 x^2)/dx = 30 x
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 60.0);
}

TEST(Engine, SecondBackwardWithoutRetainGraphNamesTheFix) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  Tensor s = Sum::apply(Cube::apply(x));
  s.backward();
  try {
    s.backward();
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph=true"), std::string::npos) << e.what();
  }
  Tensor t = Sum::apply(Cube::apply(x));
  x.mutable_grad() = Tensor();
  t.backward({}, /*retain_graph=*/true);
  t.backward();
  EXPECT_TRUE(x.grad().allclose(tensor<float>({6, 24})));
}

TEST(Engine, NonScalarNeedsGradient) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  Tensor y = Cube::apply(x);
  EXPECT_THROW(y.backward(), ValueError);
  y.backward(ones({2}));
  EXPECT_TRUE(x.grad().allclose(tensor<float>({3, 12})));
}

TEST(Engine, NoGradBlocksRecording) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  {
    NoGradGuard ng;
    Tensor y = Cube::apply(x);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
  }
  Tensor z = Cube::apply(x.detach());
  EXPECT_FALSE(z.requires_grad());
}

TEST(Engine, DeepChainIsIterative) {
  Tensor x = tensor<double>({1.0}).requires_grad_();
  Tensor y = x;
  for (int i = 0; i < 10000; ++i) y = Scale::apply(y, 1.0);
  Sum::apply(y).backward();
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 1.0);
  y = Tensor();
}

TEST(Engine, FreeingAVeryDeepGraphDoesNotRecurse) {
  Tensor x = tensor<double>({1.0}).requires_grad_();
  Tensor y = x;
  for (int i = 0; i < 300000; ++i) y = Scale::apply(y, 1.0);
  y = Tensor();  // would overflow the stack if each node freed the next recursively
  SUCCEED();
}

TEST(Engine, HooksFireInOrderReplaceAndRemove) {
  Tensor x = tensor<double>({1.0, 2.0}).requires_grad_();
  std::vector<int> order;
  Tensor y = Scale::apply(x, 2.0);
  auto h1 = y.register_hook([&](const Tensor& g) { order.push_back(1); return g * 10; });
  auto h2 = y.register_hook([&](const Tensor& g) { order.push_back(2); return Tensor(); });
  int post = 0;
  auto hp = x.register_post_accumulate_grad_hook([&](Tensor& leaf) {
    ++post;
    EXPECT_TRUE(leaf.grad().defined());
  });
  Sum::apply(y).backward({}, true);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_TRUE(x.grad().allclose(tensor<double>({20.0, 20.0})));
  EXPECT_EQ(post, 1);
  h1.remove();
  h2.remove();
  hp.remove();
  x.mutable_grad() = Tensor();
  Sum::apply(y).backward();
  EXPECT_TRUE(x.grad().allclose(tensor<double>({2.0, 2.0})));
  EXPECT_EQ(post, 1);
}

TEST(Engine, RetainGradOnNonLeaf) {
  Tensor x = tensor<double>({1.0, 2.0}).requires_grad_();
  Tensor y = Cube::apply(x);
  y.retain_grad();
  Sum::apply(y).backward();
  ASSERT_TRUE(y.grad().defined());
  EXPECT_TRUE(y.grad().allclose(ones({2}, kFloat64)));
}

TEST(Engine, GradFunctionDoesNotTouchDotGrad) {
  Tensor x = tensor<double>({1.0, 2.0}).requires_grad_();
  Tensor w = tensor<double>({3.0}).requires_grad_();
  Tensor s = Sum::apply(Cube::apply(x));
  auto g = autograd::grad({s}, {x});
  EXPECT_TRUE(g[0].allclose(tensor<double>({3.0, 12.0})));
  EXPECT_FALSE(x.grad().defined());
  Tensor s2 = Sum::apply(Cube::apply(x));
  EXPECT_THROW(autograd::grad({s2}, {x, w}), ValueError);  // w unused
  Tensor s3 = Sum::apply(Cube::apply(x));
  auto g3 = autograd::grad({s3}, {x, w}, {}, std::nullopt, false, /*allow_unused=*/true);
  EXPECT_FALSE(g3[1].defined());
}

TEST(Engine, InPlaceModificationOfSavedTensorNamesEverything) {
  Tensor x = tensor<float>({1, 2, 3, 4}).requires_grad_();
  autograd::set_name(x, "layer.weight");
  Tensor y = Cube::apply(x);
  {
    NoGradGuard ng;
    x.add_(1);
  }
  Tensor s = Sum::apply(y);
  // PyTorch, for the same program:
  //   RuntimeError: one of the variables needed for gradient computation has been modified by
  //   an inplace operation: [torch.FloatTensor [4]] is at version 1; expected version 0 instead.
  //   Hint: enable anomaly detection to find the operation that failed to compute its gradient...
  try {
    s.backward();
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parameter 'layer.weight' [4] float32"), std::string::npos) << m;
    EXPECT_NE(m.find("saved by:    CubeBackward"), std::string::npos) << m;
    EXPECT_NE(m.find("saved at version 0, now at version 1"), std::string::npos) << m;
  }
}

TEST(Engine, InPlaceOnLeafThatRequiresGradIsAnError) {
  Tensor x = tensor<float>({1, 2}).requires_grad_();
  autograd::set_name(x, "fc.bias");
  try {
    autograd::check_inplace(x, "add_");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'fc.bias'"), std::string::npos) << e.what();
  }
  NoGradGuard ng;
  EXPECT_NO_THROW(autograd::check_inplace(x, "add_"));
}

TEST(Engine, AnomalyModeNamesTheBackwardNode) {
  autograd::AnomalyModeGuard anomaly;
  Tensor x = tensor<double>({0.0, 4.0}).requires_grad_();
  Tensor s = Sum::apply(Sqrt::apply(x));
  try {
    s.backward();
    FAIL() << "expected an anomaly";
  } catch (const autograd::AnomalyError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("SqrtBackward"), std::string::npos) << m;
    EXPECT_NE(m.find("1 Inf"), std::string::npos) << m;
  }
}

TEST(Engine, GradcheckPassesForCorrectAndFailsForWrongGradient) {
  Tensor x = tensor<double>({0.5, -1.5, 2.0}).requires_grad_();
  EXPECT_TRUE(autograd::gradcheck([](const TensorList& in) { return TensorList{Cube::apply(in[0])}; }, {x}));
  struct WrongCube : autograd::Function<WrongCube> {
    static Tensor forward(AutogradContext&, const Tensor& x) { return x * x * x; }
    static TensorList backward(AutogradContext&, TensorList g) { return {g[0] * 3}; }
  };
  EXPECT_THROW(autograd::gradcheck([](const TensorList& in) { return TensorList{WrongCube::apply(in[0])}; }, {x}),
               ValueError);
  autograd::GradcheckOptions quiet;
  quiet.raise = false;
  EXPECT_FALSE(autograd::gradcheck([](const TensorList& in) { return TensorList{WrongCube::apply(in[0])}; }, {x},
                                   quiet));
}

TEST(Engine, GradcheckFastModeComparesRandomProjections) {
  // 2 x 40 inputs, 40 outputs: fast mode checks u^T J v per (output, input) pair.
  Tensor a = randn({40}, kFloat64).requires_grad_();
  Tensor b = randn({40}, kFloat64).requires_grad_();
  autograd::GradcheckOptions fast;
  fast.fast_mode = true;
  auto mul = [](const TensorList& in) { return TensorList{Mul2::apply(in[0], in[1]), Cube::apply(in[0])}; };
  EXPECT_TRUE(autograd::gradcheck(mul, {a, b}, fast));
  // A backward that swaps the operands' gradients passes no projection.
  struct SwappedMul : autograd::Function<SwappedMul> {
    static Tensor forward(AutogradContext& ctx, const Tensor& x, const Tensor& y) {
      ctx.save_for_backward({x, y});
      return x * y;
    }
    static TensorList backward(AutogradContext& ctx, TensorList g) {
      auto s = ctx.get_saved_variables();
      return {g[0] * s[0], g[0] * s[1]};
    }
  };
  try {
    autograd::gradcheck([](const TensorList& in) { return TensorList{SwappedMul::apply(in[0], in[1])}; }, {a, b},
                        fast);
    FAIL() << "expected a mismatch";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("gradcheck (fast mode): mismatch for output 0 w.r.t. input "), std::string::npos) << m;
    EXPECT_NE(m.find("fast_mode=false"), std::string::npos) << m;
  }
  // An output that does not require grad but moves with the input is caught too.
  fast.raise = false;
  EXPECT_FALSE(autograd::gradcheck([](const TensorList& in) { return TensorList{in[0].detach() * 2}; }, {a}, fast));
}

TEST(Engine, GradcheckFastModeLeavesInputsUnchanged) {
  Tensor x = randn({8, 9}, kFloat64).transpose(0, 1).requires_grad_();  // non-contiguous leaf
  Tensor before = x.detach().clone();
  const uint32_t version = x.version();
  autograd::GradcheckOptions fast;
  fast.fast_mode = true;
  EXPECT_TRUE(autograd::gradcheck([](const TensorList& in) { return TensorList{Cube::apply(in[0])}; }, {x}, fast));
  EXPECT_TRUE(x.detach().equal(before));
  EXPECT_EQ(x.version(), version);
}

TEST(Engine, InferenceTensorsCannotBeSavedForBackward) {
  Tensor w;
  {
    InferenceModeGuard inference;
    w = tensor<float>({1, 2});
  }
  Tensor x = tensor<float>({3, 4}).requires_grad_();
  // torch: "Inference tensors cannot be saved for backward. To work around you can make a clone to
  // get a normal tensor and use it in autograd."
  try {
    (void)Mul2::apply(x, w);
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("inference tensors cannot be saved for backward"), std::string::npos) << m;
    EXPECT_NE(m.find("clone()"), std::string::npos) << m;
  }
  Tensor y = Mul2::apply(x, w.clone());  // a clone made outside inference mode is a normal tensor
  Sum::apply(y).backward();
  EXPECT_TRUE(x.grad().allclose(tensor<float>({1, 2})));
}

// Run in-process, this checks the default follows KILN_DETECT_ANOMALY (normally unset: off);
// AnomalyEnv.VariableTurnsItOn runs it again in a child process with the variable set.
TEST(AnomalyEnv, DefaultFollowsTheEnvironment) {
  const char* env = std::getenv("KILN_DETECT_ANOMALY");
  const bool on = env && *env && std::string(env) != "0";
  EXPECT_EQ(autograd::anomaly_mode_enabled(), on);
  Tensor x = tensor<double>({-1.0, 4.0}).requires_grad_();
  if (!on) {
    EXPECT_NO_THROW((void)Log::apply(x));  // a NaN goes unnoticed without anomaly mode
    return;
  }
  try {
    (void)Log::apply(x);
    ADD_FAILURE() << "expected an anomaly";
  } catch (const autograd::AnomalyError& e) {
    std::cout << "child saw: " << e.what() << "\n";
  }
}

TEST(AnomalyEnv, VariableTurnsItOn) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string out;
  const int rc = test::run_command("KILN_DETECT_ANOMALY=1 " + test::shell_quote(self) +
                                       " --gtest_filter=AnomalyEnv.DefaultFollowsTheEnvironment",
                                   out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("child saw: anomaly mode: the forward of LogBackward produced 1 NaN"), std::string::npos)
      << out;
  EXPECT_NE(out.find("input 0 [2]: min -1, max 4"), std::string::npos) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
}
