// Attention with dropout on the heads kernel (Note [Dropout inside the heads]
// in kiln/kernels/attention.h): the mask is rand's draws over the [B, H, L, S]
// weights, so a float64 reference built from that mask checks the values and
// the q, k, v gradients; the composite from the same seed draws the same
// mask; the generator advances as the composite's; the bits do not depend on
// the thread count; and a create_graph backward differentiates the same mask.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/autograd/node.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/nn/attention.h"
#include "kiln/ops/factory.h"

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

struct Shape {
  std::string id;
  int64_t B, H, T, E;
  bool causal;
  bool projection;  // q, k, v heads of one [B, T, 3C] tensor (the GPT layout), else three tensors
};

struct Outcome {
  Tensor out, dx;     // dx: the gradient of the one input ([B, T, 3C] or [3, B, H, T, E])
  uint64_t advanced;  // Philox blocks the call reserved
  std::string node;
};

// Heads of x as the shape says; x [B, T, 3C] or [3, B, H, T, E].
std::array<Tensor, 3> heads_of(const Shape& s, const Tensor& x) {
  if (!s.projection) return {x.select(0, 0), x.select(0, 1), x.select(0, 2)};
  auto parts = x.split(s.H * s.E, 2);
  auto heads = [&](const Tensor& t) { return t.view({s.B, s.T, s.H, s.E}).transpose(1, 2); };
  return {heads(parts[0]), heads(parts[1]), heads(parts[2])};
}

Tensor input(const Shape& s, DType dt = kFloat32) {
  manual_seed(5);
  TensorOptions o(dt);
  return s.projection ? randn({s.B, s.T, 3 * s.H * s.E}, o) : randn({3, s.B, s.H, s.T, s.E}, o);
}

Outcome run(const Shape& s, const Tensor& x0, const Tensor& g, double p, bool composite, uint64_t seed) {
  Tensor x = x0.clone().requires_grad_();
  Tensor xi = x * 1.0;  // an interior tensor, as a linear's output
  auto [q, k, v] = heads_of(s, xi);
  manual_seed(seed);
  const uint64_t before = default_generator().get_state().offset;
  Tensor out = composite ? F::detail::sdpa_composite(q, k, v, {}, p, s.causal, true)
                         : F::scaled_dot_product_attention(q, k, v, {}, p, s.causal, true);
  const uint64_t after = default_generator().get_state().offset;
  Outcome r{out.detach(), Tensor(), after - before, out.grad_fn()->name()};
  out.backward(g);
  r.dx = x.grad();
  return r;
}

// The float64 reference: rand's float32 draws over [B, H, L, S] from `seed`
// give the mask, and autograd differentiates softmax · mask / (1 - p) · v.
Outcome reference(const Shape& s, const Tensor& x0, const Tensor& g, double p, uint64_t seed) {
  manual_seed(seed);
  const Tensor keep = rand({s.B, s.H, s.T, s.T}).lt(1.0 - p).to(kFloat64).mul(1.0 / (1.0 - p));
  Tensor x = x0.to(kFloat64).requires_grad_();
  auto [q, k, v] = heads_of(s, x);
  Tensor scores = q.matmul(k.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(s.E)));
  if (s.causal) {
    const Tensor hidden = arange(s.T).unsqueeze(0).gt(arange(s.T).unsqueeze(1));
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  Tensor out = (scores.softmax(-1) * keep).matmul(v);
  out.backward(g.to(kFloat64));
  return {out.detach(), x.grad(), 0, ""};
}

std::vector<Shape> shapes() {
  // T 70: rows start at every offset inside a Philox block, and blocks of 64 rows split it.
  return {{"projection_causal", 2, 3, 70, 16, true, true},
          {"projection_full", 2, 3, 70, 16, false, true},
          {"separate_causal", 2, 2, 70, 8, true, false},
          {"separate_full_one_block", 1, 4, 33, 16, false, false}};
}

}  // namespace

