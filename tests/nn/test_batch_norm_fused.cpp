// The fused training-mode batch norm (ops/batch_norm.h, kernels/cpu/batch_norm.cpp)
// against the composite it replaced in nn::BatchNorm (mean, var, subtract,
// rsqrt, scale, shift, each differentiated by autograd): the same outputs,
// statistics and gradients; float64 gradcheck and gradgradcheck (the
// create_graph path); layouts, threads and the dtypes left to the composite.
// Agreement with torch is checked by test_layers / test_training_parity.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/core/threads.h"
#include "kiln/kiln.h"
#include "kiln/ops/batch_norm.h"

using namespace kiln;

namespace {

std::vector<int64_t> stat_dims(const Tensor& x) {
  std::vector<int64_t> d = {0};
  for (int64_t i = 2; i < x.dim(); ++i) d.push_back(i);
  return d;
}

std::vector<int64_t> cshape(const Tensor& x) {
  std::vector<int64_t> s(static_cast<size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

// nn::BatchNorm's former composite.
Tensor composite(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  const auto dims = stat_dims(x);
  Tensor y = (x - x.mean(dims).view(cshape(x))) * (x.var(dims, 0).view(cshape(x)) + eps).rsqrt();
  if (w.defined()) y = y * w.view(cshape(x));
  if (b.defined()) y = y + b.view(cshape(x));
  return y;
}

Tensor data(IntArrayRef sizes, uint64_t seed, DType dt, double scale = 3.0, double offset = 10.0) {
  Generator gen(seed);
  return (randn(sizes, TensorOptions().dtype(dt), &gen) * scale + offset).detach();
}

void expect_matches_composite(IntArrayRef sizes, DType dt, bool affine, uint64_t seed, double tol) {
  const int64_t c = sizes[1];
  Tensor x = data(sizes, seed, dt).requires_grad_();
  Tensor w = affine ? data({c}, seed + 1, dt, 0.3, 1.0).requires_grad_() : Tensor();
  Tensor b = affine ? data({c}, seed + 2, dt, 0.3, 0.0).requires_grad_() : Tensor();
  Tensor gy = data(sizes, seed + 3, dt, 1.0, 0.2);

  ops::BatchNormResult r = ops::batch_norm_train(x, w, b, 1e-5);
  Tensor y_ref = composite(x, w, b, 1e-5);
  EXPECT_TRUE(r.output.allclose(y_ref, tol, tol));
  EXPECT_TRUE(r.mean.allclose(x.detach().mean(stat_dims(x)), tol, tol));
  EXPECT_TRUE(r.var.allclose(x.detach().var(stat_dims(x), 0), tol, tol));
  EXPECT_FALSE(r.mean.requires_grad());

  TensorList in = {x};
  if (affine) in.insert(in.end(), {w, b});
  TensorList got = autograd::grad({r.output}, in, {gy});
  TensorList want = autograd::grad({y_ref}, in, {gy});
  for (size_t i = 0; i < in.size(); ++i) {
    SCOPED_TRACE("input " + std::to_string(i));
    EXPECT_TRUE(got[i].allclose(want[i], tol, tol)) << (got[i] - want[i]).abs().max().item<double>();
  }
}

TEST(BatchNormFused, MatchesTheComposite) {
  expect_matches_composite({8, 5, 7, 9}, kFloat32, true, 1, 2e-4);
  expect_matches_composite({8, 5, 7, 9}, kFloat64, true, 2, 1e-10);
  expect_matches_composite({6, 4}, kFloat32, true, 3, 2e-4);           // BatchNorm1d, 2-D
  expect_matches_composite({3, 4, 37}, kFloat32, false, 4, 2e-4);      // no affine, odd inner size
  expect_matches_composite({2, 3, 1, 1}, kFloat64, true, 5, 1e-10);    // inner size 1
  expect_matches_composite({32, 16, 16, 16}, kFloat32, true, 6, 2e-4);  // several threads' worth
}

TEST(BatchNormFused, GradcheckAndGradgradcheck) {
  for (bool affine : {true, false}) {
    SCOPED_TRACE(affine ? "affine" : "plain");
    Tensor x = data({3, 2, 4}, 11, kFloat64, 1.0, 0.5).requires_grad_();
    TensorList in = {x};
    if (affine) {
      in.push_back(data({2}, 12, kFloat64, 0.3, 1.0).requires_grad_());
      in.push_back(data({2}, 13, kFloat64, 0.3, 0.0).requires_grad_());
    }
    const auto fn = [affine](const TensorList& t) {
      return TensorList{ops::batch_norm_train(t[0], affine ? t[1] : Tensor(), affine ? t[2] : Tensor(), 1e-5).output};
    };
    EXPECT_TRUE(autograd::gradcheck(fn, in));
    EXPECT_TRUE(autograd::gradgradcheck(fn, in));
  }
}

TEST(BatchNormFused, NonContiguousInputAndGradient) {
  Tensor base = data({5, 6, 4, 3}, 21, kFloat32);
  Tensor x = base.permute({0, 3, 2, 1}).detach().requires_grad_();  // [5, 3, 4, 6], channels strided
  ASSERT_FALSE(x.is_contiguous());
  Tensor w = data({3}, 22, kFloat32, 0.3, 1.0).requires_grad_();
  Tensor b = data({3}, 23, kFloat32, 0.3, 0.0).requires_grad_();
  Tensor gy = data({6, 4, 3, 5}, 24, kFloat32, 1.0, 0.0).permute({3, 2, 1, 0});
  ASSERT_EQ(gy.sizes(), x.sizes());
  Tensor y = ops::batch_norm_train(x, w, b, 1e-5).output;
  Tensor y_ref = composite(x, w, b, 1e-5);
  EXPECT_TRUE(y.allclose(y_ref, 2e-4, 2e-4));
  TensorList got = autograd::grad({y}, {x, w, b}, {gy});
  TensorList want = autograd::grad({y_ref}, {x, w, b}, {gy});
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(got[i].allclose(want[i], 2e-4, 2e-4)) << i;
}

TEST(BatchNormFused, ThreadCountDoesNotChangeTheResult) {
  Tensor x = data({16, 8, 32, 32}, 31, kFloat32).requires_grad_();
  Tensor w = data({8}, 32, kFloat32, 0.3, 1.0).requires_grad_();
  Tensor gy = data({16, 8, 32, 32}, 33, kFloat32, 1.0, 0.0);
  const int before = get_num_threads();
  TensorList results[2];
  for (int t : {1, 2}) {
    set_num_threads(t);
    Tensor y = ops::batch_norm_train(x, w, Tensor(), 1e-5).output;
    TensorList g = autograd::grad({y}, {x, w}, {gy});
    results[t - 1] = {y, g[0], g[1]};
  }
  set_num_threads(before);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(results[0][i].equal(results[1][i])) << i;
}

TEST(BatchNormFused, ModuleUsesItWhereSupportedAndTheCompositeElsewhere) {
  EXPECT_TRUE(ops::batch_norm_train_supported(zeros({2, 3, 4}), ones({3}), zeros({3})));
  EXPECT_TRUE(ops::batch_norm_train_supported(zeros({2, 3}, kFloat64), Tensor(), Tensor()));
  EXPECT_FALSE(ops::batch_norm_train_supported(zeros({2, 3, 4}, kBFloat16), Tensor(), Tensor()));
  EXPECT_FALSE(ops::batch_norm_train_supported(zeros({2, 3, 4}), ones({3}, kFloat64), Tensor()));

  nn::BatchNorm2d bn({.num_features = 3});
  Tensor x = data({4, 3, 5, 5}, 41, kFloat32).requires_grad_();
  Tensor y = bn.forward(x);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "NativeBatchNormBackward0");
  EXPECT_TRUE(y.allclose(composite(x, bn.weight, bn.bias, 1e-5), 2e-4, 2e-4));
  // Running stats: momentum 0.1 from (0, 1), the unbiased variance.
  const auto dims = stat_dims(x);
  EXPECT_TRUE(bn.running_mean.allclose(x.detach().mean(dims) * 0.1, 1e-5, 1e-5));
  EXPECT_TRUE(bn.running_var.allclose(x.detach().var(dims, 1) * 0.1 + 0.9, 1e-4, 1e-5));

  nn::BatchNorm2d half({.num_features = 3, .dtype = kBFloat16});
  Tensor yh = half.forward(x.detach().to(kBFloat16));
  EXPECT_EQ(yh.dtype(), kBFloat16);
}

TEST(BatchNormFused, OneValuePerChannelIsAnError) {
  EXPECT_THROW((void)ops::batch_norm_train(zeros({1, 3}), Tensor(), Tensor(), 1e-5), ValueError);
}

}  // namespace
