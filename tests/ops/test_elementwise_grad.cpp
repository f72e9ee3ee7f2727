// Backward of the elementwise family (binary.cpp, pow_minmax.cpp, unary.cpp):
// float64 gradcheck of every differentiable op (broadcast, non-contiguous and
// Scalar operands), gradgradcheck where the formula is differentiable,
// PyTorch's choices at kinks and ties, in-place history rewriting and its
// errors, mixed dtypes, and the ops that record nothing.
//
// Expected gradients were computed with /usr/bin/python3 torch 1.13
// (torch.set_num_threads(1), float64) from the inputs beside them; see each test.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "kiln/ops/elementwise.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

using Fn = std::function<Tensor(const TensorList&)>;

// Uniform values in [lo, hi), float64, a leaf that requires grad.
Tensor leaf(IntArrayRef shape, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  Generator gen(seed);
  Tensor t = rand(shape, kFloat64, &gen) * (hi - lo) + lo;
  return t.requires_grad_();
}

// The same, non-contiguous: the transpose of a [n, m] tensor (2-D shapes only).
Tensor leaf_t(IntArrayRef shape, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  Generator gen(seed);
  Tensor t = (rand({shape[1], shape[0]}, kFloat64, &gen) * (hi - lo) + lo).t();
  EXPECT_FALSE(t.is_contiguous());
  return t.requires_grad_();
}

Tensor values(std::vector<double> v) { return tensor<double>(v).requires_grad_(); }

void expect_gradcheck(const Fn& f, const TensorList& inputs) {
  try {
    EXPECT_TRUE(autograd::gradcheck([&](const TensorList& in) { return TensorList{f(in)}; }, inputs));
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
}

void expect_gradgradcheck(const Fn& f, const TensorList& inputs) {
  try {
    EXPECT_TRUE(autograd::gradgradcheck([&](const TensorList& in) { return TensorList{f(in)}; }, inputs));
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
}

// d(sum(y))/dx without depending on sum's backward: backward with ones.
Tensor grad_of_sum(const Tensor& y, const Tensor& x) {
  return autograd::grad({y}, {x}, {ones_like(y)})[0];
}

void expect_values(const Tensor& got, const std::vector<double>& expected, double tol = 1e-12) {
  ASSERT_TRUE(got.defined());
  const std::vector<double> v = test::to_doubles(got);
  ASSERT_EQ(v.size(), expected.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isinf(expected[i])) EXPECT_EQ(v[i], expected[i]) << "element " << i;
    else EXPECT_NEAR(v[i], expected[i], tol) << "element " << i;
  }
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return {};
}

}  // namespace

// ---- binary ops ----

TEST(ElementwiseGrad, AddSubWithAlphaBroadcastAndScalars) {
  const Tensor a = leaf({3, 1, 4}, 1), b = leaf({5, 4}, 2);
  expect_gradcheck([](const TensorList& x) { return x[0].add(x[1]); }, {a, b});
  expect_gradcheck([](const TensorList& x) { return x[0].add(x[1], 2.5); }, {a, b});
  expect_gradcheck([](const TensorList& x) { return x[0].sub(x[1], -3); }, {a, b});
  expect_gradcheck([](const TensorList& x) { return x[0] - x[1]; }, {a, b});
  expect_gradcheck([](const TensorList& x) { return x[0].add(1.5, 2); }, {a});
  expect_gradcheck([](const TensorList& x) { return x[0].sub(1.5); }, {a});
  expect_gradcheck([](const TensorList& x) { return rsub(x[0], 1.5, 2); }, {a});
  expect_gradcheck([](const TensorList& x) { return 2 - x[0]; }, {a});
  expect_gradcheck([](const TensorList& x) { return 2 + x[0]; }, {a});
  expect_gradcheck([](const TensorList& x) { return x[0] + x[1]; }, {leaf_t({3, 4}, 3), leaf({4}, 4)});
}

