// ReLU's backward through the one-pass threshold_backward kernel
// (src/kernels/cpu/threshold.cpp): the same values as the composition it
// replaced (where(result <= 0, 0, grad)) for every dtype, layout and special
// value, PyTorch's choices at 0, -0, NaN and infinities, and double backward
// through ThresholdBackwardBackward0.
//
// Expected values from /usr/bin/python3 torch 1.13 (torch.set_num_threads(1)):
//   x = [nan, 0, -0, 1, -1, inf, -inf]; x.relu().backward(arange(1, 8))
//   -> x.grad = [1, 0, 0, 4, 0, 6, 0]
//   torch.autograd.grad(x.relu(), x, g, create_graph=True)[0].grad_fn.name()
//   -> "ThresholdBackwardBackward0"
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/autograd/node.h"
#include "kiln/core/threads.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

// relu's gradient for `x` with incoming gradient `g`, through autograd.
Tensor relu_grad(const Tensor& x, const Tensor& g) {
  Tensor xl = x.detach().requires_grad_();
  return autograd::grad({xl.relu()}, {xl}, {g})[0];
}

// The formula the kernel replaced, computed without autograd.
Tensor reference(const Tensor& x, const Tensor& g) {
  const Tensor r = x.detach().relu();
  return where(r <= 0, Scalar(0), g);
}

Tensor values(int64_t n, uint64_t seed, DType dt) {
  Generator gen(seed);
  Tensor t = rand({n}, kFloat64, &gen) * 4 - 2;
  // Exact zeros and negative zeros at fixed places: the kink.
  for (int64_t i = 0; i < n; i += 7) t.narrow(0, i, 1).fill_(i % 2 ? -0.0 : 0.0);
  return t.to(dt);
}

TEST(ThresholdBackward, SpecialValuesAsTorch) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = tensor<double>({nan, 0.0, -0.0, 1.0, -1.0, inf, -inf}).to(dt);
    Tensor g = arange(1, 8, 1, TensorOptions().dtype(dt));
    Tensor got = relu_grad(x, g);
    EXPECT_EQ(got.dtype(), dt);
    EXPECT_TRUE(got.to(kFloat64).equal(tensor<double>({1, 0, 0, 4, 0, 6, 0}))) << got;
  }
}

TEST(ThresholdBackward, MatchesTheCompositionForEveryDTypeAndSize) {
  uint64_t seed = 1;
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    // Sizes around the vector width, the conversion block and the threading grain.
    for (int64_t n : {1, 15, 16, 17, 255, 257, 4099, 300001}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n=" + std::to_string(n));
      Tensor x = values(n, seed++, dt), g = values(n, seed++, dt);
      EXPECT_TRUE(relu_grad(x, g).equal(reference(x, g)));
    }
  }
}

TEST(ThresholdBackward, NonContiguousGradient) {
  // A transposed incoming gradient, out of place and in place.
  Tensor x = values(60, 11, kFloat32).view({6, 10});
  Tensor g = values(60, 12, kFloat32).view({10, 6}).t();
  ASSERT_FALSE(g.is_contiguous());
  EXPECT_TRUE(relu_grad(x, g).equal(reference(x, g)));

  // relu_ saves the result it wrote in place; the gradient arrives transposed.
  Tensor xl = x.detach().requires_grad_();
  Tensor y = xl * 1;
  y.relu_();
  Tensor got = autograd::grad({y}, {xl}, {g})[0];
  EXPECT_TRUE(got.equal(reference(x, g)));
}

TEST(ThresholdBackward, ThreadCountDoesNotChangeTheResult) {
  Tensor x = values(1 << 20, 21, kFloat32), g = values(1 << 20, 22, kFloat32);
  const int before = get_num_threads();
  set_num_threads(1);
  Tensor one = relu_grad(x, g);
  set_num_threads(std::max(2, before));
  Tensor many = relu_grad(x, g);
  set_num_threads(before);
  EXPECT_TRUE(one.equal(many));
  EXPECT_TRUE(one.equal(reference(x, g)));
}

using test::ArrivalProbe;

TEST(ThresholdBackward, WritesIntoASoleOwnedIncomingGradient) {
  Tensor x = values(64, 51, kFloat32).requires_grad_();
  Tensor w = values(64, 52, kFloat32);
  Tensor y = x.relu();
  ArrivalProbe at_relu(y), at_leaf(x);
  (y * w).sum().backward();  // MulBackward's g * w is the relu node's own buffer
  ASSERT_NE(at_relu.ptr, nullptr);
  EXPECT_EQ(at_leaf.ptr, at_relu.ptr) << "relu's backward allocated instead of reusing its incoming buffer";
  EXPECT_TRUE(x.grad().equal(reference(x, w)));
}

TEST(ThresholdBackward, SharedOrKeptIncomingGradientIsLeftAlone) {
  // AddBackward hands the same buffer to both relu nodes: the first may not overwrite it.
  Tensor x1 = values(40, 61, kFloat32).requires_grad_(), x2 = values(40, 62, kFloat32).requires_grad_();
  Tensor w = values(40, 63, kFloat32);
  ((x1.relu() + x2.relu()) * w).sum().backward();
  EXPECT_TRUE(x1.grad().equal(reference(x1, w)));
  EXPECT_TRUE(x2.grad().equal(reference(x2, w)));

  // The caller's gradient (held by the graph root) is never written.
  Tensor xr = values(40, 65, kFloat32).requires_grad_();
  Tensor user_grad = w.clone();
  xr.relu().backward(user_grad);
  EXPECT_TRUE(user_grad.equal(w));
  EXPECT_TRUE(xr.grad().equal(reference(xr, w)));

  // A hook that keeps the incoming gradient sees it unchanged.
  Tensor x = values(40, 64, kFloat32).requires_grad_();
  Tensor y = x.relu();
  test::GradKeeper keeper(y);
  (y * w).sum().backward();
  EXPECT_TRUE(keeper.kept.equal(w));
  EXPECT_TRUE(x.grad().equal(reference(x, w)));
}

TEST(ThresholdBackward, DoubleBackward) {
  Generator gen(5);
  // Values away from the kink, where the finite differences would straddle it.
  Tensor x = tensor<double>({-1.5, -0.7, -0.2, 0.3, 0.9, 1.7, -1.1, 0.45, -0.35, 1.2, -1.9, 0.6}, {3, 4}).requires_grad_();
  Tensor g = (rand({3, 4}, kFloat64, &gen) - 0.5).requires_grad_();
  Tensor gx = autograd::grad({x.relu()}, {x}, {g}, std::nullopt, /*create_graph=*/true)[0];
  ASSERT_NE(gx.grad_fn(), nullptr);
  EXPECT_STREQ(gx.grad_fn()->name(), "ThresholdBackwardBackward0");
  // d(sum(gx * w))/dg = threshold_backward(w, relu(x)); nothing flows to x.
  Tensor w = rand({3, 4}, kFloat64, &gen);
  TensorList gg = autograd::grad({(gx * w).sum()}, {g, x}, {}, std::nullopt, false, /*allow_unused=*/true);
  EXPECT_TRUE(gg[0].equal(reference(x, w)));
  if (gg[1].defined()) {
    EXPECT_EQ(gg[1].abs().sum().item<double>(), 0.0);
  }

  const auto fn = [](const TensorList& in) { return TensorList{in[0].relu() * in[0]}; };
  EXPECT_TRUE(autograd::gradcheck(fn, {x}));
  EXPECT_TRUE(autograd::gradgradcheck(fn, {x}));
}

}  // namespace
