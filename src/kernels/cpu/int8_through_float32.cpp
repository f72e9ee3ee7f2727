// Int8 convolution and linear on a CPU without VNNI (Note [Int8 sums without
// VNNI] in dnnl_int8.cpp): the integer operands widened to float32, the
// float32 product or convolution, then the epilogue of Note [Int8 kernel
// arithmetic] (kiln/kernels/int8.h) in one pass over the sums.
//
// Each product of a (u8 - zero point) and an s8 is an integer of at most
// 255 * 128 in magnitude, exact in float32, and so is every partial sum below
// 2^24: a sum of up to 514 terms is the int32 accumulator exactly, a longer
// one within float32 rounding of it (a relative 6e-8, far below a
// requantization step). oneDNN's reference int8 kernels are exact too, but
// ran gpt's dynamic int8 linears 800 times slower than float32 here.
#include <cmath>

#include "dnnl_common.h"
#include "kiln/core/parallel.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kernels/int8.h"

namespace kiln::kernels::dnnl_detail {

namespace {

constexpr int64_t kGrain = 16384;  // elements per thread at least

void widen_u8(const uint8_t* x, int64_t n, int32_t zero_point, float* out) {
  const auto zp = static_cast<float>(zero_point);
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = static_cast<float>(x[i]) - zp;
  });
}

// y = act(scale[o] * (acc + bias[o]) + residual), then float32 out or
// clamp(round(y) + zy, 0, 255) (the scales already divided by sy). acc is
// [rows, o] with the channel innermost (NHWC, or a linear's rows).
void epilogue(const Int8Epilogue& e, const float* acc, int64_t rows, int64_t o, const float* bias,
              const float* residual, void* out) {
  const bool per_channel = e.out_scales.size() > 1;
  parallel_for(rows * o, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = i % o;
      float v = e.out_scales[per_channel ? static_cast<size_t>(c) : 0] * (acc[i] + (bias ? bias[c] : 0.0f));
      if (residual) v += residual[i];
      if (e.relu) v = v > 0.0f ? v : 0.0f;
      if (!e.u8_out) {
        static_cast<float*>(out)[i] = v;
        continue;
      }
      float q = std::nearbyint(v) + static_cast<float>(e.dst_zero_point);
      q = q >= 0.0f ? (q <= 255.0f ? q : 255.0f) : 0.0f;  // NaN to 0
      static_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(q);
    }
  });
}

}  // namespace

bool int8_jit_is_exact() {
  static const bool vnni = isa_has(dnnl_cpu_isa_avx512_core_vnni) || isa_has(dnnl_cpu_isa_avx2_vnni);
  return vnni;
}

void int8_widen_weight(const void* weight, int64_t n, float* out) {
  const auto* w = static_cast<const int8_t*>(weight);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(w[i]);
}

void int8_linear_through_float32(const Int8LinearArgs& a, const void* x, const float* w, const void* bias, void* y) {
  ScratchBlock block(align64(static_cast<size_t>(a.m * a.k) * 4) + static_cast<size_t>(a.m * a.n) * 4);
  auto* xf = reinterpret_cast<float*>(block.data());
  auto* acc = reinterpret_cast<float*>(block.data() + align64(static_cast<size_t>(a.m * a.k) * 4));
  widen_u8(static_cast<const uint8_t*>(x), a.m * a.k, a.e.src_zero_point, xf);
  MatmulArgs g;
  g.m = a.m, g.n = a.n, g.k = a.k;
  g.a = MatrixOperand{xf, {0, a.k, 1}, 0};
  g.b = MatrixOperand{w, {0, 1, a.k}, 0};  // W [n, k] read as Wᵀ
  g.c = acc;
  matmul(g);
  epilogue(a.e, acc, a.m, a.n, a.e.bias ? static_cast<const float*>(bias) : nullptr, nullptr, y);
}

void int8_conv_through_float32(const Int8ConvArgs& a, const void* input, const float* w, const void* bias, void* output,
                               const void* residual) {
  const Conv2dParams& p = a.p;
  const int64_t in_n = p.n * p.c * p.h * p.w, out_n = p.n * p.o * p.oh * p.ow;
  ScratchBlock block(align64(static_cast<size_t>(in_n) * 4) + static_cast<size_t>(out_n) * 4);
  auto* xf = reinterpret_cast<float*>(block.data());
  auto* acc = reinterpret_cast<float*>(block.data() + align64(static_cast<size_t>(in_n) * 4));
  // x - zx: padding then reads 0, the real zero, as oneDNN's source zero point does.
  widen_u8(static_cast<const uint8_t*>(input), in_n, a.e.src_zero_point, xf);
  Conv2dParams q = p;
  q.dtype = kFloat32;
  q.input_nhwc = q.output_nhwc = true;
  conv2d_forward(q, xf, w, nullptr, acc);
  epilogue(a.e, acc, out_n / p.o, p.o, a.e.bias ? static_cast<const float*>(bias) : nullptr,
           a.e.residual ? static_cast<const float*>(residual) : nullptr, output);
}

}  // namespace kiln::kernels::dnnl_detail

namespace kiln::kernels {

bool int8_products_native() { return dnnl_detail::int8_jit_is_exact(); }

}  // namespace kiln::kernels
