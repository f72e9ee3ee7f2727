// Reductions with an identity or a plain fold: sum, mean, prod, amax/amin,
// max()/min() over all elements, all/any; each forward with its backward.
//
// Backward formulas are kiln tensor ops (so create_graph differentiates them
// again) and follow PyTorch 1.13's: sum and mean broadcast the gradient back
// over the reduced dims (a view: unsqueeze, then expand); prod gives each
// element the product of the others, without dividing by zero; amax/amin and
// max()/min() share the gradient evenly among tied extremes. all/any give
// bool and record nothing.
#include "kiln/ops/reduce.h"

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/ops/index.h"
#include "op_record.h"
#include "reduce_util.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;
using ops::DimMask;

namespace {

// Where a reduction put its output relative to its input: enough to send a
// gradient back (saved by value in the nodes; no tensor).
struct ReducedDims {
  DimVector sizes;  // the input's
  DimMask mask = 0;
  bool keepdim = false;
  int64_t ndim() const { return static_cast<int64_t>(sizes.size()); }
};

}  // namespace

// ---- sum ----

namespace {

struct SumBackward final : autograd::Node {
  ReducedDims r;
  DType self_dtype = kFloat32;
  bool all_form = false;  // sum() (SumBackward0) or sum(dims) (SumBackward1)
  const char* name() const override { return all_form ? "SumBackward0" : "SumBackward1"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    // sum(dtype=d) converted first: the gradient goes back to the input's dtype
    // (on the small reduced tensor, before expanding).
    const Tensor gi = g[0].dtype() == self_dtype ? g[0] : g[0].to(self_dtype);
    return {ops::expand_reduced(gi, r.mask, r.sizes, r.keepdim)};
  }
};

Tensor sum_impl(const Tensor& self, IntArrayRef dims, bool keepdim, std::optional<DType> dtype, bool all_form,
                CallSite site) {
  ops::OpScope rs("sum", {&self});
  ops::check_defined(self, "sum", "self");
  const DimMask mask = ops::reduce_mask(self, dims, "sum");
  // torch.sum(x, dtype=d) converts first, then sums in d; without dtype, integers and bool sum to int64.
  // The conversion records nothing: this op's node covers it.
  Tensor src = self;
  if (dtype && *dtype != self.dtype()) {
    NoGradGuard no_grad;
    src = self.to(*dtype);
  }
  const DType out_dtype = dtype ? *dtype : (is_integral(self.dtype(), true) ? kInt64 : self.dtype());
  Tensor out = ops::run_reduction(src, mask, keepdim, out_dtype,
                                  [&](const kernels::ReduceLayout& l) { kernels::sum(l, src.dtype(), out_dtype); });
  // The node hangs off `self`, not the converted copy: the dtype conversion is part of this op.
  if (is_floating_point(out_dtype) && autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<SumBackward>();
    node->r = {self.sizes(), mask, keepdim};
    node->self_dtype = self.dtype();
    node->all_form = all_form;
    autograd::set_history(out, node, {&self}, site);
  }
  return out;
}

}  // namespace

Tensor Tensor::sum(std::optional<DType> dtype, std::source_location loc) const {
  return sum_impl(*this, IntArrayRef{}, false, dtype, true, CallSite::from(loc));
}

Tensor Tensor::sum(IntArrayRef dims, bool keepdim, std::optional<DType> dtype, std::source_location loc) const {
  return sum_impl(*this, dims, keepdim, dtype, false, CallSite::from(loc));
}

// ---- mean ----

namespace {

void check_mean_dtype(const Tensor& self) {
  KILN_CHECK(self.is_floating_point(), DTypeError,
             "mean(): could not infer output dtype. Input dtype must be either a floating point or complex dtype. "
             "Got: ",
             dtype_name(self.dtype()), " (convert with .to(kFloat32) first)");
}

struct MeanBackward final : autograd::Node {
  ReducedDims r;
  int64_t count = 1;  // elements averaged per output
  bool all_form = false;
  const char* name() const override { return all_form ? "MeanBackward0" : "MeanBackward1"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    // Divide the reduced gradient, then expand: count times fewer divisions.
    return {ops::expand_reduced(g[0] / static_cast<double>(count), r.mask, r.sizes, r.keepdim)};
  }
};

Tensor mean_impl(const Tensor& self, IntArrayRef dims, bool keepdim, bool all_form, CallSite site) {
  ops::OpScope rs("mean", {&self});
  ops::check_defined(self, "mean", "self");
  const DimMask mask = ops::reduce_mask(self, dims, "mean");
  check_mean_dtype(self);
  Tensor out = ops::run_reduction(self, mask, keepdim, self.dtype(),
                                  [&](const kernels::ReduceLayout& l) { kernels::mean(l, self.dtype()); });
  if (autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<MeanBackward>();
    node->r = {self.sizes(), mask, keepdim};
    int64_t count = 1;
    for (int64_t d = 0; d < self.dim(); ++d) {
      if (mask >> d & 1) count *= self.sizes()[d];
    }
    node->count = count;
    node->all_form = all_form;
    autograd::set_history(out, node, {&self}, site);
  }
  return out;
}

}  // namespace

