// softmax and log_softmax along one dim (fused, numerically stable kernels in
// src/kernels/cpu/softmax.cpp), with their backward. Backward needs only the
// output y: y * (g - sum(g * y)) for softmax, g - exp(y) * sum(g) for
// log_softmax. It is hot in training, so a plain backward runs one fused
// kernel per row; under create_graph (grad mode on during backward) it uses
// the same formula in tensor ops, which can be differentiated again.
#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/guards.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/reduce.h"
#include "op_record.h"
#include "reduce_util.h"

namespace kiln {

namespace {

struct SoftmaxBackward final : autograd::Node {
  autograd::SavedVariable result_;
  int64_t dim = 0;  // wrapped (0 for a 0-dim tensor)
  bool log = false;
  const char* name() const override { return log ? "LogSoftmaxBackward0" : "SoftmaxBackward0"; }

  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor()};
    const Tensor y = result_.unpack(this);
    if (grad_mode_enabled()) {
      return {log ? g - y.exp() * g.sum({dim}, true) : y * (g - (g * y).sum({dim}, true))};
    }
    // The forward's output is contiguous; the incoming gradient may be any
    // view (an expanded ones from a sum, say) and is made contiguous once.
    const Tensor yc = y.contiguous();
    const Tensor gc = g.dtype() == y.dtype() ? g.contiguous() : g.to(y.dtype()).contiguous();
    Tensor out = ops::new_output(y.sizes(), y.dtype());
    kernels::softmax_backward(ops::dim_layout(yc.sizes(), dim), yc.dtype(), yc.data_ptr(), gc.data_ptr(),
                              out.data_ptr(), log);
    return {out};
  }
  void release_variables() override { result_.reset(); }
};

Tensor softmax_impl(const Tensor& self, int64_t dim, bool log, autograd::CallSite site) {
  ops::OpScope rs(log ? std::string_view("log_softmax") : std::string_view("softmax"), {&self});
  const char* op = log ? "log_softmax" : "softmax";
  ops::check_defined(self, op, "self");
  const int64_t d = wrap_dim(dim, self.dim(), op);
  ops::check_floating(self, op);
  // As torch, the result is contiguous whatever the input's layout.
  const Tensor src = self.contiguous();
  Tensor out = ops::new_output(self.sizes(), self.dtype());
  kernels::softmax(ops::dim_layout(src.sizes(), d), src.dtype(), src.data_ptr(), out.data_ptr(), log);
  if (autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<SoftmaxBackward>();
    node->result_ = autograd::SavedVariable(out, true);
    node->dim = d;
    node->log = log;
    autograd::set_history(out, node, {&self}, site);
  }
  return out;
}

}  // namespace

Tensor Tensor::softmax(int64_t dim, std::source_location loc) const {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::softmax, [&](const Tensor& x) { return x.softmax(dim, loc); }, *this);
  return softmax_impl(*this, dim, false, autograd::CallSite::from(loc));
}
Tensor Tensor::log_softmax(int64_t dim, std::source_location loc) const {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::log_softmax, [&](const Tensor& x) { return x.log_softmax(dim, loc); }, *this);
  return softmax_impl(*this, dim, true, autograd::CallSite::from(loc));
}

Tensor softmax(const Tensor& x, int64_t dim, std::source_location loc) { return x.softmax(dim, loc); }
Tensor log_softmax(const Tensor& x, int64_t dim, std::source_location loc) { return x.log_softmax(dim, loc); }

}  // namespace kiln