// float32 against float64 with the same mask: |a - b| <= 2e-5 + 2e-5 |b| for
// the output and the gradients (sums of up to 70 float32 terms of order 1).
TEST(AttentionDropout, HeadsKernelMatchesAFloat64ReferenceWithRandsMask) {
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(s.id);
    for (double p : {0.1, 0.5}) {
      const Tensor x0 = input(s);
      const Tensor g = randn(IntArrayRef({s.B, s.H, s.T, s.E}));
      const Outcome fused = run(s, x0, g, p, false, 21);
      EXPECT_EQ(fused.node, "FusedSdpaBackward");
      const Outcome ref = reference(s, x0, g, p, 21);
      EXPECT_TRUE(fused.out.to(kFloat64).allclose(ref.out, 2e-5, 2e-5)) << "p " << p;
      EXPECT_TRUE(fused.dx.to(kFloat64).allclose(ref.dx, 2e-5, 2e-5)) << "p " << p;
      // Some weights were dropped and some kept: the reference differs from no dropout.
      const Outcome none = reference(s, x0, g, 1e-300, 21);
      EXPECT_FALSE(ref.out.allclose(none.out, 1e-3, 1e-3));
    }
  }
}

TEST(AttentionDropout, TheCompositeFromTheSameSeedDrawsTheSameMaskAndAdvancesAsFar) {
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(s.id);
    const Tensor x0 = input(s);
    const Tensor g = randn(IntArrayRef({s.B, s.H, s.T, s.E}));
    const Outcome fused = run(s, x0, g, 0.2, false, 3);
    const Outcome composite = run(s, x0, g, 0.2, true, 3);
    EXPECT_NE(composite.node, "FusedSdpaBackward");
    EXPECT_EQ(fused.advanced, composite.advanced);
    EXPECT_EQ(fused.advanced, static_cast<uint64_t>((s.B * s.H * s.T * s.T + 3) / 4));
    EXPECT_TRUE(fused.out.allclose(composite.out, 1e-5, 1e-5));
    EXPECT_TRUE(fused.dx.allclose(composite.dx, 1e-5, 1e-5));
  }
}

TEST(AttentionDropout, OneAndTwoThreadsGiveTheSameBits) {
  const Shape s = shapes()[0];
  const Tensor x0 = input(s);
  const Tensor g = randn(IntArrayRef({s.B, s.H, s.T, s.E}));
  const int before = get_num_threads();
  set_num_threads(1);
  const Outcome one = run(s, x0, g, 0.1, false, 9);
  set_num_threads(2);
  const Outcome two = run(s, x0, g, 0.1, false, 9);
  set_num_threads(before);
  EXPECT_TRUE(one.out.equal(two.out));
  EXPECT_TRUE(one.dx.equal(two.dx));
}

TEST(AttentionDropout, WithoutGradTheOutputIsTheSameAndEvalDropsNothing) {
  const Shape s = shapes()[0];
  const Tensor x0 = input(s);
  const Tensor g = randn(IntArrayRef({s.B, s.H, s.T, s.E}));
  const Outcome with_grad = run(s, x0, g, 0.3, false, 13);
  auto [q, k, v] = heads_of(s, x0);
  manual_seed(13);
  Tensor no_grad_out;
  {
    const NoGradGuard no_grad;
    no_grad_out = F::scaled_dot_product_attention(q, k, v, {}, 0.3, s.causal, true);
  }
  EXPECT_TRUE(no_grad_out.equal(with_grad.out));
  EXPECT_TRUE(F::scaled_dot_product_attention(q, k, v, {}, 0.3, s.causal, /*training=*/false)
                  .equal(F::scaled_dot_product_attention(q, k, v, {}, 0.0, s.causal, true)));
}

TEST(AttentionDropout, CreateGraphDifferentiatesTheSameMask) {
  const Shape s = shapes()[2];
  const Tensor x0 = input(s);
  const Tensor g = randn(IntArrayRef({s.B, s.H, s.T, s.E}));
  const Outcome plain = run(s, x0, g, 0.25, false, 17);
  Tensor x = x0.clone().requires_grad_();
  auto [q, k, v] = heads_of(s, x);
  manual_seed(17);
  Tensor out = F::scaled_dot_product_attention(q, k, v, {}, 0.25, s.causal, true);
  ASSERT_STREQ(out.grad_fn()->name(), "FusedSdpaBackward");
  const Tensor dx = autograd::grad({out}, {x}, {g}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  EXPECT_TRUE(dx.requires_grad());
  EXPECT_TRUE(dx.detach().allclose(plain.dx, 1e-5, 1e-5));
  // The second derivative against float64 autograd over the composite with rand's mask.
  const Tensor ddx = autograd::grad({dx.pow(2).sum()}, {x})[0];
  manual_seed(17);
  const Tensor keep = rand({s.B, s.H, s.T, s.T}).lt(0.75).to(kFloat64).mul(1.0 / 0.75);
  Tensor xr = x0.to(kFloat64).requires_grad_();
  auto [qr, kr, vr] = heads_of(s, xr);
  Tensor scores = qr.matmul(kr.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(s.E)));
  scores = scores.masked_fill(arange(s.T).unsqueeze(0).gt(arange(s.T).unsqueeze(1)),
                              -std::numeric_limits<double>::infinity());
  const Tensor outr = (scores.softmax(-1) * keep).matmul(vr);
  const Tensor dxr = autograd::grad({outr}, {xr}, {g.to(kFloat64)}, true, true)[0];
  const Tensor ddxr = autograd::grad({dxr.pow(2).sum()}, {xr})[0];
  EXPECT_TRUE(ddx.to(kFloat64).allclose(ddxr, 1e-4, 1e-4));
}