Tensor Tensor::mean(std::source_location loc) const {
  return mean_impl(*this, IntArrayRef{}, false, true, CallSite::from(loc));
}

Tensor Tensor::mean(IntArrayRef dims, bool keepdim, std::source_location loc) const {
  return mean_impl(*this, dims, keepdim, false, CallSite::from(loc));
}

// ---- prod ----

namespace {

// d prod / d x_i = the product of the other elements of x_i's slice, as
// torch's prod_backward, without dividing by zero: a slice with no zero gives
// result / x; one zero gives the product of the nonzeros at the zero and 0
// elsewhere; two or more give 0. `result` broadcasts against x; dim < 0: one
// slice (every dim). Written so that create_graph also gets the second
// derivatives right where x has zeros: the zeros' own values enter through
// `result` and through `other_zero`, not as constants. While kiln::compile
// records, the general formula is taken without looking for zeros on the host
// (it gives the same values where there are none), so that a replay is right
// whatever the new x holds.
Tensor prod_factor(const Tensor& x, const Tensor& result, int64_t dim) {
  const Tensor zero = x.eq(0);
  if (!capture::recording() && !zero.any().item<bool>()) return result / x;
  auto red_sum = [dim](const Tensor& t) { return dim < 0 ? t.sum() : t.sum({dim}, true); };
  auto red_prod = [dim](const Tensor& t) { return dim < 0 ? t.prod() : t.prod(dim, true); };
  const Tensor count = red_sum(zero);
  const Tensor x_safe = where(zero, 1.0, x);
  const Tensor nonzero_prod = red_prod(x_safe);
  // In a slice with exactly two zeros, the product of the others at one zero is
  // the other zero (0) times nonzero_prod; its derivative is nonzero_prod.
  const Tensor other_zero = red_sum(where(zero, x, 0.0)) - x;
  const Tensor at_zero = where(count.eq(1), nonzero_prod, where(count.eq(2), nonzero_prod * other_zero, 0.0));
  // Elsewhere, result is 0 whenever the slice holds a zero.
  return where(zero, at_zero, result / x_safe);
}

struct ProdBackward final : autograd::Node {
  SavedVariable self_, result_;
  int64_t dim = -1;  // wrapped; -1: prod() over every element
  bool keepdim = false;
  const char* name() const override { return dim < 0 ? "ProdBackward0" : "ProdBackward1"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const Tensor x = self_.unpack(this);
    if (x.dim() == 0) return {g[0]};
    Tensor gk = g[0], rk = result_.unpack(this);
    if (dim >= 0 && !keepdim) {
      gk = gk.unsqueeze(dim);
      rk = rk.unsqueeze(dim);
    }
    return {gk * prod_factor(x, rk, dim)};
  }
  void release_variables() override {
    self_.reset();
    result_.reset();
  }
};

Tensor prod_impl(const Tensor& self, DimMask mask, bool keepdim, int64_t dim, CallSite site) {
  const DType out_dtype = is_integral(self.dtype(), true) ? kInt64 : self.dtype();
  Tensor out = ops::run_reduction(self, mask, keepdim, out_dtype,
                                  [&](const kernels::ReduceLayout& l) { kernels::prod(l, self.dtype(), out_dtype); });
  if (autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<ProdBackward>();
    node->self_ = SavedVariable(self, false);
    node->result_ = SavedVariable(out, true);
    node->dim = dim;
    node->keepdim = keepdim;
    autograd::set_history(out, node, {&self}, site);
  }
  return out;
}

}  // namespace

Tensor Tensor::prod(std::source_location loc) const {
  ops::OpScope rs("prod", {this});
  ops::check_defined(*this, "prod", "self");
  return prod_impl(*this, ops::all_dims_mask(*this), false, -1, CallSite::from(loc));
}

Tensor Tensor::prod(int64_t dim, bool keepdim, std::source_location loc) const {
  ops::OpScope rs("prod", {this});
  ops::check_defined(*this, "prod", "self");
  const DimMask mask = ops::single_dim_mask(*this, dim, "prod");
  return prod_impl(*this, mask, keepdim, wrap_dim(dim, this->dim(), "prod"), CallSite::from(loc));
}

// ---- amax / amin / max() / min() ----

