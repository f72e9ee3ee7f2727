// View ops: results share storage (and so the version counter) with the input.
// Backward formulas will sit beside each forward (autograd issue).
#include <numeric>
#include <optional>

#include "iter.h"
#include "kiln/core/factory.h"

namespace kiln {

namespace {

Tensor make_view(const Tensor& base, IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  auto impl = make_intrusive<TensorImpl>(base.storage(), base.dtype(), sizes, strides, offset);
  impl->set_inference(base.impl()->is_inference());
  return Tensor(std::move(impl));
}

// Resolves a single -1 in `shape` against numel; checks the element count.
DimVector infer_size(IntArrayRef shape, int64_t numel, const char* op, IntArrayRef input_shape) {
  DimVector out(shape);
  int64_t known = 1;
  std::optional<size_t> infer;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KILN_CHECK(!infer, ShapeError, op, ": only one dimension can be inferred (-1), got ", shape);
      infer = i;
    } else {
      KILN_CHECK(shape[i] >= 0, ShapeError, op, ": invalid shape dimension ", shape[i], " in ", shape);
      known *= shape[i];
    }
  }
  if (infer) {
    KILN_CHECK(known != 0 && numel % known == 0, ShapeError, op, ": shape ", shape, " is invalid for input of shape ",
               input_shape, " (", numel, " elements)");
    out[*infer] = numel / known;
  } else {
    KILN_CHECK(known == numel, ShapeError, op, ": shape ", shape, " is invalid for input of shape ", input_shape,
               " (", numel, " elements vs ", known, ")");
  }
  return out;
}