TEST(ElementwiseGrad, MulDivBroadcastNoncontigAndScalars) {
  const Tensor a = leaf({3, 1, 4}, 5), b = leaf({5, 4}, 6, 0.5, 2.0);
  expect_gradcheck([](const TensorList& x) { return x[0].mul(x[1]); }, {a, b});
  expect_gradcheck([](const TensorList& x) { return x[0] * x[1]; }, {leaf_t({4, 3}, 7), leaf_t({4, 3}, 8)});
  expect_gradcheck([](const TensorList& x) { return x[0] * x[0]; }, {a});
  expect_gradcheck([](const TensorList& x) { return x[0].mul(-1.5); }, {a});
  expect_gradcheck([](const TensorList& x) { return 3 * x[0]; }, {a});
  expect_gradcheck([](const TensorList& x) { return x[0].div(x[1]); }, {a, b});
  expect_gradcheck([](const TensorList& x) { return x[0] / x[1]; }, {leaf_t({4, 3}, 9), leaf_t({4, 3}, 10, 0.5, 2)});
  expect_gradcheck([](const TensorList& x) { return x[0].div(4); }, {a});
  expect_gradcheck([](const TensorList& x) { return div(2.5, x[0]); }, {b});
  expect_gradcheck([](const TensorList& x) { return 2 / x[0]; }, {b});
  // A 0-dim operand broadcast against a matrix.
  expect_gradcheck([](const TensorList& x) { return x[0] * x[1]; }, {leaf({3, 4}, 11), leaf({}, 12)});
  expect_gradcheck([](const TensorList& x) { return x[0] / x[1]; }, {leaf({3, 4}, 13), leaf({}, 14, 0.5, 2)});
}

TEST(ElementwiseGrad, PowAllForms) {
  const Tensor base = leaf({3, 4}, 15, 0.5, 2.0), e = leaf({3, 4}, 16, -1.5, 1.5);
  expect_gradcheck([](const TensorList& x) { return x[0].pow(x[1]); }, {base, e});
  expect_gradcheck([](const TensorList& x) { return x[0].pow(x[1]); }, {leaf({3, 1}, 17, 0.5, 2), leaf({4}, 18)});
  expect_gradcheck([](const TensorList& x) { return pow(x[0], x[1]); }, {leaf_t({4, 3}, 19, 0.5, 2), leaf_t({4, 3}, 20)});
  for (const Scalar s : {Scalar(2), Scalar(3), Scalar(0.5), Scalar(-0.5), Scalar(-1), Scalar(-2), Scalar(1.7),
                         Scalar(1), Scalar(0)}) {
    expect_gradcheck([s](const TensorList& x) { return x[0].pow(s); }, {base});
  }
  expect_gradcheck([](const TensorList& x) { return pow(2.5, x[0]); }, {e});
  expect_gradcheck([](const TensorList& x) { return pow(0.5, x[0]); }, {leaf_t({4, 3}, 21)});
}

// pow at base 0 follows torch: d/dexponent is 0 where base == 0 and exponent >= 0,
// d/dbase is 0 where exponent == 0. torch, float64:
//   b = [0, 0, 0, 2, -1]; e = [0, 2, -1, 0.5, 0.5]; torch.pow(b, e).backward(ones)
//   b.grad = [0, 0, -inf, 0.3535533905932738, nan], e.grad = [0, 0, -inf, 0.9802581434685472, nan]
//   torch.pow(0.0, e).backward(ones): e.grad = [0, 0, -inf, 0, 0]
//   b.pow(0).backward(ones): b.grad = 0; b.pow(0.5): [inf, inf, inf, 0.35355339059327373, nan]
TEST(ElementwiseGrad, PowAtBaseZeroFollowsTorch) {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor b = values({0, 0, 0, 2, -1}), e = values({0, 2, -1, 0.5, 0.5});
  auto g = autograd::grad({b.pow(e)}, {b, e}, {ones({5}, kFloat64)});
  const auto gb = test::to_doubles(g[0]), ge = test::to_doubles(g[1]);
  EXPECT_EQ(gb[0], 0);
  EXPECT_EQ(gb[1], 0);
  EXPECT_EQ(gb[2], -inf);
  EXPECT_NEAR(gb[3], 0.3535533905932738, 1e-15);
  EXPECT_TRUE(std::isnan(gb[4]));
  EXPECT_EQ(ge[0], 0);
  EXPECT_EQ(ge[1], 0);
  EXPECT_EQ(ge[2], -inf);
  EXPECT_NEAR(ge[3], 0.9802581434685472, 1e-15);
  EXPECT_TRUE(std::isnan(ge[4]));
  expect_values(grad_of_sum(pow(0.0, e), e), {0, 0, -inf, 0, 0});
  expect_values(grad_of_sum(b.pow(0), b), {0, 0, 0, 0, 0});
  const auto half = test::to_doubles(grad_of_sum(b.pow(0.5), b));
  EXPECT_EQ(half[0], inf);
  EXPECT_NEAR(half[3], 0.35355339059327373, 1e-15);
  EXPECT_TRUE(std::isnan(half[4]));
}

