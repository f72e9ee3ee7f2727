// ops::Int8Conv2d / ops::Int8Linear against an exact integer reference
// written here: the input quantized by quant::quantize_per_tensor (itself
// checked against torch), the weight per output channel (symmetric qint8),
// int32 accumulation of (xq - zx) · wq with padding read as real zero, then
// y = sx · sw[o] · acc + bias (ReLU). Float outputs agree to 1e-5 relative
// (the scale product and the folded bias round differently); requantized
// uint8 outputs to ±1 (a float tie may round either way).
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/int8.h"
#include "kiln/quant/observer.h"
#include "kiln/quant/qtensor.h"

using namespace kiln;
using quant::QDType;

namespace {

struct QWeight {
  Tensor bytes, scales;
  std::vector<int32_t> ints;
};

QWeight quantize_weight(const Tensor& w) {
  quant::PerChannelMinMaxObserver obs;
  obs.observe(w);
  const quant::QTensor q = quant::quantize(w, obs.qparams());
  const Tensor ir = q.int_repr().contiguous();
  return {q.data, q.scales, std::vector<int32_t>(ir.data_ptr<int32_t>(), ir.data_ptr<int32_t>() + ir.numel())};
}

std::vector<int32_t> quantize_input(const Tensor& x, float scale, int64_t zp) {
  const Tensor ir = quant::quantize_per_tensor(x, scale, zp, QDType::QUInt8).int_repr().contiguous();
  return std::vector<int32_t>(ir.data_ptr<int32_t>(), ir.data_ptr<int32_t>() + ir.numel());
}

float epilogue(int64_t acc, float sx, float sw, float bias, bool relu) {
  float y = static_cast<float>(static_cast<double>(sx) * sw * static_cast<double>(acc) + bias);
  return relu ? std::max(y, 0.0f) : y;
}

void expect_output(const Tensor& got_t, const std::vector<float>& want, const ops::Int8Quantization& q,
                   const std::string& what) {
  const Tensor got = got_t.contiguous();
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  if (q.output_scale > 0) {
    ASSERT_EQ(got.dtype(), kUInt8);
    const uint8_t* g = got.data_ptr<uint8_t>();
    for (size_t i = 0; i < want.size(); ++i) {
      const double r = std::clamp(std::nearbyint(static_cast<double>(want[i]) / q.output_scale) + static_cast<double>(q.output_zero_point), 0.0, 255.0);
      ASSERT_LE(std::fabs(g[i] - r), 1.0) << what << " at " << i;
    }
    return;
  }
  const float* g = got.data_ptr<float>();
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(g[i], want[i], 1e-5 * std::max(1.0f, std::fabs(want[i]))) << what << " at " << i;
}

struct ConvCase {
  int64_t n, c, h, w, o, k, stride, pad, groups;
  bool bias, relu;
  float out_scale;
  int64_t in_zp;
};

}  // namespace

TEST(Int8Kernels, Conv2dMatchesIntegerReference) {
  const ConvCase cases[] = {
      {2, 3, 9, 8, 16, 3, 1, 1, 1, true, false, 0.0f, 100},  // padding reads the zero point as real 0
      {1, 8, 7, 7, 12, 3, 2, 1, 2, true, true, 0.0f, 37},    // stride 2, groups 2, ReLU
      {3, 1, 6, 6, 5, 1, 1, 0, 1, false, false, 0.0f, 0},
      {2, 4, 5, 5, 8, 3, 1, 1, 1, true, true, 0.05f, 128},   // requantized uint8 out
  };
  Generator g(11);
  int id = 0;
  for (const ConvCase& c : cases) {
    const std::string what = "conv case " + std::to_string(id++);
    const Tensor x = randn({c.n, c.c, c.h, c.w}, TensorOptions(kFloat32), &g);
    const Tensor w = randn({c.o, c.c / c.groups, c.k, c.k}, TensorOptions(kFloat32), &g).mul(0.3);
    const Tensor b = c.bias ? randn({c.o}, TensorOptions(kFloat32), &g) : Tensor();
    const float sx = 0.021f;
    const QWeight qw = quantize_weight(w);
    const std::vector<int32_t> xq = quantize_input(x, sx, c.in_zp);
    ops::Int8Conv2dOptions opt;
    opt.stride = {c.stride, c.stride};
    opt.padding = {c.pad, c.pad};
    opt.groups = c.groups;
    opt.q = {sx, c.in_zp, c.relu, c.out_scale, c.out_scale > 0 ? 3 : 0};
    const ops::Int8Conv2d conv(qw.bytes, qw.scales, b, opt);
    const Tensor y = conv(x);
    const int64_t oh = (c.h + 2 * c.pad - c.k) / c.stride + 1, ow = (c.w + 2 * c.pad - c.k) / c.stride + 1;
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{c.n, c.o, oh, ow}));
    const int64_t cg = c.c / c.groups, og = c.o / c.groups;
    std::vector<float> want(c.n * c.o * oh * ow), want_pre(want.size());  // want_pre: before the ReLU
    const float* sw = qw.scales.data_ptr<float>();
    for (int64_t n = 0; n < c.n; ++n)
      for (int64_t o = 0; o < c.o; ++o)
        for (int64_t i = 0; i < oh; ++i)
          for (int64_t j = 0; j < ow; ++j) {
            int64_t acc = 0;
            const int64_t gi = o / og;
            for (int64_t ci = 0; ci < cg; ++ci)
              for (int64_t u = 0; u < c.k; ++u)
                for (int64_t v = 0; v < c.k; ++v) {
                  const int64_t r = i * c.stride - c.pad + u, s = j * c.stride - c.pad + v;
                  if (r < 0 || r >= c.h || s < 0 || s >= c.w) continue;  // real zero: (zx - zx) · w
                  const int64_t ch = gi * cg + ci;
                  acc += static_cast<int64_t>(xq[((n * c.c + ch) * c.h + r) * c.w + s] - c.in_zp) *
                         qw.ints[((o * cg + ci) * c.k + u) * c.k + v];
                }
            const float bo = c.bias ? b.data_ptr<float>()[o] : 0.0f;
            want[((n * c.o + o) * oh + i) * ow + j] = epilogue(acc, sx, sw[o], bo, c.relu);
            want_pre[((n * c.o + o) * oh + i) * ow + j] = epilogue(acc, sx, sw[o], bo, false);
          }
    expect_output(y, want, opt.q, what);
    if (c.out_scale == 0) {  // a residual joins in the epilogue, after the scales and bias, before the ReLU
      const Tensor r = randn({c.n, c.o, oh, ow}, TensorOptions(kFloat32), &g);
      std::vector<float> want_r(want.size());
      const Tensor rc = r.contiguous();
      for (size_t i = 0; i < want.size(); ++i) {
        const float v = want_pre[i] + rc.data_ptr<float>()[i];
        want_r[i] = c.relu ? std::max(v, 0.0f) : v;
      }
      expect_output(conv(x, r), want_r, opt.q, what + " (residual)");
    }
    // An already-quantized uint8 input gives the same result.
    const Tensor xu8 = quant::quantize_per_tensor(x, sx, c.in_zp, QDType::QUInt8).data;
    expect_output(conv(xu8), want, opt.q, what + " (uint8 input)");
  }
}

