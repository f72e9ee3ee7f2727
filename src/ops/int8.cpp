// ops::Int8Conv2d / ops::Int8Linear (include/kiln/ops/int8.h): argument
// checks, the per-channel output scales and the bias folded for oneDNN, input
// quantization, packed-weight buffers per layout, and the calls into
// kernels/cpu/dnnl_int8.cpp.
#include "kiln/ops/int8.h"

#include <cmath>
#include <map>
#include <mutex>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/int8.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/memory_format.h"
#include "op_record.h"

namespace kiln::ops {
namespace {

class PackedBuffers {
 public:
  template <typename Pack>
  const void* get(uint64_t id, size_t bytes, Pack&& pack) {
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(id);
    if (it == buffers_.end()) {
      Tensor buf = empty({static_cast<int64_t>(bytes)}, TensorOptions(kUInt8));
      // The source is a frozen copy: packed once, it stays valid, so a capture does not record
      // the packing for every replay (the scope keeps it out of the record).
      const capture::KernelScope not_recorded("pack (frozen weight)");
      pack(buf.data_ptr());
      it = buffers_.emplace(id, buf).first;
    }
    return it->second.data_ptr();
  }

 private:
  std::mutex mu_;
  std::map<uint64_t, Tensor> buffers_;
};

Tensor frozen(const Tensor& t, DType dtype) {
  const NoGradGuard no_grad;
  return t.detach().to(dtype).contiguous().clone();
}

void check_int8_weight(const char* op, const Tensor& w, int64_t rank, const char* layout) {
  KILN_CHECK(
      w.defined() && w.dim() == rank && w.dtype() == kUInt8, ShapeError, op, ": expected a weight ", layout,
      " of int8 bytes (kUInt8), got ",
      w.defined() ? w.shape_string() + " " + std::string(dtype_name(w.dtype())) : std::string("an undefined tensor"));
}

// A linear's problem for `input` [..., k] against an int8 weight [n, k].
kernels::Int8LinearArgs linear_problem(const char* op, const Tensor& weight, const kernels::Int8Epilogue& e,
                                       const Tensor& input) {
  const int64_t n = weight.size(0), k = weight.size(1);
  KILN_CHECK(input.dim() >= 1 && input.size(-1) == k, ShapeError, op, ": expected an input [..., ", k, "], got ",
             input.shape_string());
  kernels::Int8LinearArgs a;
  a.m = k == 0 ? 0 : input.numel() / k;
  a.n = n;
  a.k = k;
  a.e = e;
  return a;
}

// The epilogue both layers share: out_scale[o] = sx · sw[o] (/ sy), and the
// bias divided by sx · sw[o], since oneDNN 2.6 adds an int8 primitive's bias
// to the int32 accumulator before the output scale.
void build_epilogue(const char* op, const Int8Quantization& q, const Tensor& w_scales, const Tensor& bias, int64_t out,
                    kernels::Int8Epilogue& e, Tensor& folded_bias) {
  KILN_CHECK(q.input_scale > 0 && std::isfinite(q.input_scale), ValueError, op,
             ": expected a positive finite input scale, got ", q.input_scale);
  KILN_CHECK(q.input_zero_point >= 0 && q.input_zero_point <= 255, ValueError, op,
             ": expected an input zero point in [0, 255] (uint8 activations), got ", q.input_zero_point);
  KILN_CHECK(q.output_scale >= 0 && std::isfinite(q.output_scale), ValueError, op,
             ": expected a non-negative output scale (0: float output), got ", q.output_scale);
  KILN_CHECK(q.output_zero_point >= 0 && q.output_zero_point <= 255, ValueError, op,
             ": expected an output zero point in [0, 255], got ", q.output_zero_point);
  KILN_CHECK(w_scales.defined() && w_scales.dim() == 1 && w_scales.size(0) == out, ShapeError, op,
             ": expected weight scales [", out, "], got ",
             w_scales.defined() ? w_scales.shape_string() : std::string("an undefined tensor"));
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out), ShapeError, op, ": expected a bias [", out,
             "], got ", bias.shape_string());
  const Tensor ws = frozen(w_scales, kFloat32);
  const float* sw = ws.data_ptr<float>();
  e.src_zero_point = static_cast<int32_t>(q.input_zero_point);
  e.relu = q.relu;
  e.u8_out = q.output_scale > 0;
  e.dst_zero_point = e.u8_out ? static_cast<int32_t>(q.output_zero_point) : 0;
  e.out_scales.resize(out);
  for (int64_t o = 0; o < out; ++o) {
    KILN_CHECK(sw[o] > 0 && std::isfinite(sw[o]), ValueError, op, ": expected positive weight scales, got ", sw[o],
               " for output channel ", o);
    e.out_scales[o] = q.input_scale * sw[o] / (e.u8_out ? q.output_scale : 1.0f);
  }
  e.bias = bias.defined();
  if (e.bias) {
    folded_bias = frozen(bias, kFloat32);
    float* b = folded_bias.data_ptr<float>();
    for (int64_t o = 0; o < out; ++o) b[o] /= q.input_scale * sw[o];
  }
}

