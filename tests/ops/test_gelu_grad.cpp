// GELU's backward over its incoming gradient (Note [GELU's gradient over its
// incoming buffer] in src/ops/unary.cpp): written in place when the engine's
// buffer is the only reference, with the bits of the out-of-place op, and
// never over a gradient something else holds.
#include <gtest/gtest.h>

#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/autograd/node.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

Tensor values(int64_t n, uint64_t seed, DType dt) {
  Generator gen(seed);
  return ((rand({n}, kFloat64, &gen) * 8 - 4)).to(dt);
}

// x's gradient through gelu with incoming gradient g held by the caller: the
// out-of-place op (the caller's buffer is never written).
Tensor held_grad(const Tensor& x, const Tensor& g, const std::string& form) {
  Tensor xl = x.detach().requires_grad_();
  return autograd::grad({xl.gelu(form)}, {xl}, {g})[0];
}

}  // namespace

using test::ArrivalProbe;

TEST(GeluBackward, WritesIntoASoleOwnedIncomingGradientWithTheSameBits) {
  // 300,000 float32 values: the out-of-place op streams a row that long, the in-place one cannot.
  for (DType dt : {kFloat32, kBFloat16, kFloat64})
    for (const std::string form : {"tanh", "none"}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + form);
      Tensor x = values(300000, 71, dt).requires_grad_();
      const Tensor w = values(300000, 72, dt);
      Tensor y = x.gelu(form);
      ArrivalProbe at_gelu(y), at_leaf(x);
      (y * w).sum().backward();  // MulBackward's g * w is the gelu node's own buffer
      ASSERT_NE(at_gelu.ptr, nullptr);
      EXPECT_EQ(at_leaf.ptr, at_gelu.ptr) << "gelu's backward allocated instead of reusing its incoming buffer";
      EXPECT_TRUE(x.grad().equal(held_grad(x, w, form)));
    }
}

TEST(GeluBackward, SharedOrKeptIncomingGradientIsLeftAlone) {
  const Tensor w = values(40, 83, kFloat32);
  // AddBackward hands the same buffer to both gelu nodes: the first may not overwrite it.
  Tensor x1 = values(40, 81, kFloat32).requires_grad_(), x2 = values(40, 82, kFloat32).requires_grad_();
  ((x1.gelu("tanh") + x2.gelu("tanh")) * w).sum().backward();
  EXPECT_TRUE(x1.grad().equal(held_grad(x1, w, "tanh")));
  EXPECT_TRUE(x2.grad().equal(held_grad(x2, w, "tanh")));

  // The caller's gradient (held by the graph root) is never written.
  Tensor xr = values(40, 84, kFloat32).requires_grad_();
  Tensor user_grad = w.clone();
  xr.gelu("tanh").backward(user_grad);
  EXPECT_TRUE(user_grad.equal(w));

  // A hook that keeps the incoming gradient sees it unchanged.
  Tensor x = values(40, 85, kFloat32).requires_grad_();
  Tensor y = x.gelu("tanh");
  test::GradKeeper keeper(y);
  (y * w).sum().backward();
  EXPECT_TRUE(keeper.kept.equal(w));
  EXPECT_TRUE(x.grad().equal(held_grad(x, w, "tanh")));

  // Under create_graph the gradient is a differentiable op's output.
  Tensor xc = values(40, 86, kFloat64).requires_grad_();
  const Tensor gx = autograd::grad({(xc.gelu("tanh") * w.to(kFloat64)).sum()}, {xc}, {}, std::nullopt, true)[0];
  ASSERT_NE(gx.grad_fn(), nullptr);
  EXPECT_STREQ(gx.grad_fn()->name(), "GeluBackwardBackward0");
}
