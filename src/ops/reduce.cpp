// Reductions with an identity or a plain fold: sum, mean, prod, amax/amin,
// max()/min() over all elements, all/any. Backward formulas will sit beside
// each forward (autograd issue): sum and mean broadcast the gradient back,
// prod divides the product by each input, amax/amin split it among ties.
#include "kiln/ops/reduce.h"

#include "iter.h"
#include "reduce_util.h"

namespace kiln {

using ops::DimMask;

// ---- sum ----

Tensor Tensor::sum(std::optional<DType> dtype) const { return sum(IntArrayRef{}, false, dtype); }

Tensor Tensor::sum(IntArrayRef dims, bool keepdim, std::optional<DType> dtype) const {
  ops::check_defined(*this, "sum", "self");
  const DimMask mask = ops::reduce_mask(*this, dims, "sum");
  // torch.sum(x, dtype=d) converts first, then sums in d; without dtype, integers and bool sum to int64.
  const Tensor src = dtype && *dtype != this->dtype() ? to(*dtype) : *this;
  const DType out_dtype = dtype ? *dtype : (is_integral(this->dtype(), true) ? kInt64 : this->dtype());
  return ops::run_reduction(src, mask, keepdim, out_dtype,
                            [&](const kernels::ReduceLayout& l) { kernels::sum(l, src.dtype(), out_dtype); });
}

// ---- mean ----

namespace {

void check_mean_dtype(const Tensor& self) {
  KILN_CHECK(self.is_floating_point(), DTypeError,
             "mean(): could not infer output dtype. Input dtype must be either a floating point or complex dtype. "
             "Got: ",
             dtype_name(self.dtype()), " (convert with .to(kFloat32) first)");
}

}  // namespace

Tensor Tensor::mean() const { return mean(IntArrayRef{}, false); }

Tensor Tensor::mean(IntArrayRef dims, bool keepdim) const {
  ops::check_defined(*this, "mean", "self");
  const DimMask mask = ops::reduce_mask(*this, dims, "mean");
  check_mean_dtype(*this);
  return ops::run_reduction(*this, mask, keepdim, dtype(),
                            [&](const kernels::ReduceLayout& l) { kernels::mean(l, dtype()); });
}

// ---- prod ----

namespace {

Tensor prod_impl(const Tensor& self, DimMask mask, bool keepdim) {
  const DType out_dtype = is_integral(self.dtype(), true) ? kInt64 : self.dtype();
  return ops::run_reduction(self, mask, keepdim, out_dtype,
                            [&](const kernels::ReduceLayout& l) { kernels::prod(l, self.dtype(), out_dtype); });
}

}  // namespace

Tensor Tensor::prod() const {
  ops::check_defined(*this, "prod", "self");
  return prod_impl(*this, ops::all_dims_mask(*this), false);
}

Tensor Tensor::prod(int64_t dim, bool keepdim) const {
  ops::check_defined(*this, "prod", "self");
  return prod_impl(*this, ops::single_dim_mask(*this, dim, "prod"), keepdim);
}

// ---- amax / amin / max() / min() ----

namespace {

Tensor amax_amin(const Tensor& self, DimMask mask, bool keepdim, bool is_max, const char* op) {
  ops::check_reduce_nonempty(self, mask, op);
  return ops::run_reduction(self, mask, keepdim, self.dtype(),
                            [&](const kernels::ReduceLayout& l) { kernels::amax_amin(l, self.dtype(), is_max); });
}

}  // namespace

Tensor Tensor::amax(IntArrayRef dims, bool keepdim) const {
  ops::check_defined(*this, "amax", "self");
  return amax_amin(*this, ops::reduce_mask(*this, dims, "amax"), keepdim, true, "amax");
}

Tensor Tensor::amin(IntArrayRef dims, bool keepdim) const {
  ops::check_defined(*this, "amin", "self");
  return amax_amin(*this, ops::reduce_mask(*this, dims, "amin"), keepdim, false, "amin");
}

Tensor Tensor::max() const {
  ops::check_defined(*this, "max", "self");
  return amax_amin(*this, ops::all_dims_mask(*this), false, true, "max");
}

Tensor Tensor::min() const {
  ops::check_defined(*this, "min", "self");
  return amax_amin(*this, ops::all_dims_mask(*this), false, false, "min");
}

// ---- all / any ----

namespace {

Tensor all_any(const Tensor& self, bool is_all) {
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

Tensor sum(const Tensor& x, std::optional<DType> dtype) { return x.sum(dtype); }
Tensor sum(const Tensor& x, IntArrayRef dims, bool keepdim, std::optional<DType> dtype) {
  return x.sum(dims, keepdim, dtype);
}
Tensor mean(const Tensor& x) { return x.mean(); }
Tensor mean(const Tensor& x, IntArrayRef dims, bool keepdim) { return x.mean(dims, keepdim); }
Tensor prod(const Tensor& x) { return x.prod(); }
Tensor prod(const Tensor& x, int64_t dim, bool keepdim) { return x.prod(dim, keepdim); }
Tensor max(const Tensor& x) { return x.max(); }
Tensor min(const Tensor& x) { return x.min(); }
Tensor amax(const Tensor& x, IntArrayRef dims, bool keepdim) { return x.amax(dims, keepdim); }
Tensor amin(const Tensor& x, IntArrayRef dims, bool keepdim) { return x.amin(dims, keepdim); }
Tensor all(const Tensor& x) { return x.all(); }
Tensor any(const Tensor& x) { return x.any(); }

}  // namespace kiln