// With q = 0 every row's weights are 1 / (keys it sees), and with v the
// identity out[i, j] = keep[i, j] · scale / keys: the output shows the mask.
// The heads kernel's masks are the composite's bit for bit, float32 and bf16
// (whose rand rounds the uniforms to bf16 before `< 1 - p`), causal or not.
TEST(AttentionDropout, TheMaskIsTheCompositesInFloat32AndBf16) {
  const int64_t B = 2, H = 3, T = 45;
  for (DType dt : {kFloat32, kBFloat16})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (causal ? " causal" : " full"));
      TensorOptions o(dt);
      const Tensor q = zeros({B, H, T, 8}, o), k = randn({B, H, T, 8}).to(dt);
      const Tensor v = eye(T).to(dt).expand({B, H, T, T}).contiguous();
      auto masks = [&](bool composite) {
        manual_seed(29);
        const Tensor out = composite ? F::detail::sdpa_composite(q, k, v, {}, 0.3, causal, true)
                                     : F::scaled_dot_product_attention(q, k, v, {}, 0.3, causal, true);
        return std::make_pair(out.ne(0), out);
      };
      const auto [fused_mask, fused] = masks(false);
      const auto [composite_mask, composite] = masks(true);
      EXPECT_TRUE(fused_mask.equal(composite_mask));
      EXPECT_TRUE(fused.equal(composite)) << "the kept weights are 1 / keys times the same scale";
      const double kept = fused_mask.to(kFloat64).sum().item<double>();
      const double seen = causal ? static_cast<double>(B * H * T * (T + 1) / 2) : static_cast<double>(B * H * T * T);
      EXPECT_NEAR(kept / seen, 0.7, 0.03);
    }
}

TEST(AttentionDropout, Bf16FollowsTheCompositeAndFloat32) {
  const Shape s = shapes()[0];
  const Tensor x0 = input(s, kBFloat16);
  const Tensor g = randn(IntArrayRef({s.B, s.H, s.T, s.E})).to(kBFloat16);
  const Outcome fused = run(s, x0, g, 0.2, false, 37);
  EXPECT_EQ(fused.node, "FusedSdpaBackward");
  const Outcome composite = run(s, x0, g, 0.2, true, 37);
  EXPECT_EQ(fused.advanced, composite.advanced);
  // bf16 rounds every step differently in the two forms: 2^-6 relative plus a small absolute floor.
  EXPECT_TRUE(fused.out.to(kFloat32).allclose(composite.out.to(kFloat32), 1.6e-2, 1e-2));
  EXPECT_TRUE(fused.dx.to(kFloat32).allclose(composite.dx.to(kFloat32), 1.6e-2, 2e-2));
}

TEST(AttentionDropout, OtherCasesKeepTheComposite) {
  manual_seed(2);
  Tensor q = randn({2, 2, 10, 8}).requires_grad_(), k = randn({2, 2, 10, 8}), v = randn({2, 2, 10, 8});
  // float64, a mask, 3-D operands and p = 1 draw as the composite does.
  EXPECT_STRNE(F::scaled_dot_product_attention(q.to(kFloat64), k.to(kFloat64), v.to(kFloat64), {}, 0.1)
                   .grad_fn()
                   ->name(),
               "FusedSdpaBackward");
  EXPECT_STRNE(F::scaled_dot_product_attention(q, k, v, ones({10, 10}, TensorOptions(kBool)), 0.1).grad_fn()->name(),
               "FusedSdpaBackward");
  EXPECT_STRNE(F::scaled_dot_product_attention(q.select(0, 0), k.select(0, 0), v.select(0, 0), {}, 0.1)
                   .grad_fn()
                   ->name(),
               "FusedSdpaBackward");
  const Tensor all_dropped = F::scaled_dot_product_attention(q, k, v, {}, 1.0);
  EXPECT_TRUE(all_dropped.eq(0).all().item<bool>());
}
