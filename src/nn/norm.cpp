// Normalisation layers as composites of kiln ops.
#include "kiln/nn/norm.h"

#include <limits>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/batch_norm.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/layer_norm.h"
#include "nn_util.h"

namespace kiln::nn {

namespace {
using util::dtype_or_default;
using util::int_tuple;
using util::num;
using util::py_bool;

/// The trailing dims {-n, ..., -1} after checking x ends with `shape`.
std::vector<int64_t> trailing_dims(const Tensor& x, const std::vector<int64_t>& shape, const char* who) {
  const auto n = static_cast<int64_t>(shape.size());
  bool ok = x.dim() >= n;
  for (int64_t i = 0; ok && i < n; ++i) ok = x.size(x.dim() - n + i) == shape[static_cast<size_t>(i)];
  KILN_CHECK(ok, ShapeError, who, ": expected input ending in normalized_shape ", int_tuple(shape), ", got shape ",
             x.shape_string());
  std::vector<int64_t> dims;
  for (int64_t i = -n; i < 0; ++i) dims.push_back(i);
  return dims;
}
/// [1, C, 1, ...] for broadcasting a per-channel vector against x.
std::vector<int64_t> channel_shape(const Tensor& x, int64_t c) {
  std::vector<int64_t> s(static_cast<size_t>(x.dim()), 1);
  s[1] = c;
  return s;
}
}  // namespace

// ---- LayerNorm ----
LayerNorm::LayerNorm(LayerNormOptions o)
    : Module("LayerNorm"),
      options(std::move(o)),
      weight(register_parameter("weight", options.elementwise_affine
                                              ? ones(options.normalized_shape, dtype_or_default(options.dtype))
                                              : Tensor())),
      bias(register_parameter("bias", options.elementwise_affine
                                          ? zeros(options.normalized_shape, dtype_or_default(options.dtype))
                                          : Tensor())) {
  KILN_CHECK(!options.normalized_shape.empty(), ValueError, "LayerNorm: normalized_shape must not be empty");
}
Tensor LayerNorm::forward(const Tensor& x) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::layer_norm, [&](const Tensor& xx) { return forward(xx); }, x);
  trailing_dims(x, options.normalized_shape, "LayerNorm");
  return ops::layer_norm(x, options.normalized_shape, weight, bias, options.eps);
}
// Note [Layer norm into a product]
// Autocast keeps layer norm in float32 (its policy row, as torch's CPU
// autocast leaves it in the float32 residual stream's dtype), and the linear
// after it casts the output to bf16: a pass that reads the float32 output and
// writes a bf16 copy, and backward a ToCopyBackward that widens the bf16
// gradient into a float32 one for the norm's backward. When the caller knows
// the product is the output's only consumer (the pre-norm transformer block,
// GPT's final norm before the LM head), the kernel rounds each float32 output
// as Tensor::to would and stores bf16, and its backward widens the bf16
// gradient as it reads it: the same bits forward and backward, two passes
// fewer per norm. A hook on the norm or on the module it feeds sees what it
// saw before (the float32 output), so any hook turns the fusion off.
Tensor LayerNorm::forward_for_product(const Tensor& x) {
  const bool into_bf16 = autocast_enabled() && autocast_dtype() == kBFloat16 && !has_forward_hooks() &&
                         x.dtype() == kFloat32 && weight.defined() && bias.defined() && weight.dtype() == kFloat32 &&
                         bias.dtype() == kFloat32;
  if (!into_bf16) return (*this)(x);
  trailing_dims(x, options.normalized_shape, "LayerNorm");
  const autocast_detail::SuspendGuard suspend;
  return ops::layer_norm_to(x, options.normalized_shape, weight, bias, options.eps, kBFloat16);
}
std::string LayerNorm::extra_repr() const {
  return int_tuple(options.normalized_shape) + ", eps=" + num(options.eps) +
         ", elementwise_affine=" + py_bool(options.elementwise_affine);
}

