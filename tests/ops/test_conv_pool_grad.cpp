// Backward of conv2d, max_pool2d (and _with_indices), avg_pool2d and
// adaptive_avg_pool2d: float64 gradcheck (our loops and im2col/col2im) for
// groups, stride, dilation, padding, ceil_mode, count_include_pad,
// divisor_override, non-uniform adaptive bins and unbatched inputs;
// gradgradcheck (every backward here is differentiable); float32 and
// bfloat16 (oneDNN backward primitives) against float64; max-pool ties and
// NaN against PyTorch 1.13; and primitive reuse.
//
// Tie and NaN expectations were printed by /usr/bin/python3 with torch 1.13
// (torch.set_num_threads(1)): y = F.max_pool2d(x, ...), y.backward(g) with
// g = arange(1, numel + 1) in y's shape, then x.grad.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "dense_grad_util.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/ops/conv.h"

using namespace kiln;
using kiln::test::expect_gradcheck;
using kiln::test::expect_gradgradcheck;
using kiln::test::expect_grads_match_float64;
using kiln::test::Fn;
using kiln::test::leaf;
using kiln::test::transposed_leaf;

namespace {

struct ConvCase {
  const char* label;
  std::vector<int64_t> x, w;
  bool bias;
  Fn f;               // over (x, w[, b])
  const char* torch;  // the same over x0, x1[, x2]
};

std::vector<ConvCase> conv_cases() {
  return {
      {"bias", {2, 3, 5, 6}, {4, 3, 3, 3}, true, [](const TensorList& t) { return conv2d(t[0], t[1], t[2]); },
       "F.conv2d(x0, x1, x2)"},
      {"stride 2 padding 1", {2, 3, 6, 5}, {4, 3, 3, 3}, true,
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], 2, 1); }, "F.conv2d(x0, x1, x2, stride=2, padding=1)"},
      {"dilation 2, rectangular padding and kernel", {1, 3, 8, 8}, {4, 3, 3, 2}, false,
       [](const TensorList& t) { return conv2d(t[0], t[1], {}, 1, {2, 1}, 2); },
       "F.conv2d(x0, x1, None, padding=(2, 1), dilation=2)"},
      {"groups 2", {1, 4, 6, 6}, {6, 2, 3, 3}, true,
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], 1, 1, 1, 2); },
       "F.conv2d(x0, x1, x2, padding=1, groups=2)"},
      {"depthwise, stride (2, 1)", {1, 4, 6, 6}, {4, 1, 3, 3}, false,
       [](const TensorList& t) { return conv2d(t[0], t[1], {}, {2, 1}, 1, 1, 4); },
       "F.conv2d(x0, x1, None, stride=(2, 1), padding=1, groups=4)"},
      {"unbatched", {3, 6, 6}, {2, 3, 3, 3}, true, [](const TensorList& t) { return conv2d(t[0], t[1], t[2]); },
       "F.conv2d(x0, x1, x2)"},
      {"padding same (odd total)", {1, 3, 6, 5}, {2, 3, 2, 3}, false,
       [](const TensorList& t) { return conv2d(t[0], t[1], {}, 1, PaddingMode::Same); },
       "F.conv2d(x0, x1, None, padding='same')"},
      {"1x1 stride (1, 2)", {2, 5, 4, 4}, {3, 5, 1, 1}, true,
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], {1, 2}); }, "F.conv2d(x0, x1, x2, stride=(1, 2))"},
      {"1x1 direct", {2, 5, 4, 4}, {3, 5, 1, 1}, true, [](const TensorList& t) { return conv2d(t[0], t[1], t[2]); },
       "F.conv2d(x0, x1, x2)"},
      {"stride 3 leaves rows unread", {1, 2, 8, 7}, {3, 2, 2, 2}, true,
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], 3); }, "F.conv2d(x0, x1, x2, stride=3)"},
      {"empty batch", {0, 3, 5, 5}, {2, 3, 3, 3}, true, [](const TensorList& t) { return conv2d(t[0], t[1], t[2]); },
       "F.conv2d(x0, x1, x2)"},
  };
}

