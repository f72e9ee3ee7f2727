// LayerNorm's fused kernel (src/ops/layer_norm.cpp): values and gradients of
// input, weight and bias against torch 1.13's F.layer_norm in float32 (one and
// two normalised dims, a non-contiguous input, rows enough to split the weight
// gradient over several chunks), gradcheck in float64, the create_graph
// backward (the composite, differentiated) agreeing with the kernel, and the composite
// fallbacks (no affine, bfloat16) giving the same values as the kernel;
// layer_norm_to (a bf16 output straight from the float32 kernel) against
// layer_norm followed by the cast, bit for bit, alone and inside a
// transformer block under bf16 autocast.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/autograd/node.h"
#include "kiln/core/autocast.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/layer_norm.h"
#include "support/oracle.h"

using namespace kiln;

namespace {

struct LnCase {
  std::string id;
  std::vector<int64_t> normalized_shape;
  Tensor x;
  std::string expr;
};

std::shared_ptr<nn::LayerNorm> perturbed(const std::vector<int64_t>& shape, DType dt = kFloat32) {
  auto ln = std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = shape, .dtype = dt});
  NoGradGuard g;
  for (auto& p : ln->parameters()) p.add_(randn(p.sizes(), TensorOptions(dt)).mul(0.3));
  return ln;
}

}  // namespace

TEST(LayerNormFused, ValuesAndGradientsMatchTorch) {
  manual_seed(41);
  const std::vector<LnCase> cases = {
      {"last_dim", {16}, randn({4, 5, 16}).mul(2).add(0.5), "F.layer_norm(x0, (16,), x1, x2, 1e-5)"},
      {"two_dims", {5, 16}, randn({3, 5, 16}), "F.layer_norm(x0, (5, 16), x1, x2, 1e-5)"},
      {"transposed_input", {6}, randn({6, 7}).t(), "F.layer_norm(x0, (6,), x1, x2, 1e-5)"},
      {"many_rows", {256}, randn({2048, 256}), "F.layer_norm(x0, (256,), x1, x2, 1e-5)"},
      // Two whole vectors and a short one per row (Note [Layer norm backward in two passes]).
      {"odd_width", {37}, randn({300, 37}).mul(1.5).sub(0.25), "F.layer_norm(x0, (37,), x1, x2, 1e-5)"},
  };
  test::OracleBatch b;
  struct Got {
    Tensor y, gx, gw, gb, g;
  };
  std::vector<Got> got;
  for (const auto& c : cases) {
    auto ln = perturbed(c.normalized_shape);
    Tensor x = c.x.detach().requires_grad_();
    Tensor y = (*ln)(x);
    Tensor g = randn(y.sizes());
    y.backward(g);
    got.push_back({y.detach(), x.grad(), ln->weight.grad(), ln->bias.grad(), g});
    const std::vector<Tensor> in = {c.x, ln->weight.detach(), ln->bias.detach()};
    b.add(c.id, c.expr, in);
    b.add_grad(c.id + "_grad", c.expr, in, {0, 1, 2}, {g});
  }
  b.run();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = b.outcome(2 * i);
    ASSERT_TRUE(r.ok) << cases[i].id << ": " << r.error;
    EXPECT_TRUE(got[i].y.allclose(r.outputs[0], 1e-5, 1e-5)) << cases[i].id;
    const auto& rg = b.outcome(2 * i + 1);
    ASSERT_TRUE(rg.ok) << cases[i].id << ": " << rg.error;
    const Tensor mine[3] = {got[i].gx, got[i].gw, got[i].gb};
    for (int j = 0; j < 3; ++j) {
      ASSERT_EQ(mine[j].sizes(), rg.outputs[j].sizes()) << cases[i].id << " grad " << j;
      // Weight and bias gradients sum thousands of rows: a float32 tolerance to match.
      const double atol = j == 0 ? 1e-5 : 1e-3;
      EXPECT_TRUE(mine[j].allclose(rg.outputs[j], 1e-4, atol))
          << cases[i].id << " grad " << j << " max diff " << (mine[j] - rg.outputs[j]).abs().max().item<double>();
    }
  }
}

