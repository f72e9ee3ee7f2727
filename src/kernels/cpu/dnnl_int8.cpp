// Int8 convolution and linear on oneDNN (Note [Int8 kernel arithmetic] in
// kiln/kernels/int8.h). One per-thread cache entry per problem and epilogue
// (Note [oneDNN primitive cache]): the primitive, the weight-packing reorder
// and the memory objects. The source zero point is a runtime argument (the
// form oneDNN 2.6's jit int8 convolutions take); the output scales are fixed
// at creation.
#include <cmath>
#include <cstring>

#include "dnnl_common.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/int8.h"

namespace kiln::kernels {

namespace {

using namespace dnnl_detail;
using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

constexpr auto kInt8Conv = static_cast<PrimKind>(201);
constexpr auto kInt8Linear = static_cast<PrimKind>(202);

FusedWeightLayout layout_of(const dnnl::memory::desc& md) { return {md.get_size(), desc_hash(md)}; }

void add_epilogue(Key& key, const Int8Epilogue& e) {
  key.add_all(e.src_zero_point, e.bias, e.residual, e.relu, e.u8_out, e.dst_zero_point, e.out_scales.size(),
              static_cast<int64_t>(fnv1a(e.out_scales.data(), e.out_scales.size() * sizeof(float)) >> 1),
              max_threads());
}

// The residual, when there is one, is post-op 0: a binary add of a float32
// tensor of the destination's shape and layout (residual_md).
dnnl::primitive_attr int8_attr(const Int8Epilogue& e, int scale_mask, const dnnl::memory::desc& residual_md) {
  dnnl::primitive_attr attr = default_attr();
  attr.set_output_scales(e.out_scales.size() == 1 ? 0 : scale_mask, e.out_scales);
  attr.set_zero_points(DNNL_ARG_SRC, 0, {DNNL_RUNTIME_S32_VAL});
  if (e.u8_out && e.dst_zero_point != 0) attr.set_zero_points(DNNL_ARG_DST, 0, {e.dst_zero_point});
  dnnl::post_ops po;
  if (e.residual) po.append_binary(dnnl::algorithm::binary_add, residual_md);
  if (e.relu) po.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
  if (po.len() > 0) attr.set_post_ops(po);
  return attr;
}

constexpr int kResidualArg = DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1;

// Note [Int8 sums without VNNI]
// Without VNNI (AVX2-only CPUs, AVX-512 before Cascade Lake) oneDNN's jit
// int8 kernels multiply u8 x s8 with vpmaddubsw, which adds each pair of
// products into a saturating int16: 255 * 127 * 2 overflows it, so an
// accumulator can be off by thousands, and a requantized output by several
// steps (seen: 3-4 on an AVX2 EPYC, against the integer reference). torch's
// fbgemm avoids it by quantizing activations to 7 bits (reduce_range), which
// would change every scale kiln computes; oneDNN's reference kernels are
// exact but ran gpt's dynamic int8 linears 800 times slower than float32.
// So there the weights are packed as float32 and the sums run as a float32
// product or convolution, exact for the integers involved
// (int8_through_float32.cpp): within 2x of the float32 model's time.

constexpr int kSrcZeroPointArg = DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC;

struct Entry {
  dnnl::primitive prim;
  dnnl::reorder pack;
  dnnl::memory src, wei_plain, wei_packed, bias, dst, scratch, zp, residual;
  size_t scratch_bytes = 0;
  FusedWeightLayout layout;
  std::string impl;
};

Entry* conv_entry(const Int8ConvArgs& a) {
  const Conv2dParams& p = a.p;
  Key key(kInt8Conv);
  key.add_all(p.n, p.c, p.h, p.w, p.o, p.kh, p.kw, p.groups, p.oh, p.ow, p.stride[0], p.stride[1], p.dilation[0],
              p.dilation[1], p.pad_l[0], p.pad_l[1], p.pad_r[0], p.pad_r[1]);
  add_epilogue(key, a.e);
  auto& c = thread_cache<Entry>();
  if (Entry* e = c.find(key)) return e;

  const dims src{p.n, p.c, p.h, p.w}, dst{p.n, p.o, p.oh, p.ow};
  const dims wei =
      p.groups > 1 ? dims{p.groups, p.o / p.groups, p.c / p.groups, p.kh, p.kw} : dims{p.o, p.c, p.kh, p.kw};
  const dims strides{p.stride[0], p.stride[1]}, dil{p.dilation[0] - 1, p.dilation[1] - 1};
  const dims pl{p.pad_l[0], p.pad_l[1]}, pr{p.pad_r[0], p.pad_r[1]};
  const dnnl::memory::desc src_md(src, dt::u8, tag::nhwc), dst_md(dst, a.e.u8_out ? dt::u8 : dt::f32, tag::nhwc);
  const dnnl::memory::desc res_md(dst, dt::f32, tag::nhwc);
  const dnnl::memory::desc wei_plain(wei, dt::s8, p.groups > 1 ? tag::goihw : tag::oihw),
      wei_any(wei, dt::s8, tag::any);
  const dnnl::memory::desc bias_md({p.o}, dt::f32, tag::x);
  auto e = std::make_unique<Entry>();
  try {
    constexpr auto kInfer = dnnl::prop_kind::forward_inference;
    constexpr auto kDirect = dnnl::algorithm::convolution_direct;
    const auto desc =
        a.e.bias
            ? dnnl::convolution_forward::desc(kInfer, kDirect, src_md, wei_any, bias_md, dst_md, strides, dil, pl, pr)
            : dnnl::convolution_forward::desc(kInfer, kDirect, src_md, wei_any, dst_md, strides, dil, pl, pr);
    const dnnl::convolution_forward::primitive_desc pd(desc, int8_attr(a.e, 1 << 1, res_md), engine());
    e->impl = pd.impl_info_str();
    e->prim = dnnl::convolution_forward(pd);
    note_created();
    e->layout = layout_of(pd.weights_desc());
    e->wei_plain = make_memory(wei_plain);
    e->wei_packed = make_memory(pd.weights_desc());
    e->pack = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), wei_plain, engine(), pd.weights_desc()));
    note_created();
    e->src = make_memory(pd.src_desc());
    e->dst = make_memory(pd.dst_desc());
    if (a.e.bias) e->bias = make_memory(bias_md);
    e->scratch = make_memory(pd.scratchpad_desc());
    e->scratch_bytes = pd.scratchpad_desc().get_size();
    e->zp = make_memory(dnnl::memory::desc({1}, dt::s32, tag::x));
    if (a.e.residual) e->residual = make_memory(res_md);
  } catch (const dnnl::error& err) {
    rethrow(err, "int8 conv2d");
  }
  return c.insert(key, std::move(e));
}