TensorList conv_inputs(const ConvCase& c, uint64_t seed) {
  TensorList in{leaf(c.x, seed), leaf(c.w, seed + 1)};
  if (c.bias) in.push_back(leaf({c.w[0]}, seed + 2));
  return in;
}

struct PoolCase {
  const char* label;
  std::vector<int64_t> x;
  Fn f;
  const char* torch;
};

std::vector<PoolCase> max_pool_cases() {
  return {
      {"kernel 2", {2, 2, 6, 6}, [](const TensorList& t) { return max_pool2d(t[0], 2); }, "F.max_pool2d(x0, 2)"},
      {"kernel 3 stride 2 padding 1", {1, 2, 9, 8}, [](const TensorList& t) { return max_pool2d(t[0], 3, 2, 1); },
       "F.max_pool2d(x0, 3, stride=2, padding=1)"},
      {"overlapping, stride 1", {1, 2, 5, 6}, [](const TensorList& t) { return max_pool2d(t[0], 3, 1, 1); },
       "F.max_pool2d(x0, 3, stride=1, padding=1)"},
      {"dilation 2", {1, 2, 9, 9}, [](const TensorList& t) { return max_pool2d(t[0], 2, 1, 1, 2); },
       "F.max_pool2d(x0, 2, stride=1, padding=1, dilation=2)"},
      {"ceil_mode", {1, 2, 7, 6}, [](const TensorList& t) { return max_pool2d(t[0], 3, 2, 0, 1, true); },
       "F.max_pool2d(x0, 3, stride=2, ceil_mode=True)"},
      {"rectangular", {1, 2, 7, 8}, [](const TensorList& t) { return max_pool2d(t[0], {2, 3}, {1, 2}); },
       "F.max_pool2d(x0, (2, 3), stride=(1, 2))"},
      {"unbatched", {3, 6, 6}, [](const TensorList& t) { return max_pool2d(t[0], 3, 3); },
       "F.max_pool2d(x0, 3, stride=3)"},
      {"with indices, ceil_mode padding", {1, 3, 7, 6},
       [](const TensorList& t) { return std::get<0>(max_pool2d_with_indices(t[0], 3, 2, 1, 1, true)); },
       "F.max_pool2d(x0, 3, stride=2, padding=1, ceil_mode=True, return_indices=True)[0]"},
  };
}

std::vector<PoolCase> avg_pool_cases() {
  return {
      {"kernel 2", {2, 2, 6, 6}, [](const TensorList& t) { return avg_pool2d(t[0], 2); }, "F.avg_pool2d(x0, 2)"},
      {"padding, count_include_pad", {1, 2, 7, 6}, [](const TensorList& t) { return avg_pool2d(t[0], 3, 2, 1); },
       "F.avg_pool2d(x0, 3, stride=2, padding=1)"},
      {"padding, exclude pad", {1, 2, 7, 6},
       [](const TensorList& t) { return avg_pool2d(t[0], 3, 2, 1, false, false); },
       "F.avg_pool2d(x0, 3, stride=2, padding=1, count_include_pad=False)"},
      {"ceil_mode, count_include_pad", {1, 2, 7, 6},
       [](const TensorList& t) { return avg_pool2d(t[0], 2, 2, 1, true); },
       "F.avg_pool2d(x0, 2, stride=2, padding=1, ceil_mode=True)"},
      {"ceil_mode, exclude pad", {1, 2, 7, 6},
       [](const TensorList& t) { return avg_pool2d(t[0], 2, 2, 1, true, false); },
       "F.avg_pool2d(x0, 2, stride=2, padding=1, ceil_mode=True, count_include_pad=False)"},
      {"ceil_mode past the input", {1, 2, 7, 6}, [](const TensorList& t) { return avg_pool2d(t[0], 3, 2, 0, true); },
       "F.avg_pool2d(x0, 3, stride=2, ceil_mode=True)"},
      {"divisor_override", {1, 2, 6, 6}, [](const TensorList& t) { return avg_pool2d(t[0], 2, {}, 0, false, true, 3); },
       "F.avg_pool2d(x0, 2, divisor_override=3)"},
      {"overlapping, stride 1", {1, 2, 5, 5}, [](const TensorList& t) { return avg_pool2d(t[0], 3, 1, 1); },
       "F.avg_pool2d(x0, 3, stride=1, padding=1)"},
      {"unbatched", {3, 6, 6}, [](const TensorList& t) { return avg_pool2d(t[0], {3, 2}); },
       "F.avg_pool2d(x0, (3, 2))"},
  };
}