// ---- BatchNorm ----
BatchNorm::BatchNorm(std::string type_name, BatchNormOptions o, int64_t min_dim, int64_t max_dim)
    : Module(std::move(type_name)),
      options(o),
      weight(register_parameter("weight", o.affine ? ones({o.num_features}, dtype_or_default(o.dtype)) : Tensor())),
      bias(register_parameter("bias", o.affine ? zeros({o.num_features}, dtype_or_default(o.dtype)) : Tensor())),
      running_mean(register_buffer(
          "running_mean", o.track_running_stats ? zeros({o.num_features}, dtype_or_default(o.dtype)) : Tensor())),
      running_var(register_buffer(
          "running_var", o.track_running_stats ? ones({o.num_features}, dtype_or_default(o.dtype)) : Tensor())),
      num_batches_tracked(register_buffer("num_batches_tracked", o.track_running_stats ? zeros({}, kInt64) : Tensor())),
      min_dim_(min_dim),
      max_dim_(max_dim) {
  KILN_CHECK(o.num_features > 0, ValueError, "BatchNorm", ": num_features must be > 0, got ", o.num_features);
}
Tensor BatchNorm::forward(const Tensor& x) { return forward_impl(x, false, Tensor()); }

Tensor BatchNorm::forward_relu(const Tensor& x) {
  if (has_forward_hooks()) return (*this)(x).relu();  // hooks see this module's own output
  return forward_impl(x, true, Tensor());
}

Tensor BatchNorm::forward_add_relu(const Tensor& x, const Tensor& residual) {
  if (has_forward_hooks()) return ((*this)(x) + residual).relu();
  return forward_impl(x, true, residual);
}

Tensor BatchNorm::forward_impl(const Tensor& x, bool relu, const Tensor& residual) {
  // A channels-last bf16 input in training (a conv's output under autocast) runs the mixed kernel: bf16
  // activations, float32 statistics and parameters, as PyTorch's CPU batch norm, and no cast on either
  // side; with a residual of the same dtype the block's end stays fused too.
  const bool mixed_bf16 = autocast_enabled() && (is_training() || !options.track_running_stats) &&
                          ops::batch_norm_train_supported(x, weight, bias) && x.dtype() == kBFloat16 &&
                          (!residual.defined() || residual.dtype() == kBFloat16);
  if (autocast_enabled() && !mixed_bf16) {
    // Otherwise under autocast batch norm runs in float32, its ReLU and residual add fused as without
    // autocast; a residual of another dtype is cast to the result's first, as the add's type promotion would.
    return ops::autocast_call(
        AutocastOp::batch_norm,
        [&](const Tensor& xx) {
          const bool cast = residual.defined() && residual.dtype() != xx.dtype();
          return forward_impl(xx, relu, cast ? residual.to(xx.dtype()) : residual);
        },
        x);
  }
  KILN_CHECK(x.dim() >= min_dim_ && x.dim() <= max_dim_ && x.size(1) == options.num_features, ShapeError, type_name(),
             ": expected a ", min_dim_, (min_dim_ == max_dim_ ? "" : " or " + std::to_string(max_dim_)),
             "-dim input with ", options.num_features, " channels in dim 1, got shape ", x.shape_string());
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  const auto cshape = channel_shape(x, options.num_features);
  Tensor mean, var;
  if (is_training() || !options.track_running_stats) {
    const int64_t n = x.numel() / options.num_features;
    KILN_CHECK(n > 1 || !is_training(), ValueError, type_name(),
               ": expected more than 1 value per channel when training, got input shape ", x.shape_string());
    // float32/float64: the fused two-pass op (ops/batch_norm.h); other dtypes: the composite below.
    Tensor fused_out;
    if (ops::batch_norm_train_supported(x, weight, bias)) {
      ops::BatchNormResult r = !relu ? ops::batch_norm_train(x, weight, bias, options.eps)
                               : residual.defined()
                                   ? ops::batch_norm_add_relu_train(x, weight, bias, residual, options.eps)
                                   : ops::batch_norm_relu_train(x, weight, bias, options.eps);
      fused_out = std::move(r.output);
      mean = std::move(r.mean);
      var = std::move(r.var);
    } else {
      mean = x.mean(dims);
      var = x.var(dims, 0);
    }
    if (is_training() && options.track_running_stats) {
      NoGradGuard g;
      num_batches_tracked.add_(1);
      const double m = options.momentum ? *options.momentum : 1.0 / num_batches_tracked.item<double>();
      ops::batch_norm_update_running_stats(running_mean, running_var, mean, var, m, n);
    }
    if (fused_out.defined()) return fused_out;
  } else {
    mean = running_mean;
    var = running_var;
  }
  Tensor y = (x - mean.view(cshape)) * (var.view(cshape) + options.eps).rsqrt();
  if (weight.defined()) y = y * weight.view(cshape) + bias.view(cshape);
  if (residual.defined()) y = y + residual;
  return relu ? y.relu() : y;
}
std::string BatchNorm::extra_repr() const {
  return std::to_string(options.num_features) + ", eps=" + num(options.eps) +
         ", momentum=" + (options.momentum ? num(*options.momentum) : std::string("None")) +
         ", affine=" + py_bool(options.affine) + ", track_running_stats=" + py_bool(options.track_running_stats);
}

