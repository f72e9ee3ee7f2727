// Layer norm (include/kiln/ops/layer_norm.h): shape checks, the fused
// one-pass-per-row kernels of kernels/cpu/layer_norm.cpp, and the backward
// beside the forward.
//
// Forward saves x, weight, bias (the arguments, for create_graph), and per-row
// mean and rstd = 1 / sqrt(var + eps). Backward runs the fused kernel
// (grad_x, and the weight and bias gradients summed independently of the
// thread count). Under create_graph (grad mode on in backward) it
// differentiates the composite form instead, so higher orders stay exact.
// The composite also serves every case the kernels do not take (other
// dtypes, no affine step, an empty input).
#include "kiln/ops/layer_norm.h"

#include <optional>
#include <vector>

#include "iter.h"
#include "kiln/autograd/custom_function.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/layer_norm.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln::ops {

namespace detail {

// y = (x - mean) / sqrt(var + eps) [* w] [+ b] over the last `n_dims` dims, as kiln ops.
Tensor layer_norm_composite(const Tensor& x, int64_t n_dims, const Tensor& weight, const Tensor& bias, double eps) {
  std::vector<int64_t> dims;
  for (int64_t i = -n_dims; i < 0; ++i) dims.push_back(i);
  Tensor mean = x.mean(dims, true);
  Tensor var = x.var(dims, 0, true);
  Tensor y = (x - mean) * (var + eps).rsqrt();
  if (weight.defined()) y = y * weight;
  return bias.defined() ? y + bias : y;
}

}  // namespace detail

namespace {

using detail::layer_norm_composite;

struct LnArgs {
  int64_t n_dims = 1;
  double eps = 1e-5;
  std::optional<DType> out;  // layer_norm_to's dtype: y is written in it (Note [Layer norm into a product])
};

// The composite, and the cast layer_norm_to folds into the kernel.
Tensor composite_as(const Tensor& x, const Tensor& weight, const Tensor& bias, const LnArgs& a) {
  Tensor y = layer_norm_composite(x, a.n_dims, weight, bias, a.eps);
  return a.out ? y.to(*a.out) : y;
}

struct FusedLayerNorm : autograd::Function<FusedLayerNorm> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const LnArgs& a) {
    const Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias.contiguous();
    const int64_t n = wc.numel(), rows = xc.numel() / n;
    Tensor y = empty(xc.sizes(), TensorOptions(a.out.value_or(xc.dtype())));
    Tensor mean = empty({rows}, TensorOptions(xc.dtype())), rstd = empty({rows}, TensorOptions(xc.dtype()));
    kernels::layer_norm_forward(xc.dtype(), rows, n, xc.data_ptr(), wc.data_ptr(), bc.data_ptr(), a.eps, y.data_ptr(),
                                mean.data_ptr(), rstd.data_ptr(), y.dtype());
    // The arguments themselves, not xc/wc/bc: those copies (of a transposed,
    // sliced or expanded argument) are made under the no-grad guard, and the
    // create_graph branch would see them as constants without a gradient.
    // Backward makes them contiguous again (free when they already are).
    ctx.save_for_backward({x, weight, bias, mean, rstd});
    ctx.saved_data["args"] = a;
    return y;
  }

  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    TensorList saved = ctx.get_saved_variables();
    const auto a = std::any_cast<LnArgs>(ctx.saved_data["args"]);
    if (grad_mode_enabled()) {
      // create_graph: differentiate the composite so the gradients carry their own history.
      return ctx.differentiate_composite({saved[0], saved[1], saved[2]}, grads, [&](const TensorList& in) {
        return TensorList{composite_as(in[0], in[1], in[2], a)};
      });
    }
    const auto& need = ctx.needs_input_grad();
    const Tensor x = saved[0].contiguous(), w = saved[1].contiguous(), b = saved[2];
    const Tensor &mean = saved[3], &rstd = saved[4];
    // Note [Layer norm's input gradient over its incoming buffer]
    // dx is written over dy when the engine's buffer is the only reference to
    // it, as batch norm's and GELU's backwards do (Note [GELU's gradient over
    // its incoming buffer] in unary.cpp): dy is a linear's input gradient just
    // written, so dx lands in lines still in cache and is not streamed out,
    // where a fresh output is a block last touched a step ago. The kernel
    // reads a row's dy whole before it writes the row's dx.
    const bool reuse = need[0] && writable_incoming_grad(grads[0]) && grads[0].is_contiguous() &&
                       grads[0].dtype() == x.dtype() && grads[0].sizes() == x.sizes() && !grads[0].is_alias_of(x);
    Tensor g, gx;
    if (reuse) {
      gx = std::move(grads[0]);
      gx.bump_version();
      g = gx;
    } else {
      // The gradient of a bf16 y (layer_norm_to) is read as bf16 and widened in
      // the kernel; any other pair the kernel does not read is widened first.
      g = grads[0].contiguous();
      if (g.dtype() != x.dtype() && !(x.dtype() == kFloat32 && g.dtype() == kBFloat16)) g = g.to(x.dtype());
      if (need[0]) gx = empty(x.sizes(), TensorOptions(x.dtype()));
    }
    const int64_t n = w.numel(), rows = x.numel() / n;
    const bool want_wb = need[1] || need[2];
    Tensor gw = want_wb ? empty(w.sizes(), TensorOptions(w.dtype())) : Tensor();
    Tensor gb = want_wb ? empty(b.sizes(), TensorOptions(b.dtype())) : Tensor();
    kernels::layer_norm_backward(x.dtype(), rows, n, g.data_ptr(), x.data_ptr(), w.data_ptr(), mean.data_ptr(),
                                 rstd.data_ptr(), need[0] ? gx.data_ptr() : nullptr, want_wb ? gw.data_ptr() : nullptr,
                                 want_wb ? gb.data_ptr() : nullptr, g.dtype());
    return {gx, need[1] ? gw : Tensor(), need[2] ? gb : Tensor()};
  }
};

}  // namespace