std::vector<PoolCase> adaptive_cases() {
  return {
      {"uniform bins", {2, 3, 6, 4}, [](const TensorList& t) { return adaptive_avg_pool2d(t[0], {3, 2}); },
       "F.adaptive_avg_pool2d(x0, (3, 2))"},
      {"non-uniform bins", {1, 2, 7, 6}, [](const TensorList& t) { return adaptive_avg_pool2d(t[0], {3, 4}); },
       "F.adaptive_avg_pool2d(x0, (3, 4))"},
      {"global", {2, 3, 5, 5}, [](const TensorList& t) { return adaptive_avg_pool2d(t[0], 1); },
       "F.adaptive_avg_pool2d(x0, 1)"},
      {"larger than the input", {1, 2, 3, 3}, [](const TensorList& t) { return adaptive_avg_pool2d(t[0], {5, 4}); },
       "F.adaptive_avg_pool2d(x0, (5, 4))"},
      {"unbatched", {3, 7, 7}, [](const TensorList& t) { return adaptive_avg_pool2d(t[0], 2); },
       "F.adaptive_avg_pool2d(x0, 2)"},
  };
}

// Gradient of max_pool2d(x, ...) for g = arange(1, numel + 1) in the output's
// shape, or with `cycle`, g[i] = i % cycle + 1 (small integers, so sums stay exact in bfloat16).
std::vector<double> max_pool_grad(const Tensor& x, const std::function<Tensor(const Tensor&)>& pool,
                                  int64_t cycle = 0) {
  const Tensor y = pool(x);
  std::vector<double> gv(static_cast<size_t>(y.numel()));
  for (size_t i = 0; i < gv.size(); ++i) gv[i] = static_cast<double>(cycle ? i % cycle + 1 : i + 1);
  const Tensor g = tensor<double>(gv).to(x.dtype()).reshape(y.sizes());
  return kiln::test::values(autograd::grad({y}, {x}, {g})[0]);
}

// The 4x5 pattern with ties used for the torch expectations below.
Tensor tie_pattern(DType dt) {
  return tensor<double>({1, 2, 2, 0, 3, 2, 1, 2, 3, 3, 0, 2, 1, 1, 0, 3, 3, 0, 2, 2}).reshape({1, 1, 4, 5}).to(dt);
}

}  // namespace

TEST(ConvPoolGrad, Conv2dGradcheck) {
  uint64_t seed = 1;
  for (const ConvCase& c : conv_cases()) {
    expect_gradcheck(c.f, conv_inputs(c, seed), c.label);
    seed += 3;
  }
  // Non-contiguous input and weight (read through a contiguous copy).
  const ConvCase plain = conv_cases()[0];
  expect_gradcheck(plain.f, {transposed_leaf({2, 3, 6, 5}, 50, 2, 3), transposed_leaf({4, 3, 3, 3}, 51, 2, 3),
                             leaf({4}, 52)},
                   "noncontig");
  // Only some inputs require grad: the others get no gradient computed.
  TensorList only_w = conv_inputs(plain, 53);
  only_w[0] = only_w[0].detach();
  expect_gradcheck(plain.f, only_w, "weight and bias only");
  TensorList only_x = conv_inputs(plain, 56);
  only_x[1] = only_x[1].detach();
  only_x[2] = only_x[2].detach();
  expect_gradcheck(plain.f, only_x, "input only");
  TensorList frozen_w = conv_inputs(plain, 59);
  frozen_w[1] = frozen_w[1].detach();
  expect_gradcheck(plain.f, frozen_w, "frozen weight (the bias gradient alone is a sum)");
}

