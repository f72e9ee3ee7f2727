// Statistics reductions: var/std (two-pass), norm, logsumexp. Backward
// formulas will sit beside each forward (autograd issue): var's gradient is
// 2 (x - mean) / dof, norm's x |x|^(p-2) / norm^(p-1), logsumexp's softmax.
#include <cmath>

#include "iter.h"
#include "kiln/core/factory.h"
#include "kiln/ops/reduce.h"
#include "reduce_util.h"

namespace kiln {

using ops::DimMask;

namespace {

Tensor var_std(const Tensor& self, IntArrayRef dims, int64_t correction, bool keepdim, bool take_sqrt) {
  const char* op = take_sqrt ? "std" : "var";
  ops::check_defined(self, op, "self");
  const DimMask mask = ops::reduce_mask(self, dims, op);
  KILN_CHECK(self.is_floating_point(), DTypeError, op,
             "(): std and var only support floating point dtypes, got ", dtype_name(self.dtype()));
  return ops::run_reduction(self, mask, keepdim, self.dtype(), [&](const kernels::ReduceLayout& l) {
    kernels::var(l, self.dtype(), correction, take_sqrt);
  });
}

}  // namespace

Tensor Tensor::var(IntArrayRef dims, int64_t correction, bool keepdim) const {
  return var_std(*this, dims, correction, keepdim, false);
}

Tensor Tensor::std(IntArrayRef dims, int64_t correction, bool keepdim) const {
  return var_std(*this, dims, correction, keepdim, true);
}

Tensor Tensor::norm(double p, IntArrayRef dims, bool keepdim) const {
  ops::check_defined(*this, "norm", "self");
  const DimMask mask = ops::reduce_mask(*this, dims, "norm");
  KILN_CHECK(is_floating_point(), DTypeError, "norm(): input dtype should be floating point, got ",
             dtype_name(dtype()), " (convert with .to(kFloat32) first)");
  KILN_CHECK(!std::isnan(p), ValueError, "norm(): expected a number or +-inf for p, got nan");
  Tensor out = ops::new_output(ops::reduced_shape(sizes(), mask, keepdim), dtype());
  if (out.numel() == 0) return out;
  const kernels::ReduceLayout l = ops::make_reduce_layout(*this, mask, out);
  // Tensor.norm gives 0 over an empty slice for every p (inf and -inf included).
  if (l.reduce_numel() == 0) return out.zero_();
  kernels::norm(l, dtype(), p);
  return out;
}

Tensor Tensor::logsumexp(IntArrayRef dims, bool keepdim) const {
  ops::check_defined(*this, "logsumexp", "self");
  const DimMask mask = ops::reduce_mask(*this, dims, "logsumexp");
  // As torch: integer and bool inputs are computed in the default float dtype.
  const Tensor src = is_floating_point() ? *this : to(default_dtype());
  return ops::run_reduction(src, mask, keepdim, src.dtype(),
                            [&](const kernels::ReduceLayout& l) { kernels::logsumexp(l, src.dtype()); });
}

// ---- free functions ----

Tensor var(const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim) {
  return x.var(dims, correction, keepdim);
}
Tensor std(const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim) {
  return x.std(dims, correction, keepdim);
}
Tensor norm(const Tensor& x, double p, IntArrayRef dims, bool keepdim) { return x.norm(p, dims, keepdim); }
Tensor logsumexp(const Tensor& x, IntArrayRef dims, bool keepdim) { return x.logsumexp(dims, keepdim); }

}  // namespace kiln
