// Layer norm's input gradient over its incoming buffer (Note [Layer norm's
// input gradient over its incoming buffer] in src/ops/layer_norm.cpp):
// written in place when the engine's buffer is the only reference, with the
// bits of the backward into a fresh (and, past 1 MB, streamed) output, and
// never over a gradient something else holds.
#include <gtest/gtest.h>

#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/ops/layer_norm.h"
#include "support/test_util.h"

using namespace kiln;
using ops::layer_norm;
using test::ArrivalProbe;

TEST(LayerNormGradBuffer, InputGradientOverASoleOwnedIncomingGradientWithTheSameBits) {
  // [2048, 256] float32 is gpt's (2 MB: streamed when fresh); float64 takes the generic rows.
  for (DType dt : {kFloat32, kFloat64})
    for (int64_t n : {256, 100}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n=" + std::to_string(n));
      manual_seed(40 + n);
      const Tensor x0 = randn({2048, n}, dt), w0 = randn({n}, dt), b0 = randn({n}, dt), u = randn({2048, n}, dt);
      TensorList grads[2];
      for (int held = 0; held < 2; ++held) {
        const Tensor x = x0.detach().requires_grad_(), w = w0.detach().requires_grad_(),
                     b = b0.detach().requires_grad_();
        const Tensor y = layer_norm(x, {n}, w, b, 1e-5);
        if (held) {
          grads[1] = autograd::grad({y}, {x, w, b}, {u});  // the caller holds the gradient: a fresh output
          continue;
        }
        ArrivalProbe at_ln(y), at_leaf(x);
        (y * u).sum().backward();  // MulBackward's g * u is the layer norm node's own buffer
        ASSERT_NE(at_ln.ptr, nullptr);
        EXPECT_EQ(at_leaf.ptr, at_ln.ptr) << "layer norm's backward allocated instead of reusing its incoming buffer";
        grads[0] = {x.grad(), w.grad(), b.grad()};
      }
      EXPECT_TRUE(grads[0][0].equal(grads[1][0])) << "grad x";
      EXPECT_TRUE(grads[0][1].equal(grads[1][1])) << "grad weight";
      EXPECT_TRUE(grads[0][2].equal(grads[1][2])) << "grad bias";
    }
}

TEST(LayerNormGradBuffer, SharedOrKeptIncomingGradientIsLeftAlone) {
  manual_seed(8);
  const Tensor u = randn({64, 32});
  const Tensor w = randn({32}).requires_grad_(), b = randn({32}).requires_grad_();
  auto alone = [&](const Tensor& x) {
    const Tensor xl = x.detach().requires_grad_();
    return autograd::grad({layer_norm(xl, {32}, w.detach(), b.detach(), 1e-5)}, {xl}, {u})[0];
  };
  // AddBackward hands the same buffer to both layer norm nodes: the first may not overwrite it.
  const Tensor x1 = randn({64, 32}).requires_grad_(), x2 = randn({64, 32}).requires_grad_();
  ((layer_norm(x1, {32}, w, b, 1e-5) + layer_norm(x2, {32}, w, b, 1e-5)) * u).sum().backward();
  EXPECT_TRUE(x1.grad().equal(alone(x1)));
  EXPECT_TRUE(x2.grad().equal(alone(x2)));

  // The caller's gradient (held by the graph root) is never written.
  const Tensor xr = randn({64, 32}).requires_grad_();
  const Tensor user_grad = u.clone();
  layer_norm(xr, {32}, w, b, 1e-5).backward(user_grad);
  EXPECT_TRUE(user_grad.equal(u));

  // A hook that keeps the incoming gradient sees it unchanged.
  const Tensor x = randn({64, 32}).requires_grad_();
  const Tensor y = layer_norm(x, {32}, w, b, 1e-5);
  test::GradKeeper keeper(y);
  (y * u).sum().backward();
  EXPECT_TRUE(keeper.kept.equal(u));
  EXPECT_TRUE(x.grad().equal(alone(x)));
}
