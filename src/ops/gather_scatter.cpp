// index_select, gather, scatter, scatter_add (Tensor methods and free forms),
// embedding and one_hot, with their backward: gather <-> scatter_add,
// index_select and embedding -> index_add (grad_ops.h), scatter's self ->
// the gradient with the scattered positions zeroed. Gradients never flow to
// indices; one_hot is not differentiable (integer result).
//
// Shapes follow torch: a 0-dim self or index is treated as 1-D of one element
// (torch's ensure_nonempty_dim), so gather(scalar, 0, [0, 0]) is legal.
// Index values are checked before the kernel runs (kernels/index.h), so an
// in-place scatter that raises leaves self unmodified.
#include <algorithm>
#include <cstring>

#include "grad_ops.h"
#include "iter.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/index.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;

namespace {

using kernels::ScatterMode;

// Sizes and strides with 0-dim seen as [1] (torch's ensure_nonempty_*).
struct NonemptyDims {
  DimVector sizes;
  DimVector strides;
};
NonemptyDims nonempty_dims(const Tensor& t) {
  if (t.dim() == 0) return {DimVector{1}, DimVector{1}};
  return {DimVector(t.sizes()), DimVector(t.strides())};
}

kernels::StridedOperand operand(const Tensor& t, IntArrayRef strides) {
  return {static_cast<char*>(t.data_ptr()), strides, t.element_size()};
}

// A contiguous copy that, unlike clone(), leaves the new tensor at version 0.
Tensor fresh_copy(const Tensor& t) {
  Tensor out = ops::new_output(t.sizes(), t.dtype());
  if (t.numel() > 0) kernels::copy_cast(ops::make_loop(out.sizes(), {&out, &t}), t.dtype(), t.dtype());
  return out;
}

// The first index value outside [0, size), or nullopt; scans with a parallel
// min/max first so the common all-valid case costs one read of the index.
std::optional<int64_t> find_bad_index(const Tensor& index, IntArrayRef sizes, IntArrayRef strides, int64_t size) {
  if (shape_numel(sizes) == 0) return std::nullopt;
  capture::sync("an index check");  // the indices may come from kernels a compiled function has not run yet
  const auto loop = kernels::make_strided_loop(sizes, {operand(index, strides)});
  const auto r = kernels::index_min_max(loop, index.dtype());
  if (r.min >= 0 && r.max < size) return std::nullopt;
  return kernels::first_out_of_range(loop, index.dtype(), 0, size);
}

void check_index_values(const Tensor& index, IntArrayRef sizes, IntArrayRef strides, int64_t size, const char* op,
                        int64_t dim) {
  if (auto bad = find_bad_index(index, sizes, strides, size)) {
    throw IndexError(
        detail::concat(op, ": index ", *bad, " is out of bounds for dimension ", dim, " with size ", size));
  }
}

// index_select on validated arguments (dim wrapped, index values in range).
Tensor index_select_unchecked(const Tensor& self, int64_t dim, const Tensor& index) {
  if (self.dim() == 0) return fresh_copy(self);
  const int64_t k = index.numel();
  DimVector out_sizes(self.sizes());
  out_sizes[dim] = k;
  Tensor out = ops::new_output(out_sizes, self.dtype());
  if (out.numel() == 0) return out;
  const int64_t index_stride = index.dim() == 0 ? 0 : index.stride(0);
  if (self.is_contiguous()) {
    int64_t outer = 1, inner = 1;
    for (int64_t d = 0; d < dim; ++d) outer *= self.sizes()[d];
    for (int64_t d = dim + 1; d < self.dim(); ++d) inner *= self.sizes()[d];
    kernels::index_select_contiguous(static_cast<char*>(out.data_ptr()), static_cast<const char*>(self.data_ptr()),
                                     index.data_ptr(), self.dtype(), index.dtype(), index_stride, outer,
                                     self.sizes()[dim], k, inner);
    return out;
  }
  // Note [Gather/scatter as a restrided loop]: gather with an index that
  // varies only along dim.
  DimVector self_strides(self.strides()), idx_strides(self.dim(), 0);
  self_strides[dim] = 0;
  idx_strides[dim] = index_stride;
  const auto loop = kernels::make_strided_loop(
      out_sizes, {operand(out, out.strides()), operand(self, self_strides), operand(index, idx_strides)});
  const bool valid =
      kernels::gather(loop, self.dtype(), index.dtype(), self.strides()[dim] * self.element_size(), self.sizes()[dim]);
  KILN_ASSERT(valid, "index_select: indices were checked before the kernel");
  return out;
}

// Shared checks and kernel call of scatter_, scatter_add_ and the value form.
void scatter_into(const Tensor& self, int64_t dim, const Tensor& index, const Tensor* src, const Scalar* value,
                  ScatterMode mode, const char* op) {
  ops::check_defined(self, op, "self");
  ops::check_defined(index, op, "index");
  if (src) {
    ops::check_defined(*src, op, "src");
    KILN_CHECK(src->dtype() == self.dtype(), DTypeError, op, ": Expected self.dtype to be equal to src.dtype, got ",
               dtype_name(self.dtype()), " and ", dtype_name(src->dtype()));
  }
  const int64_t nd = std::max<int64_t>(self.dim(), 1);
  dim = wrap_dim(dim, nd, op);
  if (value) ops::check_scalar_fits(*value, self.dtype(), op);
  if (index.numel() == 0) return;  // torch skips the index checks for an empty index
  KILN_CHECK(index.dtype() == kInt64, DTypeError, op, ": Expected dtype int64 for index, got ",
             dtype_name(index.dtype()));
  KILN_CHECK(std::max<int64_t>(index.dim(), 1) == nd, ShapeError, op,
             ": index tensor must have the same number of dimensions as self tensor, got index shape ", index.sizes(),
             " and self shape ", self.sizes());
  if (src) {
    KILN_CHECK(std::max<int64_t>(src->dim(), 1) == nd, ShapeError, op,
               ": index tensor must have the same number of dimensions as src tensor, got index shape ", index.sizes(),
               " and src shape ", src->sizes());
  }
  const NonemptyDims s = nonempty_dims(self), ix = nonempty_dims(index);
  NonemptyDims sr;
  if (src) sr = nonempty_dims(*src);
  for (int64_t d = 0; d < nd; ++d) {
    const bool ok = (d == dim || ix.sizes[d] <= s.sizes[d]) && (!src || ix.sizes[d] <= sr.sizes[d]);
    if (!ok && src) {
      throw ShapeError(detail::concat(op, ": expected index ", index.sizes(), " to be no larger than self ",
                                      self.sizes(), " apart from dimension ", dim, " and no larger than src ",
                                      src->sizes(), " (mismatch at dimension ", d, ")"));
    }
    KILN_CHECK(ok, ShapeError, op, ": expected index ", index.sizes(), " to be no larger than self ", self.sizes(),
               " apart from dimension ", dim, " (mismatch at dimension ", d, ")");
  }
  for (int64_t d = 0; d < nd; ++d) {
    KILN_CHECK(s.strides[d] != 0 || s.sizes[d] <= 1, ValueError, op,
               ": more than one element of the written-to tensor (shape ", self.sizes(), ", strides ", self.strides(),
               ") refers to a single memory location; clone() it first");
  }
  check_index_values(index, ix.sizes, ix.strides, s.sizes[dim], op, dim);
  // Reads that alias the written tensor would see earlier writes: read a copy.
  const Tensor idx = index.is_alias_of(self) ? fresh_copy(index) : index;
  DimVector self_strides = s.strides;
  self_strides[dim] = 0;
  const int64_t dim_stride = s.strides[dim] * self.element_size();
  if (src) {
    const Tensor source = src->is_alias_of(self) ? fresh_copy(*src) : *src;
    const NonemptyDims so = nonempty_dims(source);
    const auto loop = kernels::make_strided_loop(
        ix.sizes, {operand(self, self_strides), operand(source, so.strides), operand(idx, ix.strides)});
    kernels::scatter(loop, self.dtype(), idx.dtype(), dim_stride, mode);
  } else {
    const auto loop = kernels::make_strided_loop(ix.sizes, {operand(self, self_strides), operand(idx, ix.strides)});
    kernels::scatter_value(loop, self.dtype(), idx.dtype(), dim_stride, *value);
  }
}

// The gradient of scatter's src: grad gathered at the scattered positions,
// padded with zeros where src is larger than index (those elements were not
// used). torch 1.13 raises for that case; the padded gradient is the true one.
Tensor src_gradient(const Tensor& g, int64_t dim, const Tensor& index, IntArrayRef src_sizes) {
  Tensor picked = g.gather(dim, index);
  if (index.sizes() == src_sizes) return picked;
  const NonemptyDims ix = nonempty_dims(index);
  const DimVector src_nd = src_sizes.empty() ? DimVector{1} : DimVector(src_sizes);
  if (ix.sizes == src_nd) return picked.reshape(src_sizes);
  return ops::view_scatter_zeros(picked.reshape(ix.sizes), src_nd, ix.sizes, contiguous_strides(src_nd), 0,
                                 "GatherBackwardBackward0")
      .reshape(src_sizes);
}

// scatter (src or value form, in place or not) and scatter_add: edges
// {self, src} (src absent for the value form).
struct ScatterBackward final : autograd::Node {
  const char* node_name = "ScatterBackward0";
  bool add = false;  // scatter_add: self's gradient passes unchanged
  bool has_src = true;
  int64_t dim = 0;
  SavedVariable index;
  DimVector src_sizes;
  const char* name() const override { return node_name; }
  TensorList apply(TensorList&& g) override {
    const Tensor idx = index.unpack(this);
    TensorList out(has_src ? 2 : 1);
    if (!g[0].defined()) return out;
    if (next_edges()[0].is_valid()) out[0] = add ? g[0] : g[0].scatter(dim, idx, 0);
    if (has_src && next_edges()[1].is_valid()) out[1] = src_gradient(g[0], dim, idx, src_sizes);
    return out;
  }
  void release_variables() override { index.reset(); }
};

struct IndexSelectBackward final : autograd::Node {
  DimVector self_sizes;
  int64_t dim = 0;
  SavedVariable index;
  const char* name() const override { return "IndexSelectBackward0"; }
  TensorList apply(TensorList&& g) override {
    const Tensor idx = index.unpack(this);
    if (!g[0].defined()) return {Tensor()};
    if (self_sizes.size() == 0) return {g[0].reshape(self_sizes)};
    return {ops::index_add_zeros(self_sizes, dim, idx, g[0])};
  }
  void release_variables() override { index.reset(); }
};

struct GatherBackward final : autograd::Node {
  DimVector self_sizes;
  int64_t dim = 0;
  SavedVariable index;
  const char* name() const override { return "GatherBackward0"; }
  TensorList apply(TensorList&& g) override {
    const Tensor idx = index.unpack(this);
    if (!g[0].defined()) return {Tensor()};
    return {ops::scatter_add_zeros(self_sizes, dim, idx, g[0])};
  }
  void release_variables() override { index.reset(); }
};

// Backward of scatter_add_zeros (the double backward of gather).
struct ScatterAddZerosBackward final : autograd::Node {
  int64_t dim = 0;
  SavedVariable index;
  const char* name() const override { return "ScatterAddBackward0"; }
  TensorList apply(TensorList&& g) override {
    const Tensor idx = index.unpack(this);
    if (!g[0].defined()) return {Tensor()};
    return {g[0].gather(dim, idx)};
  }
  void release_variables() override { index.reset(); }
};

struct EmbeddingBackward final : autograd::Node {
  int64_t num_weights = 0;
  SavedVariable indices;
  const char* name() const override { return "EmbeddingBackward0"; }
  TensorList apply(TensorList&& g) override {
    const Tensor idx = indices.unpack(this);
    if (!g[0].defined()) return {Tensor()};
    const int64_t width = g[0].sizes().back();
    return {ops::index_add_zeros({num_weights, width}, 0, idx.reshape({-1}), g[0].reshape({-1, width}))};
  }
  void release_variables() override { indices.reset(); }
};

IntrusivePtr<ScatterBackward> scatter_node(const char* name, bool add, const Tensor* src, int64_t dim,
                                           const Tensor& index) {
  auto node = make_intrusive<ScatterBackward>();
  node->node_name = name;
  node->add = add;
  node->has_src = src != nullptr;
  node->dim = dim;
  node->index = SavedVariable(index, false);
  if (src) node->src_sizes = DimVector(src->sizes());
  return node;
}

// An out-of-place scatter: a copy of self, scattered into, with its node.
Tensor scatter_out_of_place(const Tensor& self, int64_t dim, const Tensor& index, const Tensor* src,
                            const Scalar* value, ScatterMode mode, const char* op, const char* node_name,
                            CallSite site) {
  ops::OpScope rs(ops::NamePtr{op}, {&self, &index, src});
  ops::check_defined(self, op, "self");
  Tensor out = fresh_copy(self);
  scatter_into(out, dim, index, src, value, mode, op);
  if (self.is_floating_point() && autograd::compute_requires_grad({&self, src})) {
    auto node = scatter_node(node_name, mode == ScatterMode::Add, src, dim, index);
    if (src)
      autograd::set_history(out, node, {&self, src}, site);
    else
      autograd::set_history(out, node, {&self}, site);
  }
  return out;
}

Tensor& scatter_in_place(Tensor& self, int64_t dim, const Tensor& index, const Tensor* src, const Scalar* value,
                         ScatterMode mode, const char* op, const char* node_name, CallSite site) {
  ops::OpScope rs(ops::NamePtr{op}, {&self, &index, src});
  ops::check_defined(self, op, "self");
  autograd::check_inplace(self, op, site, {src});
  const bool record = self.is_floating_point() && autograd::compute_requires_grad({&self, src});
  scatter_into(self, dim, index, src, value, mode, op);
  self.bump_version();
  if (record) {
    auto node = scatter_node(node_name, mode == ScatterMode::Add, src, dim, index);
    if (src)
      autograd::rebase_history(self, node, {src}, site);
    else
      autograd::rebase_history(self, node, {}, site);
  }
  return self;
}

}  // namespace

