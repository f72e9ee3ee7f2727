// Pooling with parsed parameters and its backward (Note [Differentiable
// backward of conv2d and pooling] in conv_pool_internal.h).
//
// Max pooling keeps what its forward already produced: oneDNN's workspace
// when oneDNN ran (a NaN-free float32/bfloat16 input without dilation), read
// by oneDNN's pooling backward; otherwise torch-style int64 indices from our
// loop, scattered by our backward loop. Average pooling saves no tensor at
// all: its backward is the adjoint of the same windows (oneDNN pooling
// backward where the forward used oneDNN, our loops otherwise).
#include "conv_pool_internal.h"

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"

namespace kiln::ops::conv_detail {

namespace {

using autograd::CallSite;
using autograd::SavedVariable;
using kernels::Pool2dParams;

DimVector input_shape(const Pool2dParams& p, bool unbatched) {
  return unbatched ? DimVector{p.c, p.h, p.w} : DimVector{p.n, p.c, p.h, p.w};
}

DimVector output_shape(const Pool2dParams& p, bool unbatched) {
  return unbatched ? DimVector{p.c, p.oh, p.ow} : DimVector{p.n, p.c, p.oh, p.ow};
}

Tensor in_dtype(const Tensor& t, DType dt) { return t.dtype() == dt ? t : t.to(dt); }

// ---- max pooling: scatter to the argmax and its adjoint, gather from it ----

Tensor max_pool_scatter(const Tensor& grad_output, const Tensor& indices, const Pool2dParams& p, bool unbatched,
                        CallSite site);
Tensor max_pool_gather(const Tensor& src, const Tensor& indices, const Pool2dParams& p, bool unbatched, CallSite site);

// Both directions keep the indices (max_pool2d_with_indices returns them to
// the user, who might change them in place) with their version.
struct MaxPoolScatterBackward final : autograd::Node {
  SavedVariable indices;
  Pool2dParams p;
  bool unbatched = false;
  const char* name() const override { return "MaxPool2DWithIndicesBackwardBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {max_pool_gather(grads[0], indices.unpack(this), p, unbatched, site())};
  }
  void release_variables() override { indices.reset(); }
};

struct MaxPoolGatherBackward final : autograd::Node {
  SavedVariable indices;
  Pool2dParams p;
  bool unbatched = false;
  const char* name() const override { return "MaxPool2DGatherBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {max_pool_scatter(grads[0], indices.unpack(this), p, unbatched, site())};
  }
  void release_variables() override { indices.reset(); }
};

Tensor max_pool_scatter(const Tensor& grad_output, const Tensor& indices, const Pool2dParams& p, bool unbatched,
                        CallSite site) {
  Tensor gi;
  {
    const NoGradGuard no_grad;
    const Tensor g = kernel_operand(grad_output, p.dtype), idx = indices.contiguous();
    gi = new_output(input_shape(p, unbatched), p.dtype);
    kernels::max_pool2d_backward_indices(p, g.data_ptr(), idx.data_ptr<int64_t>(), gi.data_ptr());
    gi = in_dtype(gi, grad_output.dtype());
  }
  if (autograd::compute_requires_grad({&grad_output})) {
    auto node = make_intrusive<MaxPoolScatterBackward>();
    node->indices = SavedVariable(indices, false);
    node->p = p;
    node->unbatched = unbatched;
    autograd::set_history(gi, node, {&grad_output}, site);
  }
  return gi;
}

Tensor max_pool_gather(const Tensor& src, const Tensor& indices, const Pool2dParams& p, bool unbatched, CallSite site) {
  Tensor out;
  {
    const NoGradGuard no_grad;
    const Tensor s = kernel_operand(src, p.dtype), idx = indices.contiguous();
    out = new_output(output_shape(p, unbatched), p.dtype);
    kernels::max_pool2d_gather(p, s.data_ptr(), idx.data_ptr<int64_t>(), out.data_ptr());
    out = in_dtype(out, src.dtype());
  }
  if (autograd::compute_requires_grad({&src})) {
    auto node = make_intrusive<MaxPoolGatherBackward>();
    node->indices = SavedVariable(indices, false);
    node->p = p;
    node->unbatched = unbatched;
    autograd::set_history(out, node, {&src}, site);
  }
  return out;
}

// Torch-style indices of the maxima of `input` (the loop's argmax: first
// maximum in the window, NaN wins).
Tensor argmax_indices(const Tensor& input, const Pool2dParams& p, bool unbatched) {
  const NoGradGuard no_grad;
  const Tensor x = kernel_operand(input, p.dtype);
  Tensor out = new_output(output_shape(p, unbatched), p.dtype);
  Tensor idx = new_output(output_shape(p, unbatched), kInt64);
  kernels::max_pool2d_with_indices(p, x.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>());
  return idx;
}

struct MaxPoolBackward final : autograd::Node {
  // Saved as torch saves it, so that writing into the input after pooling fails at backward by
  // name (the indices or workspace would silently route the gradient by the old values); with
  // the workspace only, a higher derivative also recomputes the indices from it.
  SavedVariable input;
  SavedVariable indices;  // torch-style argmax indices (our loop ran), or
  Tensor workspace;       // oneDNN's or kiln's channels-last kernel's; internal, never seen by the user
  Pool2dParams p;         // NCHW, for the index paths
  bool nhwc = false;      // the workspace belongs to a channels-last run
  bool unbatched = false;
  const char* name() const override { return "MaxPool2DWithIndicesBackward0"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor()};
    const Tensor x = input.unpack(this);  // the version check, whichever path runs
    if (!workspace.defined() || autograd::compute_requires_grad({&g})) {
      // Indices: through the differentiable scatter, so create_graph gives the gather as the next derivative.
      const Tensor idx = indices.defined() ? indices.unpack(this) : argmax_indices(x, p, unbatched);
      return {max_pool_scatter(g, idx, p, unbatched, site())};
    }
    const NoGradGuard no_grad;
    Pool2dParams q = p;
    q.nhwc = nhwc;
    const MemoryFormat fmt = nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
    const Tensor gk = contiguous(g.dtype() == p.dtype ? g : g.to(p.dtype), fmt);
    Tensor gi = new_output(input_shape(p, unbatched), p.dtype, fmt);
    kernels::max_pool2d_backward_workspace(q, gk.data_ptr(), workspace.data_ptr(), gi.data_ptr());
    // kiln::compile's rewrites (docs/compile.md, "Rewrites") may never write this gradient: the ReLU-pooling
    // one, and the one that reads it through the pool in the weight gradient after it.
    if (capture::recording()) capture::watch(*gi.storage(), "max_pool2d grad_input");
    return {in_dtype(gi, g.dtype())};
  }
  void release_variables() override {
    input.reset();
    indices.reset();
    workspace = Tensor();
  }
};

// ---- average pooling: the backward is the adjoint of the same windows ----

Tensor avg_pool_backward(const Tensor& grad_output, const Pool2dParams& p, bool unbatched, CallSite site);

struct AvgPoolBackward final : autograd::Node {
  Pool2dParams p;
  bool unbatched = false;
  const char* name() const override { return "AvgPool2DBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {avg_pool_backward(grads[0], p, unbatched, site())};
  }
};

struct AvgPoolBackwardBackward final : autograd::Node {
  Pool2dParams p;
  const char* name() const override { return "AvgPool2DBackwardBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {avg_pool2d(grads[0], p, site())};
  }
};

Tensor avg_pool_backward(const Tensor& grad_output, const Pool2dParams& p, bool unbatched, CallSite site) {
  Tensor gi;
  {
    const NoGradGuard no_grad;
    const Tensor g = kernel_operand(grad_output, p.dtype);
    gi = new_output(input_shape(p, unbatched), p.dtype);
    kernels::avg_pool2d_backward(p, g.data_ptr(), gi.data_ptr());
    gi = in_dtype(gi, grad_output.dtype());
  }
  if (autograd::compute_requires_grad({&grad_output})) {
    auto node = make_intrusive<AvgPoolBackwardBackward>();
    node->p = p;
    autograd::set_history(gi, node, {&grad_output}, site);
  }
  return gi;
}

// ---- adaptive average pooling ----

Tensor adaptive_backward(const Tensor& grad_output, const Pool2dParams& p, bool unbatched, CallSite site);

struct AdaptiveAvgPoolBackward final : autograd::Node {
  Pool2dParams p;
  bool unbatched = false;
  const char* name() const override { return "AdaptiveAvgPool2DBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {adaptive_backward(grads[0], p, unbatched, site())};
  }
};

struct AdaptiveAvgPoolBackwardBackward final : autograd::Node {
  Pool2dParams p;
  const char* name() const override { return "AdaptiveAvgPool2DBackwardBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    return {adaptive_avg_pool2d(grads[0], p.oh, p.ow, site())};
  }
};

Tensor adaptive_backward(const Tensor& grad_output, const Pool2dParams& p, bool unbatched, CallSite site) {
  Tensor gi;
  {
    const NoGradGuard no_grad;
    const Tensor g = kernel_operand(grad_output, p.dtype);
    gi = new_output(input_shape(p, unbatched), p.dtype);
    kernels::adaptive_avg_pool2d_backward(p.dtype, p.n * p.c, p.h, p.w, p.oh, p.ow, g.data_ptr(), gi.data_ptr());
    gi = in_dtype(gi, grad_output.dtype());
  }
  if (autograd::compute_requires_grad({&grad_output})) {
    auto node = make_intrusive<AdaptiveAvgPoolBackwardBackward>();
    node->p = p;
    autograd::set_history(gi, node, {&grad_output}, site);
  }
  return gi;
}

}  // namespace