TEST(ConvPoolGrad, GradientsMatchTorch) {
  std::vector<kiln::test::TorchGradCase> cases;
  uint64_t seed = 1000;
  for (const ConvCase& c : conv_cases()) {
    cases.push_back({c.label, c.f, conv_inputs(c, seed), c.torch});
    seed += 3;
  }
  for (const auto& pools : {max_pool_cases(), avg_pool_cases(), adaptive_cases()}) {
    for (const PoolCase& c : pools) cases.push_back({c.label, c.f, {leaf(c.x, seed++)}, c.torch});
  }
  cases.push_back({"conv2d noncontig", conv_cases()[0].f,
                   {transposed_leaf({2, 3, 6, 5}, 1200, 2, 3), transposed_leaf({4, 3, 3, 3}, 1201, 2, 3),
                    leaf({4}, 1202)},
                   "F.conv2d(x0, x1, x2)"});
  kiln::test::expect_grads_match_torch(cases, 1e-10, 1e-12);
}

TEST(ConvPoolGrad, Conv2dSecondDerivatives) {
  const std::vector<ConvCase> cases = conv_cases();
  uint64_t seed = 100;
  for (size_t i : {0, 1, 2, 3, 5, 6}) {  // bias, stride+padding, dilation, groups, unbatched, same
    expect_gradgradcheck(cases[i].f, conv_inputs(cases[i], seed), cases[i].label);
    seed += 3;
  }
  TensorList frozen_w = conv_inputs(cases[0], seed);
  frozen_w[1] = frozen_w[1].detach();
  expect_gradgradcheck(cases[0].f, frozen_w, "frozen weight");
}

TEST(ConvPoolGrad, Conv2dFloat32AndBFloat16MatchFloat64) {
  // float32 on oneDNN's backward-data/weights primitives: sums of up to
  // C*kH*kW (data) or N*oH*oW (weights) products in another order: 1e-5 of
  // the largest gradient. bfloat16: results rounded to 8 bits: 1.6e-2.
  struct Tol {
    DType dt;
    double tol;
  };
  uint64_t seed = 200;
  for (const Tol t : {Tol{kFloat32, 1e-5}, Tol{kBFloat16, 1.6e-2}}) {
    for (const ConvCase& c : conv_cases()) {
      expect_grads_match_float64(c.f, conv_inputs(c, seed), seed + 3, t.dt, t.tol, c.label);
      seed += 4;
    }
    const Fn big = [](const TensorList& x) { return conv2d(x[0], x[1], x[2], 1, 1); };
    expect_grads_match_float64(big, {leaf({4, 16, 10, 10}, 290), leaf({32, 16, 3, 3}, 291), leaf({32}, 292)}, 293,
                               t.dt, t.tol, "N=4 C=16 10x10 K=32 3x3 pad 1");
  }
}

TEST(ConvPoolGrad, Conv2dFloat16ComputesInFloat32) {
  const Tensor x = leaf({1, 2, 4, 4}, 300).detach().to(kFloat16).requires_grad_();
  const Tensor w = leaf({3, 2, 3, 3}, 301).detach().to(kFloat16).requires_grad_();
  const Tensor y = conv2d(x, w, {}, 1, 1);
  const TensorList g = autograd::grad({y}, {x, w}, {ones(y.sizes(), kFloat16)});
  EXPECT_EQ(g[0].dtype(), kFloat16);
  const Tensor x32 = x.detach().to(kFloat32).requires_grad_(), w32 = w.detach().to(kFloat32).requires_grad_();
  const Tensor y32 = conv2d(x32, w32, {}, 1, 1);
  const TensorList g32 = autograd::grad({y32}, {x32, w32}, {ones(y32.sizes())});
  EXPECT_TRUE(g[0].to(kFloat32).allclose(g32[0], 1e-3, 1e-2));
  EXPECT_TRUE(g[1].to(kFloat32).allclose(g32[1], 1e-3, 1e-2));
}