Tensor Tensor::index_select(int64_t d, const Tensor& index, std::source_location loc) const {
  ops::OpScope rs("index_select", {this, &index});
  ops::check_defined(*this, "index_select", "self");
  ops::check_defined(index, "index_select", "index");
  KILN_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, DTypeError,
             "index_select(): Expected dtype int32 or int64 for index, got ", dtype_name(index.dtype()));
  KILN_CHECK(index.dim() <= 1, IndexError,
             "index_select(): index is supposed to be a vector (0-dim or 1-D), got shape ", index.sizes());
  d = wrap_dim(d, std::max<int64_t>(dim(), 1), "index_select");
  const int64_t size = dim() == 0 ? 1 : sizes()[d];
  const DimVector idx_sizes{index.numel()}, idx_strides{index.dim() == 0 ? 1 : index.stride(0)};
  check_index_values(index, idx_sizes, idx_strides, size, "index_select()", d);
  Tensor out = index_select_unchecked(*this, d, index);
  if (autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<IndexSelectBackward>();
    node->self_sizes = DimVector(sizes());
    node->dim = d;
    node->index = SavedVariable(index, false);
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

Tensor Tensor::gather(int64_t d, const Tensor& index, std::source_location loc) const {
  ops::OpScope rs("gather", {this, &index});
  ops::check_defined(*this, "gather", "self");
  ops::check_defined(index, "gather", "index");
  const int64_t nd = std::max<int64_t>(dim(), 1);
  d = wrap_dim(d, nd, "gather");
  Tensor out = ops::new_output(index.sizes(), dtype());
  auto recorded = [&]() -> Tensor {
    if (autograd::compute_requires_grad({this})) {
      auto node = make_intrusive<GatherBackward>();
      node->self_sizes = DimVector(sizes());
      node->dim = d;
      node->index = SavedVariable(index, false);
      autograd::set_history(out, node, {this}, CallSite::from(loc));
    }
    return out;
  };
  // torch skips the index checks for an empty index.
  if (index.numel() == 0) return recorded();
  KILN_CHECK(index.dtype() == kInt64, DTypeError, "gather(): Expected dtype int64 for index, got ",
             dtype_name(index.dtype()));
  KILN_CHECK(std::max<int64_t>(index.dim(), 1) == nd, ShapeError,
             "gather(): index tensor must have the same number of dimensions as input tensor, got index shape ",
             index.sizes(), " and input shape ", sizes());
  const NonemptyDims s = nonempty_dims(*this), ix = nonempty_dims(index);
  for (int64_t i = 0; i < nd; ++i) {
    KILN_CHECK(i == d || ix.sizes[i] <= s.sizes[i], ShapeError, "gather(): size does not match at dimension ", i,
               ": expected index ", index.sizes(), " to be no larger than self ", sizes(), " apart from dimension ", d);
  }
  // An empty dim makes every index bad, and the kernel's fallback read of
  // index 0 would itself be out of bounds: report before reading.
  if (s.sizes[d] == 0) check_index_values(index, ix.sizes, ix.strides, 0, "gather()", d);
  DimVector self_strides = s.strides;
  self_strides[d] = 0;
  const DimVector out_strides = contiguous_strides(ix.sizes);
  const auto loop = kernels::make_strided_loop(
      ix.sizes, {operand(out, out_strides), operand(*this, self_strides), operand(index, ix.strides)});
  if (!kernels::gather(loop, dtype(), index.dtype(), s.strides[d] * element_size(), s.sizes[d])) {
    check_index_values(index, ix.sizes, ix.strides, s.sizes[d], "gather()", d);  // raises with the first bad index
    KILN_ASSERT(false, "gather: the kernel saw a bad index that the scan did not find");
  }
  return recorded();
}

Tensor& Tensor::scatter_(int64_t d, const Tensor& index, const Tensor& src, std::source_location loc) {
  return scatter_in_place(*this, d, index, &src, nullptr, ScatterMode::Assign, "scatter_", "ScatterBackward0",
                          CallSite::from(loc));
}

Tensor& Tensor::scatter_(int64_t d, const Tensor& index, const Scalar& value, std::source_location loc) {
  return scatter_in_place(*this, d, index, nullptr, &value, ScatterMode::Assign, "scatter_", "ScatterBackward1",
                          CallSite::from(loc));
}

Tensor& Tensor::scatter_add_(int64_t d, const Tensor& index, const Tensor& src, std::source_location loc) {
  return scatter_in_place(*this, d, index, &src, nullptr, ScatterMode::Add, "scatter_add_", "ScatterAddBackward0",
                          CallSite::from(loc));
}

Tensor Tensor::scatter(int64_t d, const Tensor& index, const Tensor& src, std::source_location loc) const {
  return scatter_out_of_place(*this, d, index, &src, nullptr, ScatterMode::Assign, "scatter", "ScatterBackward0",
                              CallSite::from(loc));
}

Tensor Tensor::scatter(int64_t d, const Tensor& index, const Scalar& value, std::source_location loc) const {
  return scatter_out_of_place(*this, d, index, nullptr, &value, ScatterMode::Assign, "scatter", "ScatterBackward1",
                              CallSite::from(loc));
}

Tensor Tensor::scatter_add(int64_t d, const Tensor& index, const Tensor& src, std::source_location loc) const {
  return scatter_out_of_place(*this, d, index, &src, nullptr, ScatterMode::Add, "scatter_add", "ScatterAddBackward0",
                              CallSite::from(loc));
}

Tensor index_select(const Tensor& self, int64_t dim, const Tensor& index, std::source_location loc) {
  return self.index_select(dim, index, loc);
}
Tensor gather(const Tensor& self, int64_t dim, const Tensor& index, std::source_location loc) {
  return self.gather(dim, index, loc);
}
Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src, std::source_location loc) {
  return self.scatter(dim, index, src, loc);
}
Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Scalar& value, std::source_location loc) {
  return self.scatter(dim, index, value, loc);
}
Tensor scatter_add(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src, std::source_location loc) {
  return self.scatter_add(dim, index, src, loc);
}