// torch, float64: b = [0.5, 1.5, 2.0], e = [1.3, -0.7, 2.0]; torch.pow(b, e).sum() backward.
TEST(ElementwiseGrad, PowValuesMatchTorch) {
  Tensor b = values({0.5, 1.5, 2.0}), e = values({1.3, -0.7, 2.0});
  auto g = autograd::grad({b.pow(e)}, {b, e}, {ones({3}, kFloat64)});
  expect_values(g[0], {1.0559281152631061, -0.3513523799199106, 4.0});
  expect_values(g[1], {-0.2815052292186919, 0.3052738515177587, 2.772588722239781});
}

// Ties split the gradient half and half; NaN sends it to both (torch 1.13):
//   a = [1, 2, 3, nan], b = [1, 1, 4, 1]; torch.maximum(a, b).backward(ones)
//   a.grad = [0.5, 1, 0, 1], b.grad = [0.5, 0, 1, 1]; minimum: a [0.5, 0, 1, 1], b [0.5, 1, 0, 1]
TEST(ElementwiseGrad, MaximumMinimumTiesAndNaN) {
  Tensor a = values({1, 2, 3, std::numeric_limits<double>::quiet_NaN()}), b = values({1, 1, 4, 1});
  auto g = autograd::grad({a.maximum(b)}, {a, b}, {ones({4}, kFloat64)});
  expect_values(g[0], {0.5, 1, 0, 1});
  expect_values(g[1], {0.5, 0, 1, 1});
  g = autograd::grad({minimum(a, b)}, {a, b}, {ones({4}, kFloat64)});
  expect_values(g[0], {0.5, 0, 1, 1});
  expect_values(g[1], {0.5, 1, 0, 1});
  EXPECT_STREQ(a.maximum(b).grad_fn()->name(), "MaximumBackward0");
  EXPECT_STREQ(a.minimum(b).grad_fn()->name(), "MinimumBackward0");
  // Away from ties: gradcheck, with broadcasting and a non-contiguous operand.
  expect_gradcheck([](const TensorList& x) { return x[0].maximum(x[1]); }, {leaf({3, 1, 4}, 22), leaf({5, 4}, 23)});
  expect_gradcheck([](const TensorList& x) { return x[0].minimum(x[1]); }, {leaf_t({4, 3}, 24), leaf_t({4, 3}, 25)});
}

// ---- unary ops ----

TEST(ElementwiseGrad, UnaryGradcheckContiguousAndNoncontig) {
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
    double lo, hi;  // a domain away from kinks and poles
  };
  const std::vector<Case> cases = {
      {"neg", [](const Tensor& x) { return x.neg(); }, -2, 2},
      {"-x", [](const Tensor& x) { return -x; }, -2, 2},
      {"abs+", [](const Tensor& x) { return x.abs(); }, 0.1, 2},
      {"abs-", [](const Tensor& x) { return x.abs(); }, -2, -0.1},
      {"exp", [](const Tensor& x) { return x.exp(); }, -2, 2},
      {"log", [](const Tensor& x) { return x.log(); }, 0.3, 3},
      {"log1p", [](const Tensor& x) { return x.log1p(); }, -0.5, 3},
      {"sqrt", [](const Tensor& x) { return x.sqrt(); }, 0.3, 3},
      {"rsqrt", [](const Tensor& x) { return x.rsqrt(); }, 0.3, 3},
      {"sin", [](const Tensor& x) { return x.sin(); }, -3, 3},
      {"cos", [](const Tensor& x) { return x.cos(); }, -3, 3},
      {"tanh", [](const Tensor& x) { return x.tanh(); }, -2, 2},
      {"sigmoid", [](const Tensor& x) { return x.sigmoid(); }, -3, 3},
      {"relu+", [](const Tensor& x) { return x.relu(); }, 0.1, 2},
      {"relu-", [](const Tensor& x) { return relu(x); }, -2, -0.1},
      {"gelu", [](const Tensor& x) { return x.gelu(); }, -3, 3},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, "tanh"); }, -3, 3},
      {"silu", [](const Tensor& x) { return x.silu(); }, -3, 3},
      {"clamp", [](const Tensor& x) { return x.clamp(-0.95, 1.05); }, -2, 2},
      {"clamp min", [](const Tensor& x) { return x.clamp(0.05); }, -2, 2},
      {"clamp max", [](const Tensor& x) { return clamp(x, std::nullopt, -0.05); }, -2, 2},
  };
  uint64_t seed = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto f = [&c](const TensorList& x) { return c.f(x[0]); };
    expect_gradcheck(f, {leaf({3, 4}, seed++, c.lo, c.hi)});
    expect_gradcheck(f, {leaf_t({4, 3}, seed++, c.lo, c.hi)});
    expect_gradcheck(f, {leaf({}, seed++, c.lo, c.hi)});
  }
}