void check_input(const Tensor& t, const char* op) {
  KILN_CHECK(t.defined(), ValueError, op, ": expected a defined input");
  KILN_CHECK(t.dtype() == kUInt8 || is_floating_point(t.dtype()), DTypeError, op,
             ": expected a float input (quantized here) or a uint8 one (already quantized), got ",
             dtype_name(t.dtype()));
  KILN_CHECK(!t.requires_grad(), ValueError, op,
             " is inference-only, but its input requires grad; run it under NoGradGuard / InferenceModeGuard");
}

// The input as uint8 in memory format f (float inputs quantized with the layer's parameters).
Tensor quantized_input(const Tensor& input, const Int8Quantization& q, MemoryFormat f) {
  if (input.dtype() == kUInt8) return is_contiguous(input, f) ? input : contiguous(input, f);
  const NoGradGuard no_grad;
  Tensor x = input.dtype() == kFloat32 ? input : input.to(kFloat32);
  if (f == MemoryFormat::ChannelsLast && x.dim() == 4 && !is_contiguous(x, f) && x.is_contiguous()) {
    Tensor out = empty(x.sizes(), TensorOptions(kUInt8), f);  // an NCHW image batch: one pass, no float copy
    kernels::quantize_u8_nchw_to_nhwc(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2) * x.size(3),
                                      1.0f / q.input_scale, static_cast<int32_t>(q.input_zero_point),
                                      out.data_ptr<uint8_t>());
    return out;
  }
  if (!is_contiguous(x, f)) x = contiguous(x, f);
  Tensor out = empty(x.sizes(), TensorOptions(kUInt8), f);
  kernels::quantize_u8(x.data_ptr<float>(), x.numel(), 1.0f / q.input_scale, static_cast<int32_t>(q.input_zero_point),
                       out.data_ptr<uint8_t>());
  return out;
}

}  // namespace

struct Int8Conv2d::State {
  Tensor weight, bias;  // weight: int8 bytes, OIHW; bias folded
  Int8Conv2dOptions options;
  kernels::Int8Epilogue epilogue;
  PackedBuffers packed;
};

Int8Conv2d::Int8Conv2d(const Tensor& weight_s8, const Tensor& weight_scales, const Tensor& bias,
                       Int8Conv2dOptions options)
    : state_(std::make_shared<State>()) {
  constexpr const char* op = "Int8Conv2d";
  check_int8_weight(op, weight_s8, 4, "[out, in / groups, kH, kW]");
  KILN_CHECK(options.groups >= 1 && weight_s8.size(0) % options.groups == 0, ShapeError, op,
             ": groups=", options.groups, " must divide the weight's ", weight_s8.size(0), " output channels");
  for (int d = 0; d < 2; ++d)
    KILN_CHECK(options.stride[d] >= 1 && options.dilation[d] >= 1 && options.padding[d] >= 0, ValueError, op,
               ": expected positive strides and dilations and non-negative padding");
  build_epilogue(op, options.q, weight_scales, bias, weight_s8.size(0), state_->epilogue, state_->bias);
  state_->weight = frozen(weight_s8, kUInt8);
  state_->options = options;
}

const Int8Conv2dOptions& Int8Conv2d::options() const { return state_->options; }

namespace {

kernels::Int8ConvArgs conv_args(const Int8Conv2d::State& s, const Tensor& input) {
  constexpr const char* op = "Int8Conv2d";
  const Tensor& w = s.weight;
  KILN_CHECK(input.dim() == 4 && input.size(1) == w.size(1) * s.options.groups, ShapeError, op,
             ": expected an input [N, ", w.size(1) * s.options.groups, ", H, W], got ", input.shape_string());
  kernels::Int8ConvArgs a;
  kernels::Conv2dParams& p = a.p;
  p.n = input.size(0);
  p.c = input.size(1);
  p.h = input.size(2);
  p.w = input.size(3);
  p.o = w.size(0);
  p.kh = w.size(2);
  p.kw = w.size(3);
  p.groups = s.options.groups;
  const int64_t in[2] = {p.h, p.w}, k[2] = {p.kh, p.kw};
  int64_t out[2];
  for (int d = 0; d < 2; ++d) {
    p.stride[d] = s.options.stride[d];
    p.dilation[d] = s.options.dilation[d];
    p.pad_l[d] = p.pad_r[d] = s.options.padding[d];
    const int64_t span = in[d] + 2 * p.pad_l[d] - p.dilation[d] * (k[d] - 1) - 1;
    KILN_CHECK(span >= 0, ShapeError, op, ": input ", input.shape_string(), " is smaller than the kernel");
    out[d] = span / p.stride[d] + 1;
  }
  p.oh = out[0];
  p.ow = out[1];
  p.input_nhwc = p.output_nhwc = true;
  a.e = s.epilogue;
  return a;
}

}  // namespace

