// conv2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d: argument parsing and
// shape and dtype checks, into the kernel parameter structs; conv_grad.cpp
// and pool_grad.cpp run the kernels (oneDNN, BLAS, own loops) and record the
// backward nodes (conv_pool_internal.h).
#include "kiln/ops/conv.h"

#include "conv_pool_internal.h"
#include "iter.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/ops/autocast.h"
#include "op_record.h"

namespace kiln {

namespace {

// A size argument as two values: one int means both dims.
struct Pair {
  int64_t v[2];
  int64_t operator[](int i) const { return v[i]; }
};

Pair pair_arg(IntArrayRef a, const char* op, const char* name) {
  KILN_CHECK(a.size() == 1 || a.size() == 2, ValueError, op, ": expected ", name, " to be a single int or 2 ints, got ",
             a);
  return a.size() == 1 ? Pair{{a[0], a[0]}} : Pair{{a[0], a[1]}};
}

std::string pair_str(Pair p) { return detail::concat(p[0], " x ", p[1]); }

void check_input_4d(const Tensor& input, const char* op) {
  ops::check_defined(input, op, "input");
  KILN_CHECK(input.dim() == 3 || input.dim() == 4, ShapeError, op,
             ": expected a 3-D [C, H, W] (unbatched) or 4-D [N, C, H, W] input, got shape ", input.sizes());
}

// ---- conv2d ----

Tensor conv2d_impl(const Tensor& input, const Tensor& weight, const Tensor& bias, Pair stride, Pair pad_l, Pair pad_r,
                   Pair dilation, int64_t groups, autograd::CallSite site) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::conv2d,
        [&](const Tensor& x, const Tensor& w, const Tensor& b) {
          return conv2d_impl(x, w, b, stride, pad_l, pad_r, dilation, groups, site);
        },
        input, weight, bias);
  constexpr const char* op = "conv2d";
  ops::OpScope rs("conv2d", {&input, &weight, &bias});
  check_input_4d(input, op);
  ops::check_defined(weight, op, "weight");
  KILN_CHECK(weight.dim() == 4, ShapeError, op,
             ": expected weight of shape [out_channels, in_channels / groups, kH, kW] (4-D), got ", weight.sizes());
  KILN_CHECK(input.dtype() == weight.dtype(), DTypeError, op,
             ": expected input and weight to have the same dtype, got ", dtype_name(input.dtype()), " and ",
             dtype_name(weight.dtype()), " (convert one with .to(dtype))");
  KILN_CHECK(!bias.defined() || bias.dtype() == input.dtype(), DTypeError, op,
             ": expected bias to have the input's dtype ", dtype_name(input.dtype()), ", got ",
             dtype_name(bias.dtype()));
  KILN_CHECK(input.dtype() != kBool, DTypeError, op, ": bool tensors are not supported; convert to a floating dtype");
  KILN_CHECK(groups >= 1, ValueError, op, ": groups must be positive, got ", groups);
  for (int d = 0; d < 2; ++d) {
    KILN_CHECK(stride[d] >= 1, ValueError, op, ": stride must be positive, got ", pair_str(stride));
    KILN_CHECK(dilation[d] >= 1, ValueError, op, ": dilation must be positive, got ", pair_str(dilation));
    KILN_CHECK(pad_l[d] >= 0 && pad_r[d] >= 0, ValueError, op, ": padding must be non-negative, got ", pair_str(pad_l));
  }
  const int64_t o = weight.size(0), c = input.size(-3);
  KILN_CHECK(o % groups == 0, ShapeError, op, ": groups=", groups, " must divide out_channels, but weight of shape ",
             weight.sizes(), " has ", o, " out_channels");
  KILN_CHECK(c == weight.size(1) * groups, ShapeError, op, ": with groups=", groups, ", weight of shape ",
             weight.sizes(), " (expected [out_channels, in_channels / groups, kH, kW]) expects input with ",
             weight.size(1) * groups, " channels, but input of shape ", input.sizes(), " has ", c);
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == o), ShapeError, op, ": expected bias of shape [", o,
             "] (one per out channel of weight ", weight.sizes(), "), got ", bias.sizes());
  kernels::Conv2dParams p;
  p.dtype = ops::conv_detail::kernel_dtype(input.dtype());
  p.n = input.dim() == 4 ? input.size(0) : 1;
  p.c = c;
  p.h = input.size(-2);
  p.w = input.size(-1);
  p.o = o;
  p.kh = weight.size(2);
  p.kw = weight.size(3);
  p.groups = groups;
  const int64_t k[2] = {p.kh, p.kw}, in[2] = {p.h, p.w};
  int64_t out[2], padded[2], span[2];
  for (int d = 0; d < 2; ++d) {
    p.stride[d] = stride[d];
    p.dilation[d] = dilation[d];
    p.pad_l[d] = pad_l[d];
    p.pad_r[d] = pad_r[d];
    padded[d] = in[d] + pad_l[d] + pad_r[d];
    span[d] = dilation[d] * (k[d] - 1) + 1;
    const int64_t num = padded[d] - span[d];  // floor division: a negative numerator means no output
    out[d] = (num >= 0 ? num / stride[d] : -((-num + stride[d] - 1) / stride[d])) + 1;
  }
  KILN_CHECK(out[0] >= 1 && out[1] >= 1, ShapeError, op, ": input of shape ", input.sizes(), " padded to ", padded[0],
             " x ", padded[1], " is smaller than the kernel ", p.kh, " x ", p.kw, " (", span[0], " x ", span[1],
             " with dilation ", pair_str(dilation), "): computed output size ", std::max<int64_t>(out[0], 0), " x ",
             std::max<int64_t>(out[1], 0), "; use a smaller kernel or more padding");
  p.oh = out[0];
  p.ow = out[1];
  Tensor result = ops::conv_detail::conv2d(input, weight, bias, p, site);
  if (rs.recording()) rs.set_flops(ops::conv_flops(result, weight));
  return result;
}