namespace {

Tensor layer_norm_as(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight, const Tensor& bias,
                     double eps, std::optional<DType> out, const std::source_location& loc) {
  OpScope rs("layer_norm", {&x, &weight, &bias});
  const autograd::CallSite site = autograd::CallSite::from(loc);
  const auto n_dims = static_cast<int64_t>(normalized_shape.size());
  KILN_CHECK(n_dims > 0, ValueError, "layer_norm: expected a non-empty normalized_shape");
  bool ends = x.dim() >= n_dims;
  for (int64_t i = 0; ends && i < n_dims; ++i)
    ends = x.size(x.dim() - n_dims + i) == normalized_shape[static_cast<size_t>(i)];
  KILN_CHECK(ends, ShapeError, "layer_norm: expected input ending in normalized_shape ", normalized_shape,
             ", got shape ", x.shape_string());
  KILN_CHECK(!weight.defined() || weight.sizes() == normalized_shape, ShapeError,
             "layer_norm: expected weight of normalized_shape ", normalized_shape, ", got ", weight.sizes());
  KILN_CHECK(!bias.defined() || bias.sizes() == normalized_shape, ShapeError,
             "layer_norm: expected bias of normalized_shape ", normalized_shape, ", got ", bias.sizes());
  // The fused kernel covers the affine float32/float64 case with a non-empty input; the rest is the composite.
  const bool fused = weight.defined() && bias.defined() && (x.dtype() == kFloat32 || x.dtype() == kFloat64) &&
                     weight.dtype() == x.dtype() && bias.dtype() == x.dtype() && x.numel() > 0 && weight.numel() > 0;
  // y in another dtype is fused for float32 into bf16 only.
  const std::optional<DType> other = out && *out != x.dtype() ? out : std::nullopt;
  const bool fused_out = !other || (x.dtype() == kFloat32 && *other == kBFloat16);
  const LnArgs args{.n_dims = n_dims, .eps = eps, .out = other};
  if (!fused || !fused_out) return composite_as(x, weight, bias, args);
  if (!autograd::compute_requires_grad({&x, &weight, &bias})) {
    // Inference: the kernel alone, without the autograd node, its saved
    // tensors and the per-row statistics only backward reads (gpt_infer's
    // norms are 5 µs each; that bookkeeping was a fifth of it).
    const Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias.contiguous();
    const int64_t n = wc.numel(), rows = xc.numel() / n;
    Tensor y = empty(xc.sizes(), TensorOptions(other.value_or(xc.dtype())));
    kernels::layer_norm_forward(xc.dtype(), rows, n, xc.data_ptr(), wc.data_ptr(), bc.data_ptr(), eps, y.data_ptr(),
                                nullptr, nullptr, y.dtype());
    return y;
  }
  return FusedLayerNorm::apply_at(site, x, weight, bias, args);
}

}  // namespace

Tensor layer_norm(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight, const Tensor& bias, double eps,
                  std::source_location loc) {
  return layer_norm_as(x, normalized_shape, weight, bias, eps, std::nullopt, loc);
}

Tensor layer_norm_to(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight, const Tensor& bias,
                     double eps, DType dtype, std::source_location loc) {
  return layer_norm_as(x, normalized_shape, weight, bias, eps, dtype, loc);
}

}  // namespace kiln::ops