Tensor Int8Conv2d::operator()(const Tensor& input) const { return (*this)(input, Tensor()); }

Tensor Int8Conv2d::operator()(const Tensor& input, const Tensor& residual) const {
  OpScope rs("int8_conv2d", {&input, residual.defined() ? &residual : nullptr});
  State& s = *state_;
  check_input(input, "Int8Conv2d");
  kernels::Int8ConvArgs a = conv_args(s, input);
  Tensor res;
  if (residual.defined()) {
    const kernels::Conv2dParams& q = a.p;
    KILN_CHECK(!a.e.u8_out, ValueError,
               "Int8Conv2d: a residual needs a float32 output; this layer requantizes to uint8");
    KILN_CHECK(residual.dtype() == kFloat32 && residual.sizes() == IntArrayRef({q.n, q.o, q.oh, q.ow}), ShapeError,
               "Int8Conv2d: expected a float32 residual [", q.n, ", ", q.o, ", ", q.oh, ", ", q.ow, "], got ",
               residual.shape_string(), " ", dtype_name(residual.dtype()));
    res = is_contiguous(residual, MemoryFormat::ChannelsLast) ? residual
                                                              : contiguous(residual, MemoryFormat::ChannelsLast);
    a.e.residual = true;
  }
  const kernels::Conv2dParams& p = a.p;
  Tensor y = empty({p.n, p.o, p.oh, p.ow}, TensorOptions(a.e.u8_out ? kUInt8 : kFloat32), MemoryFormat::ChannelsLast);
  if (p.n == 0) return y;
  const Tensor x = quantized_input(input, s.options.q, MemoryFormat::ChannelsLast);
  const kernels::FusedWeightLayout layout = kernels::int8_conv_weight_layout(a);
  const void* packed = s.packed.get(layout.id, layout.bytes,
                                    [&](void* buf) { kernels::int8_conv_pack_weight(a, s.weight.data_ptr(), buf); });
  if (rs.recording())
    rs.set_flops(2.0 * static_cast<double>(p.n * p.o * p.oh * p.ow) *
                 static_cast<double>(p.c / p.groups * p.kh * p.kw));
  kernels::int8_conv_forward(a, x.data_ptr(), packed, a.e.bias ? s.bias.data_ptr() : nullptr, y.data_ptr(),
                             res.defined() ? res.data_ptr() : nullptr);
  return y;
}

std::string Int8Conv2d::implementation(const Tensor& input) const {
  return kernels::int8_conv_impl(conv_args(*state_, input));
}

struct Int8Linear::State {
  Tensor weight, bias;
  Int8Quantization q;
  kernels::Int8Epilogue epilogue;
  PackedBuffers packed;
};

Int8Linear::Int8Linear(const Tensor& weight_s8, const Tensor& weight_scales, const Tensor& bias, Int8Quantization q)
    : state_(std::make_shared<State>()) {
  constexpr const char* op = "Int8Linear";
  check_int8_weight(op, weight_s8, 2, "[out, in]");
  build_epilogue(op, q, weight_scales, bias, weight_s8.size(0), state_->epilogue, state_->bias);
  state_->weight = frozen(weight_s8, kUInt8);
  state_->q = q;
}

const Int8Quantization& Int8Linear::quantization() const { return state_->q; }

namespace {

kernels::Int8LinearArgs linear_args(const Int8Linear::State& s, const Tensor& input) {
  return linear_problem("Int8Linear", s.weight, s.epilogue, input);
}

}  // namespace

Tensor Int8Linear::operator()(const Tensor& input) const {
  OpScope rs("int8_linear", {&input});
  State& s = *state_;
  check_input(input, "Int8Linear");
  const kernels::Int8LinearArgs a = linear_args(s, input);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = a.n;
  Tensor y = empty(out_shape, TensorOptions(a.e.u8_out ? kUInt8 : kFloat32));
  if (a.m == 0) return y;
  const Tensor x = quantized_input(input, s.q, MemoryFormat::Contiguous);
  const kernels::FusedWeightLayout layout = kernels::int8_linear_weight_layout(a);
  const void* packed = s.packed.get(layout.id, layout.bytes,
                                    [&](void* buf) { kernels::int8_linear_pack_weight(a, s.weight.data_ptr(), buf); });
  if (rs.recording())
    rs.set_flops(2.0 * static_cast<double>(a.m) * static_cast<double>(a.n) * static_cast<double>(a.k));
  kernels::int8_linear_forward(a, x.data_ptr(), packed, a.e.bias ? s.bias.data_ptr() : nullptr, y.data_ptr());
  return y;
}