Entry* linear_entry(const Int8LinearArgs& a) {
  Key key(kInt8Linear);
  key.add_all(a.m, a.n, a.k);
  add_epilogue(key, a.e);
  auto& c = thread_cache<Entry>();
  if (Entry* e = c.find(key)) return e;

  const dnnl::memory::desc src_md({a.m, a.k}, dt::u8, dims{a.k, 1});
  const dnnl::memory::desc dst_md({a.m, a.n}, a.e.u8_out ? dt::u8 : dt::f32, dims{a.n, 1});
  const dnnl::memory::desc res_md({a.m, a.n}, dt::f32, dims{a.n, 1});
  const dnnl::memory::desc wei_plain({a.k, a.n}, dt::s8, dims{1, a.k}), wei_any({a.k, a.n}, dt::s8, tag::any);
  const dnnl::memory::desc bias_md({1, a.n}, dt::f32, dims{a.n, 1});
  auto e = std::make_unique<Entry>();
  try {
    const auto desc =
        a.e.bias ? dnnl::matmul::desc(src_md, wei_any, bias_md, dst_md) : dnnl::matmul::desc(src_md, wei_any, dst_md);
    const dnnl::matmul::primitive_desc pd(desc, int8_attr(a.e, 1 << 1, res_md), engine());
    e->impl = pd.impl_info_str();
    e->prim = dnnl::matmul(pd);
    note_created();
    e->layout = layout_of(pd.weights_desc());
    e->wei_plain = make_memory(wei_plain);
    e->wei_packed = make_memory(pd.weights_desc());
    e->pack = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), wei_plain, engine(), pd.weights_desc()));
    note_created();
    e->src = make_memory(src_md);
    e->dst = make_memory(dst_md);
    if (a.e.bias) e->bias = make_memory(bias_md);
    e->scratch = make_memory(pd.scratchpad_desc());
    e->scratch_bytes = pd.scratchpad_desc().get_size();
    e->zp = make_memory(dnnl::memory::desc({1}, dt::s32, tag::x));
    if (a.e.residual) e->residual = make_memory(res_md);
  } catch (const dnnl::error& err) {
    rethrow(err, "int8 linear");
  }
  return c.insert(key, std::move(e));
}

