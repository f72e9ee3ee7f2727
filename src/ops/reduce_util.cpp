#include "reduce_util.h"

#include <algorithm>

namespace kiln::ops {

namespace {

void check_rank(const Tensor& self, const char* op) {
  KILN_CHECK(self.dim() <= kernels::kMaxLoopDims, ShapeError, op, ": reductions support tensors of at most ",
             kernels::kMaxLoopDims, " dims, got shape ", self.sizes());
}

}  // namespace

DimMask reduce_mask(const Tensor& self, IntArrayRef dims, const char* op) {
  check_rank(self, op);
  if (dims.empty()) return all_dims_mask(self);
  DimMask mask = 0;
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, self.dim(), op);
    KILN_CHECK(!(mask >> w & 1), ValueError, op, ": dim ", w, " appears multiple times in the list of dims ", dims);
    mask |= DimMask{1} << w;
  }
  // A 0-dim tensor accepts dim 0, but has no dim to reduce.
  return mask & all_dims_mask(self);
}

DimMask single_dim_mask(const Tensor& self, int64_t dim, const char* op) {
  check_rank(self, op);
  const int64_t w = wrap_dim(dim, self.dim(), op);
  return (DimMask{1} << w) & all_dims_mask(self);
}

DimVector reduced_shape(IntArrayRef sizes, DimMask mask, bool keepdim) {
  DimVector out;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (!(mask >> d & 1))
      out.push_back(sizes[d]);
    else if (keepdim)
      out.push_back(1);
  }
  return out;
}

void check_reduce_nonempty(const Tensor& self, DimMask mask, const char* op) {
  if (self.numel() != 0) return;
  if (mask == all_dims_mask(self)) {
    KILN_CHECK(false, IndexError, op, "(): expected a non-empty input when reducing over all dims, got shape ",
               self.sizes(), "; the operation has no identity, so specify a dim of non-zero size with 'dim'");
  }
  for (int64_t d = 0; d < self.dim(); ++d) {
    KILN_CHECK(!((mask >> d & 1) && self.sizes()[d] == 0), IndexError, op, "(): expected reduction dim ", d,
               " to have non-zero size, got shape ", self.sizes(), "; the operation has no identity");
  }
}

kernels::ReduceLayout make_reduce_layout(const Tensor& in, DimMask mask, const Tensor& out) {
  check_rank(in, "reduction");
  kernels::ReduceLayout l;
  l.in = static_cast<const char*>(in.data_ptr());
  l.out = static_cast<char*>(out.data_ptr());
  const int64_t es = in.element_size();
  // Kept dims, innermost first; the output is contiguous, so two kept dims merge
  // whenever the input is dense across them.
  for (int64_t d = in.dim() - 1; d >= 0; --d) {
    const int64_t size = in.sizes()[d], stride = in.strides()[d] * es;
    if ((mask >> d & 1) || size == 1) continue;
    const int k = l.out_ndim;
    if (k > 0 && l.out_strides[k - 1] * l.out_sizes[k - 1] == stride) {
      l.out_sizes[k - 1] *= size;
      continue;
    }
    l.out_sizes[k] = size;
    l.out_strides[k] = stride;
    ++l.out_ndim;
  }
  // Reduced dims in memory order (smallest stride first), merged where dense.
  struct Dim {
    int64_t size, stride;
  };
  Dim red[kernels::kMaxLoopDims];
  int nred = 0;
  for (int64_t d = in.dim() - 1; d >= 0; --d) {
    if (!(mask >> d & 1) || in.sizes()[d] == 1) continue;
    red[nred++] = {in.sizes()[d], in.strides()[d] * es};
  }
  std::stable_sort(red, red + nred, [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  for (int i = 0; i < nred; ++i) {
    const int k = l.red_ndim;
    if (k > 0 && l.red_strides[k - 1] * l.red_sizes[k - 1] == red[i].stride) {
      l.red_sizes[k - 1] *= red[i].size;
      continue;
    }
    l.red_sizes[k] = red[i].size;
    l.red_strides[k] = red[i].stride;
    ++l.red_ndim;
  }
  return l;
}

kernels::DimLayout dim_layout(IntArrayRef sizes, int64_t dim) {
  kernels::DimLayout l;
  if (sizes.empty()) {
    l.n = 1;
    return l;
  }
  for (int64_t d = 0; d < dim; ++d) l.outer *= sizes[d];
  l.n = sizes[dim];
  for (size_t d = dim + 1; d < sizes.size(); ++d) l.inner *= sizes[d];
  return l;
}

void check_floating(const Tensor& self, const char* op) {
  KILN_CHECK(self.is_floating_point(), DTypeError, op, "(): expected a floating-point input (float32, float64, ",
             "bfloat16, float16), got ", dtype_name(self.dtype()));
}

DimVector mask_dims(DimMask mask, int64_t ndim) {
  DimVector dims;
  for (int64_t d = 0; d < ndim; ++d) {
    if (mask >> d & 1) dims.push_back(d);
  }
  return dims;
}

Tensor unsqueeze_reduced(const Tensor& t, DimMask mask, int64_t ndim, bool keepdim) {
  if (keepdim) return t;
  Tensor r = t;
  // Ascending order: each unsqueeze puts dim d where the input has it.
  for (int64_t d = 0; d < ndim; ++d) {
    if (mask >> d & 1) r = r.unsqueeze(d);
  }
  return r;
}

Tensor expand_reduced(const Tensor& t, DimMask mask, IntArrayRef sizes, bool keepdim) {
  return unsqueeze_reduced(t, mask, static_cast<int64_t>(sizes.size()), keepdim).expand(sizes);
}

Tensor sign_of(const Tensor& x) { return x.gt(0).to(x.dtype()) - x.lt(0).to(x.dtype()); }

}  // namespace kiln::ops