std::string Int8Linear::implementation(const Tensor& input) const {
  return kernels::int8_linear_impl(linear_args(*state_, input));
}

struct Int8DynamicLinear::State {
  Tensor weight;
  kernels::Int8Epilogue epilogue;  // zero point 128, out_scales sw, float output, nothing else
  PackedBuffers packed;
};

Int8DynamicLinear::Int8DynamicLinear(const Tensor& weight_s8, const Tensor& weight_scales)
    : state_(std::make_shared<State>()) {
  constexpr const char* op = "Int8DynamicLinear";
  check_int8_weight(op, weight_s8, 2, "[out, in]");
  Tensor no_bias;
  build_epilogue(op, Int8Quantization{.input_scale = 1.0f, .input_zero_point = 128}, weight_scales, Tensor(),
                 weight_s8.size(0), state_->epilogue, no_bias);
  state_->weight = frozen(weight_s8, kUInt8);
}

namespace {

kernels::Int8LinearArgs dynamic_args(const Int8DynamicLinear::State& s, const Tensor& input) {
  return linear_problem("Int8DynamicLinear", s.weight, s.epilogue, input);
}

kernels::FusedActivation fused(Int8DynamicLinear::Activation act) {
  using A = Int8DynamicLinear::Activation;
  using F = kernels::FusedActivation;
  return act == A::Relu ? F::Relu : act == A::GeluTanh ? F::GeluTanh : act == A::GeluErf ? F::GeluErf : F::None;
}

}  // namespace

Tensor Int8DynamicLinear::operator()(const Tensor& input, const Tensor& bias, Activation act,
                                     const Tensor& residual) const {
  OpScope rs("int8_dynamic_linear",
             {&input, bias.defined() ? &bias : nullptr, residual.defined() ? &residual : nullptr});
  State& s = *state_;
  KILN_CHECK(input.defined() && input.dtype() == kFloat32, DTypeError,
             "Int8DynamicLinear: expected a float32 input, got ",
             input.defined() ? dtype_name(input.dtype()) : "an undefined tensor");
  const kernels::Int8LinearArgs a = dynamic_args(s, input);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = a.n;
  Tensor b, res;
  if (bias.defined()) {
    KILN_CHECK(bias.dim() == 1 && bias.size(0) == a.n && bias.dtype() == kFloat32, ShapeError,
               "Int8DynamicLinear: expected a float32 bias [", a.n, "], got ", bias.shape_string(), " ",
               dtype_name(bias.dtype()));
    b = bias.contiguous();
  }
  if (residual.defined()) {
    KILN_CHECK(residual.dtype() == kFloat32 && residual.sizes() == IntArrayRef(out_shape), ShapeError,
               "Int8DynamicLinear: expected a float32 residual ", shape_str(IntArrayRef(out_shape)), ", got ",
               residual.shape_string(), " ", dtype_name(residual.dtype()));
    res = residual.contiguous();
  }
  Tensor y = empty(out_shape, TensorOptions(kFloat32));
  if (a.m == 0 || a.n == 0) return y;
  const Tensor x = input.contiguous();
  Tensor xq = empty({a.m, a.k}, TensorOptions(kUInt8));
  Tensor row_scales = empty({a.m}, TensorOptions(kFloat32));
  kernels::quantize_rows_absmax_u8(x.data_ptr<float>(), a.m, a.k, xq.data_ptr<uint8_t>(), row_scales.data_ptr<float>());
  const float* rows = row_scales.data_ptr<float>();
  for (int64_t t = 0; t < a.m; ++t)
    KILN_CHECK(std::isfinite(rows[t]), ValueError, "Int8DynamicLinear: expected a finite input, got ", rows[t] * 127,
               " as the largest magnitude of row ", t);
  const kernels::FusedWeightLayout layout = kernels::int8_linear_weight_layout(a);
  const void* packed = s.packed.get(layout.id, layout.bytes,
                                    [&](void* buf) { kernels::int8_linear_pack_weight(a, s.weight.data_ptr(), buf); });
  if (rs.recording())
    rs.set_flops(2.0 * static_cast<double>(a.m) * static_cast<double>(a.n) * static_cast<double>(a.k));
  kernels::int8_linear_forward(a, xq.data_ptr(), packed, nullptr, y.data_ptr());
  kernels::int8_dynamic_epilogue(a.m, a.n, rows, b.defined() ? b.data_ptr<float>() : nullptr, fused(act),
                                 res.defined() ? res.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

std::string Int8DynamicLinear::implementation(const Tensor& input) const {
  return kernels::int8_linear_impl(dynamic_args(*state_, input));
}

bool int8_products_native() { return kernels::int8_products_native(); }

}  // namespace kiln::ops