// torch, float64, x = [0.3, -1.2, 2.0, 0.0]: torch.autograd.grad(f(x).sum(), x).
TEST(ElementwiseGrad, UnaryValuesMatchTorch) {
  const std::vector<double> xv = {0.3, -1.2, 2.0, 0.0};
  auto g = [&](const std::function<Tensor(const Tensor&)>& f) {
    Tensor x = values(xv);
    return grad_of_sum(f(x), x);
  };
  expect_values(g([](const Tensor& x) { return x.gelu(); }),
                {0.7323277668271099, -0.11795359575814726, 1.085231801078197, 0.5});
  expect_values(g([](const Tensor& x) { return x.gelu("tanh"); }),
                {0.7322954516388018, -0.11772613473311258, 1.0860992566236183, 0.5});
  expect_values(g([](const Tensor& x) { return x.silu(); }),
                {0.6477800103188829, 0.01800188772481552, 1.0907842487848955, 0.5});
  expect_values(g([](const Tensor& x) { return x.sigmoid(); }),
                {0.24445831169074586, 0.1778944406468057, 0.10499358540350662, 0.25});
  expect_values(g([](const Tensor& x) { return x.tanh(); }),
                {0.9151369618266292, 0.30501999620740905, 0.07065082485316443, 1.0});
  expect_values(g([](const Tensor& x) { return (x.abs() + 1).rsqrt(); }),
                {-0.33733000742578045, 0.1532272414689186, -0.09622504486493767, 0.0});
  expect_values(g([](const Tensor& x) { return x.abs().log1p(); }),
                {0.7692307692307692, -0.45454545454545453, 0.3333333333333333, 0.0});
}

// Kinks, as torch 1.13 chooses (x = [-1, 0, -0, 2]):
//   abs: [-1, 0, 0, 1]; relu: [0, 0, 0, 1]; clamp(0, 2): [0, 1, 1, 1]; clamp(min=0): [0, 1, 1, 1];
//   clamp(max=0): [1, 1, 1, 0]; clamp(nan, 1): [0, 0, 0, 0]; clamp(2, 0) (lo > hi): [0, 0, 0, 0];
//   abs at nan: 0.
TEST(ElementwiseGrad, KinksFollowTorchSubgradients) {
  const std::vector<double> xv = {-1, 0, -0.0, 2};
  auto g = [&](const std::function<Tensor(const Tensor&)>& f) {
    Tensor x = values(xv);
    return grad_of_sum(f(x), x);
  };
  expect_values(g([](const Tensor& x) { return x.abs(); }), {-1, 0, 0, 1});
  expect_values(g([](const Tensor& x) { return x.relu(); }), {0, 0, 0, 1});
  expect_values(g([](const Tensor& x) { return x.clamp(0, 2); }), {0, 1, 1, 1});
  expect_values(g([](const Tensor& x) { return x.clamp(0); }), {0, 1, 1, 1});
  expect_values(g([](const Tensor& x) { return x.clamp(std::nullopt, 0); }), {1, 1, 1, 0});
  expect_values(g([](const Tensor& x) { return x.clamp(std::numeric_limits<double>::quiet_NaN(), 1); }),
                {0, 0, 0, 0});
  expect_values(g([](const Tensor& x) { return x.clamp(2, 0); }), {0, 0, 0, 0});
  Tensor n = values({std::numeric_limits<double>::quiet_NaN(), 1});
  expect_values(grad_of_sum(n.abs(), n), {0, 1});
  // The in-place forms choose the same.
  expect_values(g([](const Tensor& x) { Tensor y = x * 1; return y.abs_(); }), {-1, 0, 0, 1});
  expect_values(g([](const Tensor& x) { Tensor y = x * 1; return y.relu_(); }), {0, 0, 0, 1});
  expect_values(g([](const Tensor& x) { Tensor y = x * 1; return y.clamp_(0, 2); }), {0, 1, 1, 1});
  expect_values(g([](const Tensor& x) { Tensor y = x * 1; return y.clamp_(std::nullopt, 0); }), {1, 1, 1, 0});
}

