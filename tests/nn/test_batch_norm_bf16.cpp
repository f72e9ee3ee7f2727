// Mixed bf16 batch norm (ops/batch_norm.h, kernels/cpu/batch_norm.cpp): a
// channels-last bf16 input with float32 weight, bias and statistics, as
// PyTorch's CPU kernel and as autocast now runs a conv's output. The oracle is
// float64 arithmetic on the very bf16 values the kernel read (x, dy, the
// residual), so the only differences left are the kernel's float32 arithmetic
// and the one rounding of each bf16 result.
//
// Tolerances, stated once: a bf16 result is within half a bf16 ulp of the
// float64 value (the ulp is 2^-7 of the value's binade, so relative 2^-8),
// plus float32 arithmetic on values of order 10 (absolute 1e-4); a float32 result (mean, var, dweight, dbias) within
// 1e-5 relative of the float64 one, plus 1e-4 absolute for sums that cancel.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/core/threads.h"
#include "kiln/kiln.h"
#include "kiln/ops/batch_norm.h"
#include "kiln/ops/memory_format.h"

using namespace kiln;

namespace {

constexpr double kBf16Rtol = 1.0 / 256, kBf16Atol = 1e-4;
constexpr double kF32Rtol = 1e-5, kF32Atol = 1e-4;

// Channels-last bf16 values of N(offset, scale^2), each exactly representable.
Tensor cl_bf16(IntArrayRef sizes, uint64_t seed, double scale, double offset) {
  Generator gen(seed);
  Tensor t = randn(sizes, TensorOptions().dtype(kFloat32), &gen) * scale + offset;
  return contiguous(t.to(kBFloat16), MemoryFormat::ChannelsLast).detach();
}

Tensor f32(IntArrayRef sizes, uint64_t seed, double scale, double offset) {
  Generator gen(seed);
  return (randn(sizes, TensorOptions().dtype(kFloat32), &gen) * scale + offset).detach();
}

// y, mean, var and the gradients in float64 from the same inputs.
struct Reference {
  Tensor y, mean, var, dx, dw, db, dres;
};

Reference reference(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& res, const Tensor& gy, bool relu,
                    double eps) {
  const std::vector<int64_t> dims = {0, 2, 3}, cs = {1, x.size(1), 1, 1};
  Tensor xd = x.to(kFloat64).requires_grad_(), wd = w.to(kFloat64).requires_grad_(),
         bd = b.to(kFloat64).requires_grad_();
  Tensor rd = res.defined() ? res.to(kFloat64).requires_grad_() : Tensor();
  Reference r;
  r.mean = xd.detach().mean(dims);
  r.var = xd.detach().var(dims, 0);
  Tensor y = (xd - xd.mean(dims).view(cs)) * (xd.var(dims, 0).view(cs) + eps).rsqrt() * wd.view(cs) + bd.view(cs);
  if (rd.defined()) y = y + rd;
  if (relu) y = y.relu();
  TensorList in = {xd, wd, bd};
  if (rd.defined()) in.push_back(rd);
  TensorList g = autograd::grad({y}, in, {gy.to(kFloat64)});
  r.y = y.detach();
  r.dx = g[0];
  r.dw = g[1];
  r.db = g[2];
  if (rd.defined()) r.dres = g[3];
  return r;
}

void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const char* what) {
  const Tensor diff = (got.to(kFloat64) - want).abs();
  const Tensor bound = want.abs() * rtol + atol;
  EXPECT_TRUE((diff <= bound).all().item<bool>())
      << what << ": worst excess " << (diff - bound).max().item<double>() << ", largest difference "
      << diff.max().item<double>();
}