void run(Entry* e, const Int8Epilogue& ep, const void* src, const void* packed, const void* bias, void* dst,
         const void* residual = nullptr) {
  ScratchBlock block(e->scratch_bytes);
  const int32_t zp = ep.src_zero_point;
  const Arg a_src{DNNL_ARG_SRC, &e->src, src}, a_wei{DNNL_ARG_WEIGHTS, &e->wei_packed, packed},
      a_dst{DNNL_ARG_DST, &e->dst, dst}, a_scr{DNNL_ARG_SCRATCHPAD, &e->scratch, block.data()},
      a_bias{DNNL_ARG_BIAS, &e->bias, bias}, a_zp{kSrcZeroPointArg, &e->zp, &zp},
      a_res{kResidualArg, &e->residual, residual};
  if (ep.bias && ep.residual)
    execute(e->prim, {a_src, a_wei, a_bias, a_dst, a_scr, a_zp, a_res});
  else if (ep.bias)
    execute(e->prim, {a_src, a_wei, a_bias, a_dst, a_scr, a_zp});
  else if (ep.residual)
    execute(e->prim, {a_src, a_wei, a_dst, a_scr, a_zp, a_res});
  else
    execute(e->prim, {a_src, a_wei, a_dst, a_scr, a_zp});
}

bool serial(const Int8ConvArgs& a) {
  const Conv2dParams& p = a.p;
  return p.n * p.o * p.oh * p.ow * (p.c / p.groups) * p.kh * p.kw < kSerialMacs;
}
bool serial(const Int8LinearArgs& a) { return a.m * a.n * a.k < kSerialMacs; }

constexpr uint64_t kFloat32WeightsId = 0x6b696c6e66333277;  // the layout id of float32-packed weights
constexpr const char* kFloat32Impl = "kiln float32 sums (no VNNI)";

int64_t weight_count(const Int8ConvArgs& a) { return a.p.o * (a.p.c / a.p.groups) * a.p.kh * a.p.kw; }

}  // namespace

FusedWeightLayout int8_conv_weight_layout(const Int8ConvArgs& a) {
  if (!int8_jit_is_exact()) return {static_cast<size_t>(weight_count(a)) * 4, kFloat32WeightsId};
  const SerialScope scope(serial(a));
  return conv_entry(a)->layout;
}

void int8_conv_pack_weight(const Int8ConvArgs& a, const void* weight, void* packed) {
  KILN_CAPTURE_KERNEL("int8_conv_pack_weight", int8_conv_pack_weight(a, weight, packed));
  if (!int8_jit_is_exact()) return int8_widen_weight(weight, weight_count(a), static_cast<float*>(packed));
  const SerialScope scope(serial(a));
  Entry* e = conv_entry(a);
  execute(e->pack, {{DNNL_ARG_FROM, &e->wei_plain, weight}, {DNNL_ARG_TO, &e->wei_packed, packed}});
}

void int8_conv_forward(const Int8ConvArgs& a, const void* input, const void* packed, const void* bias, void* output,
                       const void* residual) {
  KILN_CAPTURE_KERNEL("int8_conv_forward", int8_conv_forward(a, input, packed, bias, output, residual));
  if (!int8_jit_is_exact())
    return int8_conv_through_float32(a, input, static_cast<const float*>(packed), bias, output, residual);
  const SerialScope scope(serial(a));
  run(conv_entry(a), a.e, input, packed, bias, output, residual);
}