namespace ops {

Tensor scatter_add_zeros(IntArrayRef sizes, int64_t dim, const Tensor& index, const Tensor& src) {
  OpScope rs("scatter_add", {&index, &src});
  Tensor out = zeros(sizes, src.dtype());
  scatter_into(out, dim, index, &src, nullptr, ScatterMode::Add, "scatter_add");
  if (autograd::compute_requires_grad({&src})) {
    auto node = make_intrusive<ScatterAddZerosBackward>();
    node->dim = dim;
    node->index = SavedVariable(index, false);
    autograd::set_history(out, node, {&src});
  }
  return out;
}

}  // namespace ops

Tensor embedding(const Tensor& weight, const Tensor& indices, std::source_location loc) {
  ops::OpScope rs("embedding", {&weight, &indices});
  ops::check_defined(weight, "embedding", "weight");
  ops::check_defined(indices, "embedding", "indices");
  KILN_CHECK(weight.dim() == 2, ShapeError,
             "embedding: 'weight' must be 2-D [num_embeddings, embedding_dim], got shape ", weight.sizes());
  KILN_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32, DTypeError,
             "embedding: expected indices of dtype int64 or int32, got ", dtype_name(indices.dtype()));
  const int64_t table = weight.sizes()[0];
  const Tensor flat = indices.reshape({-1});
  const DimVector idx_sizes{flat.numel()}, idx_strides{flat.stride(0)};
  if (auto bad = find_bad_index(flat, idx_sizes, idx_strides, table)) {
    throw IndexError(detail::concat("embedding: index ", *bad, " is out of range for an embedding table of ", table,
                                    " entries (weight shape ", weight.sizes(), ", indices shape ", indices.sizes(),
                                    ")"));
  }
  DimVector out_sizes(indices.sizes());
  out_sizes.push_back(weight.sizes()[1]);
  Tensor out = index_select_unchecked(weight, 0, flat).view(out_sizes);
  if (autograd::compute_requires_grad({&weight})) {
    auto node = make_intrusive<EmbeddingBackward>();
    node->num_weights = table;
    node->indices = SavedVariable(indices, false);
    autograd::set_history(out, node, {&weight}, CallSite::from(loc));
  }
  return out;
}

