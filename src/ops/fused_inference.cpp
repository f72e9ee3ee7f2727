// ops::PackedConv2d / ops::PackedLinear (include/kiln/ops/fused_inference.h):
// argument checks, the packed-weight buffers per oneDNN layout, and the call
// into kernels/cpu/dnnl_fused_inference.cpp.
#include "kiln/ops/fused_inference.h"

#include <map>
#include <mutex>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/fused_inference.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/memory_format.h"
#include "op_record.h"

namespace kiln::ops {
namespace {

kernels::FusedActivation to_kernel(InferenceActivation a) {
  switch (a) {
    case InferenceActivation::Relu: return kernels::FusedActivation::Relu;
    case InferenceActivation::GeluErf: return kernels::FusedActivation::GeluErf;
    case InferenceActivation::GeluTanh: return kernels::FusedActivation::GeluTanh;
    case InferenceActivation::None: break;
  }
  return kernels::FusedActivation::None;
}

void check_inference_input(const Tensor& t, const char* op, const char* what) {
  KILN_CHECK(t.defined(), ValueError, op, ": expected a defined ", what);
  KILN_CHECK(t.dtype() == kFloat32, DTypeError, op, ": expected a float32 ", what, ", got ", dtype_name(t.dtype()));
  KILN_CHECK(!t.requires_grad(), ValueError, op, " is inference-only (it records no backward), but its ", what,
             " requires grad; run it on detached tensors or under NoGradGuard / InferenceModeGuard");
}

// A frozen float32 copy of a parameter: the packed objects own what they read.
Tensor frozen(const Tensor& t) {
  const NoGradGuard no_grad;
  return t.detach().contiguous().clone();
}

// Packed weights per oneDNN layout id: a layout may differ between problem
// shapes, and each is packed once, the first time a shape asks for it.
class PackedBuffers {
 public:
  template <typename Pack>
  const void* get(uint64_t id, size_t bytes, Pack&& pack) {
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(id);
    if (it == buffers_.end()) {
      Tensor buf = empty({static_cast<int64_t>((bytes + 3) / 4)}, TensorOptions(kFloat32));
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

}  // namespace

const char* activation_name(InferenceActivation a) {
  switch (a) {
    case InferenceActivation::Relu: return "relu";
    case InferenceActivation::GeluErf: return "gelu";
    case InferenceActivation::GeluTanh: return "gelu_tanh";
    case InferenceActivation::None: break;
  }
  return "none";
}

struct PackedConv2d::State {
  Tensor weight, bias;
  PackedConv2dOptions options;
  PackedBuffers packed;
};

PackedConv2d::PackedConv2d(const Tensor& weight, const Tensor& bias, PackedConv2dOptions options)
    : state_(std::make_shared<State>()) {
  constexpr const char* op = "PackedConv2d";
  KILN_CHECK(weight.defined() && weight.dim() == 4, ShapeError, op,
             ": expected a weight [out_channels, in_channels / groups, kH, kW], got ",
             weight.defined() ? weight.shape_string() : std::string("an undefined tensor"));
  KILN_CHECK(weight.dtype() == kFloat32, DTypeError, op, ": expected a float32 weight, got ",
             dtype_name(weight.dtype()));
  KILN_CHECK(options.groups >= 1 && weight.size(0) % options.groups == 0, ShapeError, op, ": groups=", options.groups,
             " must divide the weight's ", weight.size(0), " output channels");
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0) && bias.dtype() == kFloat32),
             ShapeError, op, ": expected a float32 bias [", weight.size(0), "], got ", bias.shape_string());
  for (int d = 0; d < 2; ++d) {
    if (options.padding_end[d] < 0) options.padding_end[d] = options.padding[d];
    KILN_CHECK(options.stride[d] >= 1 && options.dilation[d] >= 1 && options.padding[d] >= 0, ValueError, op,
               ": expected positive strides and dilations and non-negative padding");
  }
  state_->weight = frozen(weight);
  if (bias.defined()) state_->bias = frozen(bias);
  state_->options = options;
}

const PackedConv2dOptions& PackedConv2d::options() const { return state_->options; }

Tensor PackedConv2d::operator()(const Tensor& input, const Tensor& residual) const {
  constexpr const char* op = "PackedConv2d";
  OpScope rs("packed_conv2d", {&input, &residual});
  State& s = *state_;
  check_inference_input(input, op, "input");
  const Tensor& w = s.weight;
  KILN_CHECK(input.dim() == 4 && input.size(1) == w.size(1) * s.options.groups, ShapeError, op,
             ": expected an input [N, ", w.size(1) * s.options.groups, ", H, W], got ", input.shape_string());
  kernels::FusedConvArgs a;
  kernels::Conv2dParams& p = a.p;
  p.dtype = kFloat32;
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
    p.pad_l[d] = s.options.padding[d];
    p.pad_r[d] = s.options.padding_end[d];
    const int64_t span = in[d] + p.pad_l[d] + p.pad_r[d] - p.dilation[d] * (k[d] - 1) - 1;
    KILN_CHECK(span >= 0, ShapeError, op, ": input ", input.shape_string(), " is smaller than the kernel");
    out[d] = span / p.stride[d] + 1;
  }
  p.oh = out[0];
  p.ow = out[1];
  const bool nhwc = !is_contiguous(input, MemoryFormat::Contiguous) && is_contiguous(input, MemoryFormat::ChannelsLast);
  const Tensor x = nhwc || input.is_contiguous() ? input : input.contiguous();
  p.input_nhwc = nhwc;
  p.output_nhwc = true;
  a.bias = s.bias.defined();
  a.act = to_kernel(s.options.activation);
  Tensor res;
  if (residual.defined()) {
    check_inference_input(residual, op, "residual");
    KILN_CHECK(residual.dim() == 4 && residual.size(0) == p.n && residual.size(1) == p.o && residual.size(2) == p.oh &&
                   residual.size(3) == p.ow,
               ShapeError, op, ": expected a residual of the output's shape [", p.n, ", ", p.o, ", ", p.oh, ", ", p.ow,
               "], got ", residual.shape_string());
    res = contiguous(residual, MemoryFormat::ChannelsLast);
    a.residual = true;
  }
  Tensor y = empty({p.n, p.o, p.oh, p.ow}, TensorOptions(kFloat32), MemoryFormat::ChannelsLast);
  if (p.n == 0) return y;
  const kernels::FusedWeightLayout layout = kernels::fused_conv_weight_layout(a);
  const void* packed =
      s.packed.get(layout.id, layout.bytes, [&](void* buf) { kernels::fused_conv_pack_weight(a, w.data_ptr(), buf); });
  if (rs.recording())
    rs.set_flops(2.0 * static_cast<double>(p.n * p.o * p.oh * p.ow) *
                 static_cast<double>(p.c / p.groups * p.kh * p.kw));
  kernels::fused_conv_forward(a, x.data_ptr(), packed, a.bias ? s.bias.data_ptr() : nullptr,
                              a.residual ? res.data_ptr() : nullptr, y.data_ptr());
  return y;
}