const char* int8_conv_impl(const Int8ConvArgs& a) {
  if (!int8_jit_is_exact()) return kFloat32Impl;
  const SerialScope scope(serial(a));
  return conv_entry(a)->impl.c_str();
}

FusedWeightLayout int8_linear_weight_layout(const Int8LinearArgs& a) {
  if (!int8_jit_is_exact()) return {static_cast<size_t>(a.n * a.k) * 4, kFloat32WeightsId};
  const SerialScope scope(serial(a));
  return linear_entry(a)->layout;
}

void int8_linear_pack_weight(const Int8LinearArgs& a, const void* weight, void* packed) {
  KILN_CAPTURE_KERNEL("int8_linear_pack_weight", int8_linear_pack_weight(a, weight, packed));
  if (!int8_jit_is_exact()) return int8_widen_weight(weight, a.n * a.k, static_cast<float*>(packed));
  const SerialScope scope(serial(a));
  Entry* e = linear_entry(a);
  execute(e->pack, {{DNNL_ARG_FROM, &e->wei_plain, weight}, {DNNL_ARG_TO, &e->wei_packed, packed}});
}

void int8_linear_forward(const Int8LinearArgs& a, const void* x, const void* packed, const void* bias, void* y) {
  KILN_CAPTURE_KERNEL("int8_linear_forward", int8_linear_forward(a, x, packed, bias, y));
  if (!int8_jit_is_exact()) return int8_linear_through_float32(a, x, static_cast<const float*>(packed), bias, y);
  const SerialScope scope(serial(a));
  run(linear_entry(a), a.e, x, packed, bias, y);
}

const char* int8_linear_impl(const Int8LinearArgs& a) {
  if (!int8_jit_is_exact()) return kFloat32Impl;
  const SerialScope scope(serial(a));
  return linear_entry(a)->impl.c_str();
}

// Round half to even by the float trick: once |v| < 2^22, (v + 1.5 · 2^23) -
// 1.5 · 2^23 is v rounded in the default rounding mode, and it vectorises
// where std::nearbyint does not (measured: 0.64 ms scalar for the cnn's
// conv2 input at batch 64). v is clamped first to the range that can reach
// [0, 255] after the zero point, which also keeps it small; NaN becomes 0.
inline uint8_t quantize_one(float x, float inv_scale, float zp, float lo, float hi) {
  constexpr float kMagic = 12582912.0f;
  float v = x * inv_scale;
  v = v >= lo ? (v <= hi ? v : hi) : lo;  // NaN to lo
  float q = (v + kMagic) - kMagic + zp;
  q = q >= 0.0f ? (q <= 255.0f ? q : 255.0f) : 0.0f;
  return static_cast<uint8_t>(static_cast<int32_t>(q));
}

void quantize_u8(const float* x, int64_t n, float inv_scale, int32_t zero_point, uint8_t* out) {
  KILN_CAPTURE_KERNEL("quantize_u8", quantize_u8(x, n, inv_scale, zero_point, out));
  const auto zp = static_cast<float>(zero_point);
  const float lo = -zp - 1.0f, hi = 256.0f - zp;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = quantize_one(x[i], inv_scale, zp, lo, hi);
}

void quantize_u8_nchw_to_nhwc(const float* x, int64_t n, int64_t c, int64_t hw, float inv_scale, int32_t zero_point,
                              uint8_t* out) {
  KILN_CAPTURE_KERNEL("quantize_u8_nchw_to_nhwc", quantize_u8_nchw_to_nhwc(x, n, c, hw, inv_scale, zero_point, out));
  const auto zp = static_cast<float>(zero_point);
  const float lo = -zp - 1.0f, hi = 256.0f - zp;
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch) {
      const float* src = x + (b * c + ch) * hw;
      uint8_t* dst = out + b * c * hw + ch;
#pragma omp simd
      for (int64_t i = 0; i < hw; ++i) dst[i * c] = quantize_one(src[i], inv_scale, zp, lo, hi);
    }
}

}  // namespace kiln::kernels
