// max/min along a dim with indices, and argmax/argmin. The backward of
// max(dim)/min(dim) scatters the gradient to the returned indices (one per
// slice, the first of tied extremes, as torch's value_selecting_reduction_backward);
// the indices and argmax/argmin are integers and record nothing.
#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/reduce.h"
#include "op_record.h"
#include "reduce_util.h"

namespace kiln {

namespace {

struct MaxMinDimBackward final : autograd::Node {
  autograd::SavedVariable indices_;
  DimVector sizes;  // the input's
  int64_t dim = 0;  // wrapped
  bool keepdim = false;
  bool is_max = true;
  const char* name() const override { return is_max ? "MaxBackward0" : "MinBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    if (sizes.size() == 0) return {g[0]};
    Tensor gk = g[0], idx = indices_.unpack(this);
    if (!keepdim) {
      gk = gk.unsqueeze(dim);
      idx = idx.unsqueeze(dim);
    }
    Tensor out = zeros(sizes, g[0].dtype());
    // Without create_graph nothing needs the zeros: scatter into them.
    if (!grad_mode_enabled()) return {out.scatter_(dim, idx, gk)};
    return {out.scatter(dim, idx, gk)};
  }
  void release_variables() override { indices_.reset(); }
};

// (values, indices) of the max/min along `dim`; values is skipped for argmax/argmin.
std::tuple<Tensor, Tensor> arg_reduce(const Tensor& self, int64_t dim, bool keepdim, bool is_max, bool want_values,
                                      const char* op) {
  const ops::DimMask mask = ops::single_dim_mask(self, dim, op);
  const int64_t d = wrap_dim(dim, self.dim(), op);
  KILN_CHECK(self.dim() == 0 || self.sizes()[d] != 0, IndexError, op, "(): expected reduction dim ", d,
             " to have non-zero size, got shape ", self.sizes(), "; the operation has no identity");
  const DimVector shape = ops::reduced_shape(self.sizes(), mask, keepdim);
  Tensor values = want_values ? ops::new_output(shape, self.dtype()) : Tensor();
  Tensor indices = ops::new_output(shape, kInt64);
  if (indices.numel() == 0) return {values, indices};
  const Tensor src = self.contiguous();
  kernels::arg_reduce(ops::dim_layout(src.sizes(), d), src.dtype(), src.data_ptr(),
                      want_values ? values.data_ptr() : nullptr, indices.data_ptr<int64_t>(), is_max);
  return {values, indices};
}

Tensor arg_flat(const Tensor& self, std::optional<int64_t> dim, bool keepdim, bool is_max, const char* op) {
  ops::OpScope rs(ops::NamePtr{op}, {&self});
  ops::check_defined(self, op, "self");
  if (dim) return std::get<1>(arg_reduce(self, *dim, keepdim, is_max, false, op));
  // No dim: the index into the flattened tensor, as torch.
  KILN_CHECK(self.numel() != 0, IndexError, op, "(): expected a non-empty input when no dim is given, got shape ",
             self.sizes(), "; the operation has no identity, so specify a dim of non-zero size with 'dim'");
  const DimVector shape = keepdim ? DimVector(static_cast<size_t>(self.dim()), 1) : DimVector();
  Tensor indices = ops::new_output(shape, kInt64);
  const Tensor src = self.contiguous();
  kernels::DimLayout l;
  l.n = src.numel();
  kernels::arg_reduce(l, src.dtype(), src.data_ptr(), nullptr, indices.data_ptr<int64_t>(), is_max);
  return indices;
}

std::tuple<Tensor, Tensor> max_min_dim(const Tensor& self, int64_t dim, bool keepdim, bool is_max,
                                       autograd::CallSite site) {
  ops::OpScope rs(is_max ? std::string_view("max") : std::string_view("min"), {&self});
  const char* op = is_max ? "max" : "min";
  ops::check_defined(self, op, "self");
  auto [values, indices] = arg_reduce(self, dim, keepdim, is_max, true, op);
  if (values.is_floating_point() && autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<MaxMinDimBackward>();
    node->indices_ = autograd::SavedVariable(indices, false);
    node->sizes = self.sizes();
    node->dim = wrap_dim(dim, self.dim(), op);
    node->keepdim = keepdim;
    node->is_max = is_max;
    autograd::set_history(values, node, {&self}, site);
  }
  return {values, indices};
}

}  // namespace

std::tuple<Tensor, Tensor> Tensor::max(int64_t dim, bool keepdim, std::source_location loc) const {
  return max_min_dim(*this, dim, keepdim, true, autograd::CallSite::from(loc));
}

std::tuple<Tensor, Tensor> Tensor::min(int64_t dim, bool keepdim, std::source_location loc) const {
  return max_min_dim(*this, dim, keepdim, false, autograd::CallSite::from(loc));
}

Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const {
  return arg_flat(*this, dim, keepdim, true, "argmax");
}
Tensor Tensor::argmin(std::optional<int64_t> dim, bool keepdim) const {
  return arg_flat(*this, dim, keepdim, false, "argmin");
}

// ---- free functions ----

std::tuple<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim, std::source_location loc) {
  return x.max(dim, keepdim, loc);
}
std::tuple<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim, std::source_location loc) {
  return x.min(dim, keepdim, loc);
}
Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) { return x.argmax(dim, keepdim); }
Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) { return x.argmin(dim, keepdim); }

}  // namespace kiln