TEST(Int8Kernels, LinearMatchesIntegerReference) {
  Generator g(12);
  struct Case {
    int64_t m, k, n;
    bool bias, relu;
    float out_scale;
    int64_t zp;
  };
  const Case cases[] = {{5, 37, 11, true, false, 0.0f, 77}, {1, 64, 10, false, true, 0.0f, 0},
                        {33, 130, 17, true, true, 0.1f, 128}};
  int id = 0;
  for (const Case& c : cases) {
    const std::string what = "linear case " + std::to_string(id++);
    const Tensor x = randn({c.m, c.k}, TensorOptions(kFloat32), &g);
    const Tensor w = randn({c.n, c.k}, TensorOptions(kFloat32), &g).mul(0.2);
    const Tensor b = c.bias ? randn({c.n}, TensorOptions(kFloat32), &g) : Tensor();
    const float sx = 0.017f;
    const QWeight qw = quantize_weight(w);
    const std::vector<int32_t> xq = quantize_input(x, sx, c.zp);
    const ops::Int8Quantization q{sx, c.zp, c.relu, c.out_scale, 0};
    const ops::Int8Linear fc(qw.bytes, qw.scales, b, q);
    std::vector<float> want(c.m * c.n);
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t o = 0; o < c.n; ++o) {
        int64_t acc = 0;
        for (int64_t kk = 0; kk < c.k; ++kk)
          acc += static_cast<int64_t>(xq[i * c.k + kk] - c.zp) * qw.ints[o * c.k + kk];
        want[i * c.n + o] =
            epilogue(acc, sx, qw.scales.data_ptr<float>()[o], c.bias ? b.data_ptr<float>()[o] : 0.0f, c.relu);
      }
    expect_output(fc(x), want, q, what);
  }
}

TEST(Int8Kernels, RejectsWhatItCannotRun) {
  const Tensor w = zeros({4, 3}, TensorOptions(kUInt8));
  const Tensor s = full({4}, 0.1f);
  EXPECT_THROW(ops::Int8Linear(zeros({4, 3}), s, Tensor(), {}), ShapeError);  // float weight
  EXPECT_THROW(ops::Int8Linear(w, full({3}, 0.1f), Tensor(), {}), ShapeError);
  EXPECT_THROW(ops::Int8Linear(w, s, Tensor(), {0.1f, 300}), ValueError);
  const ops::Int8Linear fc(w, s, Tensor(), {0.1f, 0});
  EXPECT_THROW(fc(zeros({2, 5})), ShapeError);
  EXPECT_THROW(fc(zeros({2, 3}, TensorOptions(kInt64))), DTypeError);
  // A residual must be float32 of the output's shape, and only a float-output layer takes one.
  const Tensor cw = zeros({4, 3, 1, 1}, TensorOptions(kUInt8));
  ops::Int8Conv2dOptions o;
  o.q = {0.1f, 0};
  const ops::Int8Conv2d conv(cw, s, Tensor(), o);
  const Tensor x = zeros({2, 3, 5, 5});
  EXPECT_THROW(conv(x, zeros({2, 4, 5, 4})), ShapeError);
  EXPECT_THROW(conv(x, zeros({2, 4, 5, 5}, TensorOptions(kFloat64))), ShapeError);
  o.q = {0.1f, 0, false, 0.05f, 0};
  EXPECT_THROW(ops::Int8Conv2d(cw, s, Tensor(), o)(x, zeros({2, 4, 5, 5})), ValueError);
}
