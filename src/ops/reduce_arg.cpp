// max/min along a dim with indices, and argmax/argmin. Backward (autograd
// issue) scatters the gradient to the returned indices.
#include "iter.h"
#include "kiln/ops/reduce.h"
#include "reduce_util.h"

namespace kiln {

namespace {

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

}  // namespace

std::tuple<Tensor, Tensor> Tensor::max(int64_t dim, bool keepdim) const {
  ops::check_defined(*this, "max", "self");
  return arg_reduce(*this, dim, keepdim, true, true, "max");
}

std::tuple<Tensor, Tensor> Tensor::min(int64_t dim, bool keepdim) const {
  ops::check_defined(*this, "min", "self");
  return arg_reduce(*this, dim, keepdim, false, true, "min");
}

Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const { return arg_flat(*this, dim, keepdim, true, "argmax"); }
Tensor Tensor::argmin(std::optional<int64_t> dim, bool keepdim) const { return arg_flat(*this, dim, keepdim, false, "argmin"); }

// ---- free functions ----

std::tuple<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) { return x.max(dim, keepdim); }
std::tuple<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim) { return x.min(dim, keepdim); }
Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) { return x.argmax(dim, keepdim); }
Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) { return x.argmin(dim, keepdim); }

}  // namespace kiln
