// conv2d with parsed parameters, and its backward as two differentiable ops
// (Note [Differentiable backward of conv2d and pooling] in
// conv_pool_internal.h): the input gradient Bx(g, w) and the weight and bias
// gradient (Bw, Bb)(g, x). float32/bfloat16 run oneDNN's backward-data and
// backward-weights primitives (the bias gradient in the same pass), float64
// gemm + col2im / im2col + gemm.
#include "conv_pool_internal.h"

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln::ops::conv_detail {

namespace {

using autograd::CallSite;
using autograd::SavedVariable;
using kernels::Conv2dParams;

Tensor conv2d_input_grad(const Tensor& grad_output, const Tensor& weight, const Conv2dParams& p, bool unbatched,
                         CallSite site);
std::tuple<Tensor, Tensor> conv2d_weight_grad(const Tensor& grad_output, const Tensor& input, const Conv2dParams& p,
                                              bool unbatched, bool with_bias, CallSite site);

DimVector input_shape(const Conv2dParams& p, bool unbatched) {
  return unbatched ? DimVector{p.c, p.h, p.w} : DimVector{p.n, p.c, p.h, p.w};
}

DimVector output_shape(const Conv2dParams& p, bool unbatched) {
  return unbatched ? DimVector{p.o, p.oh, p.ow} : DimVector{p.n, p.o, p.oh, p.ow};
}

// A result computed in the kernel dtype, returned in the dtype of the op's tensors.
Tensor in_dtype(const Tensor& t, DType dt) { return t.dtype() == dt ? t : t.to(dt); }

// Whether the call runs on oneDNN with NHWC activations: float32/bfloat16,
// batched, nothing empty (the empty-channel paths of conv_gemm.cpp write NCHW).
bool nhwc_path(const Conv2dParams& p, bool unbatched) {
  const bool dnnl = p.dtype == kFloat32 || p.dtype == kBFloat16;
  return dnnl && !unbatched && p.n > 0 && p.c > 0 && p.o > 0 && p.oh > 0 && p.ow > 0;
}

// An activation in the kernel dtype: kept as it is when channels-last on the
// NHWC path (no reorder), else made contiguous NCHW. `nhwc` says which.
Tensor activation_operand(const Tensor& t, DType kernel_dtype, bool path_nhwc, bool& nhwc) {
  const Tensor k = t.dtype() == kernel_dtype ? t : t.to(kernel_dtype);
  nhwc = path_nhwc && is_contiguous(k, MemoryFormat::ChannelsLast);
  return nhwc ? k : k.contiguous();
}

// 2·N·Cout·Hout·Wout·(Cin/groups)·kH·kW: a convolution, or either of its gradients.
double conv_flops(const Conv2dParams& p) {
  return 2.0 * static_cast<double>(p.n * p.o * p.oh * p.ow) * static_cast<double>(p.c / p.groups * p.kh * p.kw);
}

MemoryFormat result_format(bool nhwc) { return nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous; }

struct ConvolutionBackward final : autograd::Node {
  SavedVariable input, weight;  // input for the weight gradient, weight for the input gradient
  Conv2dParams p;
  bool unbatched = false;
  const char* name() const override { return "ConvolutionBackward0"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    TensorList out(3);
    if (!g.defined()) return out;
    const bool need_x = next_edges()[0].is_valid(), need_w = next_edges()[1].is_valid();
    const bool need_b = next_edges()[2].is_valid();
    // As torch's aten::convolution_backward under ConvolutionBackward0: each gradient
    // (input, weight) is one convolution's worth of FLOPs; the bias sum is not counted.
    ops::OpScope rs("convolution_backward", {&g});
    if (rs.recording()) rs.set_flops((need_x ? conv_flops(p) : 0.0) + (need_w ? conv_flops(p) : 0.0));
    if (need_x && need_w) {
      const Tensor w = weight.unpack(this), x = input.unpack(this);
      if (!autograd::compute_requires_grad({&g, &x, &w})) {
        // No graph to record: both directions in one kernel call (oneDNN reorders g once).
        std::tie(out[0], out[1], out[2]) = both_grads(g, x, w, need_b);
        return out;
      }
    }
    if (need_x) out[0] = conv2d_input_grad(g, weight.unpack(this), p, unbatched, site());
    if (need_w) {
      std::tie(out[1], out[2]) = conv2d_weight_grad(g, input.unpack(this), p, unbatched, need_b, site());
    } else if (need_b) {
      // A frozen weight with a trainable bias: the bias gradient alone.
      out[2] = unbatched ? g.sum({1, 2}) : g.sum({0, 2, 3});
    }
    return out;
  }
  void release_variables() override {
    input.reset();
    weight.reset();
  }

 private:
  std::tuple<Tensor, Tensor, Tensor> both_grads(const Tensor& grad_output, const Tensor& x, const Tensor& w,
                                                bool with_bias) const {
    const NoGradGuard no_grad;
    Conv2dParams q = p;
    const bool path = nhwc_path(p, unbatched);
    const Tensor g = activation_operand(grad_output, p.dtype, path, q.output_nhwc);
    const Tensor xk = activation_operand(x, p.dtype, path, q.input_nhwc);
    const Tensor wk = kernel_operand(w, p.dtype);
    Tensor gi = new_output(input_shape(p, unbatched), p.dtype, result_format(q.input_nhwc));  // x's layout
    Tensor gw = new_output({p.o, p.c / p.groups, p.kh, p.kw}, p.dtype);
    Tensor gb = with_bias ? new_output({p.o}, p.dtype) : Tensor();
    kernels::conv2d_backward(q, g.data_ptr(), xk.data_ptr(), wk.data_ptr(), gi.data_ptr(), gw.data_ptr(),
                             with_bias ? gb.data_ptr() : nullptr);
    const DType dt = grad_output.dtype();
    return {in_dtype(gi, dt), in_dtype(gw, dt), with_bias ? in_dtype(gb, dt) : gb};
  }
};

// gi = Bx(g, w): adjoint of conv(., w) applied to g.
struct ConvInputGradBackward final : autograd::Node {
  SavedVariable grad_output, weight;
  Conv2dParams p;
  bool unbatched = false;
  const char* name() const override { return "ConvolutionBackwardBackward0"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor& gg = grads[0];
    TensorList out(2);
    if (!gg.defined()) return out;
    if (next_edges()[0].is_valid()) out[0] = conv2d(gg, weight.unpack(this), Tensor(), p, site());
    if (next_edges()[1].is_valid()) {
      out[1] = std::get<0>(conv2d_weight_grad(grad_output.unpack(this), gg, p, unbatched, false, site()));
    }
    return out;
  }
  void release_variables() override {
    grad_output.reset();
    weight.reset();
  }
};

// (gw, gb) = (Bw, Bb)(g, x): the weight gradient and, when asked, the bias gradient.
struct ConvWeightGradBackward final : autograd::Node {
  SavedVariable grad_output, input;
  Conv2dParams p;
  DType weight_dtype = kFloat32;
  bool unbatched = false;
  const char* name() const override { return "ConvolutionBackwardBackward0"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor& ggw = grads[0];
    const Tensor ggb = grads.size() > 1 ? grads[1] : Tensor();
    TensorList out(2);
    if (!ggw.defined() && !ggb.defined()) return out;
    if (next_edges()[0].is_valid()) {
      const Tensor w = ggw.defined() ? ggw : zeros({p.o, p.c / p.groups, p.kh, p.kw}, weight_dtype);
      out[0] = conv2d(input.unpack(this), w, ggb, p, site());
    }
    if (next_edges()[1].is_valid() && ggw.defined()) {
      out[1] = conv2d_input_grad(grad_output.unpack(this), ggw, p, unbatched, site());
    }
    return out;
  }
  void release_variables() override {
    grad_output.reset();
    input.reset();
  }
};

Tensor conv2d_input_grad(const Tensor& grad_output, const Tensor& weight, const Conv2dParams& p, bool unbatched,
                         CallSite site) {
  Tensor gi;
  {
    const NoGradGuard no_grad;
    Conv2dParams q = p;
    const bool path = nhwc_path(p, unbatched);
    const Tensor g = activation_operand(grad_output, p.dtype, path, q.output_nhwc);
    const Tensor w = kernel_operand(weight, p.dtype);
    q.input_nhwc = path;  // the input's layout is not known here: channels-last, as conv2d's results
    gi = new_output(input_shape(p, unbatched), p.dtype, result_format(q.input_nhwc));
    kernels::conv2d_backward_input(q, g.data_ptr(), w.data_ptr(), gi.data_ptr());
    gi = in_dtype(gi, grad_output.dtype());
  }
  if (autograd::compute_requires_grad({&grad_output, &weight})) {
    auto node = make_intrusive<ConvInputGradBackward>();
    node->p = p;
    node->unbatched = unbatched;
    if (weight.requires_grad()) node->grad_output = SavedVariable(grad_output, false);
    if (grad_output.requires_grad()) node->weight = SavedVariable(weight, false);
    autograd::set_history(gi, node, {&grad_output, &weight}, site);
  }
  return gi;
}

std::tuple<Tensor, Tensor> conv2d_weight_grad(const Tensor& grad_output, const Tensor& input, const Conv2dParams& p,
                                              bool unbatched, bool with_bias, CallSite site) {
  Tensor gw, gb;
  {
    const NoGradGuard no_grad;
    Conv2dParams q = p;
    const bool path = nhwc_path(p, unbatched);
    const Tensor g = activation_operand(grad_output, p.dtype, path, q.output_nhwc);
    const Tensor x = activation_operand(input, p.dtype, path, q.input_nhwc);
    gw = new_output({p.o, p.c / p.groups, p.kh, p.kw}, p.dtype);
    if (with_bias) gb = new_output({p.o}, p.dtype);
    kernels::conv2d_backward_weight(q, g.data_ptr(), x.data_ptr(), gw.data_ptr(), with_bias ? gb.data_ptr() : nullptr);
    gw = in_dtype(gw, grad_output.dtype());
    if (with_bias) gb = in_dtype(gb, grad_output.dtype());
  }
  if (autograd::compute_requires_grad({&grad_output, &input})) {
    auto node = make_intrusive<ConvWeightGradBackward>();
    node->p = p;
    node->unbatched = unbatched;
    node->weight_dtype = grad_output.dtype();
    if (input.requires_grad()) node->grad_output = SavedVariable(grad_output, false);
    if (grad_output.requires_grad()) node->input = SavedVariable(input, false);
    autograd::set_history({&gw, &gb}, node, {&grad_output, &input}, site);
  }
  return {gw, gb};
}

}  // namespace

DType kernel_dtype(DType dt) {
  return dt == kFloat16 || (dt == kBFloat16 && !kernels::bf16_products_on_dnnl()) ? kFloat32 : dt;
}

Tensor kernel_operand(const Tensor& t, DType kernel_dtype) {
  return (t.dtype() == kernel_dtype ? t : t.to(kernel_dtype)).contiguous();
}

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Conv2dParams& p, CallSite site) {
  const bool unbatched = input.dim() == 3;
  Tensor out;
  {
    const NoGradGuard no_grad;
    Conv2dParams q = p;
    const bool path = nhwc_path(p, unbatched);
    const Tensor x = activation_operand(input, p.dtype, path, q.input_nhwc);
    const Tensor w = kernel_operand(weight, p.dtype);
    const Tensor b = bias.defined() ? kernel_operand(bias, p.dtype) : Tensor();
    q.output_nhwc = path;  // docs/decisions.md: conv2d returns channels-last
    out = new_output(output_shape(p, unbatched), p.dtype, result_format(q.output_nhwc));
    kernels::conv2d_forward(q, x.data_ptr(), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr, out.data_ptr());
    // kiln::compile's rewrite of a convolution and the max pool after it (docs/compile.md, "Rewrites") may never
    // write this output.
    if (capture::recording()) capture::watch(*out.storage(), "conv2d output");
    out = in_dtype(out, input.dtype());
  }
  if (autograd::compute_requires_grad({&input, &weight, &bias})) {
    auto node = make_intrusive<ConvolutionBackward>();
    node->p = p;
    node->unbatched = unbatched;
    if (weight.requires_grad()) node->input = SavedVariable(input, false);
    if (input.requires_grad()) node->weight = SavedVariable(weight, false);
    autograd::set_history(out, node, {&input, &weight, &bias}, site);
  }
  return out;
}

}  // namespace kiln::ops::conv_detail