// Strides for viewing (old sizes, old strides) as new sizes without a copy, or
// nullopt when the memory layout does not allow it (PyTorch's computeStride).
std::optional<DimVector> compute_view_strides(IntArrayRef old_sizes, IntArrayRef old_strides, IntArrayRef new_sizes) {
  DimVector new_strides(new_sizes.size());
  if (old_sizes.empty()) {
    for (auto& s : new_strides) s = 1;
    return new_strides;
  }
  const int64_t numel = shape_numel(old_sizes);
  if (numel == 0) {
    if (old_sizes == new_sizes) return DimVector(old_strides);
    return contiguous_strides(new_sizes);
  }
  int64_t view_d = static_cast<int64_t>(new_sizes.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t td = static_cast<int64_t>(old_sizes.size()) - 1; td >= 0; --td) {
    tensor_numel *= old_sizes[td];
    if (td == 0 || (old_sizes[td - 1] != 1 && old_strides[td - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_sizes[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (td > 0) {
        chunk_base_stride = old_strides[td - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

}  // namespace

Tensor Tensor::view(IntArrayRef shape) const {
  ops::check_defined(*this, "view", "self");
  const DimVector sz = infer_size(shape, numel(), "view", sizes());
  auto st = compute_view_strides(sizes(), strides(), sz);
  KILN_CHECK(st.has_value(), ShapeError, "view: shape ", shape, " is not compatible with the input's size ", sizes(),
             " and stride ", strides(), " (at least one dimension spans across two contiguous subspaces); use "
             ".reshape(...) instead, which copies when it must");
  return make_view(*this, sz, *st, storage_offset());
}

Tensor Tensor::reshape(IntArrayRef shape) const {
  ops::check_defined(*this, "reshape", "self");
  const DimVector sz = infer_size(shape, numel(), "reshape", sizes());
  if (auto st = compute_view_strides(sizes(), strides(), sz)) return make_view(*this, sz, *st, storage_offset());
  return clone().view(sz);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  ops::check_defined(*this, "transpose", "self");
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  if (dim() == 0) return make_view(*this, sizes(), strides(), storage_offset());
  DimVector sz(sizes()), st(strides());
  std::swap(sz[d0], sz[d1]);
  std::swap(st[d0], st[d1]);
  return make_view(*this, sz, st, storage_offset());
}

Tensor Tensor::permute(IntArrayRef dims) const {
  ops::check_defined(*this, "permute", "self");
  KILN_CHECK(static_cast<int64_t>(dims.size()) == dim(), ShapeError, "permute: number of dims ", dims,
             " does not match the tensor's ", dim(), " dims (shape ", sizes(), ")");
  DimVector sz(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], dim(), "permute");
    KILN_CHECK(!seen[d], ShapeError, "permute: dim ", d, " appears more than once in ", dims);
    seen[d] = true;
    sz[i] = sizes()[d];
    st[i] = strides()[d];
  }
  return make_view(*this, sz, st, storage_offset());
}

Tensor Tensor::t() const {
  ops::check_defined(*this, "t", "self");
  KILN_CHECK(dim() <= 2, ShapeError, "t: expects a tensor with <= 2 dimensions, got ", dim(), " (shape ", sizes(),
             "); use transpose(dim0, dim1) or mT");
  return dim() < 2 ? transpose(0, 0) : transpose(0, 1);
}

Tensor Tensor::squeeze() const {
  ops::check_defined(*this, "squeeze", "self");
  DimVector sz, st;
  for (int64_t d = 0; d < dim(); ++d) {
    if (sizes()[d] != 1) {
      sz.push_back(sizes()[d]);
      st.push_back(strides()[d]);
    }
  }
  return make_view(*this, sz, st, storage_offset());
}

Tensor Tensor::squeeze(int64_t d) const {
  ops::check_defined(*this, "squeeze", "self");
  d = wrap_dim(d, dim(), "squeeze");
  if (dim() == 0 || sizes()[d] != 1) return make_view(*this, sizes(), strides(), storage_offset());
  DimVector sz(sizes()), st(strides());
  sz.erase(d);
  st.erase(d);
  return make_view(*this, sz, st, storage_offset());
}

Tensor Tensor::unsqueeze(int64_t d) const {
  ops::check_defined(*this, "unsqueeze", "self");
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  DimVector sz(sizes()), st(strides());
  const int64_t new_stride = d >= dim() ? 1 : sizes()[d] * strides()[d];
  sz.insert(d, 1);
  st.insert(d, new_stride);
  return make_view(*this, sz, st, storage_offset());
}

Tensor Tensor::expand(IntArrayRef shape) const {
  ops::check_defined(*this, "expand", "self");
  KILN_CHECK(shape.size() >= static_cast<size_t>(dim()), ShapeError, "expand: the requested shape ", shape,
             " has fewer dims than the tensor's shape ", sizes());
  const int64_t nd = static_cast<int64_t>(shape.size()), lead = nd - dim();
  DimVector sz(nd), st(nd);
  for (int64_t i = nd - 1; i >= 0; --i) {
    const int64_t src = i - lead;
    int64_t want = shape[i];
    if (src < 0) {
      KILN_CHECK(want >= 0, ShapeError, "expand: -1 is not allowed in a new leading dim, got ", shape);
      sz[i] = want;
      st[i] = 0;
      continue;
    }
    const int64_t have = sizes()[src];
    if (want == -1) want = have;
    KILN_CHECK(have == want || have == 1, ShapeError, "expand: the expanded size (", want,
               ") must match the existing size (", have, ") at non-singleton dimension ", i, ": target shape ",
               shape, ", tensor shape ", sizes());
    sz[i] = want;
    st[i] = have == want ? strides()[src] : 0;
  }
  return make_view(*this, sz, st, storage_offset());
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  ops::check_defined(*this, "narrow", "self");
  KILN_CHECK(dim() > 0, ShapeError, "narrow: cannot be applied to a 0-dim tensor");
  d = wrap_dim(d, dim(), "narrow");
  const int64_t n = sizes()[d];
  if (start < 0) start += n;
  KILN_CHECK(start >= 0 && length >= 0 && start + length <= n, IndexError, "narrow: start (", start,
             ") + length (", length, ") exceeds dimension ", d, " of size ", n, " (shape ", sizes(), ")");
  return slice(d, start, start + length, 1);
}

Tensor Tensor::slice(int64_t d, std::optional<int64_t> start, std::optional<int64_t> end, int64_t step) const {
  ops::check_defined(*this, "slice", "self");
  KILN_CHECK(dim() > 0, ShapeError, "slice: cannot be applied to a 0-dim tensor");
  KILN_CHECK(step > 0, ValueError, "slice: step must be positive, got ", step);
  d = wrap_dim(d, dim(), "slice");
  const int64_t n = sizes()[d];
  int64_t s = start.value_or(0), e = end.value_or(n);
  if (s < 0) s += n;
  if (e < 0) e += n;
  s = std::clamp<int64_t>(s, 0, n);
  e = std::clamp<int64_t>(e, s, n);
  DimVector sz(sizes()), st(strides());
  sz[d] = (e - s + step - 1) / step;
  st[d] = strides()[d] * step;
  return make_view(*this, sz, st, storage_offset() + s * strides()[d]);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  ops::check_defined(*this, "select", "self");
  KILN_CHECK(dim() > 0, IndexError, "select: cannot index a 0-dim tensor");
  d = wrap_dim(d, dim(), "select");
  const int64_t n = sizes()[d];
  KILN_CHECK(index >= -n && index < n, IndexError, "select: index ", index, " is out of bounds for dimension ", d,
             " with size ", n);
  if (index < 0) index += n;
  DimVector sz(sizes()), st(strides());
  sz.erase(d);
  st.erase(d);
  return make_view(*this, sz, st, storage_offset() + index * strides()[d]);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  ops::check_defined(*this, "flatten", "self");
  if (dim() == 0) return reshape({1});
  start_dim = wrap_dim(start_dim, dim(), "flatten");
  end_dim = wrap_dim(end_dim, dim(), "flatten");
  KILN_CHECK(start_dim <= end_dim, ValueError, "flatten: start_dim (", start_dim, ") must not come after end_dim (",
             end_dim, ")");
  DimVector sz;
  for (int64_t d = 0; d < start_dim; ++d) sz.push_back(sizes()[d]);
  int64_t m = 1;
  for (int64_t d = start_dim; d <= end_dim; ++d) m *= sizes()[d];
  sz.push_back(m);
  for (int64_t d = end_dim + 1; d < dim(); ++d) sz.push_back(sizes()[d]);
  return reshape(sz);
}

Tensor Tensor::unflatten(int64_t d, IntArrayRef shape) const {
  ops::check_defined(*this, "unflatten", "self");
  KILN_CHECK(dim() > 0, IndexError, "unflatten: dimension ", d, " specified but a 0-dim tensor has no dimensions");
  d = wrap_dim(d, dim(), "unflatten");
  KILN_CHECK(!shape.empty(), ShapeError, "unflatten: sizes must be non-empty");
  const DimVector inner = infer_size(shape, sizes()[d], "unflatten", sizes());
  DimVector sz;
  for (int64_t i = 0; i < d; ++i) sz.push_back(sizes()[i]);
  for (int64_t s : inner) sz.push_back(s);
  for (int64_t i = d + 1; i < dim(); ++i) sz.push_back(sizes()[i]);
  return view(sz);
}

std::vector<Tensor> Tensor::split(int64_t split_size, int64_t d) const {
  ops::check_defined(*this, "split", "self");
  KILN_CHECK(dim() > 0, ShapeError, "split: cannot split a 0-dim tensor");
  d = wrap_dim(d, dim(), "split");
  const int64_t n = sizes()[d];
  KILN_CHECK(split_size > 0 || (split_size == 0 && n == 0), ValueError, "split: split_size must be positive, got ",
             split_size);
  std::vector<Tensor> out;
  if (n == 0) {
    out.push_back(*this);
    return out;
  }
  for (int64_t s = 0; s < n; s += split_size) out.push_back(narrow(d, s, std::min(split_size, n - s)));
  return out;
}

std::vector<Tensor> Tensor::split_with_sizes(IntArrayRef split_sizes, int64_t d) const {
  ops::check_defined(*this, "split_with_sizes", "self");
  KILN_CHECK(dim() > 0, ShapeError, "split_with_sizes: cannot split a 0-dim tensor");
  d = wrap_dim(d, dim(), "split_with_sizes");
  int64_t total = 0;
  for (int64_t s : split_sizes) {
    KILN_CHECK(s >= 0, ValueError, "split_with_sizes: sizes must be non-negative, got ", split_sizes);
    total += s;
  }
  KILN_CHECK(total == sizes()[d], ShapeError, "split_with_sizes: sizes ", split_sizes, " sum to ", total,
             " but dimension ", d, " has size ", sizes()[d]);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : split_sizes) {
    out.push_back(narrow(d, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t d) const {
  ops::check_defined(*this, "chunk", "self");
  KILN_CHECK(dim() > 0, ShapeError, "chunk: cannot chunk a 0-dim tensor");
  KILN_CHECK(chunks > 0, ValueError, "chunk: number of chunks must be positive, got ", chunks);
  d = wrap_dim(d, dim(), "chunk");
  const int64_t n = sizes()[d];
  const int64_t size = (n + chunks - 1) / chunks;
  if (size == 0) {  // torch.chunk of an empty dim: `chunks` empty pieces
    std::vector<Tensor> out;
    for (int64_t i = 0; i < chunks; ++i) out.push_back(narrow(d, 0, 0));
    return out;
  }
  return split(size, d);
}

std::vector<Tensor> Tensor::unbind(int64_t d) const {
  ops::check_defined(*this, "unbind", "self");
  KILN_CHECK(dim() > 0, IndexError, "unbind: dimension ", d, " specified but a 0-dim tensor has no dimensions");
  d = wrap_dim(d, dim(), "unbind");
  std::vector<Tensor> out;
  for (int64_t i = 0; i < sizes()[d]; ++i) out.push_back(select(d, i));
  return out;
}

Tensor Tensor::as_strided(IntArrayRef sz, IntArrayRef st, std::optional<int64_t> offset) const {
  ops::check_defined(*this, "as_strided", "self");
  KILN_CHECK(sz.size() == st.size(), ShapeError, "as_strided: sizes ", sz, " and strides ", st,
             " must have the same length");
  const int64_t off = offset.value_or(storage_offset());
  KILN_CHECK(off >= 0, ValueError, "as_strided: storage offset must be non-negative, got ", off);
  int64_t max_index = off;
  bool empty_view = false;
  for (size_t i = 0; i < sz.size(); ++i) {
    KILN_CHECK(sz[i] >= 0 && st[i] >= 0, ShapeError, "as_strided: negative sizes or strides are not supported, got "
               "sizes ", sz, ", strides ", st);
    if (sz[i] == 0) empty_view = true;
    else max_index += (sz[i] - 1) * st[i];
  }
  const int64_t storage_elems = static_cast<int64_t>(storage()->nbytes()) / element_size();
  KILN_CHECK(empty_view || max_index < storage_elems, IndexError, "as_strided: sizes ", sz, ", strides ", st,
             " and offset ", off, " reach element ", max_index, ", beyond the storage's ", storage_elems,
             " elements");
  return make_view(*this, sz, st, off);
}

Tensor Tensor::diagonal(int64_t offset, int64_t d1, int64_t d2) const {
  ops::check_defined(*this, "diagonal", "self");
  KILN_CHECK(dim() >= 2, ShapeError, "diagonal: expects a tensor of at least 2 dims, got shape ", sizes());
  d1 = wrap_dim(d1, dim(), "diagonal");
  d2 = wrap_dim(d2, dim(), "diagonal");
  KILN_CHECK(d1 != d2, ValueError, "diagonal: dim1 and dim2 cannot be identical, got ", d1, " and ", d2);
  int64_t len, off = storage_offset();
  if (offset >= 0) {
    len = std::max<int64_t>(std::min(sizes()[d1], sizes()[d2] - offset), 0);
    if (len > 0) off += offset * strides()[d2];
  } else {
    len = std::max<int64_t>(std::min(sizes()[d1] + offset, sizes()[d2]), 0);
    if (len > 0) off -= offset * strides()[d1];
  }
  DimVector sz, st;
  for (int64_t d = 0; d < dim(); ++d) {
    if (d == d1 || d == d2) continue;
    sz.push_back(sizes()[d]);
    st.push_back(strides()[d]);
  }
  sz.push_back(len);
  st.push_back(strides()[d1] + strides()[d2]);
  return make_view(*this, sz, st, off);
}

}  // namespace kiln
