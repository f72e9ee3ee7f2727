// Statistics reductions: var/std (two-pass), norm, logsumexp; each forward
// with its backward, following PyTorch 1.13's formulas (FunctionsManual):
// var's gradient is 2 (x - mean) / (N - correction); std's is var's over
// 2 std, 0 where std is 0; logsumexp's is the softmax exp(x - result); the
// norm's depends on p (see NormBackward).
#include <cmath>
#include <limits>

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/reduce.h"
#include "op_record.h"
#include "reduce_util.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;
using ops::DimMask;

namespace {

// ---- var / std ----

struct VarStdBackward final : autograd::Node {
  SavedVariable self_, result_;  // result_: std only
  DimMask mask = 0;
  int64_t correction = 1;
  bool keepdim = false;
  bool is_std = false;
  bool no_dims = false;  // called without dims (or on a 0-dim tensor): torch's other formula at dof <= 0
  const char* name() const override { return is_std ? "StdBackward0" : "VarBackward0"; }

  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const Tensor x = self_.unpack(this);
    Tensor gv = g[0];
    // d std = d var / (2 std); torch masks the 0/0 of a constant slice to 0.
    if (is_std) {
      const Tensor result = result_.unpack(this);
      gv = (gv / (result * 2)).masked_fill(result.eq(0), 0);
    }
    const int64_t nd = x.dim();
    const Tensor gk = ops::unsqueeze_reduced(gv, mask, nd, keepdim);
    int64_t n = 1;
    for (int64_t d = 0; d < nd; ++d) {
      if (mask >> d & 1) n *= x.sizes()[d];
    }
    const int64_t dof = n - correction;
    const Tensor mean = x.mean(ops::mask_dims(mask, nd), true);
    if (no_dims && dof <= 0) {
      // As torch: 2 / 0 is infinite, times (x - mean) gives NaN where x equals
      // the mean and +inf elsewhere.
      const Tensor c =
          where(x.eq(mean), std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity())
              .to(x.dtype());
      return {gk * c};
    }
    // torch keeps 2 / dof as is for explicit dims (infinite at 0, negative below).
    return {gk * (2.0 / static_cast<double>(dof)) * (x - mean)};
  }
  void release_variables() override {
    self_.reset();
    result_.reset();
  }
};

Tensor var_std(const Tensor& self, IntArrayRef dims, int64_t correction, bool keepdim, bool take_sqrt, CallSite site) {
  ops::OpScope rs(take_sqrt ? std::string_view("std") : std::string_view("var"), {&self});
  const char* op = take_sqrt ? "std" : "var";
  ops::check_defined(self, op, "self");
  const DimMask mask = ops::reduce_mask(self, dims, op);
  KILN_CHECK(self.is_floating_point(), DTypeError, op, "(): std and var only support floating point dtypes, got ",
             dtype_name(self.dtype()));
  Tensor out = ops::run_reduction(self, mask, keepdim, self.dtype(), [&](const kernels::ReduceLayout& l) {
    kernels::var(l, self.dtype(), correction, take_sqrt);
  });
  if (autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<VarStdBackward>();
    node->self_ = SavedVariable(self, false);
    if (take_sqrt) node->result_ = SavedVariable(out, true);
    node->mask = mask;
    node->correction = correction;
    node->keepdim = keepdim;
    node->is_std = take_sqrt;
    node->no_dims = dims.empty() || self.dim() == 0;
    autograd::set_history(out, node, {&self}, site);
  }
  return out;
}

// ---- norm ----

// torch's norm_backward for each p; n is the norm and g the gradient, both
// broadcasting against x:
//   p = 0: no gradient (an undefined tensor, as torch);
//   p = 1: sign(x) g;
//   p = 2: g x / n, 0 where n = 0;
//   p = +-inf: sign(x) g shared evenly among the |x| equal to n (and NaNs);
//   p < 1: sign(x) |x|^(p-1) g n^(1-p), 0 where x = 0;
//   other p: sign(x) |x|^(p-1) g / n^(p-1), 0 where n = 0.
struct NormBackward final : autograd::Node {
  SavedVariable self_, result_;
  double p = 2;
  DimMask mask = 0;
  bool keepdim = false;
  const char* name() const override { return "NormBackward1"; }

