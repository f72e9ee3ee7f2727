// Dropout in one pass (Note [Dropout in one pass] in src/ops/dropout.cpp):
// values, gradients and the generator's advance bit for bit those of the
// composite it replaced, the gradient written over a sole-owned incoming
// buffer, and create_graph still differentiable.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/ops/dropout.h"
#include "support/test_util.h"

using namespace kiln;
using test::ArrivalProbe;

namespace {

// What nn::functional::dropout computed before the fused op.
Tensor composite(const Tensor& x, double p) {
  const Tensor keep = rand(x.sizes(), TensorOptions(x.dtype())).lt(1.0 - p).to(x.dtype());
  return x * keep.mul(1.0 / (1.0 - p));
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), static_cast<size_t>(a.nbytes())) == 0;
}

}  // namespace

TEST(Dropout, OnePassHasTheCompositesBitsGradientsAndGeneratorAdvance) {
  // Sizes around the 1024-value chunks and 64-value steps; p whose 1 - p and
  // 1 / (1 - p) round in float32; a 2M-value tensor for the comparison's edge.
  const int64_t sizes[] = {1, 5, 64, 1023, 1025, 4099, 2 * 1024 * 1024 + 3};
  for (double p : {0.1, 0.5, 0.3, 0.9})
    for (int64_t n : sizes) {
      SCOPED_TRACE("p " + std::to_string(p) + " n " + std::to_string(n));
      manual_seed(1000 + n);
      const Tensor x0 = randn({n}) * 3;
      x0.narrow(0, 0, 1).fill_(-0.0);  // a negative zero, dropped or kept
      const Tensor g = randn({n});
      Tensor out[2], gx[2];
      GeneratorState after[2];
      for (int fused = 0; fused < 2; ++fused) {
        manual_seed(77);
        const Tensor x = x0.detach().requires_grad_();
        out[fused] = fused ? ops::dropout_train(x, p) : composite(x, p);
        after[fused] = default_generator().get_state();
        out[fused].backward(g);
        gx[fused] = x.grad();
      }
      EXPECT_STREQ(out[1].grad_fn()->name(), "NativeDropoutBackward0");
      EXPECT_TRUE(same_bits(out[1], out[0])) << "values";
      EXPECT_TRUE(same_bits(gx[1], gx[0])) << "gradient";
      EXPECT_EQ(after[1], after[0]) << "generator advance";
    }
}

TEST(Dropout, OtherDtypesAndLayoutsRunTheComposite) {
  for (const Tensor& x : {randn({6, 10}).to(kBFloat16), randn({6, 10}, kFloat64), randn({10, 6}).t()}) {
    manual_seed(5);
    const Tensor a = ops::dropout_train(x, 0.25);
    manual_seed(5);
    EXPECT_TRUE(same_bits(a, composite(x, 0.25))) << dtype_name(x.dtype());
  }
  EXPECT_THROW(ops::dropout_train(randn({3}), 0.0), ValueError);
  EXPECT_THROW(ops::dropout_train(randn({3}), 1.0), ValueError);
}

TEST(Dropout, BackwardWritesOverASoleOwnedIncomingGradient) {
  manual_seed(3);
  const Tensor x = randn({4096}).requires_grad_(), w = randn({4096});
  const GeneratorState before = default_generator().get_state();
  const Tensor y = ops::dropout_train(x, 0.2);
  ArrivalProbe at_drop(y), at_leaf(x);
  (y * w).sum().backward();  // MulBackward's g * w is the dropout node's own buffer
  ASSERT_NE(at_drop.ptr, nullptr);
  EXPECT_EQ(at_leaf.ptr, at_drop.ptr) << "dropout's backward allocated instead of reusing its incoming buffer";
  // The caller's gradient is never written, and gives the same gradient.
  const Tensor user = w.clone();
  const Tensor xl = x.detach().requires_grad_();
  default_generator().set_state(before);  // the same mask
  const Tensor yl = ops::dropout_train(xl, 0.2);
  yl.backward(user);
  EXPECT_TRUE(user.equal(w));
  EXPECT_TRUE(same_bits(xl.grad(), x.grad()));
}

TEST(Dropout, CreateGraphDifferentiatesTheGradient) {
  manual_seed(11);
  const Tensor x = randn({257}).requires_grad_();
  const Tensor y = ops::dropout_train(x, 0.4);
  const Tensor g = randn({257}).requires_grad_();
  const Tensor gx = autograd::grad({y}, {x}, {g}, std::nullopt, /*create_graph=*/true)[0];
  ASSERT_NE(gx.grad_fn(), nullptr);
  // d(sum(gx * v))/dg = v * factor, and factor is y / x where x != 0.
  const Tensor v = randn({257});
  const Tensor dg = autograd::grad({(gx * v).sum()}, {g})[0];
  const Tensor factor = gx.detach() / g.detach();
  EXPECT_TRUE(allclose(dg, v * factor, 1e-6, 1e-6));
  EXPECT_TRUE(allclose(y.detach(), x.detach() * factor, 1e-6, 1e-6));
}