// The fused node (a custom Function inside kiln) records its caller's line.
TEST(LayerNormFused, TheNodeRecordsTheCallersLine) {
  manual_seed(3);
  const Tensor x = randn({4, 6}).requires_grad_(), w = randn({6}), b = randn({6});
  const int line = __LINE__ + 1;
  const Tensor y = ops::layer_norm(x, {6}, w, b);
  ASSERT_STREQ(y.grad_fn()->name(), "FusedLayerNormBackward");
  EXPECT_EQ(y.grad_fn()->site().line, static_cast<uint32_t>(line));
  EXPECT_TRUE(y.grad_fn()->site().str().find("test_layer_norm.cpp") != std::string::npos)
      << y.grad_fn()->site().str();
  // Through the module, the line is the module's own call, as for nn::Linear.
  nn::LayerNorm ln(nn::LayerNormOptions{.normalized_shape = {6}});
  EXPECT_TRUE(ln(x).grad_fn()->site().known());
}

TEST(LayerNormFused, GradcheckFloat64AndCreateGraph) {
  manual_seed(43);
  const TensorOptions f64(kFloat64);
  Tensor x = randn({3, 2, 5}, f64).requires_grad_();
  Tensor w = randn({2, 5}, f64).add(1).requires_grad_(), bias = randn({2, 5}, f64).requires_grad_();
  Tensor w1 = randn({5}, f64).add(1).requires_grad_(), b1 = randn({5}, f64).requires_grad_();
  auto two = [](const TensorList& t) {
    nn::LayerNorm ln({.normalized_shape = {2, 5}, .dtype = kFloat64});
    ln.weight = t[1];
    ln.bias = t[2];
    return TensorList{ln(t[0])};
  };
  auto one = [](const TensorList& t) {
    nn::LayerNorm ln({.normalized_shape = {5}, .dtype = kFloat64});
    ln.weight = t[1];
    ln.bias = t[2];
    return TensorList{ln(t[0])};
  };
  EXPECT_TRUE(autograd::gradcheck(two, {x, w, bias}));
  EXPECT_TRUE(autograd::gradcheck(one, {x, w1, b1}));
  // Under create_graph the backward differentiates the composite: same first-order values, with history.
  const Tensor y = one({x, w1, b1})[0], g = randn(y.sizes(), f64);
  const TensorList fused = autograd::grad({y}, {x, w1, b1}, {g}, /*retain_graph=*/true);
  const TensorList graph = autograd::grad({y}, {x, w1, b1}, {g}, /*retain_graph=*/true, /*create_graph=*/true);
  for (size_t i = 0; i < 3; ++i) {
    // grad_bias = Σ g depends on no input, so (as in torch) only grad_x and grad_w carry history.
    EXPECT_EQ(graph[i].requires_grad(), i < 2) << "input " << i;
    EXPECT_TRUE(graph[i].detach().allclose(fused[i], 1e-10, 1e-10)) << "input " << i;
  }
  // Only the input requires grad: the weight and bias gradients are not formed.
  EXPECT_TRUE(autograd::gradcheck(one, {x, w1.detach(), b1.detach()}));
}

// Frozen affine parameters (fine-tuning with a frozen norm) under create_graph:
// only x wants a gradient, and its second order must still be right.
TEST(LayerNormFused, CreateGraphWithFrozenWeightAndBias) {
  manual_seed(44);
  const TensorOptions f64(kFloat64);
  Tensor x = randn({4, 6}, f64).requires_grad_();
  const Tensor w = randn({6}, f64).add(1), b = randn({6}, f64);
  auto f = [&](const TensorList& t) {
    nn::LayerNorm ln({.normalized_shape = {6}, .dtype = kFloat64});
    ln.weight = w;
    ln.bias = b;
    return TensorList{ln(t[0]).pow(2)};
  };
  const Tensor y = f({x})[0];
  const TensorList g = autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  ASSERT_TRUE(g[0].requires_grad());
  EXPECT_TRUE(autograd::gradgradcheck(f, {x}));
}

TEST(LayerNormFused, CompositeFallbacksAgreeWithKernel) {
  manual_seed(47);
  const Tensor x = randn({4, 8});
  auto ln = perturbed({8});
  const Tensor fused = (*ln)(x);
  // bfloat16 takes the composite: same values to bfloat16 precision.
  auto ln16 = std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {8}, .dtype = kBFloat16});
  {
    NoGradGuard g;
    ln16->weight.copy_(ln->weight);
    ln16->bias.copy_(ln->bias);
  }
  const Tensor half = (*ln16)(x.to(kBFloat16)).to(kFloat32);
  EXPECT_TRUE(half.allclose(fused, 5e-2, 5e-2)) << "max diff " << (half - fused).abs().max().item<double>();
  // Without affine parameters the composite runs; with unit weight and zero bias the kernel must agree.
  nn::LayerNorm plain({.normalized_shape = {8}, .elementwise_affine = false});
  nn::LayerNorm unit({.normalized_shape = {8}});
  EXPECT_TRUE(plain(x).allclose(unit(x), 1e-6, 1e-6));
}

