// Internal to the ops layer: PyTorch's dim handling for reductions and the
// translation of (tensor, reduced dims) into a kernels::ReduceLayout.
#pragma once

#include <cstdint>

#include "kiln/core/tensor.h"
#include "kiln/kernels/reduce.h"

namespace kiln::ops {

/// Bit d set: dim d is reduced.
using DimMask = uint64_t;

/// Resolves `dims` against `self` as torch does: negative dims wrap, an empty
/// list means every dim, a 0-dim tensor accepts 0 and -1. Out of range raises
/// IndexError, a repeated dim ValueError; both name `op`.
DimMask reduce_mask(const Tensor& self, IntArrayRef dims, const char* op);
/// The mask of a single dim (wrapped and range-checked).
DimMask single_dim_mask(const Tensor& self, int64_t dim, const char* op);
inline DimMask all_dims_mask(const Tensor& self) {
  return self.dim() >= 64 ? ~DimMask{0} : (DimMask{1} << self.dim()) - 1;
}

/// The result shape: reduced dims dropped, or kept as size 1 with keepdim.
DimVector reduced_shape(IntArrayRef sizes, DimMask mask, bool keepdim);

/// For ops without an identity (max, amax, argmax...): IndexError when a reduced
/// dim has size 0, or when every dim is reduced over an empty tensor.
void check_reduce_nonempty(const Tensor& self, DimMask mask, const char* op);

/// Layout for reducing `in` over `mask` into `out` (contiguous, reduced_shape).
kernels::ReduceLayout make_reduce_layout(const Tensor& in, DimMask mask, const Tensor& out);

/// Allocates the result and runs kernel(layout) on it.
template <typename Kernel>
Tensor run_reduction(const Tensor& in, DimMask mask, bool keepdim, DType out_dtype, Kernel&& kernel);

/// A contiguous tensor viewed as [outer, n, inner] around `dim` (already wrapped).
kernels::DimLayout dim_layout(IntArrayRef sizes, int64_t dim);

/// DTypeError unless `self` is floating point; the message follows PyTorch's for `op`.
void check_floating(const Tensor& self, const char* op);

// ---- backward helpers ----

/// The reduced dims of `mask` as a list, ascending (to call the ops again in backward).
DimVector mask_dims(DimMask mask, int64_t ndim);
/// A reduction's output, or its gradient, shaped to broadcast against the
/// input: with keepdim it already is; otherwise the reduced dims are
/// unsqueezed back. A view, never a copy.
Tensor unsqueeze_reduced(const Tensor& t, DimMask mask, int64_t ndim, bool keepdim);
/// unsqueeze_reduced, then expanded to the input's sizes (stride 0 along the reduced dims).
Tensor expand_reduced(const Tensor& t, DimMask mask, IntArrayRef sizes, bool keepdim);
/// sign(x) in x's dtype: -1, 0 or 1, and 0 for NaN (as torch's sgn on real
/// tensors). Built from comparisons, so it carries no gradient, which is its derivative.
Tensor sign_of(const Tensor& x);

}  // namespace kiln::ops

// ---- template definitions ----
#include "iter.h"

namespace kiln::ops {

template <typename Kernel>
Tensor run_reduction(const Tensor& in, DimMask mask, bool keepdim, DType out_dtype, Kernel&& kernel) {
  Tensor out = new_output(reduced_shape(in.sizes(), mask, keepdim), out_dtype);
  if (out.numel() == 0) return out;
  const kernels::ReduceLayout layout = make_reduce_layout(in, mask, out);
  kernel(layout);
  return out;
}

}  // namespace kiln::ops