// ---- pooling ----

struct PoolArgs {
  Pair kernel, stride, pad, dilation;
};

PoolArgs pool_args(const char* op, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                   IntArrayRef dilation) {
  PoolArgs a;
  a.kernel = pair_arg(kernel_size, op, "kernel_size");
  a.stride = stride.empty() ? a.kernel : pair_arg(stride, op, "stride");
  a.pad = pair_arg(padding, op, "padding");
  a.dilation = pair_arg(dilation, op, "dilation");
  for (int d = 0; d < 2; ++d) {
    KILN_CHECK(a.kernel[d] >= 1, ValueError, op, ": kernel_size must be positive, got ", pair_str(a.kernel));
    KILN_CHECK(a.stride[d] >= 1, ValueError, op, ": stride must be positive, got ", pair_str(a.stride));
    KILN_CHECK(a.dilation[d] >= 1, ValueError, op, ": dilation must be positive, got ", pair_str(a.dilation));
    KILN_CHECK(a.pad[d] >= 0 && a.pad[d] <= a.kernel[d] / 2, ValueError, op,
               ": padding must be at most half the kernel size, got padding ", pair_str(a.pad), " for kernel ",
               pair_str(a.kernel));
  }
  return a;
}

// torch's pooling_output_shape: floor or ceil, and a ceil_mode window must
// start inside the input or its left padding.
int64_t pool_out_size(int64_t in, int64_t k, int64_t s, int64_t pad, int64_t d, bool ceil_mode) {
  const int64_t num = in + 2 * pad - d * (k - 1) - 1 + (ceil_mode ? s - 1 : 0);
  int64_t out = (num >= 0 ? num / s : -((-num + s - 1) / s)) + 1;
  if (ceil_mode && (out - 1) * s >= in + pad) --out;
  return out;
}

kernels::Pool2dParams pool_params(const char* op, const Tensor& input, const PoolArgs& a, bool ceil_mode,
                                  kernels::PoolKind kind) {
  check_input_4d(input, op);
  KILN_CHECK(input.size(-3) > 0 && input.size(-2) > 0 && input.size(-1) > 0, ShapeError, op,
             ": expected non-empty channel and spatial dims (only the batch may be empty), got shape ", input.sizes());
  kernels::Pool2dParams p;
  p.dtype = ops::conv_detail::kernel_dtype(input.dtype());
  p.kind = kind;
  p.n = input.dim() == 4 ? input.size(0) : 1;
  p.c = input.size(-3);
  p.h = input.size(-2);
  p.w = input.size(-1);
  for (int d = 0; d < 2; ++d) {
    p.kernel[d] = a.kernel[d];
    p.stride[d] = a.stride[d];
    p.pad[d] = a.pad[d];
    p.dilation[d] = a.dilation[d];
  }
  p.oh = pool_out_size(p.h, p.kernel[0], p.stride[0], p.pad[0], p.dilation[0], ceil_mode);
  p.ow = pool_out_size(p.w, p.kernel[1], p.stride[1], p.pad[1], p.dilation[1], ceil_mode);
  KILN_CHECK(p.oh >= 1 && p.ow >= 1, ShapeError, op, ": input of shape ", input.sizes(), " is too small for kernel ",
             pair_str(a.kernel), " (stride ", pair_str(a.stride), ", padding ", pair_str(a.pad), ", dilation ",
             pair_str(a.dilation), "): computed output size ", p.oh, " x ", p.ow);
  return p;
}