// ---- second derivatives ----

TEST(ElementwiseGrad, GradGradCheck) {
  const Tensor a = leaf({2, 3}, 40), b = leaf({2, 3}, 41, 0.5, 2.0);
  const std::vector<std::tuple<const char*, Fn, TensorList>> cases = {
      {"mul", [](const TensorList& x) { return x[0] * x[1]; }, {a, b}},
      {"square", [](const TensorList& x) { return x[0].mul(x[0]); }, {a}},
      {"div", [](const TensorList& x) { return x[0] / x[1]; }, {a, b}},
      {"scalar / tensor", [](const TensorList& x) { return 2 / x[0]; }, {b}},
      {"pow tensor", [](const TensorList& x) { return x[1].pow(x[0]); }, {a, b}},
      {"pow 3", [](const TensorList& x) { return x[0].pow(3); }, {a}},
      {"pow -1.5", [](const TensorList& x) { return x[0].pow(-1.5); }, {b}},
      {"scalar ** tensor", [](const TensorList& x) { return pow(1.7, x[0]); }, {a}},
      {"exp", [](const TensorList& x) { return x[0].exp(); }, {a}},
      {"log", [](const TensorList& x) { return x[0].log(); }, {b}},
      {"tanh", [](const TensorList& x) { return x[0].tanh(); }, {a}},
      {"sigmoid", [](const TensorList& x) { return x[0].sigmoid(); }, {a}},
      {"gelu", [](const TensorList& x) { return x[0].gelu(); }, {a}},
      {"gelu tanh", [](const TensorList& x) { return x[0].gelu("tanh"); }, {a}},
      {"silu", [](const TensorList& x) { return x[0].silu(); }, {a}},
      {"sqrt", [](const TensorList& x) { return x[0].sqrt(); }, {b}},
      {"rsqrt", [](const TensorList& x) { return x[0].rsqrt(); }, {b}},
      {"sin * cos", [](const TensorList& x) { return x[0].sin() * x[0].cos(); }, {a}},
      {"log1p", [](const TensorList& x) { return x[0].log1p(); }, {b}},
      // In-place forms: their saved copies of the old self keep its history.
      {"mul_", [](const TensorList& x) { Tensor y = x[0] * 1; return y.mul_(x[1]); }, {a, b}},
      {"div_", [](const TensorList& x) { Tensor y = x[0] * 1; return y.div_(x[1]); }, {a, b}},
      {"pow_", [](const TensorList& x) { Tensor y = x[0] * 1; return y.pow_(2.5); }, {b}},
      {"log_", [](const TensorList& x) { Tensor y = x[0] * 1; return y.log_(); }, {b}},
      {"exp_", [](const TensorList& x) { Tensor y = x[0] * 1; return y.exp_(); }, {a}},
      {"sigmoid_", [](const TensorList& x) { Tensor y = x[0] * 1; return y.sigmoid_(); }, {a}},
  };
  for (const auto& [name, f, inputs] : cases) {
    SCOPED_TRACE(name);
    expect_gradgradcheck(f, inputs);
  }
}

// torch, float64, x = [0.3, -1.2, 2.0, 0.0]: d2/dx2 of gelu summed.
TEST(ElementwiseGrad, GeluSecondDerivativeMatchesTorch) {
  for (const char* approx : {"none", "tanh"}) {
    Tensor x = values({0.3, -1.2, 2.0, 0.0});
    Tensor g = autograd::grad({x.gelu(approx)}, {x}, {ones({4}, kFloat64)}, std::nullopt, /*create_graph=*/true)[0];
    ASSERT_TRUE(g.requires_grad());
    Tensor gg = grad_of_sum(g, x);
    if (std::string(approx) == "none") {
      expect_values(gg, {0.728450727529601, 0.10874419079059927, -0.10798193302637613, 0.7978845608028654});
    } else {
      expect_values(gg, {0.7281484484339118, 0.109809658921978, -0.10787507995107845, 0.7978845608028654});
    }
  }
}

// ---- in-place ops ----

TEST(ElementwiseGrad, InPlaceOnNonLeafRewritesHistory) {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor y = x * 2;
  y.mul_(3);
  EXPECT_STREQ(y.grad_fn()->name(), "MulBackward0");
  y.backward(ones_like(y));
  expect_values(x.grad(), {6, 6, 6});
}