// A channels-last input stays channels-last (a conv's output on its way to
// the next conv) where oneDNN, or for max pooling kiln's channels-last
// kernel (NaN included), pools it; our own NCHW loops take the rest, and a
// NaN input that oneDNN would pool.
bool pool_nhwc(const Tensor& input, const Pool2dParams& p, bool unbatched) {
  return !unbatched && suggest_memory_format(input) == MemoryFormat::ChannelsLast && kernels::pool2d_uses_dnnl(p);
}

Tensor max_pool2d(const Tensor& input, const Pool2dParams& p, CallSite site) {
  const bool unbatched = input.dim() == 3;
  Pool2dParams q = p;
  q.nhwc = pool_nhwc(input, p, unbatched);
  if (!autograd::compute_requires_grad({&input})) {
    const NoGradGuard no_grad;
    if (q.nhwc) {
      const Tensor x = input.dtype() == p.dtype ? input : input.to(p.dtype);
      Tensor out = new_output(output_shape(p, unbatched), p.dtype, MemoryFormat::ChannelsLast);
      if (kernels::pool2d_forward(q, x.data_ptr(), out.data_ptr())) return in_dtype(out, input.dtype());
    }
    const Tensor x = kernel_operand(input, p.dtype);
    Tensor out = new_output(output_shape(p, unbatched), p.dtype);
    kernels::pool2d_forward(p, x.data_ptr(), out.data_ptr());
    return in_dtype(out, input.dtype());
  }
  auto node = make_intrusive<MaxPoolBackward>();
  Tensor out;
  {
    const NoGradGuard no_grad;
    // oneDNN writes its workspace for the backward; when it declines (NaN input) or cannot run, our loop
    // writes torch's indices instead.
    bool ran_dnnl = false;
    Tensor x;
    if (q.nhwc) {
      x = input.dtype() == p.dtype ? input : input.to(p.dtype);
      out = new_output(output_shape(p, unbatched), p.dtype, MemoryFormat::ChannelsLast);
      node->workspace = new_output({static_cast<int64_t>(kernels::pool2d_workspace_bytes(q))}, kUInt8);
      ran_dnnl = kernels::pool2d_forward(q, x.data_ptr(), out.data_ptr(), node->workspace.data_ptr());
      node->nhwc = ran_dnnl;
    }
    if (!ran_dnnl) {
      x = kernel_operand(input, p.dtype);
      out = new_output(output_shape(p, unbatched), p.dtype);
    }
    // NCHW on oneDNN; not after a channels-last try, which declined for a NaN that oneDNN would drop here too.
    const size_t ws_bytes = ran_dnnl || q.nhwc ? 0 : kernels::pool2d_workspace_bytes(p);
    if (ws_bytes > 0) {
      node->workspace = new_output({static_cast<int64_t>(ws_bytes)}, kUInt8);
      ran_dnnl = kernels::pool2d_forward(p, x.data_ptr(), out.data_ptr(), node->workspace.data_ptr());
    }
    if (!ran_dnnl) {
      node->workspace = Tensor();
      Tensor idx = new_output(output_shape(p, unbatched), kInt64);
      kernels::max_pool2d_with_indices(p, x.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>());
      node->indices = SavedVariable(idx, false);
    }
    out = in_dtype(out, input.dtype());
  }
  node->input = SavedVariable(input, false);
  node->p = p;
  node->unbatched = unbatched;
  autograd::set_history(out, node, {&input}, site);
  return out;
}

