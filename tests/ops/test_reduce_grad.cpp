// Backward of the reductions (sum mean prod var std max min amax amin
// logsumexp norm): float64 gradcheck over dims, keepdim and non-contiguous
// inputs; gradgradcheck where the formula is differentiable; the special
// cases (ties, zeros, zero variance, all -inf, zero norms) against values from
// torch 1.13 (/usr/bin/python3, the expression beside each case); what
// records a node and what does not; gradients that stay views; the
// registry's grad_inputs samples. softmax/log_softmax: test_softmax_grad.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "ops/specs/op_spec.h"
#include "kiln/ops/reduce.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::to_doubles;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using Fn = std::function<Tensor(const Tensor&)>;

Tensor leaf(std::vector<double> v, std::vector<int64_t> shape) {
  return tensor<double>(v, shape).requires_grad_();
}
Tensor rnd(std::vector<int64_t> shape, uint64_t seed) { return ops::sample_tensor(shape, kFloat64, seed).requires_grad_(); }
Tensor strided(std::vector<int64_t> shape, uint64_t seed) {
  Tensor x = ops::sample_noncontig(shape, kFloat64, seed);
  EXPECT_FALSE(x.is_contiguous());
  return x.requires_grad_();
}

// gradcheck of x -> f(x), reporting its message as the failure.
void gradcheck(const Fn& f, const Tensor& x, const std::string& what) {
  try {
    autograd::gradcheck([&](const TensorList& in) { return TensorList{f(in[0])}; }, {x});
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

void gradgradcheck(const Fn& f, const Tensor& x, const std::string& what) {
  try {
    autograd::gradgradcheck([&](const TensorList& in) { return TensorList{f(in[0])}; }, {x});
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

// d(sum(f(x) * g))/dx.
Tensor grad_of(const Fn& f, const Tensor& x, const Tensor& g) {
  return autograd::grad({f(x)}, {x}, {g})[0];
}

void expect_values(const Tensor& t, const std::vector<double>& want, double tol = 1e-10) {
  const std::vector<double> got = to_doubles(t);
  ASSERT_EQ(got.size(), want.size()) << "shape " << t.shape_string();
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) EXPECT_TRUE(std::isnan(got[i])) << "element " << i << ": got " << got[i];
    else if (std::isinf(want[i])) EXPECT_EQ(got[i], want[i]) << "element " << i;
    else EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << "element " << i;
  }
}

}  // namespace

// ---- gradcheck ----

TEST(ReduceGrad, SumAndMean) {
  for (bool mean : {false, true}) {
    auto op = [mean](const Tensor& x, IntArrayRef dims, bool keepdim) {
      return mean ? x.mean(dims, keepdim) : x.sum(dims, keepdim);
    };
    const std::string n = mean ? "mean" : "sum";
    gradcheck([&](const Tensor& x) { return mean ? x.mean() : x.sum(); }, rnd({3, 4}, 1), n + "()");
    gradcheck([&](const Tensor& x) { return op(x, {0}, true); }, rnd({3, 4}, 2), n + " dims=[0] keepdim");
    gradcheck([&](const Tensor& x) { return op(x, {-1}, false); }, rnd({3, 4}, 3), n + " dim=-1");
    gradcheck([&](const Tensor& x) { return op(x, {0, 2}, false); }, rnd({2, 3, 4}, 4), n + " dims=[0,2]");
    gradcheck([&](const Tensor& x) { return op(x, {2, 0}, true); }, rnd({2, 3, 4}, 5), n + " dims=[2,0] keepdim");
    gradcheck([&](const Tensor& x) { return op(x, {1}, false); }, strided({5, 6}, 6), n + " noncontig dim=1");
    gradcheck([&](const Tensor& x) { return op(x, {0}, true); }, strided({5, 6}, 7), n + " noncontig dim=0");
    gradcheck([&](const Tensor& x) { return op(x, {0}, false); }, rnd({}, 8), n + " 0-dim");
  }
}

TEST(ReduceGrad, Prod) {
  gradcheck([](const Tensor& x) { return x.prod(); }, rnd({3, 4}, 11), "prod()");
  gradcheck([](const Tensor& x) { return x.prod(1, true); }, rnd({3, 4}, 12), "prod dim=1 keepdim");
  gradcheck([](const Tensor& x) { return x.prod(-2); }, rnd({3, 4}, 13), "prod dim=-2");
  gradcheck([](const Tensor& x) { return x.prod(1); }, rnd({2, 3, 4}, 14), "prod middle dim");
  gradcheck([](const Tensor& x) { return x.prod(0); }, strided({4, 5}, 15), "prod noncontig");
  gradcheck([](const Tensor& x) { return x.prod(0); }, rnd({}, 16), "prod 0-dim");
  // Zeros: one, two and three per slice; the derivative is a polynomial's, so
  // central differences agree exactly there.
  const Tensor z = leaf({2, 0, 3, 0, 0, 1, 1, 2, 3, 0, 0, 0}, {4, 3});
  gradcheck([](const Tensor& x) { return x.prod(1); }, z, "prod dim=1 with zeros");
  gradcheck([](const Tensor& x) { return x.prod(0, true); }, z, "prod dim=0 with zeros");
  gradcheck([](const Tensor& x) { return x.prod(); }, leaf({2, 0, 3, 4, 5, 1}, {2, 3}), "prod() one zero");
  gradcheck([](const Tensor& x) { return x.prod(); }, leaf({2, 0, 3, 4, 0, 1}, {2, 3}), "prod() two zeros");
}

TEST(ReduceGrad, VarAndStd) {
  for (bool is_std : {false, true}) {
    auto op = [is_std](const Tensor& x, IntArrayRef dims, int64_t c, bool k) {
      return is_std ? x.std(dims, c, k) : x.var(dims, c, k);
    };
    const std::string n = is_std ? "std" : "var";
    gradcheck([&](const Tensor& x) { return op(x, {}, 1, false); }, rnd({3, 4}, 21), n + "()");
    gradcheck([&](const Tensor& x) { return op(x, {1}, 0, false); }, rnd({3, 4}, 22), n + " dim=1 correction=0");
    gradcheck([&](const Tensor& x) { return op(x, {0}, 1, true); }, rnd({3, 4}, 23), n + " dim=0 keepdim");
    gradcheck([&](const Tensor& x) { return op(x, {0, -1}, 2, false); }, rnd({2, 3, 4}, 24), n + " correction=2");
    gradcheck([&](const Tensor& x) { return op(x, {1}, 1, true); }, strided({5, 6}, 25), n + " noncontig");
  }
}

TEST(ReduceGrad, MaxMinAmaxAmin) {
  // Random float64 values have no ties: the derivative exists everywhere.
  for (bool is_max : {true, false}) {
    const std::string n = is_max ? "max" : "min";
    auto along = [is_max](const Tensor& x, int64_t d, bool k) {
      return std::get<0>(is_max ? x.max(d, k) : x.min(d, k));
    };
    auto a = [is_max](const Tensor& x, IntArrayRef dims, bool k) { return is_max ? x.amax(dims, k) : x.amin(dims, k); };
    gradcheck([&](const Tensor& x) { return is_max ? x.max() : x.min(); }, rnd({3, 4}, 31), n + "()");
    gradcheck([&](const Tensor& x) { return along(x, 1, true); }, rnd({3, 4}, 32), n + "(1, keepdim)");
    gradcheck([&](const Tensor& x) { return along(x, -2, false); }, rnd({3, 4}, 33), n + "(-2)");
    gradcheck([&](const Tensor& x) { return along(x, 1, false); }, rnd({2, 5, 3}, 34), n + "(1) 3-d");
    gradcheck([&](const Tensor& x) { return along(x, 0, false); }, strided({5, 6}, 35), n + "(0) noncontig");
    gradcheck([&](const Tensor& x) { return along(x, 0, false); }, rnd({}, 36), n + "(0) 0-dim");
    gradcheck([&](const Tensor& x) { return a(x, {0, -1}, false); }, rnd({2, 3, 4}, 37), "a" + n + " [0,-1]");
    gradcheck([&](const Tensor& x) { return a(x, {1}, true); }, rnd({2, 3, 4}, 38), "a" + n + " [1] keepdim");
    gradcheck([&](const Tensor& x) { return a(x, {}, false); }, rnd({3, 4}, 39), "a" + n + " []");
    gradcheck([&](const Tensor& x) { return a(x, {0}, false); }, strided({5, 6}, 40), "a" + n + " noncontig");
  }
}

TEST(ReduceGrad, Logsumexp) {
  gradcheck([](const Tensor& x) { return x.logsumexp({1}); }, rnd({3, 4}, 41), "logsumexp [1]");
  gradcheck([](const Tensor& x) { return x.logsumexp({0, 1}, true); }, rnd({3, 4}, 42), "logsumexp [0,1] keepdim");
  gradcheck([](const Tensor& x) { return x.logsumexp({-1}); }, rnd({2, 3, 4}, 43), "logsumexp [-1] 3-d");
  gradcheck([](const Tensor& x) { return x.logsumexp({0}); }, strided({5, 6}, 44), "logsumexp noncontig");
}

TEST(ReduceGrad, Norm) {
  for (double p : {1.0, 2.0, 3.0, 1.5, 0.5, 4.0, -1.0, kInf, -kInf}) {
    const std::string n = "norm p=" + std::to_string(p);
    gradcheck([p](const Tensor& x) { return x.norm(p); }, rnd({3, 4}, 51), n + " all");
    gradcheck([p](const Tensor& x) { return x.norm(p, {1}); }, rnd({3, 4}, 52), n + " [1]");
    gradcheck([p](const Tensor& x) { return x.norm(p, {0, -1}, true); }, rnd({2, 3, 4}, 53), n + " [0,-1] keepdim");
    gradcheck([p](const Tensor& x) { return x.norm(p, {1}); }, strided({5, 6}, 54), n + " noncontig");
  }
}

// ---- second derivatives ----

TEST(ReduceGrad, GradGrad) {
  gradgradcheck([](const Tensor& x) { return x.sum({1}); }, rnd({3, 4}, 61), "sum");
  gradgradcheck([](const Tensor& x) { return x.sum({0, 2}, true); }, rnd({2, 3, 4}, 62), "sum keepdim");
  gradgradcheck([](const Tensor& x) { return x.mean({0}); }, rnd({3, 4}, 63), "mean");
  gradgradcheck([](const Tensor& x) { return x.mean(); }, rnd({3, 4}, 64), "mean()");
  gradgradcheck([](const Tensor& x) { return x.var({1}); }, rnd({3, 4}, 65), "var");
  gradgradcheck([](const Tensor& x) { return x.var({}, 0); }, strided({4, 3}, 66), "var() noncontig");
  gradgradcheck([](const Tensor& x) { return x.std({0}, 1, true); }, rnd({3, 4}, 67), "std");
  gradgradcheck([](const Tensor& x) { return x.logsumexp({1}); }, rnd({3, 4}, 68), "logsumexp");
  gradgradcheck([](const Tensor& x) { return x.logsumexp({0, 1}, true); }, rnd({3, 4}, 69), "logsumexp all");
  gradgradcheck([](const Tensor& x) { return x.norm(2.0, {1}); }, rnd({3, 4}, 70), "norm p=2");
  gradgradcheck([](const Tensor& x) { return x.norm(); }, strided({4, 3}, 71), "norm() noncontig");
  gradgradcheck([](const Tensor& x) { return x.prod(1); }, rnd({3, 4}, 72), "prod");
  // Zeros: the second derivative at a zero is the product of the others, not 0.
  gradgradcheck([](const Tensor& x) { return x.prod(1); }, leaf({2, 0, 3, 0, 0, 1, 1, 2, 3}, {3, 3}), "prod zeros");
  gradgradcheck([](const Tensor& x) { return x.prod(); }, leaf({2, 0, 3, 4, 0.5, 1}, {2, 3}), "prod() one zero");
  gradgradcheck([](const Tensor& x) { return x.prod(); }, leaf({2, 0, 3, 4, 0, 1}, {2, 3}), "prod() two zeros");
}

// ---- ties, zeros and other special points, against torch 1.13 ----

TEST(ReduceGrad, TiesFollowTorch) {
  // torch: x.max() with grad 2 -> shared evenly among the three 3s.
  expect_values(grad_of([](const Tensor& x) { return x.max(); }, leaf({1, 3, 3, 3, 0, 2}, {2, 3}), scalar_tensor(2.0, kFloat64)),
                {0, 2.0 / 3, 2.0 / 3, 2.0 / 3, 0, 0});
  expect_values(grad_of([](const Tensor& x) { return x.min(); }, leaf({1, -3, 3, -3, 0, -3}, {2, 3}), scalar_tensor(2.0, kFloat64)),
                {0, 2.0 / 3, 0, 2.0 / 3, 0, 2.0 / 3});
  // torch: max() of [1, nan, 2, nan] -> the gradient is shared among the NaNs.
  expect_values(grad_of([](const Tensor& x) { return x.max(); }, leaf({1, kNaN, 2, kNaN}, {4}), scalar_tensor(2.0, kFloat64)),
                {0, 1, 0, 1});
  // torch: x.max(1)[0] with grad [1.5, -2] -> the first index of the tie only.
  expect_values(grad_of([](const Tensor& x) { return std::get<0>(x.max(1)); }, leaf({1, 3, 3, 2, 2, 2}, {2, 3}),
                        tensor<double>({1.5, -2})),
                {0, 1.5, 0, -2, 0, 0});
  // torch: x.min(0, keepdim=True)[0] with grad [[1.5, -2]].
  expect_values(grad_of([](const Tensor& x) { return std::get<0>(x.min(0, true)); }, leaf({1, 1, 1, 0, 1, 0}, {3, 2}),
                        tensor<double>({1.5, -2}, {1, 2})),
                {1.5, 0, 0, -2, 0, 0});
  // torch: x.amax(1) with grad [1.5, -2] -> split evenly among the tied maxima.
  expect_values(grad_of([](const Tensor& x) { return x.amax({1}); }, leaf({1, 3, 3, 2, 2, 2}, {2, 3}),
                        tensor<double>({1.5, -2})),
                {0, 0.75, 0.75, -2.0 / 3, -2.0 / 3, -2.0 / 3});
  // torch: x.amax([0, 2], keepdim=True) of [[[1,4],[2,2]],[[4,0],[2,1]]] with grad [[[3],[-1]]].
  expect_values(grad_of([](const Tensor& x) { return x.amax({0, 2}, true); }, leaf({1, 4, 2, 2, 4, 0, 2, 1}, {2, 2, 2}),
                        tensor<double>({3, -1}, {1, 2, 1})),
                {0, 1.5, -1.0 / 3, -1.0 / 3, 1.5, 0, -1.0 / 3, 0});
  // torch: x.amin(0) of [[1,3,-1],[1,2,-1]] with grad [1, 2, 3].
  expect_values(grad_of([](const Tensor& x) { return x.amin({0}); }, leaf({1, 3, -1, 1, 2, -1}, {2, 3}),
                        tensor<double>({1, 2, 3})),
                {0.5, 0, 1.5, 0.5, 2, 1.5});
  // torch: x.norm(inf, [1]) of [[3,-3,1],[3,4,0]] with grad [1, 2] -> split among |x| ties, signed.
  expect_values(grad_of([](const Tensor& x) { return x.norm(kInf, {1}); }, leaf({3, -3, 1, 3, 4, 0}, {2, 3}),
                        tensor<double>({1, 2})),
                {0.5, -0.5, 0, 0, 2, 0});
  // torch: x.norm(-inf, [1]) of [[3,-3,1],[-1,4,1]] with grad [1, 2].
  expect_values(grad_of([](const Tensor& x) { return x.norm(-kInf, {1}); }, leaf({3, -3, 1, -1, 4, 1}, {2, 3}),
                        tensor<double>({1, 2})),
                {0, 0, 1, -1, 0, 1});
  // torch: x.norm(inf) of [[2,-2],[1,2]] with grad 3.
  expect_values(grad_of([](const Tensor& x) { return x.norm(kInf); }, leaf({2, -2, 1, 2}, {2, 2}), scalar_tensor(3.0, kFloat64)),
                {1, -1, 0, 1});
}

TEST(ReduceGrad, ProdWithZerosFollowsTorch) {
  // torch: x.prod() of [[2,0,3],[4,5,1]] with grad 2 -> 2 * 120 at the zero.
  expect_values(grad_of([](const Tensor& x) { return x.prod(); }, leaf({2, 0, 3, 4, 5, 1}, {2, 3}), scalar_tensor(2.0, kFloat64)),
                {0, 240, 0, 0, 0, 0});
  // torch: two zeros -> all zero.
  expect_values(grad_of([](const Tensor& x) { return x.prod(); }, leaf({2, 0, 3, 4, 0, 1}, {2, 3}), scalar_tensor(2.0, kFloat64)),
                {0, 0, 0, 0, 0, 0});
  // torch: x.prod(1) of [[2,0,3],[0,0,1],[1,2,3]] with grad [1, 2, 3].
  expect_values(grad_of([](const Tensor& x) { return x.prod(1); }, leaf({2, 0, 3, 0, 0, 1, 1, 2, 3}, {3, 3}),
                        tensor<double>({1, 2, 3})),
                {0, 6, 0, 0, 0, 0, 18, 9, 6});
  // torch: x.prod(0, keepdim=True) of [[2,0],[0,3],[5,0],[1,1]] with grad [[2, 3]].
  expect_values(grad_of([](const Tensor& x) { return x.prod(0, true); }, leaf({2, 0, 0, 3, 5, 0, 1, 1}, {4, 2}),
                        tensor<double>({2, 3}, {1, 2})),
                {0, 0, 20, 0, 0, 0, 0, 0});
  // float32 takes the same path.
  Tensor x = tensor<float>({2, 0, 3, 4, 5, 1}, {2, 3}).requires_grad_();
  x.prod().backward();
  expect_values(x.grad(), {0, 120, 0, 0, 0, 0});
}

TEST(ReduceGrad, DegenerateStatisticsFollowTorch) {
  const Tensor ones2 = tensor<double>({1, 1});
  // torch: x.std(1) of [[2,2,2],[1,2,4]] -> 0 for the constant row (not NaN).
  expect_values(grad_of([](const Tensor& x) { return x.std({1}); }, leaf({2, 2, 2, 1, 2, 4}, {2, 3}), ones2),
                {0, 0, 0, -0.436435780472, -0.109108945118, 0.54554472559}, 1e-9);
  // torch: x.var(1, correction=2) of [[1,2],[3,3]] -> (2 / 0) (x - mean).
  expect_values(grad_of([](const Tensor& x) { return x.var({1}, 2); }, leaf({1, 2, 3, 3}, {2, 2}), ones2),
                {-kInf, kInf, kNaN, kNaN});
  // torch: x.var(correction=4) over 4 elements -> NaN where x == mean, +inf elsewhere.
  expect_values(grad_of([](const Tensor& x) { return x.var({}, 4); }, leaf({1, 2, 1.5, 1.5}, {2, 2}), scalar_tensor(1.0, kFloat64)),
                {kInf, kInf, kNaN, kNaN});
  // torch: x.logsumexp(1) of [[-inf,-inf],[0,1]] -> NaN for the all -inf row.
  expect_values(grad_of([](const Tensor& x) { return x.logsumexp({1}); }, leaf({-kInf, -kInf, 0, 1}, {2, 2}), ones2),
                {kNaN, kNaN, 0.26894142137, 0.73105857863}, 1e-9);
  // torch: zero norms give 0 (p=2 and p=3 mask norm == 0; p=0.5 masks x == 0).
  expect_values(grad_of([](const Tensor& x) { return x.norm(2.0, {1}); }, leaf({0, 0, 3, 4}, {2, 2}), ones2),
                {0, 0, 0.6, 0.8});
  expect_values(grad_of([](const Tensor& x) { return x.norm(3.0, {1}); }, leaf({0, 0, 3, -4}, {2, 2}), ones2),
                {0, 0, 0.444851351731, -0.790846847521}, 1e-9);
  expect_values(grad_of([](const Tensor& x) { return x.norm(0.5, {1}); }, leaf({0, 0, 3, -4}, {2, 2}), ones2),
                {0, 0, 2.154700538379, -1.866025403784}, 1e-9);
  // torch: norm(1) has sign(x), 0 at 0.
  expect_values(grad_of([](const Tensor& x) { return x.norm(1.0, {1}); }, leaf({0, -2, 3, 0}, {2, 2}), ones2),
                {0, -1, 1, 0});
}

TEST(ReduceGrad, NormZeroHasNoGradient) {
  // torch: x.norm(0) has a grad_fn, but x.grad stays None after backward.
  Tensor x = rnd({3, 4}, 81);
  Tensor y = x.norm(0.0);
  ASSERT_NE(y.grad_fn(), nullptr);
  y.backward();
  EXPECT_FALSE(x.grad().defined());
}

// ---- what records, names, call sites, views, dtypes ----

TEST(ReduceGrad, NodeNamesMatchTorch) {
  Tensor x = rnd({3, 4}, 91);
  auto name = [](const Tensor& t) { return std::string(t.grad_fn()->name()); };
  EXPECT_EQ(name(x.sum()), "SumBackward0");
  EXPECT_EQ(name(x.sum({1})), "SumBackward1");
  EXPECT_EQ(name(x.mean()), "MeanBackward0");
  EXPECT_EQ(name(x.mean({1})), "MeanBackward1");
  EXPECT_EQ(name(x.prod()), "ProdBackward0");
  EXPECT_EQ(name(x.prod(1)), "ProdBackward1");
  EXPECT_EQ(name(x.var({1})), "VarBackward0");
  EXPECT_EQ(name(x.std()), "StdBackward0");
  EXPECT_EQ(name(x.max()), "MaxBackward1");
  EXPECT_EQ(name(x.min()), "MinBackward1");
  EXPECT_EQ(name(std::get<0>(x.max(1))), "MaxBackward0");
  EXPECT_EQ(name(std::get<0>(x.min(1))), "MinBackward0");
  EXPECT_EQ(name(x.amax({1})), "AmaxBackward0");
  EXPECT_EQ(name(x.amin({1})), "AminBackward0");
  EXPECT_EQ(name(x.logsumexp({1})), "LogsumexpBackward0");
  EXPECT_EQ(name(x.norm()), "NormBackward1");
  EXPECT_EQ(name(x.softmax(1)), "SoftmaxBackward0");
  EXPECT_EQ(name(x.log_softmax(1)), "LogSoftmaxBackward0");
}

TEST(ReduceGrad, NonDifferentiableResultsRecordNothing) {
  Tensor x = rnd({3, 4}, 92);
  for (const Tensor& t : {x.argmax(), x.argmin(1), x.gt(0).all(), x.gt(0).any(), std::get<1>(x.max(1)),
                          std::get<1>(x.min(0, true)), x.sum(kInt64)}) {
    EXPECT_FALSE(t.requires_grad());
    EXPECT_EQ(t.grad_fn(), nullptr);
  }
  // No input requires grad, or grad mode is off: no node.
  Tensor c = ops::sample_tensor({3, 4}, kFloat32, 93);
  EXPECT_EQ(c.softmax(1).grad_fn(), nullptr);
  EXPECT_EQ(c.sum().grad_fn(), nullptr);
  NoGradGuard no_grad;
  EXPECT_EQ(x.prod().grad_fn(), nullptr);
  EXPECT_FALSE(x.logsumexp({0}).requires_grad());
  EXPECT_FALSE(std::get<0>(x.max(0)).requires_grad());
}

TEST(ReduceGrad, CallSitesAreTheCallers) {
  Tensor x = rnd({3, 4}, 94);
  const uint32_t line = __LINE__ + 1;
  Tensor a = x.sum({1}), b = kiln::var(x, {0}), c = kiln::softmax(x, -1), d = std::get<0>(kiln::max(x, 1));
  for (const Tensor& t : {a, b, c, d}) {
    const autograd::CallSite s = t.grad_fn()->site();
    ASSERT_TRUE(s.known());
    EXPECT_EQ(s.line, line);
    EXPECT_NE(std::string(s.file).find("test_reduce_grad.cpp"), std::string::npos) << s.file;
  }
}

TEST(ReduceGrad, SumAndMeanGradientsAreExpandedViews) {
  // The reduced dims come back as stride-0 views of the incoming gradient, not copies.
  Tensor x = rnd({3, 4, 5}, 95);
  const Tensor g = ops::sample_tensor({3, 5}, kFloat64, 96);
  Tensor gs = autograd::grad({x.sum({1})}, {x}, {g})[0];
  EXPECT_EQ(gs.sizes().vec(), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(gs.stride(1), 0);
  EXPECT_TRUE(gs.is_alias_of(g));
  Tensor gm = autograd::grad({x.mean({0, 2}, true)}, {x}, {ones({1, 4, 1}, kFloat64)})[0];
  EXPECT_EQ(gm.stride(0), 0);
  EXPECT_EQ(gm.stride(2), 0);
  expect_values(gm.select(0, 2).select(1, 3), std::vector<double>(4, 1.0 / 15));
}

TEST(ReduceGrad, SumWithDtypeSendsTheGradientBackInTheInputDtype) {
  Tensor x = tensor<float>({1, 2, 3, 4}, {2, 2}).requires_grad_();
  Tensor y = x.sum({1}, false, kFloat64);
  EXPECT_EQ(y.dtype(), kFloat64);
  y.backward(tensor<double>({0.5, -1}));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  expect_values(x.grad(), {0.5, 0.5, -1, -1});
  Tensor h = tensor<float>({1, 2}).to(kBFloat16).requires_grad_();
  h.sum(kFloat32).backward();
  EXPECT_EQ(h.grad().dtype(), kBFloat16);
  expect_values(h.grad(), {1, 1});
}

TEST(ReduceGrad, EmptyReductions) {
  Tensor x = zeros({0, 3}, kFloat64).requires_grad_();
  Tensor gs = autograd::grad({x.sum({0})}, {x}, {ones({3}, kFloat64)})[0];
  EXPECT_EQ(gs.sizes().vec(), (std::vector<int64_t>{0, 3}));
  Tensor gp = autograd::grad({x.prod(0)}, {x}, {ones({3}, kFloat64)})[0];
  EXPECT_EQ(gp.sizes().vec(), (std::vector<int64_t>{0, 3}));
}

TEST(ReduceGrad, SavedInputModifiedInPlaceIsAnError) {
  Tensor x = rnd({3, 4}, 97);
  Tensor y = x.softmax(1);
  {
    NoGradGuard no_grad;
    y.mul_(2);
  }
  try {
    y.backward(ones({3, 4}, kFloat64));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("SoftmaxBackward0"), std::string::npos) << e.what();
  }
}

// ---- the registry's backward samples ----

// The registry driver checks every sample with grad_inputs against torch and
// by gradcheck; here: which of this family's samples carry them.
TEST(ReduceGrad, RegistryBackwardSamplesAreTheSmallFloatingOnes) {
  const std::vector<std::string> family = {"sum",    "mean", "prod",      "var",  "std",     "max",
                                           "min",    "amax", "amin",      "logsumexp", "norm", "softmax",
                                           "log_softmax", "argmax", "argmin", "all", "any"};
  int specs = 0;
  for (const ops::OpSpec& spec : ops::op_registry()) {
    if (std::find(family.begin(), family.end(), spec.name) == family.end()) continue;
    ++specs;
    const bool integer_result = spec.name == "argmax" || spec.name == "argmin" || spec.name == "all" ||
                                spec.name == "any";
    EXPECT_EQ(spec.differentiable, !integer_result) << spec.name;
    for (DType dt : spec.dtypes) {
      for (const ops::OpSample& s : spec.samples(dt)) {
        const std::string what = spec.name + " " + std::string(dtype_name(dt)) + " [" + s.label + "]";
        const bool small = s.inputs[0].numel() <= 200;
        const bool expected = !integer_result && is_floating_point(dt) && small && s.label != "p=0";
        EXPECT_EQ(!s.grad_inputs.empty(), expected) << what;
      }
    }
  }
  EXPECT_EQ(specs, static_cast<int>(family.size()));
}