struct PackedLinear::State {
  Tensor weight, bias;
  InferenceActivation activation = InferenceActivation::None;
  PackedBuffers packed;
};

PackedLinear::PackedLinear(const Tensor& weight, const Tensor& bias, InferenceActivation activation)
    : state_(std::make_shared<State>()) {
  constexpr const char* op = "PackedLinear";
  KILN_CHECK(weight.defined() && weight.dim() == 2, ShapeError, op, ": expected a weight [out, in], got ",
             weight.defined() ? weight.shape_string() : std::string("an undefined tensor"));
  KILN_CHECK(weight.dtype() == kFloat32, DTypeError, op, ": expected a float32 weight, got ",
             dtype_name(weight.dtype()));
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0) && bias.dtype() == kFloat32),
             ShapeError, op, ": expected a float32 bias [", weight.size(0), "], got ", bias.shape_string());
  state_->weight = frozen(weight);
  if (bias.defined()) state_->bias = frozen(bias);
  state_->activation = activation;
}

InferenceActivation PackedLinear::activation() const { return state_->activation; }

Tensor PackedLinear::operator()(const Tensor& input, const Tensor& residual) const {
  constexpr const char* op = "PackedLinear";
  OpScope rs("packed_linear", {&input, &residual});
  State& s = *state_;
  check_inference_input(input, op, "input");
  const int64_t n = s.weight.size(0), k = s.weight.size(1);
  KILN_CHECK(input.dim() >= 1 && input.size(-1) == k, ShapeError, op, ": expected an input [..., ", k, "], got ",
             input.shape_string());
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = n;
  const Tensor x = input.contiguous();
  kernels::FusedLinearArgs a;
  a.m = k == 0 ? 0 : x.numel() / k;
  a.n = n;
  a.k = k;
  a.bias = s.bias.defined();
  a.act = to_kernel(s.activation);
  Tensor res;
  if (residual.defined()) {
    check_inference_input(residual, op, "residual");
    KILN_CHECK(residual.sizes() == IntArrayRef(out_shape), ShapeError, op,
               ": expected a residual of the output's shape, got ", residual.shape_string());
    res = residual.contiguous();
    a.residual = true;
  }
  Tensor y = empty(out_shape, TensorOptions(kFloat32));
  if (a.m == 0 || n == 0) return y;
  KILN_CHECK(k > 0, ShapeError, op, ": expected in_features > 0");
  const kernels::FusedWeightLayout layout = kernels::fused_linear_weight_layout(a);
  const void* packed = s.packed.get(layout.id, layout.bytes,
                                    [&](void* buf) { kernels::fused_linear_pack_weight(a, s.weight.data_ptr(), buf); });
  if (rs.recording())
    rs.set_flops(2.0 * static_cast<double>(a.m) * static_cast<double>(a.n) * static_cast<double>(a.k));
  kernels::fused_linear_forward(a, x.data_ptr(), packed, a.bias ? s.bias.data_ptr() : nullptr,
                                a.residual ? res.data_ptr() : nullptr, y.data_ptr());
  return y;
}

}  // namespace kiln::ops
