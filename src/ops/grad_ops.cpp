// Building blocks of the view/copy/indexing backward formulas (grad_ops.h).
#include "grad_ops.h"

#include <algorithm>
#include <vector>

#include "iter.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/index.h"
#include "kiln/ops/factory.h"

namespace kiln::ops {

namespace {

using autograd::SavedVariable;

// Backward of view_scatter_zeros: the view it wrote into, read back.
struct ViewScatterBackward final : autograd::Node {
  const char* node_name = "";
  DimVector sizes, strides;
  int64_t offset = 0;
  const char* name() const override { return node_name; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const Tensor c = g[0].contiguous();
    return {c.as_strided(sizes, strides, c.storage_offset() + offset)};
  }
};

// Backward of index_add_zeros: the rows it added from, read back.
struct IndexAddBackward final : autograd::Node {
  int64_t dim = 0;
  SavedVariable index;
  const char* name() const override { return "IndexAddBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].index_select(dim, index.unpack(this))};
  }
  void release_variables() override { index.reset(); }
};

}  // namespace

Tensor view_scatter_zeros(const Tensor& grad, IntArrayRef base_sizes, IntArrayRef sizes, IntArrayRef strides,
                          int64_t offset, const char* name) {
  Tensor out = zeros(base_sizes, grad.dtype());
  if (grad.numel() > 0) {
    const int64_t es = grad.element_size();
    char* dst = static_cast<char*>(out.data_ptr()) + offset * es;
    const auto loop = kernels::make_strided_loop(
        sizes, {{dst, strides, es}, {static_cast<char*>(grad.data_ptr()), grad.strides(), es}});
    kernels::copy_cast(loop, grad.dtype(), grad.dtype());
  }
  if (autograd::compute_requires_grad({&grad})) {
    auto node = make_intrusive<ViewScatterBackward>();
    node->node_name = name;
    node->sizes = DimVector(sizes);
    node->strides = DimVector(strides);
    node->offset = offset;
    autograd::set_history(out, node, {&grad});
  }
  return out;
}

Tensor index_add_zeros(IntArrayRef sizes, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out = zeros(sizes, src.dtype());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= sizes[d];
  for (int64_t d = dim + 1; d < static_cast<int64_t>(sizes.size()); ++d) inner *= sizes[d];
  const int64_t k = index.numel();
  KILN_ASSERT(src.numel() == outer * k * inner, "index_add_zeros: source of shape ", src.sizes(), " does not hold ", k,
              " slices of the output ", sizes, " along dim ", dim);
  if (out.numel() > 0 && k > 0) {
    const Tensor s = src.is_contiguous() ? src : copy_no_grad(src, src.dtype(), MemoryFormat::Contiguous);
    const int64_t index_stride = index.dim() == 0 ? 1 : index.stride(0);
    kernels::index_add_contiguous(static_cast<char*>(out.data_ptr()), static_cast<const char*>(s.data_ptr()),
                                  index.data_ptr(), out.dtype(), index.dtype(), index_stride, outer, sizes[dim], k,
                                  inner);
  }
  if (autograd::compute_requires_grad({&src})) {
    auto node = make_intrusive<IndexAddBackward>();
    node->dim = dim;
    node->index = SavedVariable(index, false);
    autograd::set_history(out, node, {&src});
  }
  return out;
}

Tensor sum_to_size(const Tensor& g, IntArrayRef sizes) {
  if (g.sizes() == sizes) return g;
  const int64_t lead = g.dim() - static_cast<int64_t>(sizes.size());
  KILN_ASSERT(lead >= 0, "sum_to_size: gradient of shape ", g.sizes(), " cannot be summed to ", sizes);
  DimVector dims;
  for (int64_t d = 0; d < g.dim(); ++d) {
    if (d < lead || (sizes[d - lead] == 1 && g.sizes()[d] != 1)) dims.push_back(d);
  }
  const Tensor r = dims.empty() ? g : g.sum(dims.ref(), /*keepdim=*/true);
  return r.reshape(sizes);
}

namespace {

// Elements a geometry spans from offset 0: 1 + offset + sum (size - 1) * stride, or 0 when empty.
int64_t min_storage_size(const StridedGeometry& g, int64_t offset) {
  int64_t n = 1 + offset;
  for (size_t d = 0; d < g.sizes.size(); ++d) {
    if (g.sizes[d] == 0) return 0;
    n += (g.sizes[d] - 1) * g.strides[d];
  }
  return n;
}

// False only when no two elements of the geometry share a location: with the
// dims sorted by stride, each stride exceeds the span of the smaller ones.
bool maybe_overlapping(const StridedGeometry& g) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (size_t d = 0; d < g.sizes.size(); ++d) {
    if (g.sizes[d] == 0) return false;
    if (g.sizes[d] > 1) dims.push_back({g.strides[d], g.sizes[d]});
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += stride * (size - 1);
  }
  return false;
}

// Calls f(location) for every element of the geometry (offset added), row-major.
template <typename F>
void for_each_location(const StridedGeometry& g, int64_t offset, F&& f) {
  const int64_t nd = static_cast<int64_t>(g.sizes.size());
  if (shape_numel(g.sizes) == 0) return;
  DimVector idx(static_cast<size_t>(nd), 0);
  int64_t loc = offset;
  while (true) {
    f(loc);
    int64_t d = nd - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < g.sizes[d]) {
        loc += g.strides[d];
        break;
      }
      loc -= (g.sizes[d] - 1) * g.strides[d];
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace

Tensor as_strided_backward(const Tensor& grad, const StridedGeometry& input, const StridedGeometry& output,
                           bool input_is_view) {
  const int64_t shared = std::min(input.offset, output.offset);
  const int64_t in_off = input.offset - shared, out_off = output.offset - shared;
  const int64_t base = std::max(min_storage_size(input, in_off), min_storage_size(output, out_off));
  Tensor storage;
  if (maybe_overlapping(output)) {
    // Several output elements read one location: their gradients sum there.
    const Tensor out_index = arange(base, kInt64).as_strided(output.sizes, output.strides, out_off).reshape({-1});
    storage = index_add_zeros({base}, 0, out_index, grad.reshape({-1}));
  } else {
    storage = view_scatter_zeros(grad, {base}, output.sizes, output.strides, out_off, "AsStridedBackwardBackward0");
  }
  const bool input_overlaps = maybe_overlapping(input);
  if (input_overlaps || input_is_view) {
    std::vector<int64_t> count(static_cast<size_t>(base), 0);
    for_each_location(input, in_off, [&](int64_t p) { ++count[static_cast<size_t>(p)]; });
    if (input_is_view) {
      for_each_location(output, out_off, [&](int64_t p) {
        KILN_CHECK(count[static_cast<size_t>(p)] > 0, ValueError, "as_strided backward: the view (sizes ", output.sizes,
                   ", strides ", output.strides, ", offset ", output.offset, ") reads memory outside its input (sizes ",
                   input.sizes, ", strides ", input.strides, ", offset ", input.offset,
                   "), which is itself a view of a tensor that requires grad; the gradient for that memory would "
                   "belong to the base and be lost. Call as_strided on the base instead");
      });
    }
    if (input_overlaps) {
      // Each location's gradient is shared among the input elements that alias it.
      std::vector<double> c(count.begin(), count.end());
      for (double& v : c) v = std::max(v, 1.0);
      storage = storage / tensor<double>(c, {base}).to(grad.dtype());
    }
  }
  return storage.as_strided(input.sizes, input.strides, storage.storage_offset() + in_off);
}

}  // namespace kiln::ops