TEST(ConvPoolGrad, PoolingGradcheck) {
  uint64_t seed = 400;
  for (const auto& cases : {max_pool_cases(), avg_pool_cases(), adaptive_cases()}) {
    for (const PoolCase& c : cases) expect_gradcheck(c.f, {leaf(c.x, seed++)}, c.label);
  }
  expect_gradcheck(max_pool_cases()[0].f, {transposed_leaf({1, 3, 8, 6}, 450, 2, 3)}, "max noncontig");
  expect_gradcheck(avg_pool_cases()[0].f, {transposed_leaf({1, 3, 8, 6}, 451, 2, 3)}, "avg noncontig");
  expect_gradcheck(adaptive_cases()[1].f, {transposed_leaf({1, 2, 6, 7}, 452, 2, 3)}, "adaptive noncontig");
}

TEST(ConvPoolGrad, PoolingSecondDerivatives) {
  uint64_t seed = 500;
  for (const auto& cases : {max_pool_cases(), avg_pool_cases(), adaptive_cases()}) {
    for (const PoolCase& c : cases) expect_gradgradcheck(c.f, {leaf(c.x, seed++)}, c.label);
  }
}

TEST(ConvPoolGrad, PoolingFloat32AndBFloat16MatchFloat64) {
  // Max pooling moves values exactly; averages divide once and sum a few
  // terms: 1e-6 (float32) and 8e-3 (bfloat16, one rounding) of the largest.
  struct Tol {
    DType dt;
    double tol;
  };
  uint64_t seed = 600;
  for (const Tol t : {Tol{kFloat32, 1e-6}, Tol{kBFloat16, 8e-3}}) {
    for (const auto& cases : {max_pool_cases(), avg_pool_cases(), adaptive_cases()}) {
      for (const PoolCase& c : cases) {
        expect_grads_match_float64(c.f, {leaf(c.x, seed)}, seed + 1, t.dt, t.tol, c.label);
        seed += 2;
      }
    }
  }
}

TEST(ConvPoolGrad, MaxPoolTiesGoToTheFirstMaximumAsTorch) {
  // torch: x = ones(1, 1, 4, 5); F.max_pool2d(x, 3, stride=1, padding=1)
  const std::vector<double> kConst = {16, 11, 13, 15, 0, 23, 13, 14, 15, 0, 33, 18, 19, 20, 0, 0, 0, 0, 0, 0};
  // torch: tie_pattern; F.max_pool2d(x, 2, stride=1)
  const std::vector<double> kPattern = {0, 3, 0, 0, 4, 5, 0, 6, 18, 0, 0, 0, 0, 0, 0, 9, 10, 0, 23, 0};
  // torch: tie_pattern; F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True)
  const std::vector<double> kPatternCeil = {0, 1, 0, 0, 3, 0, 0, 0, 13, 0, 0, 0, 0, 0, 0, 11, 8, 0, 9, 0};
  // torch: x = -ones(1, 1, 3, 3); F.max_pool2d(x, 2, stride=2, padding=1): padding never wins
  const std::vector<double> kNegativePadded = {1, 2, 0, 3, 4, 0, 0, 0, 0};
  // float32 runs oneDNN and reads its workspace; float64 runs our loop and its indices.
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    const std::string d(dtype_name(dt));
    EXPECT_EQ(max_pool_grad(ones({1, 1, 4, 5}, dt).requires_grad_(),
                            [](const Tensor& x) { return max_pool2d(x, 3, 1, 1); }),
              kConst)
        << d;
    EXPECT_EQ(max_pool_grad(tie_pattern(dt).requires_grad_(), [](const Tensor& x) { return max_pool2d(x, 2, 1); }),
              kPattern)
        << d;
    EXPECT_EQ(max_pool_grad(tie_pattern(dt).requires_grad_(),
                            [](const Tensor& x) { return max_pool2d(x, 3, 2, 1, 1, true); }),
              kPatternCeil)
        << d;
    EXPECT_EQ(max_pool_grad(tie_pattern(dt).requires_grad_(),
                            [](const Tensor& x) { return std::get<0>(max_pool2d_with_indices(x, 2, 1)); }),
              kPattern)
        << d << " with indices";
    EXPECT_EQ(max_pool_grad((-ones({1, 1, 3, 3}, dt)).requires_grad_(),
                            [](const Tensor& x) { return max_pool2d(x, 2, 2, 1); }),
              kNegativePadded)
        << d;
  }
}