void check_case(IntArrayRef sizes, bool relu, bool residual, uint64_t seed) {
  SCOPED_TRACE(std::string(relu ? (residual ? "add_relu" : "relu") : "plain") + " C=" + std::to_string(sizes[1]));
  const int64_t c = sizes[1];
  const double eps = 1e-5;
  Tensor x = cl_bf16(sizes, seed, 3.0, 10.0).requires_grad_();
  Tensor w = f32({c}, seed + 1, 0.3, 1.0).requires_grad_();
  Tensor b = f32({c}, seed + 2, 0.3, 0.0).requires_grad_();
  Tensor res = residual ? cl_bf16(sizes, seed + 3, 1.0, 0.0).requires_grad_() : Tensor();
  Tensor gy = cl_bf16(sizes, seed + 4, 1.0, 0.2);
  ASSERT_TRUE(ops::batch_norm_train_supported(x, w, b));
  EXPECT_EQ(ops::stat_dtype(x), kFloat32);

  ops::BatchNormResult r = !relu     ? ops::batch_norm_train(x, w, b, eps)
                           : residual ? ops::batch_norm_add_relu_train(x, w, b, res, eps)
                                      : ops::batch_norm_relu_train(x, w, b, eps);
  EXPECT_EQ(r.output.dtype(), kBFloat16);
  EXPECT_EQ(suggest_memory_format(r.output), MemoryFormat::ChannelsLast);
  EXPECT_EQ(r.mean.dtype(), kFloat32);
  EXPECT_EQ(r.var.dtype(), kFloat32);
  TensorList in = {x, w, b};
  if (residual) in.push_back(res);
  TensorList g = autograd::grad({r.output}, in, {gy});
  const Reference want = reference(x.detach(), w.detach(), b.detach(), residual ? res.detach() : Tensor(), gy, relu, eps);

  expect_close(r.output, want.y, kBf16Rtol, kBf16Atol, "output");
  expect_close(r.mean, want.mean, kF32Rtol, kF32Atol, "mean");
  expect_close(r.var, want.var, kF32Rtol, kF32Atol, "var");
  EXPECT_EQ(g[0].dtype(), kBFloat16);
  EXPECT_EQ(g[1].dtype(), kFloat32);
  EXPECT_EQ(g[2].dtype(), kFloat32);
  expect_close(g[0], want.dx, kBf16Rtol, kBf16Atol, "dx");
  expect_close(g[1], want.dw, kF32Rtol, kF32Atol, "dweight");
  expect_close(g[2], want.db, kF32Rtol, kF32Atol, "dbias");
  if (residual) {
    EXPECT_EQ(g[3].dtype(), kBFloat16);
    // The residual's gradient is dy masked by the ReLU: bf16 values passed through, exact.
    expect_close(g[3], want.dres, 0, 0, "dresidual");
  }
}

TEST(BatchNormBf16, MatchesFloat64OnTheSameValues) {
  check_case({8, 16, 6, 5}, false, false, 1);   // 16 channels: the vector path
  check_case({8, 16, 6, 5}, true, false, 11);   // fused ReLU
  check_case({8, 32, 4, 4}, true, true, 21);    // fused residual add and ReLU
  check_case({6, 5, 7, 3}, true, true, 31);     // 5 channels: the scalar path
  check_case({32, 16, 16, 16}, true, true, 41);  // several threads' worth of row blocks
}

TEST(BatchNormBf16, ThreadCountDoesNotChangeTheResult) {
  Tensor x = cl_bf16({16, 16, 16, 16}, 51, 3.0, 10.0).requires_grad_();
  Tensor w = f32({16}, 52, 0.3, 1.0).requires_grad_();
  Tensor b = f32({16}, 53, 0.3, 0.0).requires_grad_();
  Tensor gy = cl_bf16({16, 16, 16, 16}, 54, 1.0, 0.0);
  const int before = get_num_threads();
  TensorList results[2];
  for (int t : {1, 2}) {
    set_num_threads(t);
    ops::BatchNormResult r = ops::batch_norm_relu_train(x, w, b, 1e-5);
    TensorList g = autograd::grad({r.output}, {x, w, b}, {gy});
    results[t - 1] = {r.output, r.mean, r.var, g[0], g[1], g[2]};
  }
  set_num_threads(before);
  for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(results[0][i].equal(results[1][i])) << i;
}

