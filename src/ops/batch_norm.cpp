// Training-mode batch norm (include/kiln/ops/batch_norm.h): shape and dtype
// checks, the two-pass kernels of kernels/cpu/batch_norm.cpp, and the backward
// node. The node runs the fused backward kernel; under create_graph it
// computes the same formula with kiln ops instead, recomputing the
// statistics from the saved input, so that double backward sees how mean and
// variance depend on x.
#include "kiln/ops/batch_norm.h"

#include <vector>

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/batch_norm.h"
#include "op_record.h"

namespace kiln::ops {

namespace {

using autograd::SavedVariable;

// x is contiguous or (4-D) channels-last: the kernels take either.
kernels::BatchNormShape bn_shape(const Tensor& x) {
  kernels::BatchNormShape s;
  s.n = x.size(0);
  s.c = x.size(1);
  s.inner = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s.inner *= x.size(d);
  s.channels_last = !x.is_contiguous();
  return s;
}

// The layout the kernels run in: channels-last stays so (a conv's output),
// anything else becomes contiguous.
MemoryFormat bn_format(const Tensor& x) { return suggest_memory_format(x); }

std::vector<int64_t> reduce_dims(const Tensor& x) {
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

std::vector<int64_t> channel_shape(const Tensor& x) {
  std::vector<int64_t> s(static_cast<size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

const void* data_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

}  // namespace

// The dtype of the statistics, the parameters and their gradients: x's, or
// float32 for a bf16 x (PyTorch's mixed CPU batch norm).
DType stat_dtype(const Tensor& x) { return x.dtype() == kBFloat16 ? kFloat32 : x.dtype(); }

namespace {

struct NativeBatchNormBackward final : autograd::Node {
  // bias and residual only with the fused ReLU (its mask is recomputed from them)
  SavedVariable x, weight, bias, residual;
  Tensor mean, invstd;  // the forward's statistics, [C], outside the graph
  double eps = 1e-5;
  bool relu = false;          // relu(batch_norm(x) [+ residual]) in one node: grads arrive for the ReLU's output
  bool has_residual = false;  // a fourth input, the residual
  const char* name() const override {
    return has_residual ? "NativeBatchNormAddReluBackward0"
                        : (relu ? "NativeBatchNormReluBackward0" : "NativeBatchNormBackward0");
  }

  TensorList apply(TensorList&& grads) override {
    TensorList out(has_residual ? 4 : 3);
    const Tensor& g = grads[0];
    if (!g.defined()) return out;
    const bool want_x = next_edges()[0].is_valid(), want_w = next_edges()[1].is_valid(),
               want_b = next_edges()[2].is_valid(), want_r = has_residual && next_edges()[3].is_valid();
    const Tensor xv = x.unpack(this);
    const Tensor wv = weight.defined() ? weight.unpack(this) : Tensor();
    const Tensor bv = bias.defined() ? bias.unpack(this) : Tensor();
    const Tensor rv = residual.defined() ? residual.unpack(this) : Tensor();
    if (grad_mode_enabled()) {
      const Tensor ge = relu ? relu_masked(g, xv, wv, bv, rv) : g;
      TensorList d = differentiable(ge, xv, wv, want_x, want_w, want_b);
      for (size_t i = 0; i < d.size(); ++i) out[i] = std::move(d[i]);
      if (want_r) out[3] = ge;
      return out;
    }
    const MemoryFormat fmt = bn_format(xv);
    const DType dt = xv.dtype();
    // Note [Batch norm's input gradient over its incoming buffer]
    // dx is written over dy when the engine's buffer is the only reference to
    // it, as ReLU's and GELU's backwards do (Note [GELU's gradient over its
    // incoming buffer] in unary.cpp): dy is a convolution's input gradient
    // just written, so dx lands in lines still in cache where a fresh output
    // is a block last touched a step ago, and the convolution backward that
    // reads dx next finds it there too. resnet at 1 thread (--profile table,
    // three alternating runs): batch norm + ReLU's backward 322-346 -> 266-285
    // us a call, batch norm's 186-206 -> 140-151, convolution_backward
    // 1.29-1.37 -> 1.22-1.27 ms. The kernel reads each dy element before it
    // writes that element's dx, and the residual's gradient (a buffer of its
    // own) from the same read. A gradient kept elsewhere has more references
    // and is left alone.
    const bool reuse = want_x && writable_incoming_grad(g) && g.dtype() == dt && is_contiguous(g, fmt) &&
                       g.sizes() == xv.sizes() && !g.is_alias_of(xv) && !(rv.defined() && g.is_alias_of(rv));
    Tensor gc;
    if (reuse) {
      out[0] = std::move(grads[0]);
      out[0].bump_version();
      gc = out[0];
    } else {
      gc = contiguous(g.dtype() == dt ? g : g.to(dt), fmt);
      if (want_x) out[0] = new_output(xv.sizes(), dt, fmt);
    }
    if (want_w) out[1] = new_output({xv.size(1)}, stat_dtype(xv));
    if (want_b) out[2] = new_output({xv.size(1)}, stat_dtype(xv));
    if (want_r) out[3] = new_output(xv.sizes(), dt, fmt);
    if (xv.numel() > 0) {
      kernels::BatchNormShape s = bn_shape(xv);
      s.relu = relu;
      kernels::batch_norm_train_backward(dt, s, gc.data_ptr(), xv.data_ptr(), mean.data_ptr(), invstd.data_ptr(),
                                         data_or_null(wv), want_x ? out[0].data_ptr() : nullptr,
                                         want_w ? out[1].data_ptr() : nullptr, want_b ? out[2].data_ptr() : nullptr,
                                         data_or_null(bv), data_or_null(rv), want_r ? out[3].data_ptr() : nullptr);
    }
    return out;
  }

  // The ReLU's backward under create_graph: g where the forward's pre-ReLU
  // value was positive (the kernel's own formula, so the same mask), else 0;
  // the mask is a constant of the graph, as torch's threshold_backward.
  Tensor relu_masked(const Tensor& g, const Tensor& xv, const Tensor& wv, const Tensor& bv, const Tensor& rv) const {
    Tensor mask;
    {
      const NoGradGuard no_grad;
      const auto cs = channel_shape(xv);
      const Tensor scale = wv.defined() ? (invstd.to(kFloat64) * wv.to(kFloat64)).to(invstd.dtype()) : invstd;
      Tensor v = (xv - mean.view(cs)) * scale.view(cs);
      if (bv.defined()) v = v + bv.view(cs);
      if (rv.defined()) v = v + rv;
      mask = (v > 0).to(g.dtype());
    }
    return g * mask;
  }

  // The same gradients as kiln ops (create_graph): differentiable again.
  TensorList differentiable(const Tensor& g, const Tensor& xv, const Tensor& wv, bool want_x, bool want_w,
                            bool want_b) const {
    TensorList out(3);
    const auto dims = reduce_dims(xv);
    const auto cs = channel_shape(xv);
    const Tensor mu = xv.mean(dims, true);
    const Tensor is = (xv.var(dims, 0, true) + eps).rsqrt();
    const Tensor xhat = (xv - mu) * is;
    if (want_x) {
      const Tensor dxhat = wv.defined() ? g * wv.view(cs) : g;
      out[0] = (is * (dxhat - dxhat.mean(dims, true) - xhat * (dxhat * xhat).mean(dims, true))).to(xv.dtype());
    }
    if (want_w) out[1] = (g * xhat).sum(dims);
    if (want_b) out[2] = g.sum(dims);
    return out;
  }

  void release_variables() override {
    x.reset();
    weight.reset();
    bias.reset();
    residual.reset();
    mean = Tensor();
    invstd = Tensor();
  }
};

}  // namespace

bool batch_norm_train_supported(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (!x.defined() || x.dim() < 2) return false;
  const bool bf16 = x.dtype() == kBFloat16;
  if (bf16 && (x.dim() != 4 || suggest_memory_format(x) != MemoryFormat::ChannelsLast)) return false;
  if (!bf16 && x.dtype() != kFloat32 && x.dtype() != kFloat64) return false;
  for (const Tensor* p : {&weight, &bias}) {
    if (p->defined() && (p->dtype() != stat_dtype(x) || p->dim() != 1 || p->size(0) != x.size(1))) return false;
  }
  return true;
}

namespace {

// relu: the fused ReLU (x channels-last); residual (defined only with relu):
// added before it, in x's layout.
BatchNormResult batch_norm_train_impl(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool relu,
                                      const Tensor& residual, std::source_location loc) {
  const std::string_view op = !relu ? "batch_norm" : residual.defined() ? "batch_norm_add_relu" : "batch_norm_relu";
  OpScope rs(op, {&x, &weight, &bias, &residual});
  check_defined(x, "batch_norm", "input");
  KILN_CHECK(batch_norm_train_supported(x, weight, bias), DTypeError,
             "batch_norm: expected a float32 or float64 input of at least 2 dims (or a channels-last 4-dim "
             "bf16 one) with weight and bias of shape [C] and its dtype (float32 for bf16), got input ",
             dtype_name(x.dtype()), " ", x.shape_string(),
             weight.defined() ? ", weight " + weight.shape_string() : std::string(),
             bias.defined() ? ", bias " + bias.shape_string() : std::string());
  const DType dt = x.dtype();
  const int64_t c = x.size(1);
  KILN_CHECK(x.numel() / std::max<int64_t>(c, 1) > 1, ValueError,
             "batch_norm: expected more than 1 value per channel when training, got input shape ", x.shape_string());
  const MemoryFormat fmt = bn_format(x);
  const Tensor xc = contiguous(x, fmt);
  const Tensor wc = weight.defined() ? weight.contiguous() : Tensor();
  const Tensor bc = bias.defined() ? bias.contiguous() : Tensor();
  BatchNormResult r;
  r.output = new_output(x.sizes(), dt, fmt);
  r.mean = new_output({c}, stat_dtype(x));
  r.var = new_output({c}, stat_dtype(x));
  Tensor invstd = new_output({c}, stat_dtype(x));
  kernels::BatchNormShape s = bn_shape(xc);
  s.relu = relu;
  kernels::batch_norm_train_forward(dt, s, xc.data_ptr(), data_or_null(wc), data_or_null(bc), eps, r.output.data_ptr(),
                                    r.mean.data_ptr(), invstd.data_ptr(), r.var.data_ptr(), data_or_null(residual));
  if (autograd::compute_requires_grad({&x, &weight, &bias, &residual})) {
    auto node = make_intrusive<NativeBatchNormBackward>();
    node->x = SavedVariable(xc, false);
    if (weight.defined()) node->weight = SavedVariable(wc, false);
    node->mean = r.mean.clone();  // its own: a caller may update r.mean in place
    node->invstd = invstd;
    node->eps = eps;
    node->relu = relu;
    if (relu && bias.defined()) node->bias = SavedVariable(bc, false);
    const autograd::CallSite site = autograd::CallSite::from(loc);
    if (residual.defined()) {
      node->has_residual = true;
      node->residual = SavedVariable(residual, false);
      autograd::set_history(r.output, node, {&x, &weight, &bias, &residual}, site);
    } else {
      autograd::set_history(r.output, node, {&x, &weight, &bias}, site);
    }
  }
  return r;
}

}  // namespace

BatchNormResult batch_norm_train(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                 std::source_location loc) {
  return batch_norm_train_impl(x, weight, bias, eps, false, Tensor(), loc);
}

BatchNormResult batch_norm_relu_train(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                      std::source_location loc) {
  // The fused kernel walks channels-last rows (a conv's output); other layouts run the two ops.
  if (x.defined() && x.dim() == 4 && suggest_memory_format(x) == MemoryFormat::ChannelsLast) {
    return batch_norm_train_impl(x, weight, bias, eps, true, Tensor(), loc);
  }
  BatchNormResult r = batch_norm_train_impl(x, weight, bias, eps, false, Tensor(), loc);
  r.output = r.output.relu(loc);
  return r;
}

namespace {

template <typename T>
void update_stats(T* rm, T* rv, const T* mean, const T* var, int64_t c, double momentum, double ratio) {
  const T keep = static_cast<T>(1.0 - momentum), m = static_cast<T>(momentum), r = static_cast<T>(ratio);
  for (int64_t k = 0; k < c; ++k) {
    const T a = rm[k] * keep, b = rv[k] * keep, unbiased = var[k] * r;
    rm[k] = a + m * mean[k];
    rv[k] = b + m * unbiased;
  }
}

}  // namespace

void batch_norm_update_running_stats(Tensor& running_mean, Tensor& running_var, const Tensor& mean, const Tensor& var,
                                     double momentum, int64_t n) {
  OpScope rs("batch_norm_update_running_stats", {&running_mean, &running_var, &mean, &var});
  const NoGradGuard no_grad;
  const double ratio = static_cast<double>(n) / static_cast<double>(n - 1);
  const DType dt = running_mean.dtype();
  const bool direct = (dt == kFloat32 || dt == kFloat64) && running_var.dtype() == dt && mean.dtype() == dt &&
                      var.dtype() == dt && running_mean.is_contiguous() && running_var.is_contiguous() &&
                      mean.is_contiguous() && var.is_contiguous() && running_mean.numel() == mean.numel() &&
                      running_var.numel() == var.numel() && mean.numel() == var.numel();
  if (!direct) {  // other dtypes or layouts: the same arithmetic as ops
    running_mean.mul_(1.0 - momentum).add_(mean.detach().to(dt), momentum);
    const Tensor unbiased = var.detach().to(running_var.dtype()) * ratio;
    running_var.mul_(1.0 - momentum).add_(unbiased, momentum);
    return;
  }
  autograd::check_inplace(running_mean, "batch_norm (running_mean)", autograd::CallSite{});
  autograd::check_inplace(running_var, "batch_norm (running_var)", autograd::CallSite{});
  visit_dtype<DTypeSet{kFloat32, kFloat64}>(dt, "batch_norm (running stats)", [&]<typename T>() {
    // A host loop: recorded for kiln::compile's replay like a kernel (capture::host_write).
    capture::host_write(
        "batch_norm (running stats)",
        [rm = running_mean.data_ptr<T>(), rv = running_var.data_ptr<T>(), m = mean.data_ptr<T>(), v = var.data_ptr<T>(),
         c = mean.numel(), momentum, ratio]() { update_stats(rm, rv, m, v, c, momentum, ratio); });
  });
  running_mean.bump_version();
  running_var.bump_version();
}

BatchNormResult batch_norm_add_relu_train(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                          const Tensor& residual, double eps, std::source_location loc) {
  check_defined(residual, "batch_norm_add_relu", "residual");
  // Fused when both are channels-last of one shape and dtype (the end of a residual block); else three ops.
  if (x.defined() && x.dim() == 4 && residual.sizes() == x.sizes() && residual.dtype() == x.dtype() &&
      suggest_memory_format(x) == MemoryFormat::ChannelsLast &&
      suggest_memory_format(residual) == MemoryFormat::ChannelsLast) {
    return batch_norm_train_impl(x, weight, bias, eps, true, residual, loc);
  }
  BatchNormResult r = batch_norm_train_impl(x, weight, bias, eps, false, Tensor(), loc);
  r.output = r.output.add(residual, 1, loc).relu(loc);
  return r;
}

}  // namespace kiln::ops