void check_pool_float(const Tensor& input, const char* op) {
  KILN_CHECK(is_floating_point(input.dtype()), DTypeError, op,
             ": expected a floating-point input (float32, float64, bfloat16, float16), got ", dtype_name(input.dtype()),
             " (torch does not implement it for integers either)");
}

}  // namespace

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride, IntArrayRef padding,
              IntArrayRef dilation, int64_t groups, std::source_location loc) {
  const Pair pad = pair_arg(padding, "conv2d", "padding");
  return conv2d_impl(input, weight, bias, pair_arg(stride, "conv2d", "stride"), pad, pad,
                     pair_arg(dilation, "conv2d", "dilation"), groups, autograd::CallSite::from(loc));
}

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride, PaddingMode padding,
              IntArrayRef dilation, int64_t groups, std::source_location loc) {
  const autograd::CallSite site = autograd::CallSite::from(loc);
  const Pair st = pair_arg(stride, "conv2d", "stride"), dil = pair_arg(dilation, "conv2d", "dilation");
  if (padding == PaddingMode::Valid) return conv2d_impl(input, weight, bias, st, {{0, 0}}, {{0, 0}}, dil, groups, site);
  KILN_CHECK(st[0] == 1 && st[1] == 1, ValueError,
             "conv2d: padding=\"same\" is not supported for strided "
             "convolutions (stride ",
             pair_str(st), "), as in torch; pass explicit padding instead");
  ops::check_defined(weight, "conv2d", "weight");
  KILN_CHECK(weight.dim() == 4, ShapeError,
             "conv2d: expected weight of shape [out_channels, in_channels / groups, kH, kW] (4-D), got ",
             weight.sizes());
  // Total padding dilation * (k - 1); an odd total puts the extra at the end, as torch.
  Pair pl{}, pr{};
  for (int d = 0; d < 2; ++d) {
    const int64_t total = dil[d] * (weight.size(2 + d) - 1);
    pl.v[d] = total / 2;
    pr.v[d] = total - pl.v[d];
  }
  return conv2d_impl(input, weight, bias, st, pl, pr, dil, groups, site);
}

Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                  IntArrayRef dilation, bool ceil_mode, std::source_location loc) {
  ops::OpScope rs("max_pool2d", {&input});
  constexpr const char* op = "max_pool2d";
  const PoolArgs a = pool_args(op, kernel_size, stride, padding, dilation);
  const kernels::Pool2dParams p = pool_params(op, input, a, ceil_mode, kernels::PoolKind::Max);
  check_pool_float(input, op);
  return ops::conv_detail::max_pool2d(input, p, autograd::CallSite::from(loc));
}

std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride,
                                                   IntArrayRef padding, IntArrayRef dilation, bool ceil_mode,
                                                   std::source_location loc) {
  ops::OpScope rs("max_pool2d_with_indices", {&input});
  constexpr const char* op = "max_pool2d_with_indices";
  const PoolArgs a = pool_args(op, kernel_size, stride, padding, dilation);
  const kernels::Pool2dParams p = pool_params(op, input, a, ceil_mode, kernels::PoolKind::Max);
  check_pool_float(input, op);
  return ops::conv_detail::max_pool2d_with_indices(input, p, autograd::CallSite::from(loc));
}

Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding, bool ceil_mode,
                  bool count_include_pad, std::optional<int64_t> divisor_override, std::source_location loc) {
  ops::OpScope rs("avg_pool2d", {&input});
  constexpr const char* op = "avg_pool2d";
  const PoolArgs a = pool_args(op, kernel_size, stride, padding, 1);
  kernels::Pool2dParams p = pool_params(
      op, input, a, ceil_mode, count_include_pad ? kernels::PoolKind::AvgIncludePad : kernels::PoolKind::AvgExcludePad);
  KILN_CHECK(input.dtype() != kBool, DTypeError, op, ": bool tensors are not supported");
  KILN_CHECK(!divisor_override || *divisor_override != 0, ValueError, op, ": divisor_override must be nonzero");
  p.divisor_override = divisor_override.value_or(0);
  return ops::conv_detail::avg_pool2d(input, p, autograd::CallSite::from(loc));
}

Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size, std::source_location loc) {
  ops::OpScope rs("adaptive_avg_pool2d", {&input});
  constexpr const char* op = "adaptive_avg_pool2d";
  check_input_4d(input, op);
  const Pair os = pair_arg(output_size, op, "output_size");
  KILN_CHECK(os[0] >= 0 && os[1] >= 0, ValueError, op, ": output_size must be non-negative, got ", pair_str(os));
  KILN_CHECK(input.size(-3) > 0 && input.size(-2) > 0 && input.size(-1) > 0, ShapeError, op,
             ": expected non-empty channel and spatial dims (only the batch may be empty), got shape ", input.sizes());
  check_pool_float(input, op);
  return ops::conv_detail::adaptive_avg_pool2d(input, os[0], os[1], autograd::CallSite::from(loc));
}

Tensor adaptive_avg_pool2d(const Tensor& input, OptionalSize2d output_size, std::source_location loc) {
  check_input_4d(input, "adaptive_avg_pool2d");
  const int64_t os[2] = {output_size[0].value_or(input.size(-2)), output_size[1].value_or(input.size(-1))};
  return adaptive_avg_pool2d(input, IntArrayRef(os, 2), loc);
}

Tensor adaptive_avg_pool2d(const Tensor& input, std::initializer_list<int64_t> output_size, std::source_location loc) {
  return adaptive_avg_pool2d(input, IntArrayRef(output_size), loc);
}

}  // namespace kiln