TEST(BatchNormBf16, RoundsEachResultOnceToNearestEven) {
  // Two channels of the values -1 and 1: mean 0, var 1, so y = x + bias.
  // Channel 0's bias 1 + 2^-7 makes 2 + 2^-7, halfway between the bf16
  // values 2 and 2 + 2^-6: it ties to 2, the even one. Channel 1's bias
  // 1 + 3 * 2^-7 makes the tie between 2 + 2^-6 (odd) and 2 + 2^-5 (even):
  // it rounds up. The other outputs, 2^-7 and 3 * 2^-7, are exact.
  // 2 channels run the scalar path, 16 the vector one (even channels as 0, odd as 1).
  for (int64_t c : {2, 16}) {
    SCOPED_TRACE("C=" + std::to_string(c));
    std::vector<float> xv, bias;
    for (int64_t k = 0; k < c; ++k) xv.insert(xv.end(), {-1.0f, 1.0f});
    const float e = 1.0f / 128;
    for (int64_t k = 0; k < c; ++k) bias.push_back(k % 2 ? 1 + 3 * e : 1 + e);
    Tensor x = contiguous(tensor(xv, {1, c, 1, 2}).to(kBFloat16), MemoryFormat::ChannelsLast);
    ASSERT_TRUE(ops::batch_norm_train_supported(x, ones({c}), Tensor()));
    ops::BatchNormResult r = ops::batch_norm_train(x, ones({c}), tensor(bias), 0.0);
    const Tensor y = r.output.to(kFloat32).contiguous();
    for (int64_t k = 0; k < c; ++k) {
      EXPECT_EQ(y.data_ptr<float>()[2 * k], k % 2 ? 3 * e : e) << k;
      EXPECT_EQ(y.data_ptr<float>()[2 * k + 1], k % 2 ? 2.0f + 4 * e : 2.0f) << k;
    }
  }
  // A NaN stays NaN through the vector path's rounding (16 channels): its
  // channel's statistics are NaN, every other channel is untouched.
  std::vector<float> v(2 * 16 * 2 * 2);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 7) - 3.0f;
  v[3 * 4 + 3] = std::nanf("");  // batch 0, channel 3, last pixel (NCHW order)
  Tensor xn = contiguous(tensor(v, {2, 16, 2, 2}).to(kBFloat16), MemoryFormat::ChannelsLast);
  ops::BatchNormResult rn = ops::batch_norm_train(xn, Tensor(), Tensor(), 1e-5);
  const Tensor yn = rn.output.to(kFloat32);
  const Tensor isnan = yn != yn;
  EXPECT_TRUE(isnan.select(1, 3).all().item<bool>());
  EXPECT_EQ(isnan.sum().item<int64_t>(), 8);
}

TEST(BatchNormBf16, OnlyChannelsLastWithFloat32Parameters) {
  Tensor nchw = zeros({2, 3, 4, 4}, kBFloat16);
  Tensor cl = contiguous(nchw, MemoryFormat::ChannelsLast);
  EXPECT_FALSE(ops::batch_norm_train_supported(nchw, ones({3}), zeros({3})));
  EXPECT_TRUE(ops::batch_norm_train_supported(cl, ones({3}), zeros({3})));
  EXPECT_TRUE(ops::batch_norm_train_supported(cl, Tensor(), Tensor()));
  EXPECT_FALSE(ops::batch_norm_train_supported(cl, ones({3}, kBFloat16), Tensor()));
  try {
    (void)ops::batch_norm_train(nchw, ones({3}), zeros({3}), 1e-5);
    ADD_FAILURE() << "an NCHW bf16 input was taken";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("channels-last 4-dim bf16"), std::string::npos) << e.what();
  }
}

TEST(BatchNormBf16, AutocastKeepsAConvOutputInBf16) {
  nn::Conv2d conv({.in_channels = 3, .out_channels = 16, .kernel_size = {3}, .padding = {1}, .bias = false});
  nn::BatchNorm2d bn({.num_features = 16});
  Tensor x = f32({4, 3, 8, 8}, 71, 1.0, 0.0);
  Tensor y, h;
  {
    AutocastGuard amp(kBFloat16);
    h = conv.forward(x);
    ASSERT_EQ(h.dtype(), kBFloat16);
    y = bn.forward_relu(h);
  }
  EXPECT_EQ(y.dtype(), kBFloat16);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "NativeBatchNormReluBackward0");  // no cast node between conv and BN
  EXPECT_EQ(bn.running_mean.dtype(), kFloat32);
  const Tensor hd = h.detach().to(kFloat64);
  EXPECT_TRUE(bn.running_mean.to(kFloat64).allclose(hd.mean({0, 2, 3}) * 0.1, 1e-5, 1e-5));
  y.to(kFloat32).sum().backward();
  ASSERT_TRUE(bn.weight.grad().defined());
  EXPECT_EQ(bn.weight.grad().dtype(), kFloat32);
  EXPECT_EQ(conv.weight.grad().dtype(), kFloat32);
  // Eval mode reads the running statistics: the float32 path, as before.
  bn.eval();
  AutocastGuard amp(kBFloat16);
  EXPECT_EQ(bn.forward(conv.forward(x)).dtype(), kFloat32);
}

}  // namespace