TEST(ConvPoolGrad, MaxPoolTiesOnOneDnnMatchTheIndicesPath) {
  // Many ties (values rounded to halves) and enough channels for oneDNN's
  // blocked kernels: float32 (oneDNN workspace) must route every gradient
  // exactly where float64 (torch's first-maximum indices) does.
  Generator gen(1000);
  const Tensor base = randn({2, 32, 9, 10}, kFloat64, &gen);
  double* v = base.data_ptr<double>();
  for (int64_t i = 0; i < base.numel(); ++i) v[i] = std::round(v[i] * 2) / 2;
  for (const auto& pool : std::vector<std::function<Tensor(const Tensor&)>>{
           [](const Tensor& x) { return max_pool2d(x, 3, 2, 1); },
           [](const Tensor& x) { return max_pool2d(x, 3, 1, 1); },
           [](const Tensor& x) { return max_pool2d(x, 2, 2, 0, 1, true); },
       }) {
    const auto want = max_pool_grad(base.detach().requires_grad_(), pool, 8);
    EXPECT_EQ(max_pool_grad(base.to(kFloat32).requires_grad_(), pool, 8), want);
    EXPECT_EQ(max_pool_grad(base.to(kBFloat16).requires_grad_(), pool, 8), want);
  }
}

TEST(ConvPoolGrad, MaxPoolWithNaNFollowsTorch) {
  // torch: tie_pattern with x[1, 1] = x[3, 2] = nan; F.max_pool2d(x, 2, stride=1). oneDNN would drop the NaN,
  // so the forward runs our loop and the backward scatters by its indices.
  const std::vector<double> kNaN = {0, 0, 0, 0, 4, 0, 14, 0, 18, 0, 0, 0, 0, 0, 0, 9, 0, 21, 12, 0};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    Tensor x = tie_pattern(kFloat64);
    x.data_ptr<double>()[6] = nan;
    x.data_ptr<double>()[17] = nan;
    x = x.to(dt).requires_grad_();
    EXPECT_EQ(max_pool_grad(x, [](const Tensor& t) { return max_pool2d(t, 2, 1); }), kNaN) << dtype_name(dt);
  }
}

TEST(ConvPoolGrad, NodeNamesAndCallSites) {
  const Tensor x = leaf({1, 2, 6, 6}, 700), w = leaf({3, 2, 3, 3}, 701);
  const int line = __LINE__ + 1;
  const Tensor y = conv2d(x, w);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "ConvolutionBackward0");
  EXPECT_EQ(y.grad_fn()->site().line, static_cast<uint32_t>(line));
  EXPECT_STREQ(max_pool2d(x, 2).grad_fn()->name(), "MaxPool2DWithIndicesBackward0");
  EXPECT_STREQ(avg_pool2d(x, 2).grad_fn()->name(), "AvgPool2DBackward0");
  EXPECT_STREQ(adaptive_avg_pool2d(x, 2).grad_fn()->name(), "AdaptiveAvgPool2DBackward0");
  const TensorList g = autograd::grad({y}, {x}, {ones(y.sizes(), kFloat64).requires_grad_()}, true, true);
  ASSERT_NE(g[0].grad_fn(), nullptr);
  EXPECT_STREQ(g[0].grad_fn()->name(), "ConvolutionBackwardBackward0");
  {
    const NoGradGuard ng;
    EXPECT_EQ(conv2d(x, w).grad_fn(), nullptr);
    EXPECT_FALSE(max_pool2d(x, 2).requires_grad());
  }
}