namespace {

// a and b hold the same bits (same dtype, shape and every element's bytes).
void expect_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  EXPECT_EQ(0, std::memcmp(ac.data_ptr(), bc.data_ptr(), static_cast<size_t>(ac.nbytes())))
      << what << ": max |diff| " << (ac.to(kFloat64) - bc.to(kFloat64)).abs().max().item<double>();
}

}  // namespace

// layer_norm_to(x, ..., bf16) must be layer_norm(x).to(bf16) to the bit,
// forward and backward: rows of 256 (gpt's), an odd width with a short last
// vector and NaN and inf rows, two normalised dims, a transposed input.
// Truncating instead of rounding to bf16 fails it.
TEST(LayerNormFused, IntoBf16HasTheBitsOfTheCast) {
  manual_seed(53);
  struct Case {
    std::string id;
    std::vector<int64_t> shape;
    Tensor x;
  };
  Tensor special = randn({6, 37}).mul(3);
  {
    NoGradGuard g;
    special.select(0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
    special.select(0, 2).select(0, 5).fill_(std::numeric_limits<float>::infinity());
  }
  const std::vector<Case> cases = {
      {"gpt_rows", {256}, randn({2, 128, 256}).mul(2).add(0.25)},
      {"odd_width", {37}, special},
      {"two_dims", {5, 12}, randn({3, 5, 12})},
      {"transposed", {9}, randn({9, 11}).t()},
  };
  for (const auto& c : cases) {
    auto ln = perturbed(c.shape);
    const Tensor g = randn(c.x.sizes()).to(kBFloat16);
    Tensor x1 = c.x.detach().requires_grad_(), x2 = c.x.detach().requires_grad_();
    const Tensor fused = ops::layer_norm_to(x1, c.shape, ln->weight, ln->bias, 1e-5, kBFloat16);
    const TensorList gf = autograd::grad({fused}, {x1, ln->weight, ln->bias}, {g});
    const Tensor cast = ops::layer_norm(x2, c.shape, ln->weight, ln->bias, 1e-5).to(kBFloat16);
    const TensorList gc = autograd::grad({cast}, {x2, ln->weight, ln->bias}, {g});
    expect_same_bits(fused, cast, c.id + " y");
    for (size_t i = 0; i < 3; ++i) expect_same_bits(gf[i], gc[i], c.id + " grad " + std::to_string(i));
  }
  // Under create_graph the composite is differentiated, cast included: the same first order.
  auto ln = perturbed({8});
  Tensor x = randn({4, 8}).requires_grad_();
  const Tensor y = ops::layer_norm_to(x, {8}, ln->weight, ln->bias, 1e-5, kBFloat16);
  const Tensor g = randn({4, 8}).to(kBFloat16);
  const TensorList first = autograd::grad({y}, {x}, {g}, /*retain_graph=*/true);
  const TensorList graph = autograd::grad({y}, {x}, {g}, /*retain_graph=*/true, /*create_graph=*/true);
  EXPECT_TRUE(graph[0].requires_grad());
  EXPECT_TRUE(graph[0].detach().allclose(first[0], 1e-5, 1e-5));
  // Pairs the kernel does not fuse run the norm and then the cast.
  const Tensor x64 = randn({3, 8}, TensorOptions(kFloat64));
  auto ln64 = perturbed({8}, kFloat64);
  expect_same_bits(ops::layer_norm_to(x64, {8}, ln64->weight, ln64->bias, 1e-5, kBFloat16),
                   ops::layer_norm(x64, {8}, ln64->weight, ln64->bias, 1e-5).to(kBFloat16), "float64 into bf16");
  expect_same_bits(ops::layer_norm_to(x64, {8}, ln64->weight, ln64->bias, 1e-5, kFloat64),
                   ops::layer_norm(x64, {8}, ln64->weight, ln64->bias, 1e-5), "same dtype");
}

// A transformer block under bf16 autocast hands its norms' outputs to the
// first linears in bf16 (LayerNorm::forward_for_product). A forward hook on
// those linears (which must see what the module gets) turns that off, so the
// hooked block runs norm, then cast: the output and every gradient must be
// the same bits, and the fused block makes fewer casts.
TEST(LayerNormFused, TransformerBlockNormsGoIntoTheirLinearsInBf16) {
  manual_seed(59);
  nn::TransformerBlock fused({.d_model = 64, .n_head = 2});
  nn::TransformerBlock hooked({.d_model = 64, .n_head = 2});
  {
    NoGradGuard g;
    auto a = fused.parameters(), b = hooked.parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      a[i].add_(randn(a[i].sizes()).mul(0.05));
      b[i].copy_(a[i]);
    }
  }
  std::vector<DType> seen;
  hooked.attn->c_attn->register_forward_hook([&](nn::Module&, const Tensor& in, const Tensor&) -> Tensor {
    seen.push_back(in.dtype());
    return {};
  });
  hooked.mlp->c_fc->register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) -> Tensor { return {}; });
  const Tensor x = randn({2, 24, 64});
  Tensor x1 = x.detach().requires_grad_(), x2 = x.detach().requires_grad_();
  Tensor y1, y2;
  AutocastCounters c1, c2;
  {
    AutocastGuard amp(kBFloat16);
    reset_autocast_counters();
    y1 = fused(x1);
    c1 = autocast_counters();
    reset_autocast_counters();
    y2 = hooked(x2);
    c2 = autocast_counters();
  }
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], kFloat32);  // a hook sees the norm's float32 output, as without the fusion
  EXPECT_EQ(c1.casts + 2, c2.casts);  // the two norm outputs are not cast again
  expect_same_bits(y1, y2, "block output");
  const Tensor g = randn(y1.sizes());
  y1.backward(g);
  y2.backward(g);
  expect_same_bits(x1.grad(), x2.grad(), "input grad");
  auto n1 = fused.named_parameters(), n2 = hooked.named_parameters();
  for (size_t i = 0; i < n1.size(); ++i) expect_same_bits(n1[i].second.grad(), n2[i].second.grad(), n1[i].first);
}