TEST(ElementwiseGrad, InPlaceGradcheck) {
  const Tensor a = leaf({3, 4}, 50), b = leaf({4}, 51, 0.5, 2.0), p = leaf({3, 4}, 52, 0.5, 2.0);
  // Each op writes a non-leaf copy of x[0], so the in-place op's node joins the graph.
  auto ip = [](std::function<void(Tensor&, const TensorList&)> op) {
    return [op](const TensorList& x) {
      Tensor y = x[0] * 1;
      op(y, x);
      return y;
    };
  };
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y.add_(x[1], 2); }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y.sub_(x[1], 0.5); }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y += x[1]; }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y -= x[1]; }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y.mul_(x[1]); }), {a, b});  // needs the old y
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y *= x[1]; }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y.div_(x[1]); }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y /= x[1]; }), {a, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.add_(1.5, 2); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.sub_(1.5); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.mul_(-2.5); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.div_(4); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.pow_(2.5); }), {p});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.pow_(-1); }), {p});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.neg_(); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.abs_(); }), {p});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.exp_(); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.log_(); }), {p});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.sqrt_(); }), {p});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.tanh_(); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.sigmoid_(); }), {a});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.relu_(); }), {p});
  expect_gradcheck(ip([](Tensor& y, const TensorList&) { y.clamp_(0.8, 1.6); }), {p});
  // A chain of in-place ops on one tensor (each saves the old self it needs, none saves its result).
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y.mul_(x[1]).div_(x[1]).add_(x[1]).log_(); }), {p, b});
  expect_gradcheck(ip([](Tensor& y, const TensorList& x) { y.clamp_(0.8, 1.6).abs_().pow_(2).mul_(x[1]).tanh_(); }),
                   {p, b});
  // Self that did not require grad gets a history from other.
  expect_gradcheck([](const TensorList& x) {
    Tensor y = ones({3, 4}, kFloat64);
    y.mul_(x[0]);
    return y;
  }, {a});
}

TEST(ElementwiseGrad, InPlaceAfterSaveNamesTheOpAndBothSites) {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor w = tensor<double>({4, 5, 6}).requires_grad_();
  Tensor y = x.mul(2);
  Tensor z = y.mul(w);  // MulBackward0 saves y for d/dw
  y.exp_();
  const std::string m = message_of([&] { z.backward(ones_like(z)); });
  EXPECT_NE(m.find("saved by:    MulBackward0 (forward at "), std::string::npos) << m;
  EXPECT_NE(m.find("modified by: exp_ at "), std::string::npos) << m;
  // Both call sites are in this file: the mul that saved y and the exp_ that modified it.
  const std::string file = "test_elementwise_grad.cpp:";
  const size_t first = m.find(file);
  ASSERT_NE(first, std::string::npos) << m;
  EXPECT_NE(m.find(file, first + 1), std::string::npos) << m;
  EXPECT_NE(m.find("saved at version 0, now at version 1"), std::string::npos) << m;
}

TEST(ElementwiseGrad, InPlaceSavedResultIsCheckedToo) {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor y = x * 1;
  y.exp_();        // saves its result
  y.add_(1);       // and the result changes
  const std::string m = message_of([&] { y.backward(ones_like(y)); });
  EXPECT_NE(m.find("ExpBackward0"), std::string::npos) << m;
  EXPECT_NE(m.find("modified by: add_ at "), std::string::npos) << m;
}

TEST(ElementwiseGrad, InPlaceOnLeafThatRequiresGradIsAnError) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  autograd::set_name(x, "fc.bias");
  for (const auto& op : std::vector<std::function<void()>>{
           [&] { x.add_(1); }, [&] { x.mul_(x); }, [&] { x.exp_(); }, [&] { x.clamp_(0, 1); },
           [&] { x.pow_(2); }, [&] { x += 1; }, [&] { x.relu_(); }}) {
    const std::string m = message_of(op);
    EXPECT_NE(m.find("parameter 'fc.bias'"), std::string::npos) << m;
    EXPECT_NE(m.find("is a leaf that requires grad"), std::string::npos) << m;
  }
  const std::string m = message_of([&] { x.sigmoid_(); });
  EXPECT_EQ(m.rfind("sigmoid_: ", 0), 0u) << m;
  EXPECT_NE(m.find("test_elementwise_grad.cpp:"), std::string::npos) << m;
  expect_values(x, {1, 2});  // nothing was written
  NoGradGuard ng;
  x.add_(1);  // allowed under no-grad, as optimizers do
  expect_values(x, {2, 3});
}