namespace {

// amax/amin: the gradient of each slice is shared evenly among the elements
// equal to its result (torch's scale_grad_by_count).
struct AmaxAminBackward final : autograd::Node {
  SavedVariable self_, result_;
  ReducedDims r;
  bool is_max = true;
  const char* name() const override { return is_max ? "AmaxBackward0" : "AminBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const Tensor x = self_.unpack(this);
    const Tensor hit = x.eq(ops::unsqueeze_reduced(result_.unpack(this), r.mask, r.ndim(), r.keepdim));
    const Tensor count = hit.sum(ops::mask_dims(r.mask, r.ndim()), true);
    return {(ops::unsqueeze_reduced(g[0], r.mask, r.ndim(), r.keepdim) / count) * hit};
  }
  void release_variables() override {
    self_.reset();
    result_.reset();
  }
};

// max()/min() over everything: shared evenly among the elements equal to the
// result, or among the NaNs when the result is NaN (torch's evenly_distribute_backward).
struct MaxMinAllBackward final : autograd::Node {
  SavedVariable self_, result_;
  bool is_max = true;
  const char* name() const override { return is_max ? "MaxBackward1" : "MinBackward1"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const Tensor x = self_.unpack(this), result = result_.unpack(this);
    const Tensor hit = x.eq(result) | (x.ne(x) & result.ne(result));
    return {(g[0] / hit.sum()) * hit};
  }
  void release_variables() override {
    self_.reset();
    result_.reset();
  }
};

Tensor amax_amin(const Tensor& self, DimMask mask, bool keepdim, bool is_max, bool all_form, const char* op,
                 CallSite site) {
  ops::check_reduce_nonempty(self, mask, op);
  Tensor out = ops::run_reduction(self, mask, keepdim, self.dtype(),
                                  [&](const kernels::ReduceLayout& l) { kernels::amax_amin(l, self.dtype(), is_max); });
  if (autograd::compute_requires_grad({&self})) {
    if (all_form) {
      auto node = make_intrusive<MaxMinAllBackward>();
      node->self_ = SavedVariable(self, false);
      node->result_ = SavedVariable(out, true);
      node->is_max = is_max;
      autograd::set_history(out, node, {&self}, site);
    } else {
      auto node = make_intrusive<AmaxAminBackward>();
      node->self_ = SavedVariable(self, false);
      node->result_ = SavedVariable(out, true);
      node->r = {self.sizes(), mask, keepdim};
      node->is_max = is_max;
      autograd::set_history(out, node, {&self}, site);
    }
  }
  return out;
}

}  // namespace

Tensor Tensor::amax(IntArrayRef dims, bool keepdim, std::source_location loc) const {
  ops::OpScope rs("amax", {this});
  ops::check_defined(*this, "amax", "self");
  return amax_amin(*this, ops::reduce_mask(*this, dims, "amax"), keepdim, true, false, "amax", CallSite::from(loc));
}

Tensor Tensor::amin(IntArrayRef dims, bool keepdim, std::source_location loc) const {
  ops::OpScope rs("amin", {this});
  ops::check_defined(*this, "amin", "self");
  return amax_amin(*this, ops::reduce_mask(*this, dims, "amin"), keepdim, false, false, "amin", CallSite::from(loc));
}

Tensor Tensor::max(std::source_location loc) const {
  ops::OpScope rs("max", {this});
  ops::check_defined(*this, "max", "self");
  return amax_amin(*this, ops::all_dims_mask(*this), false, true, true, "max", CallSite::from(loc));
}

Tensor Tensor::min(std::source_location loc) const {
  ops::OpScope rs("min", {this});
  ops::check_defined(*this, "min", "self");
  return amax_amin(*this, ops::all_dims_mask(*this), false, false, true, "min", CallSite::from(loc));
}

// ---- all / any ----

namespace {

Tensor all_any(const Tensor& self, bool is_all) {
  ops::OpScope rs(is_all ? std::string_view("all") : std::string_view("any"), {&self});
  ops::check_defined(self, is_all ? "all" : "any", "self");
  // As torch: uint8 keeps its dtype (a legacy of uint8 masks), everything else gives bool.
  const DType out_dtype = self.dtype() == kUInt8 ? kUInt8 : kBool;
  return ops::run_reduction(self, ops::all_dims_mask(self), false, out_dtype, [&](const kernels::ReduceLayout& l) {
    kernels::all_any(l, self.dtype(), out_dtype, is_all);
  });
}

}  // namespace

Tensor Tensor::all() const { return all_any(*this, true); }
Tensor Tensor::any() const { return all_any(*this, false); }

// ---- free functions ----

Tensor sum(const Tensor& x, std::optional<DType> dtype, std::source_location loc) { return x.sum(dtype, loc); }
Tensor sum(const Tensor& x, IntArrayRef dims, bool keepdim, std::optional<DType> dtype, std::source_location loc) {
  return x.sum(dims, keepdim, dtype, loc);
}
Tensor mean(const Tensor& x, std::source_location loc) { return x.mean(loc); }
Tensor mean(const Tensor& x, IntArrayRef dims, bool keepdim, std::source_location loc) {
  return x.mean(dims, keepdim, loc);
}
Tensor prod(const Tensor& x, std::source_location loc) { return x.prod(loc); }
Tensor prod(const Tensor& x, int64_t dim, bool keepdim, std::source_location loc) { return x.prod(dim, keepdim, loc); }
Tensor max(const Tensor& x, std::source_location loc) { return x.max(loc); }
Tensor min(const Tensor& x, std::source_location loc) { return x.min(loc); }
Tensor amax(const Tensor& x, IntArrayRef dims, bool keepdim, std::source_location loc) {
  return x.amax(dims, keepdim, loc);
}
Tensor amin(const Tensor& x, IntArrayRef dims, bool keepdim, std::source_location loc) {
  return x.amin(dims, keepdim, loc);
}
Tensor all(const Tensor& x) { return x.all(); }
Tensor any(const Tensor& x) { return x.any(); }

}  // namespace kiln
