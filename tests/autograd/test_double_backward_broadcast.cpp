// Gradients that reach one node with different shapes: a tensor t of shape
// [..., 1] broadcast by a binary op (its gradient arrives unreduced, [..., n])
// and also used elsewhere at its own shape (its gradient arrives as
// [..., 1]). The engine must reduce each to the input's shape before summing
// them, or the [..., 1] part is broadcast and counted n times. Under
// create_graph every op that saves its own output (exp, tanh, softmax, norm,
// ...) makes such a second use, so x * exp(x.sum(-1, true)) had wrong second
// derivatives. Checked with gradgradcheck in float64 over a sweep of
// output-saving ops x broadcasting binary ops x shape-[..., 1] producers, and
// against PyTorch's exact second derivatives.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "support/compare.h"
#include "support/oracle.h"

using namespace kiln;

namespace {

using Fn = std::function<Tensor(const Tensor&)>;
struct NamedFn {
  std::string name;
  Fn fn;
};

// Values in [0.5, 1): every unary below is smooth there and no amax ties.
Tensor positive64(IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return rand(shape, TensorOptions(kFloat64), &g).mul(0.5).add(0.5);
}

Tensor randn64(IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, kFloat64, &g);
}

// Fails the test with gradgradcheck's message (raise = true names the element).
void expect_gradgrad(const std::string& what, const autograd::DifferentiableFn& fn, const TensorList& inputs) {
  try {
    EXPECT_TRUE(autograd::gradgradcheck(fn, inputs)) << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

void expect_grad(const std::string& what, const autograd::DifferentiableFn& fn, const TensorList& inputs) {
  try {
    EXPECT_TRUE(autograd::gradcheck(fn, inputs)) << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

autograd::DifferentiableFn unary_fn(Fn f) {
  return [f](const TensorList& t) { return TensorList{f(t[0])}; };
}

// ---- the reported cases ----

TEST(DoubleBackwardBroadcast, ReportedCases) {
  const Tensor x = randn64({3, 5}, 11).mul(0.3).requires_grad_();
  expect_gradgrad("x * exp(sum)", unary_fn([](const Tensor& a) { return a * a.sum({-1}, true).exp(); }), {x});
  expect_gradgrad("x * exp(mean)", unary_fn([](const Tensor& a) { return a * a.mean({-1}, true).exp(); }), {x});
  expect_gradgrad("x * exp(narrow)", unary_fn([](const Tensor& a) { return a * a.narrow(1, 0, 1).exp(); }), {x});
  expect_gradgrad("exp(sum) * x", unary_fn([](const Tensor& a) { return a.sum({-1}, true).exp() * a; }), {x});
  expect_gradgrad("x * exp(full sum)", unary_fn([](const Tensor& a) { return a * a.sum().exp(); }), {x});
}

// The same mistake at first order: t's node receives [3, 5] from x * t and
// [3, 1] twice from t * t.
TEST(DoubleBackwardBroadcast, FirstOrderMixedShapes) {
  const Tensor x = randn64({3, 5}, 12).requires_grad_(), y = randn64({3, 1}, 13).mul(0.5).requires_grad_();
  const auto f = [](const TensorList& t) {
    const Tensor e = t[1].exp();
    return TensorList{t[0] * e + e * e};
  };
  expect_grad("x * exp(y) + exp(y)^2", f, {x, y});
  expect_gradgrad("x * exp(y) + exp(y)^2", f, {x, y});

  // The gradient of y by hand with a ones gradient: sum_j x_ij * e_i, plus 2 e_i^2 from
  // each of the 5 columns that e * e is broadcast to.
  Tensor out = f({x, y})[0];
  const Tensor gy = autograd::grad({out}, {y}, {ones_like(out)})[0];
  const Tensor e = y.detach().exp();
  const Tensor want = x.detach().sum({-1}, true) * e + 10 * e * e;
  const auto c = test::compare_tensors(gy, want, 1e-12, 1e-12);
  EXPECT_TRUE(c.ok) << c.message;
}

// ---- the sweep ----

std::vector<NamedFn> producers() {  // x [3, 4] -> a tensor that broadcasts against x
  return {
      {"sum(-1,keep)", [](const Tensor& a) { return a.sum({-1}, true); }},
      {"mean(-1,keep)", [](const Tensor& a) { return a.mean({-1}, true); }},
      {"amax(-1,keep)", [](const Tensor& a) { return a.amax({-1}, true); }},
      {"sum(0,keep)", [](const Tensor& a) { return a.sum({0}, true); }},
      {"narrow(1,0,1)", [](const Tensor& a) { return a.narrow(1, 0, 1); }},
      {"narrow(0,2,1)", [](const Tensor& a) { return a.narrow(0, 2, 1); }},
      {"select(0,1)", [](const Tensor& a) { return a.select(0, 1); }},
      // Reductions that save their own output.
      {"std(-1,keep)", [](const Tensor& a) { return a.std({-1}, 1, true); }},
      {"norm(-1,keep)", [](const Tensor& a) { return a.norm(2.0, {-1}, true); }},
      {"logsumexp(-1,keep)", [](const Tensor& a) { return a.logsumexp({-1}, true); }},
      {"prod(-1,keep)", [](const Tensor& a) { return a.prod(-1, true); }},
  };
}

std::vector<NamedFn> unaries() {  // ops that save their output, and two that save their input as controls
  return {
      {"exp", [](const Tensor& u) { return u.exp(); }},
      {"tanh", [](const Tensor& u) { return u.tanh(); }},
      {"sigmoid", [](const Tensor& u) { return u.sigmoid(); }},
      {"sqrt", [](const Tensor& u) { return u.sqrt(); }},
      {"rsqrt", [](const Tensor& u) { return u.rsqrt(); }},
      {"relu", [](const Tensor& u) { return u.relu(); }},
      {"softmax(0)", [](const Tensor& u) { return kiln::softmax(u, 0); }},
      {"log_softmax(0)", [](const Tensor& u) { return kiln::log_softmax(u, 0); }},
      {"pow(u,u)", [](const Tensor& u) { return u.pow(u); }},
      {"2^u", [](const Tensor& u) { return kiln::pow(Scalar(2.0), u); }},
      {"log", [](const Tensor& u) { return u.log(); }},
      {"sin", [](const Tensor& u) { return u.sin(); }},
  };
}

using Binary = std::function<Tensor(const Tensor&, const Tensor&)>;
struct NamedBinary {
  std::string name;
  Binary fn;
};

std::vector<NamedBinary> binaries() {  // (x, u): x is [3, 4], u broadcasts
  return {
      {"x*u", [](const Tensor& x, const Tensor& u) { return x * u; }},
      {"u*x", [](const Tensor& x, const Tensor& u) { return u * x; }},
      {"x/u", [](const Tensor& x, const Tensor& u) { return x / u; }},
      {"u/x", [](const Tensor& x, const Tensor& u) { return u / x; }},
      {"x+u", [](const Tensor& x, const Tensor& u) { return x + u; }},
      {"x-u", [](const Tensor& x, const Tensor& u) { return x - u; }},
      // x + u alone has no second derivative through the add: square it.
      {"(x+u)^2", [](const Tensor& x, const Tensor& u) { return (x + u) * (x + u); }},
      {"x*u+u", [](const Tensor& x, const Tensor& u) { return x * u + u; }},
  };
}

TEST(DoubleBackwardBroadcast, SweepOutputSavingOps) {
  const Tensor x = positive64({3, 4}, 21).requires_grad_();
  int checked = 0;
  for (const auto& p : producers()) {
    for (const auto& u : unaries()) {
      for (const auto& b : binaries()) {
        const auto fn = [&](const TensorList& t) { return TensorList{b.fn(t[0], u.fn(p.fn(t[0])))}; };
        expect_gradgrad(b.name + " with u = " + u.name + "(" + p.name + "(x))", fn, {x});
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 11 * 12 * 8);
}

// The producer and the broadcast operand as separate inputs: second derivatives
// with respect to each, and the mixed ones.
TEST(DoubleBackwardBroadcast, SweepTwoInputs) {
  const Tensor x = positive64({3, 4}, 22).requires_grad_(), y = positive64({3, 4}, 23).requires_grad_();
  for (const auto& p : {producers()[0], producers()[4], producers()[8]}) {
    for (const auto& u : unaries()) {
      const auto fn = [&](const TensorList& t) { return TensorList{t[0] * u.fn(p.fn(t[1])) + t[1] * u.fn(p.fn(t[0]))}; };
      expect_gradgrad("x * " + u.name + "(" + p.name + "(y)) + y * ...(x)", fn, {x, y});
    }
  }
}

// ---- LayerNorm, whose composite normalises by rsqrt(var(x, -1, keepdim)) ----

TEST(DoubleBackwardBroadcast, LayerNormSecondOrder) {
  const Tensor x = randn64({3, 2, 5}, 31).requires_grad_();
  const Tensor w = randn64({5}, 32).add(1).requires_grad_(), b = randn64({5}, 33).requires_grad_();
  expect_gradgrad("layer_norm_composite",
                  [](const TensorList& t) {
                    return TensorList{ops::detail::layer_norm_composite(t[0], 1, t[1], t[2], 1e-5)};
                  },
                  {x, w, b});
  // The fused kernel differentiates the composite under create_graph.
  expect_gradgrad("layer_norm (fused)",
                  [](const TensorList& t) { return TensorList{ops::layer_norm(t[0], {5}, t[1], t[2], 1e-5)}; },
                  {x, w, b});
  expect_gradgrad("layer_norm without affine",
                  [](const TensorList& t) { return TensorList{ops::layer_norm(t[0], {2, 5}, Tensor(), Tensor(), 1e-5)}; },
                  {x});
  expect_gradgrad("x * rsqrt(var + eps)",
                  unary_fn([](const Tensor& a) { return a * (a.var({-1}, 0, true) + 1e-5).rsqrt(); }), {x});
}

// ---- exact second derivatives against PyTorch ----

// d/dx <grad_x(<f(x), gy>), v>: one Hessian-vector product per case.
Tensor hvp(const Fn& f, const Tensor& x0, const Tensor& gy, const Tensor& v) {
  const Tensor x = x0.detach().requires_grad_();
  const Tensor y = f(x);
  const Tensor gx = autograd::grad({y}, {x}, {gy}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  return autograd::grad({(gx * v).sum()}, {x})[0];
}

TEST(DoubleBackwardBroadcast, MatchesTorchSecondDerivatives) {
  const Tensor x = randn64({3, 5}, 41).mul(0.5), gy = randn64({3, 5}, 42), v = randn64({3, 5}, 43);
  // The fused layer norm's create_graph backward asks for the weight's and bias's gradients too.
  const Tensor w = randn64({5}, 44).add(1).requires_grad_(), bias = randn64({5}, 45).requires_grad_();
  struct Case {
    std::string name;
    Fn f;
    std::string torch_f;  // a Python lambda of x (x3, x4: the layer norm's weight and bias)
  };
  const std::vector<Case> cases = {
      {"x*exp(sum)", [](const Tensor& a) { return a * a.sum({-1}, true).exp(); },
       "lambda x: x * x.sum(-1, keepdim=True).exp()"},
      {"x*exp(mean)", [](const Tensor& a) { return a * a.mean({-1}, true).exp(); },
       "lambda x: x * x.mean(-1, keepdim=True).exp()"},
      {"x*exp(narrow)", [](const Tensor& a) { return a * a.narrow(1, 0, 1).exp(); },
       "lambda x: x * x.narrow(1, 0, 1).exp()"},
      {"x/tanh(sum)", [](const Tensor& a) { return a / a.sum({-1}, true).tanh(); },
       "lambda x: x / x.sum(-1, keepdim=True).tanh()"},
      {"x*softmax(amax)", [](const Tensor& a) { return a * kiln::softmax(a.amax({-1}, true), 0); },
       "lambda x: x * torch.softmax(x.amax(-1, keepdim=True), 0)"},
      {"layer_norm", [&](const Tensor& a) { return ops::layer_norm(a, {5}, w, bias, 1e-5); },
       "lambda x: torch.nn.functional.layer_norm(x, (5,), x3, x4, 1e-5)"},
  };
  test::OracleBatch batch;
  std::vector<size_t> ids;
  for (const auto& c : cases) {
    const std::string expr = "(lambda f, x: torch.autograd.grad((torch.autograd.grad(f(x), x, x1, create_graph=True)[0]"
                             " * x2).sum(), x)[0])(" + c.torch_f + ", x0.clone().requires_grad_())";
    ids.push_back(batch.add("gradgrad_" + c.name, expr, {x, gy, v, w, bias}));
  }
  batch.run();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = batch.outcome(ids[i]);
    ASSERT_TRUE(r.ok) << cases[i].name << ": " << r.error;
    const auto c = test::compare_tensors(hvp(cases[i].f, x, gy, v), r.outputs.at(0), 1e-9, 1e-9);
    EXPECT_TRUE(c.ok) << cases[i].name << ": " << c.message;
  }
}

}  // namespace