TEST(ElementwiseGrad, InPlaceIntoAViewOfABufferGivesTheBufferTheHistory) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor buf = zeros({4}, kFloat64);
  Tensor part = buf.narrow(0, 0, 2);
  part.add_(x);
  EXPECT_TRUE(buf.requires_grad());
  (buf * tensor<double>({3, 4, 5, 6})).sum().backward();
  expect_values(x.grad(), {3, 4});
  Tensor fresh = zeros({2}, kFloat64);
  fresh.add_(x);
  EXPECT_TRUE(fresh.requires_grad());
  // A detach() alias of the written tensor does not stop the write (as torch).
  Tensor other = zeros({2}, kFloat64);
  Tensor alias = other.detach();
  other.mul_(x);
  EXPECT_TRUE(other.requires_grad());
  EXPECT_FALSE(alias.requires_grad());
}

TEST(ElementwiseGrad, SelfMulInPlaceIsCaughtAsTorchDoes) {
  // torch: y.mul_(y) on a non-leaf raises the version error at backward (y was saved, then written).
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor y = x * 1;
  y.mul_(y);
  const std::string m = message_of([&] { y.backward(ones_like(y)); });
  EXPECT_NE(m.find("modified by: mul_"), std::string::npos) << m;
  // add_ saves nothing: fine, d(2y)/dx = 2.
  Tensor z = x * 1;
  z.add_(z);
  z.backward(ones_like(z));
  expect_values(x.grad(), {2, 2});
}

// ---- dtypes and recording ----

// torch: a float32 [1, 2, 3], w float64 [0.5, 0.25, 2]; (a * w).sum() backward:
// a.grad float32 [0.5, 0.25, 2], w.grad float64 [1, 2, 3].
TEST(ElementwiseGrad, MixedDtypesGradientInEachInputsDtype) {
  Tensor a = tensor<float>({1, 2, 3}).requires_grad_();
  Tensor w = tensor<double>({0.5, 0.25, 2}).requires_grad_();
  Tensor y = a * w;
  EXPECT_EQ(y.dtype(), kFloat64);
  y.backward(ones_like(y));
  EXPECT_EQ(a.grad().dtype(), kFloat32);
  EXPECT_EQ(w.grad().dtype(), kFloat64);
  expect_values(a.grad(), {0.5, 0.25, 2});
  expect_values(w.grad(), {1, 2, 3});
  // An int tensor with a float one: only the float gets a gradient.
  Tensor i = tensor<int64_t>({1, 2, 3});
  Tensor f = tensor<double>({1.5, -2, 0.5}).requires_grad_();
  for (const Tensor& out : {i + f, i * f, f / i, f.pow(i), i.pow(f), f.maximum(i), f.sub(i, 2)}) {
    ASSERT_TRUE(out.requires_grad());
    auto g = autograd::grad({out}, {f}, {ones_like(out)});
    EXPECT_EQ(g[0].dtype(), kFloat64);
  }
  expect_gradcheck([&i](const TensorList& x) { return i.pow(x[0]); }, {leaf({3}, 60, -1, 1)});
  expect_gradcheck([&i](const TensorList& x) { return x[0] * i + x[0] / i; }, {leaf({3}, 61)});
  // float16 self updated in place by a float32 operand: the gradient keeps each dtype.
  Tensor h = tensor<float>({1, 2}).to(kFloat16).requires_grad_();
  Tensor o = tensor<float>({3, 4}).requires_grad_();
  Tensor hy = h * 1;
  hy.mul_(o);
  EXPECT_EQ(hy.dtype(), kFloat16);
  auto g = autograd::grad({hy}, {h, o}, {ones_like(hy)});
  EXPECT_EQ(g[0].dtype(), kFloat16);
  EXPECT_EQ(g[1].dtype(), kFloat32);
  expect_values(g[0], {3, 4});
  expect_values(g[1], {1, 2});
}

TEST(ElementwiseGrad, NonDifferentiableOpsRecordNothing) {
  Tensor a = tensor<double>({1, 2, 3}).requires_grad_(), b = tensor<double>({3, 2, 1}).requires_grad_();
  for (const Tensor& t : {a == b, a != b, a < b, a <= b, a > b, a >= b, a.eq(2), a.logical_and(b), a.logical_or(b),
                          a.logical_xor(b), a.logical_not()}) {
    EXPECT_FALSE(t.requires_grad());
    EXPECT_EQ(t.grad_fn(), nullptr);
    EXPECT_EQ(t.dtype(), kBool);
  }
  Tensor i = tensor<int64_t>({1, 2, 3});
  EXPECT_FALSE((i & i).requires_grad());
  EXPECT_FALSE((~i).requires_grad());
  EXPECT_TRUE(a.equal(a));
  EXPECT_TRUE(a.allclose(a));
}

