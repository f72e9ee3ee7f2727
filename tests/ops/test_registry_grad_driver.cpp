// The registry driver's backward checks (ops/registry_grad.h) on custom
// Functions with right and wrong backward formulas, so the driver is known
// to catch what it should before any built-in op relies on it.
#include <gtest/gtest.h>

#include "kiln/autograd/custom_function.h"
#include "kiln/kiln.h"
#include "ops/registry_grad.h"

using namespace kiln;
using autograd::AutogradContext;
using ops::OpSample;

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

struct WrongCube : autograd::Function<WrongCube> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x) {
    ctx.save_for_backward({x});
    return x * x * x;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    Tensor x = ctx.get_saved_variables()[0];
    return {g[0] * 3 * x};  // should be 3 x^2
  }
};

// a * b; its gradients keep the broadcast shape (the engine sums them down).
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

OpSample cube_sample(std::string label, Tensor x, bool wrong = false) {
  auto run = [wrong](const TensorList& in) {
    return TensorList{wrong ? WrongCube::apply(in[0]) : Cube::apply(in[0])};
  };
  return OpSample{std::move(label), {std::move(x)}, run, "x0 ** 3", {0}};
}

struct Prepared {
  test::OracleBatch oracle;
  std::vector<OpSample> samples;
  std::vector<test::GradCase> cases;
};

// One oracle batch for every sample of this file.
const Prepared& prepared() {
  static Prepared* p = [] {
    auto* r = new Prepared();
    auto& s = r->samples;
    s.push_back(cube_sample("contiguous", ops::sample_tensor({3, 4}, kFloat32, 1)));
    s.push_back(cube_sample("noncontig", ops::sample_noncontig({4, 3}, kFloat64, 2)));
    s.push_back(cube_sample("expanded", ops::sample_tensor({1, 4}, kFloat64, 3).expand({3, 4})));
    s.push_back(cube_sample("large (fast mode)", ops::sample_noncontig({9, 9}, kFloat64, 4)));
    s.push_back(cube_sample("wrong", ops::sample_tensor({5}, kFloat64, 5), /*wrong=*/true));
    s.push_back(cube_sample("wrong, large", ops::sample_tensor({10, 10}, kFloat64, 6), /*wrong=*/true));
    s.push_back(OpSample{"broadcast", {ops::sample_tensor({3, 1}, kFloat64, 7), ops::sample_tensor({4}, kFloat64, 8)},
                         [](const TensorList& in) { return TensorList{Mul2::apply(in[0], in[1])}; }, "x0 * x1",
                         {0, 1}});
    s.push_back(OpSample{"unused input", {ops::sample_tensor({3}, kFloat64, 9), ops::sample_tensor({3}, kFloat64, 10)},
                         [](const TensorList& in) { return TensorList{Cube::apply(in[0])}; }, "x0 ** 3", {0, 1}});
    // A forward that records nothing, as an op whose backward is missing.
    s.push_back(OpSample{"no backward", {ops::sample_tensor({4}, kFloat32, 11)},
                         [](const TensorList& in) { return TensorList{in[0].detach() * 2}; }, "x0 * 2", {0}});
    for (size_t i = 0; i < s.size(); ++i) {
      r->cases.push_back(test::add_grad_case(r->oracle, "driver/" + s[i].label, s[i]));
    }
    r->oracle.run();
    return r;
  }();
  return *p;
}

struct Result {
  std::vector<std::string> vs_torch, gradcheck;
  std::string all() const {
    std::string m;
    for (const auto& f : vs_torch) m += "[torch] " + f + "\n";
    for (const auto& f : gradcheck) m += "[gradcheck] " + f + "\n";
    return m;
  }
};

Result check(const std::string& label) {
  const Prepared& p = prepared();
  for (size_t i = 0; i < p.samples.size(); ++i) {
    if (p.samples[i].label != label) continue;
    const test::GradCase& c = p.cases[i];
    EXPECT_TRUE(c.error.empty()) << c.error;
    const test::OracleOutcome& want = p.oracle.outcome(c.oracle_case);
    Result r;
    r.vs_torch = test::check_grad_against_torch("cube", p.samples[i], c, want, {1e-4, 1e-5});
    r.gradcheck = test::check_gradcheck("cube", p.samples[i]);
    return r;
  }
  ADD_FAILURE() << "no sample " << label;
  return {};
}

bool mentions(const std::vector<std::string>& fails, const std::string& text) {
  for (const auto& f : fails) {
    if (f.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST(RegistryGradDriver, RightGradientsPass) {
  for (const char* label : {"contiguous", "noncontig", "expanded", "large (fast mode)", "broadcast", "unused input"}) {
    const Result r = check(label);
    EXPECT_TRUE(r.vs_torch.empty() && r.gradcheck.empty()) << label << ":\n" << r.all();
  }
}

TEST(RegistryGradDriver, WrongGradientFailsBothChecks) {
  const Result r = check("wrong");
  EXPECT_TRUE(mentions(r.vs_torch, "gradient of x0")) << r.all();
  EXPECT_TRUE(mentions(r.gradcheck, "Jacobian mismatch")) << r.all();
  const Result large = check("wrong, large");  // 100 elements: fast mode
  EXPECT_TRUE(mentions(large.vs_torch, "gradient of x0")) << large.all();
  EXPECT_TRUE(mentions(large.gradcheck, "(fast mode)")) << large.all();
}

TEST(RegistryGradDriver, MissingBackwardIsNamed) {
  const Result r = check("no backward");
  EXPECT_TRUE(mentions(r.vs_torch, "op cube has grad_inputs but its output 0 does not require grad: backward not "
                                   "implemented"))
      << r.all();
}

TEST(RegistryGradDriver, LeavesKeepTheSampleLayoutAndLeaveItUntouched) {
  const Prepared& p = prepared();
  for (const OpSample& s : p.samples) {
    const Result r = check(s.label);
    EXPECT_FALSE(mentions(r.vs_torch, "lost the sample's layout")) << r.all();
    for (const Tensor& t : s.inputs) {
      EXPECT_FALSE(t.requires_grad()) << s.label << ": the sample's own tensor gained requires_grad";
      EXPECT_EQ(t.grad_fn(), nullptr) << s.label;
    }
  }
}

TEST(RegistryGradDriver, BadGradInputsAreReported) {
  OpSample s{"int input", {arange(3), ops::sample_tensor({3}, kFloat32, 1)},
             [](const TensorList& in) { return TensorList{in[1] * 2}; }, "x1 * 2", {0, 3, 1, 1}};
  const auto problems = test::grad_inputs_problems(s);
  EXPECT_TRUE(mentions(problems, "grad input x0 is int64")) << problems.size();
  EXPECT_TRUE(mentions(problems, "grad input 3 is out of range")) << problems.size();
  EXPECT_TRUE(mentions(problems, "grad input 1 is listed twice")) << problems.size();
}