// Note [Rows side by side]: rows are normalised four at a time, the rest one
// at a time; a row's values (and its saved mean and rstd, seen through the
// input gradient) must not depend on which rows it sits with. Widths: a whole
// number of vectors (gpt's 256) and an odd one with a short last vector; 7
// rows leave three rows to the single-row path.
TEST(LayerNormFused, ARowHasTheSameBitsWhicheverRowsItIsNormalisedWith) {
  manual_seed(59);
  for (const int64_t n : {256, 37}) {
    auto ln = perturbed({n});
    const Tensor x = (randn({7, n}) * 3.0 + 1.0).requires_grad_();
    const Tensor g = randn({7, n});
    const Tensor y = (*ln)(x);
    const Tensor gx = autograd::grad({y}, {x}, {g})[0];
    for (int64_t r = 0; r < 7; ++r) {
      const Tensor xr = x.detach().narrow(0, r, 1).clone().requires_grad_();
      const Tensor yr = (*ln)(xr);
      const Tensor gr = autograd::grad({yr}, {xr}, {g.narrow(0, r, 1)})[0];
      expect_same_bits(y.detach().narrow(0, r, 1), yr.detach(), "y row " + std::to_string(r) + " n " + std::to_string(n));
      expect_same_bits(gx.narrow(0, r, 1), gr, "grad row " + std::to_string(r) + " n " + std::to_string(n));
    }
  }
}

TEST(LayerNormFused, AStreamedInputGradientHasTheBitsOfEachRowAlone) {
  // An input gradient of 1 MiB or more leaves the kernel by streaming stores
  // (Note [Streaming stores for fresh outputs]); a row alone is stored
  // plainly. Rows of 256 floats fill whole lines and stream straight from the
  // registers; rows of 300 do not line up with lines and stream through a
  // staging row (Note [Layer norm backward in two passes]). The values must
  // not depend on the way out or on the thread count.
  manual_seed(61);
  for (const int64_t n : {256, 300}) {
    const int64_t rows = n == 256 ? 2048 : 1100;
    auto ln = perturbed({n});
    const Tensor x = (randn({rows, n}) * 2.0 - 0.5).requires_grad_();
    const Tensor g = randn({rows, n});
    const int before = get_num_threads();
    std::vector<Tensor> grads;
    for (const int threads : {1, 2}) {
      set_num_threads(threads);
      grads.push_back(autograd::grad({(*ln)(x)}, {x}, {g})[0]);
    }
    set_num_threads(before);
    const std::string w = " n " + std::to_string(n);
    expect_same_bits(grads[0], grads[1], "input gradient at 1 and 2 threads" + w);
    for (int64_t r = 0; r < rows; r += 97) {
      const Tensor xr = x.detach().narrow(0, r, 1).clone().requires_grad_();
      const Tensor gr = autograd::grad({(*ln)(xr)}, {xr}, {g.narrow(0, r, 1)})[0];
      expect_same_bits(grads[1].narrow(0, r, 1), gr, "grad row " + std::to_string(r) + w);
    }
  }
}