std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, const Pool2dParams& p, CallSite site) {
  const bool unbatched = input.dim() == 3;
  Tensor out, idx;
  {
    const NoGradGuard no_grad;
    const Tensor x = kernel_operand(input, p.dtype);
    out = new_output(output_shape(p, unbatched), p.dtype);
    idx = new_output(output_shape(p, unbatched), kInt64);
    kernels::max_pool2d_with_indices(p, x.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>());
    out = in_dtype(out, input.dtype());
  }
  if (autograd::compute_requires_grad({&input})) {
    auto node = make_intrusive<MaxPoolBackward>();
    node->indices = SavedVariable(idx, false);  // the user's: an in-place change to them is caught
    node->input = SavedVariable(input, false);  // as is one to the input, as torch
    node->p = p;
    node->unbatched = unbatched;
    autograd::set_history(out, node, {&input}, site);
  }
  return {out, idx};
}

Tensor avg_pool2d(const Tensor& input, const Pool2dParams& p, CallSite site) {
  const bool unbatched = input.dim() == 3;
  Tensor out;
  {
    const NoGradGuard no_grad;
    const Tensor x = kernel_operand(input, p.dtype);
    out = new_output(output_shape(p, unbatched), p.dtype);
    kernels::pool2d_forward(p, x.data_ptr(), out.data_ptr());
    out = in_dtype(out, input.dtype());
  }
  if (autograd::compute_requires_grad({&input})) {
    auto node = make_intrusive<AvgPoolBackward>();
    node->p = p;
    node->unbatched = unbatched;
    autograd::set_history(out, node, {&input}, site);
  }
  return out;
}

Tensor adaptive_avg_pool2d(const Tensor& input, int64_t oh, int64_t ow, CallSite site) {
  const bool unbatched = input.dim() == 3;
  Pool2dParams p;
  p.dtype = kernel_dtype(input.dtype());
  p.kind = kernels::PoolKind::AvgExcludePad;
  p.n = unbatched ? 1 : input.size(0);
  p.c = input.size(-3);
  p.h = input.size(-2);
  p.w = input.size(-1);
  p.oh = oh;
  p.ow = ow;
  Tensor out;
  {
    const NoGradGuard no_grad;
    const Tensor x = kernel_operand(input, p.dtype);
    out = new_output(output_shape(p, unbatched), p.dtype);
    kernels::adaptive_avg_pool2d(p.dtype, p.n * p.c, p.h, p.w, oh, ow, x.data_ptr(), out.data_ptr());
    out = in_dtype(out, input.dtype());
  }
  if (autograd::compute_requires_grad({&input})) {
    auto node = make_intrusive<AdaptiveAvgPoolBackward>();
    node->p = p;
    node->unbatched = unbatched;
    autograd::set_history(out, node, {&input}, site);
  }
  return out;
}

}  // namespace kiln::ops::conv_detail
