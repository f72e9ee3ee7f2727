// The float32 paths of kernels a CPU may lack (docs/decisions.md, Note
// [Kernels without AVX-512]), called directly so that they run on every CPU,
// the AVX-512 machines CI runs on included: a bfloat16 product where oneDNN
// has no bf16 kernel, and the int8 linear and convolution where there is no
// VNNI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/dnnl_common.h"
#include "kiln/kiln.h"

using namespace kiln;

namespace {

// c = a bᵀ over three products: a [3, 5, 33] contiguous, b stored [3, 17, 33]
// and read transposed, with a bias; bf16 c rounded once from the float32 sum,
// and the float32 c of a bf16 weight gradient.
TEST(ThroughFloat32, Bf16ProductsRoundTheFloat32SumOnce) {
  const int64_t batch = 3, m = 5, n = 17, k = 33;
  manual_seed(71);
  const Tensor a = randn({batch, m, k}).to(kBFloat16), bt = randn({batch, n, k}).to(kBFloat16);
  const Tensor bias = randn({n}).to(kBFloat16);
  const Tensor a64 = a.to(kFloat64), b64 = bt.to(kFloat64).transpose(1, 2);
  const Tensor ref = a64.matmul(b64) + bias.to(kFloat64), mag = a64.abs().matmul(b64.abs()) + bias.to(kFloat64).abs();
  kernels::MatmulArgs g;
  g.dtype = kBFloat16;
  g.batch = batch, g.m = m, g.n = n, g.k = k;
  g.a = {a.data_ptr(), {m * k, k, 1}, 0};
  g.b = {bt.data_ptr(), {n * k, 1, k}, 0};
  g.bias = bias.data_ptr();
  const Tensor c = empty({batch, m, n}, TensorOptions(kBFloat16));
  g.c = c.data_ptr();
  kernels::dnnl_detail::matmul_through_float32(g);
  // Half a bf16 ulp of the result, and float32 summation error.
  const Tensor bound = ref.abs() * std::ldexp(1.0, -8) + mag * ((k + 1) * std::ldexp(1.0, -24));
  EXPECT_TRUE((c.to(kFloat64) - ref).abs().le(bound).all().item<bool>())
      << "max error " << (c.to(kFloat64) - ref).abs().max().item<double>();
  EXPECT_TRUE(c.equal(c.to(kFloat32).to(kBFloat16)));

  kernels::MatmulArgs w = g;  // one product, float32 c: not rounded to bf16
  w.batch = 1, w.bias = nullptr, w.float_c = true;
  const Tensor cw = empty({m, n});
  w.c = cw.data_ptr();
  kernels::dnnl_detail::matmul_through_float32(w);
  const Tensor ref0 = a64.select(0, 0).matmul(b64.select(0, 0)), mag0 = a64.select(0, 0).abs().matmul(b64.select(0, 0).abs());
  EXPECT_TRUE((cw.to(kFloat64) - ref0).abs().le(mag0 * ((k + 1) * std::ldexp(1.0, -24))).all().item<bool>());
  EXPECT_FALSE(cw.equal(cw.to(kBFloat16).to(kFloat32)));
}

// The first operand in each layout the widening reads differently: rows
// contiguous, columns contiguous (a transposed view, as a weight gradient's
// dYᵀ: widened column by column) and neither (every other element). The same
// values in each, so the same float32 sums of exact products.
TEST(ThroughFloat32, EveryLayoutOfTheFirstOperandWidensToTheSameProduct) {
  const int64_t batch = 2, m = 19, n = 21, k = 37;
  manual_seed(72);
  const Tensor a = randn({batch, m, k}).to(kBFloat16), b = randn({batch, k, n}).to(kBFloat16);
  const Tensor at = a.transpose(1, 2).contiguous();  // [batch, k, m]
  const Tensor spaced = empty({batch, m, k, 2}, TensorOptions(kBFloat16));
  spaced.select(3, 0).copy_(a);
  spaced.select(3, 1).fill_(0.0);
  const Tensor ref = a.to(kFloat64).matmul(b.to(kFloat64)),
               mag = a.to(kFloat64).abs().matmul(b.to(kFloat64).abs());
  struct Layout {
    const char* name;
    const void* data;
    int64_t stride[3];
  };
  const Layout layouts[] = {{"rows contiguous", a.data_ptr(), {m * k, k, 1}},
                            {"columns contiguous", at.data_ptr(), {k * m, 1, m}},
                            {"every other element", spaced.data_ptr(), {2 * m * k, 2 * k, 2}}};
  for (const Layout& l : layouts) {
    kernels::MatmulArgs g;
    g.dtype = kBFloat16;
    g.batch = batch, g.m = m, g.n = n, g.k = k;
    g.a = {l.data, {l.stride[0], l.stride[1], l.stride[2]}, 0};
    g.b = {b.data_ptr(), {k * n, n, 1}, 0};
    const Tensor c = empty({batch, m, n}, TensorOptions(kBFloat16));
    g.c = c.data_ptr();
    kernels::dnnl_detail::matmul_through_float32(g);
    const Tensor bound = ref.abs() * std::ldexp(1.0, -8) + mag * ((k + 1) * std::ldexp(1.0, -24));
    EXPECT_TRUE((c.to(kFloat64) - ref).abs().le(bound).all().item<bool>())
        << l.name << ": max error " << (c.to(kFloat64) - ref).abs().max().item<double>();
  }
}

// y = scale[o] · (Σ (x − zx) w[o] + bias[o]) against the integer sum, over 600
// terms (past the 514 whose sums float32 holds exactly); and requantized to
// uint8 with a ReLU and a zero point, within one code.
TEST(ThroughFloat32, Int8LinearMatchesTheIntegerSum) {
  const int64_t m = 7, n = 9, k = 600;
  std::vector<uint8_t> x(static_cast<size_t>(m * k));
  std::vector<int8_t> wt(static_cast<size_t>(n * k));
  std::vector<float> bias(static_cast<size_t>(n)), scales(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>((i * 97 + 13) % 256);
  for (size_t i = 0; i < wt.size(); ++i) wt[i] = static_cast<int8_t>(static_cast<int>((i * 61 + 7) % 256) - 128);
  for (int64_t o = 0; o < n; ++o) bias[o] = 0.25f * static_cast<float>(o) - 1.0f, scales[o] = 1e-4f * (o + 1);
  kernels::Int8LinearArgs a;
  a.m = m, a.n = n, a.k = k;
  a.e.src_zero_point = 3;
  a.e.out_scales = scales;
  a.e.bias = true;
  std::vector<float> packed(static_cast<size_t>(n * k));
  kernels::dnnl_detail::int8_widen_weight(wt.data(), n * k, packed.data());
  std::vector<float> y(static_cast<size_t>(m * n));
  kernels::dnnl_detail::int8_linear_through_float32(a, x.data(), packed.data(), bias.data(), y.data());
  std::vector<double> want(y.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t o = 0; o < n; ++o) {
      int64_t acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += (int64_t{x[i * k + p]} - 3) * wt[o * k + p];
      want[i * n + o] = static_cast<double>(scales[o]) * (static_cast<double>(acc) + bias[o]);
      EXPECT_NEAR(y[i * n + o], want[i * n + o], 1e-5 * (std::abs(want[i * n + o]) + 1)) << i << ", " << o;
    }
  a.e.u8_out = true, a.e.relu = true, a.e.dst_zero_point = 5;
  std::vector<uint8_t> q(y.size());
  kernels::dnnl_detail::int8_linear_through_float32(a, x.data(), packed.data(), bias.data(), q.data());
  for (size_t i = 0; i < q.size(); ++i) {
    const double r = std::clamp(std::nearbyint(std::max(want[i], 0.0)) + 5, 0.0, 255.0);
    EXPECT_LE(std::abs(q[i] - r), 1.0) << i;
  }
}

}  // namespace