Tensor one_hot(const Tensor& indices, int64_t num_classes, std::source_location) {
  ops::OpScope rs("one_hot", {&indices});
  ops::check_defined(indices, "one_hot", "indices");
  KILN_CHECK(indices.dtype() == kInt64, DTypeError, "one_hot: is only applicable to index tensors of dtype int64, got ",
             dtype_name(indices.dtype()));
  DimVector out_sizes(indices.sizes());
  if (indices.numel() == 0) {
    KILN_CHECK(num_classes > 0, ValueError, "one_hot: can not infer the number of classes from an empty tensor (shape ",
               indices.sizes(), "); pass num_classes > 0");
    out_sizes.push_back(num_classes);
    return ops::new_output(out_sizes, kInt64);
  }
  // Without num_classes the largest index is the result's size: a replay could not follow new indices.
  // (With it, the scan below only validates.)
  if (num_classes == -1) {
    capture::graph_break_if_recording("one_hot without num_classes reads the indices on the host");
  }
  const Tensor idx = indices.contiguous();
  const DimVector flat_sizes{idx.numel()}, flat_strides{1};
  const auto loop = kernels::make_strided_loop(flat_sizes, {operand(idx, flat_strides)});
  const auto range = kernels::index_min_max(loop, kInt64);
  KILN_CHECK(range.min >= 0, ValueError, "one_hot: class values must be non-negative, got ", range.min);
  if (num_classes == -1) {
    num_classes = range.max + 1;
  } else {
    KILN_CHECK(range.max < num_classes, ValueError, "one_hot: class values must be smaller than num_classes (",
               num_classes, "), got ", range.max);
  }
  out_sizes.push_back(num_classes);
  Tensor out = ops::new_output(out_sizes, kInt64);
  capture::host_write("one_hot (zero)", [p = out.data_ptr(), nbytes = static_cast<size_t>(out.nbytes())]() {
    std::memset(p, 0, nbytes);
  });
  kernels::one_hot(idx.data_ptr<int64_t>(), idx.numel(), num_classes, out.data_ptr<int64_t>());
  return out;
}

}  // namespace kiln