// ---- RMSNorm ----
RMSNorm::RMSNorm(RMSNormOptions o)
    : Module("RMSNorm"),
      options(std::move(o)),
      weight(register_parameter("weight", options.elementwise_affine
                                              ? ones(options.normalized_shape, dtype_or_default(options.dtype))
                                              : Tensor())) {
  KILN_CHECK(!options.normalized_shape.empty(), ValueError, "RMSNorm: normalized_shape must not be empty");
}
Tensor RMSNorm::forward(const Tensor& x) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::rms_norm, [&](const Tensor& xx) { return forward(xx); }, x);
  auto dims = trailing_dims(x, options.normalized_shape, "RMSNorm");
  double eps = options.eps             ? *options.eps
               : x.dtype() == kFloat64 ? std::numeric_limits<double>::epsilon()
                                       : static_cast<double>(std::numeric_limits<float>::epsilon());
  Tensor y = x * (x.mul(x).mean(dims, true) + eps).rsqrt();
  return weight.defined() ? y * weight : y;
}
std::string RMSNorm::extra_repr() const {
  return int_tuple(options.normalized_shape) + ", eps=" + (options.eps ? num(*options.eps) : std::string("None")) +
         ", elementwise_affine=" + py_bool(options.elementwise_affine);
}

// ---- GroupNorm ----
GroupNorm::GroupNorm(GroupNormOptions o)
    : Module("GroupNorm"),
      options(o),
      weight(register_parameter("weight", o.affine ? ones({o.num_channels}, dtype_or_default(o.dtype)) : Tensor())),
      bias(register_parameter("bias", o.affine ? zeros({o.num_channels}, dtype_or_default(o.dtype)) : Tensor())) {
  KILN_CHECK(o.num_groups > 0 && o.num_channels % o.num_groups == 0, ValueError, "GroupNorm: num_channels (",
             o.num_channels, ") must be divisible by num_groups (", o.num_groups, ")");
}
Tensor GroupNorm::forward(const Tensor& x) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::group_norm, [&](const Tensor& xx) { return forward(xx); }, x);
  KILN_CHECK(x.dim() >= 2 && x.size(1) == options.num_channels, ShapeError, "GroupNorm: expected input [N, ",
             options.num_channels, ", *], got shape ", x.shape_string());
  Tensor xr = x.reshape({x.size(0), options.num_groups, -1});
  Tensor mean = xr.mean({2}, true);
  Tensor var = xr.var({2}, 0, true);
  Tensor y = ((xr - mean) * (var + options.eps).rsqrt()).reshape(x.sizes());
  if (!weight.defined()) return y;
  const auto cshape = channel_shape(x, options.num_channels);
  return y * weight.view(cshape) + bias.view(cshape);
}
std::string GroupNorm::extra_repr() const {
  return std::to_string(options.num_groups) + ", " + std::to_string(options.num_channels) +
         ", eps=" + num(options.eps) + ", affine=" + py_bool(options.affine);
}

}  // namespace kiln::nn