  TensorList apply(TensorList&& g) override {
    if (!g[0].defined() || p == 0) return {Tensor()};
    const Tensor x = self_.unpack(this);
    const int64_t nd = x.dim();
    const Tensor gk = ops::unsqueeze_reduced(g[0], mask, nd, keepdim);
    if (p == 1) return {ops::sign_of(x) * gk};
    const Tensor n = ops::unsqueeze_reduced(result_.unpack(this), mask, nd, keepdim);
    if (p == 2) return {gk * (x / n).masked_fill(n.eq(0), 0)};
    if (std::isinf(p)) {
      const Tensor a = x.abs();
      const Tensor hit = a.eq(n) | a.ne(a);
      return {ops::sign_of(x) * ((gk / hit.sum(ops::mask_dims(mask, nd), true)) * hit)};
    }
    if (p < 1) {
      const Tensor scaled = ops::sign_of(x) * x.abs().pow(p - 1).masked_fill(x.eq(0), 0);
      return {scaled * gk * n.pow(1 - p)};
    }
    const Tensor scaled = p < 2 ? ops::sign_of(x) * x.abs().pow(p - 1) : x * x.abs().pow(p - 2);
    return {scaled * (gk / n.pow(p - 1)).masked_fill(n.eq(0), 0)};
  }
  void release_variables() override {
    self_.reset();
    result_.reset();
  }
};

// ---- logsumexp ----

struct LogsumexpBackward final : autograd::Node {
  SavedVariable self_, result_;
  DimMask mask = 0;
  bool keepdim = false;
  const char* name() const override { return "LogsumexpBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const Tensor x = self_.unpack(this);
    const int64_t nd = x.dim();
    // An all -inf slice gives (-inf) - (-inf) = NaN, as torch.
    const Tensor r = ops::unsqueeze_reduced(result_.unpack(this), mask, nd, keepdim);
    return {ops::unsqueeze_reduced(g[0], mask, nd, keepdim) * (x - r).exp()};
  }
  void release_variables() override {
    self_.reset();
    result_.reset();
  }
};

}  // namespace

Tensor Tensor::var(IntArrayRef dims, int64_t correction, bool keepdim, std::source_location loc) const {
  return var_std(*this, dims, correction, keepdim, false, CallSite::from(loc));
}

Tensor Tensor::std(IntArrayRef dims, int64_t correction, bool keepdim, std::source_location loc) const {
  return var_std(*this, dims, correction, keepdim, true, CallSite::from(loc));
}

Tensor Tensor::norm(double p, IntArrayRef dims, bool keepdim, std::source_location loc) const {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::norm, [&](const Tensor& x) { return x.norm(p, dims, keepdim, loc); }, *this);
  ops::OpScope rs("norm", {this});
  ops::check_defined(*this, "norm", "self");
  const DimMask mask = ops::reduce_mask(*this, dims, "norm");
  KILN_CHECK(is_floating_point(), DTypeError, "norm(): input dtype should be floating point, got ", dtype_name(dtype()),
             " (convert with .to(kFloat32) first)");
  KILN_CHECK(!std::isnan(p), ValueError, "norm(): expected a number or +-inf for p, got nan");
  Tensor out = ops::new_output(ops::reduced_shape(sizes(), mask, keepdim), dtype());
  if (out.numel() != 0) {
    const kernels::ReduceLayout l = ops::make_reduce_layout(*this, mask, out);
    // Tensor.norm gives 0 over an empty slice for every p (inf and -inf included).
    if (l.reduce_numel() == 0)
      out.zero_();
    else
      kernels::norm(l, dtype(), p);
  }
  if (autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<NormBackward>();
    // p = 0 needs nothing, p = 1 only the input's sign.
    if (p != 0) node->self_ = SavedVariable(*this, false);
    if (p != 0 && p != 1) node->result_ = SavedVariable(out, true);
    node->p = p;
    node->mask = mask;
    node->keepdim = keepdim;
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

Tensor Tensor::logsumexp(IntArrayRef dims, bool keepdim, std::source_location loc) const {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::logsumexp, [&](const Tensor& x) { return x.logsumexp(dims, keepdim, loc); }, *this);
  ops::OpScope rs("logsumexp", {this});
  ops::check_defined(*this, "logsumexp", "self");
  const DimMask mask = ops::reduce_mask(*this, dims, "logsumexp");
  // As torch: integer and bool inputs are computed in the default float dtype.
  const Tensor src = is_floating_point() ? *this : to(default_dtype());
  Tensor out = ops::run_reduction(src, mask, keepdim, src.dtype(),
                                  [&](const kernels::ReduceLayout& l) { kernels::logsumexp(l, src.dtype()); });
  if (autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<LogsumexpBackward>();
    node->self_ = SavedVariable(*this, false);
    node->result_ = SavedVariable(out, true);
    node->mask = mask;
    node->keepdim = keepdim;
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

// ---- free functions ----

Tensor var(const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim, std::source_location loc) {
  return x.var(dims, correction, keepdim, loc);
}
Tensor std(const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim, std::source_location loc) {
  return x.std(dims, correction, keepdim, loc);
}
Tensor norm(const Tensor& x, double p, IntArrayRef dims, bool keepdim, std::source_location loc) {
  return x.norm(p, dims, keepdim, loc);
}
Tensor logsumexp(const Tensor& x, IntArrayRef dims, bool keepdim, std::source_location loc) {
  return x.logsumexp(dims, keepdim, loc);
}

}  // namespace kiln
