// linear_gelu: GELU inside the product (oneDNN post-op) when nothing is
// differentiated, against the two ops it stands for; and the cases that must
// run as the two ops (gradients, float64, a broadcast bias, autocast).
#include <gtest/gtest.h>

#include <string>

#include "kiln/kiln.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/linalg.h"

using namespace kiln;

namespace {

Tensor composite(const Tensor& x, const Tensor& w, const Tensor& b, const std::string& approximate) {
  return linear(x, w, b).gelu(approximate);
}

}  // namespace

TEST(LinearGelu, InferenceMatchesLinearThenGelu) {
  manual_seed(31);
  for (const std::string approximate : {"tanh", "none"}) {
    for (bool with_bias : {true, false}) {
      const Tensor x = randn({2, 64, 96}) * 2.0, w = randn({200, 96}) * 0.2;
      const Tensor b = with_bias ? randn({200}) * 0.5 : Tensor();
      const NoGradGuard no_grad;
      const Tensor fused = linear_gelu(x, w, b, approximate);
      const Tensor ref = composite(x, w, b, approximate);
      ASSERT_EQ(fused.sizes(), ref.sizes());
      // oneDNN's GELU and kiln's differ in their last bits (a few ulp of the result).
      EXPECT_TRUE(fused.allclose(ref, 1e-5, 1e-6)) << approximate << " bias " << with_bias << ": max diff "
                                                  << (fused - ref).abs().max().item<float>();
    }
  }
}

TEST(LinearGelu, BFloat16InferenceMatches) {
  manual_seed(32);
  const Tensor x = randn({40, 64}).to(kBFloat16), w = (randn({48, 64}) * 0.2).to(kBFloat16);
  const Tensor b = (randn({48}) * 0.5).to(kBFloat16);
  const NoGradGuard no_grad;
  const Tensor fused = linear_gelu(x, w, b, "tanh").to(kFloat32);
  const Tensor ref = composite(x, w, b, "tanh").to(kFloat32);
  EXPECT_TRUE(fused.allclose(ref, 2e-2, 2e-2));
}

TEST(LinearGelu, DifferentiatesAsTheTwoOps) {
  manual_seed(33);
  const Tensor x0 = randn({5, 7}), w0 = randn({3, 7}), b0 = randn({3});
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor xr = x0.clone().requires_grad_(), wr = w0.clone().requires_grad_(), br = b0.clone().requires_grad_();
  const Tensor y = linear_gelu(x, w, b, "tanh");
  const Tensor yr = composite(xr, wr, br, "tanh");
  EXPECT_TRUE(y.equal(yr));
  ASSERT_TRUE(y.grad_fn());
  EXPECT_STREQ(y.grad_fn()->name(), yr.grad_fn()->name());
  y.sum().backward();
  yr.sum().backward();
  EXPECT_TRUE(x.grad().equal(xr.grad()));
  EXPECT_TRUE(w.grad().equal(wr.grad()));
  EXPECT_TRUE(b.grad().equal(br.grad()));
}

TEST(LinearGelu, UnfusableCasesAreTheTwoOpsExactly) {
  manual_seed(34);
  const NoGradGuard no_grad;
  const Tensor x64 = randn({6, 5}, TensorOptions(kFloat64)), w64 = randn({4, 5}, TensorOptions(kFloat64));
  EXPECT_TRUE(linear_gelu(x64, w64, {}, "tanh").equal(composite(x64, w64, {}, "tanh")));
  const Tensor x = randn({6, 5}), w = randn({4, 5}), b2 = randn({6, 4});  // a bias that is not [out_features]
  EXPECT_TRUE(linear_gelu(x, w, b2, "none").equal(composite(x, w, b2, "none")));
  EXPECT_THROW(linear_gelu(x, w, {}, "sigmoid"), ValueError);  // gelu's own error
}

// TransformerMLP uses linear_gelu, but a hook on c_fc or gelu must still see its module run.
TEST(LinearGelu, MlpHooksStillRun) {
  manual_seed(35);
  nn::TransformerBlockOptions o{.d_model = 16, .n_head = 2};
  o.d_ff = 64;
  nn::TransformerMLP mlp(o);
  mlp.eval();
  const Tensor x = randn({2, 3, 16});
  const NoGradGuard no_grad;
  const Tensor fused = mlp(x);
  int calls = 0;
  auto handle = mlp.gelu->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) {
    ++calls;
    return out;
  });
  const Tensor hooked = mlp(x);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(fused.allclose(hooked, 1e-5, 1e-6));
}