TEST(ElementwiseGrad, NoGradPathRecordsNothing) {
  Tensor a = tensor<double>({1, 2}).requires_grad_();
  Tensor c = tensor<double>({3, 4});
  EXPECT_EQ((c * c).grad_fn(), nullptr);
  EXPECT_FALSE((c.exp() + c).requires_grad());
  {
    NoGradGuard ng;
    for (const Tensor& t : {a * a, a + 1, a.exp(), a.gelu(), a.pow(a), a.clamp(0, 1), -a}) {
      EXPECT_FALSE(t.requires_grad());
      EXPECT_EQ(t.grad_fn(), nullptr);
    }
  }
  Tensor y = a * 1;
  EXPECT_TRUE(y.requires_grad());
}

TEST(ElementwiseGrad, NodeNamesFollowTorch) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  const std::vector<std::pair<Tensor, const char*>> cases = {
      {x + x, "AddBackward0"},        {x + 2, "AddBackward0"},         {x - x, "SubBackward0"},
      {2 - x, "RsubBackward1"},       {x * x, "MulBackward0"},         {x * 2, "MulBackward0"},
      {x / x, "DivBackward0"},        {x / 2, "DivBackward0"},         {x.pow(2), "PowBackward0"},
      {x.pow(x), "PowBackward1"},     {pow(2, x), "PowBackward2"},     {-x, "NegBackward0"},
      {x.abs(), "AbsBackward0"},      {x.exp(), "ExpBackward0"},       {x.log(), "LogBackward0"},
      {x.log1p(), "Log1PBackward0"},  {x.sqrt(), "SqrtBackward0"},     {x.rsqrt(), "RsqrtBackward0"},
      {x.sin(), "SinBackward0"},      {x.cos(), "CosBackward0"},       {x.tanh(), "TanhBackward0"},
      {x.sigmoid(), "SigmoidBackward0"}, {x.relu(), "ReluBackward0"},  {x.gelu(), "GeluBackward0"},
      {x.silu(), "SiluBackward0"},    {x.clamp(0), "ClampBackward1"},  {x.clamp(0, 1), "ClampBackward1"},
  };
  for (const auto& [t, name] : cases) {
    ASSERT_NE(t.grad_fn(), nullptr) << name;
    EXPECT_STREQ(t.grad_fn()->name(), name);
  }
  Tensor y = x * 1;
  y.sigmoid_();
  EXPECT_STREQ(y.grad_fn()->name(), "SigmoidBackward0");
  y.clamp_(0, 1);
  EXPECT_STREQ(y.grad_fn()->name(), "ClampBackward1");
  y.pow_(2);
  EXPECT_STREQ(y.grad_fn()->name(), "PowBackward0");
}

// Method calls record their caller's file:line on the node; so do the operators, through
// TensorAt/ScalarAt (tensor.h), on either side and in compound assignment.
TEST(ElementwiseGrad, CallSitesOfMethodsAndOperators) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  auto at = [](int line) { return "test_elementwise_grad.cpp:" + std::to_string(line); };
  const Tensor m = x.mul(x);
  EXPECT_TRUE(m.grad_fn()->site().str().ends_with(at(__LINE__ - 1))) << m.grad_fn()->site().str();
  EXPECT_TRUE(gelu(x).grad_fn()->site().str().ends_with(at(__LINE__))) << gelu(x).grad_fn()->site().str();
  EXPECT_TRUE((x * x).grad_fn()->site().str().ends_with(at(__LINE__)));
  EXPECT_TRUE((2.0 - x).grad_fn()->site().str().ends_with(at(__LINE__)));
  EXPECT_TRUE((x / 3).grad_fn()->site().str().ends_with(at(__LINE__)));
  EXPECT_TRUE((-x).grad_fn()->site().str().ends_with(at(__LINE__)));
  Tensor acc = zeros({2}, kFloat64);
  acc += x;
  EXPECT_TRUE(acc.grad_fn()->site().str().ends_with(at(__LINE__ - 1))) << acc.grad_fn()->site().str();
  acc *= 2;
  EXPECT_TRUE(acc.grad_fn()->site().str().ends_with(at(__LINE__ - 1))) << acc.grad_fn()->site().str();
}