TEST(ConvPoolGrad, BackwardReusesCachedPrimitives) {
  const Tensor x = leaf({2, 4, 8, 8}, 800).detach().to(kFloat32).requires_grad_();
  const Tensor w = leaf({6, 4, 3, 3}, 801).detach().to(kFloat32).requires_grad_();
  const Tensor b = leaf({6}, 802).detach().to(kFloat32).requires_grad_();
  auto step = [&] {
    const Tensor y = max_pool2d(conv2d(x, w, b, 1, 1), 2);
    const Tensor z1 = avg_pool2d(y, 2), z2 = adaptive_avg_pool2d(y, 2);
    return autograd::grad({z1, z2}, {x, w, b}, {ones(z1.sizes()), ones(z2.sizes())});
  };
  const TensorList first = step();
  const int64_t created = kernels::dnnl_primitives_created();
  const TensorList second = step();
  EXPECT_EQ(kernels::dnnl_primitives_created(), created) << "a repeated backward created oneDNN primitives";
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(first[i].allclose(second[i], 0, 0)) << i;
}

TEST(ConvPoolGrad, SavedInputModifiedInPlaceIsNamed) {
  Tensor x = leaf({1, 2, 5, 5}, 900).detach();
  const Tensor w = leaf({3, 2, 3, 3}, 901);
  const Tensor y = conv2d(x, w);
  x.add_(1);
  try {
    y.backward(ones(y.sizes(), kFloat64));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("ConvolutionBackward0"), std::string::npos) << msg;
  }
}

// max_pool2d saves its input as torch does, so writing into the input after pooling fails at
// backward by name instead of routing the gradient by the old maxima. PyTorch 1.13, for
//   y = x * 1; o = F.max_pool2d(y, 2); y.add_(1); o.sum().backward()
// raises "one of the variables needed for gradient computation has been modified by an inplace
// operation: [torch.FloatTensor [1, 2, 4, 4]], which is output 0 of AddBackward0, is at version 1;
// expected version 0". Every path kiln takes is covered: float64 (kiln's indices), float32
// (oneDNN's workspace), channels-last float32, and max_pool2d_with_indices.
TEST(PoolGrad, InPlaceChangeOfTheInputAfterMaxPoolIsCaught) {
  struct Path {
    std::string label;
    std::function<Tensor(const Tensor&)> input;  // what is pooled, made from y = x * 1 (with history)
    bool with_indices;
  };
  const std::vector<Path> paths = {
      {"float64", [](const Tensor& y) { return y; }, false},
      {"float32", [](const Tensor& y) { return y.to(kFloat32); }, false},
      {"channels-last float32", [](const Tensor& y) { return contiguous(y.to(kFloat32), MemoryFormat::ChannelsLast); },
       false},
      {"with indices", [](const Tensor& y) { return y; }, true},
  };
  for (const Path& path : paths) {
    const Tensor x = leaf({1, 2, 4, 4}, 701);
    Tensor in = path.input(x * 1);
    const Tensor o = path.with_indices ? std::get<0>(max_pool2d_with_indices(in, 2)) : max_pool2d(in, 2);
    in.add_(1);
    try {
      o.sum().backward();
      ADD_FAILURE() << path.label << ": expected the version check to fail";
    } catch (const ValueError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("MaxPool2DWithIndicesBackward0"), std::string::npos) << path.label << ": " << m;
      EXPECT_NE(m.find("saved at version 0, now at version 1"), std::string::npos) << path.label << ": " << m;
    }
  }
}
