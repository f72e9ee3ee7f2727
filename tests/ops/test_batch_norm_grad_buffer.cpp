// Batch norm's input gradient over its incoming buffer (Note [Batch norm's
// input gradient over its incoming buffer] in src/ops/batch_norm.cpp): written
// in place when the engine's buffer is the only reference, with the bits of
// the backward into a fresh output, and never over a gradient something else
// holds.
#include <gtest/gtest.h>

#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/ops/batch_norm.h"
#include "kiln/ops/memory_format.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

Tensor to_cl(const Tensor& t) { return contiguous(t, MemoryFormat::ChannelsLast); }

enum class Form { Plain, PlainChannelsLast, Relu, AddRelu };

const char* form_name(Form f) {
  switch (f) {
    case Form::Plain: return "batch_norm (NCHW)";
    case Form::PlainChannelsLast: return "batch_norm (channels-last)";
    case Form::Relu: return "batch_norm_relu";
    case Form::AddRelu: return "batch_norm_add_relu";
  }
  return "?";
}

Tensor forward(Form f, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& r) {
  switch (f) {
    case Form::Plain:
    case Form::PlainChannelsLast: return ops::batch_norm_train(x, w, b, 1e-5).output;
    case Form::Relu: return ops::batch_norm_relu_train(x, w, b, 1e-5).output;
    case Form::AddRelu: return ops::batch_norm_add_relu_train(x, w, b, r, 1e-5).output;
  }
  return {};
}

}  // namespace

using test::ArrivalProbe;

TEST(BatchNormGradBuffer, InputGradientOverASoleOwnedIncomingGradientWithTheSameBits) {
  for (Form f : {Form::Plain, Form::PlainChannelsLast, Form::Relu, Form::AddRelu})
    for (int64_t c : {5, 16, 64}) {
      SCOPED_TRACE(std::string(form_name(f)) + " c=" + std::to_string(c));
      manual_seed(90 + c);
      const bool cl = f != Form::Plain;
      auto layout = [&](const Tensor& t) { return cl ? to_cl(t) : t.contiguous(); };
      const Tensor x0 = layout(randn({8, c, 6, 7})), r0 = layout(randn({8, c, 6, 7}));
      const Tensor w0 = randn({c}), b0 = randn({c}), u = layout(randn({8, c, 6, 7}));
      TensorList grads[2];
      for (int held = 0; held < 2; ++held) {
        const Tensor x = x0.detach().requires_grad_(), r = r0.detach().requires_grad_();
        const Tensor w = w0.detach().requires_grad_(), b = b0.detach().requires_grad_();
        const Tensor y = forward(f, x, w, b, r);
        if (held) {
          // The caller holds the incoming gradient: the kernel writes fresh outputs.
          grads[1] = autograd::grad({y}, {x, w, b, r}, {u}, std::nullopt, false, /*allow_unused=*/true);
          continue;
        }
        ArrivalProbe at_bn(y), at_leaf(x);
        (y * u).sum().backward();  // MulBackward's g * u is the batch norm node's own buffer
        ASSERT_NE(at_bn.ptr, nullptr);
        EXPECT_EQ(at_leaf.ptr, at_bn.ptr) << "batch norm's backward allocated instead of reusing its incoming buffer";
        grads[0] = {x.grad(), w.grad(), b.grad(), r.grad()};
      }
      EXPECT_TRUE(grads[0][0].equal(grads[1][0])) << "grad x";
      EXPECT_TRUE(grads[0][1].equal(grads[1][1])) << "grad weight";
      EXPECT_TRUE(grads[0][2].equal(grads[1][2])) << "grad bias";
      if (f == Form::AddRelu) EXPECT_TRUE(grads[0][3].equal(grads[1][3])) << "grad residual";
    }
}

TEST(BatchNormGradBuffer, SharedOrKeptIncomingGradientIsLeftAlone) {
  manual_seed(7);
  const Tensor u = to_cl(randn({4, 16, 5, 5}));
  const Tensor w = randn({16}).requires_grad_(), b = randn({16}).requires_grad_();
  // AddBackward hands the same buffer to both batch norm nodes: the first may not overwrite it.
  const Tensor x1 = to_cl(randn({4, 16, 5, 5})).requires_grad_(), x2 = to_cl(randn({4, 16, 5, 5})).requires_grad_();
  const Tensor y1 = ops::batch_norm_relu_train(x1, w, b, 1e-5).output;
  const Tensor y2 = ops::batch_norm_relu_train(x2, w, b, 1e-5).output;
  ((y1 + y2) * u).sum().backward();
  auto alone = [&](const Tensor& x) {
    const Tensor xl = x.detach().requires_grad_();
    return autograd::grad({ops::batch_norm_relu_train(xl, w.detach(), b.detach(), 1e-5).output}, {xl}, {u})[0];
  };
  EXPECT_TRUE(x1.grad().equal(alone(x1)));
  EXPECT_TRUE(x2.grad().equal(alone(x2)));

  // The caller's gradient (held by the graph root) is never written.
  const Tensor xr = to_cl(randn({4, 16, 5, 5})).requires_grad_();
  const Tensor user_grad = u.clone();
  ops::batch_norm_relu_train(xr, w, b, 1e-5).output.backward(user_grad);
  EXPECT_TRUE(user_grad.equal(u));

  // A hook that keeps the incoming gradient sees it unchanged.
  const Tensor x = to_cl(randn({4, 16, 5, 5})).requires_grad_();
  const Tensor y = ops::batch_norm_relu_train(x, w, b, 1e-5).output;
  test::GradKeeper keeper(y);
  (y * u).sum().backward();
  EXPECT_TRUE(keeper.kept.equal(u));
  EXPECT_TRUE(x.grad().equal(alone(x)));
}
