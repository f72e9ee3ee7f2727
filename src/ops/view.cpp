// View ops: results share storage (and so the version counter) with the input.
//
// Each op builds its result with make_view, which records nothing; when the
// input requires grad (and grad mode is on) the op then records its backward
// node with set_view_history, so in-place changes through other aliases are
// caught (docs/autograd.md, "Views"). The inference path costs two flag tests.
//
// Backward: views that keep every element (view, transpose, permute, squeeze,
// unsqueeze) map the gradient back with the inverse view; expand sums over
// the expanded dims; slice/select/diagonal write the gradient into the same
// view of a zeros tensor (view_scatter_zeros, grad_ops.h); split and unbind
// are one multi-output node that joins their gradients with cat/stack;
// as_strided has its own general backward (view_backward.cpp).
#include <numeric>
#include <optional>

#include "grad_ops.h"
#include "iter.h"
#include "kiln/autograd/autograd_meta.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/memory_format.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;

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
    KILN_CHECK(known == numel, ShapeError, op, ": shape ", shape, " is invalid for input of shape ", input_shape, " (",
               numel, " elements vs ", known, ")");
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

// Geometry (sizes, strides, offset) of slice/select/diagonal applied to a
// tensor of `sizes`/`strides` at `offset`. The forwards use the input's
// strides; the backwards the contiguous strides of the zeros they write into.
struct Geometry {
  DimVector sizes, strides;
  int64_t offset = 0;
};

Geometry slice_geometry(IntArrayRef sizes, IntArrayRef strides, int64_t offset, int64_t d, int64_t start, int64_t len,
                        int64_t step) {
  Geometry g{DimVector(sizes), DimVector(strides), offset + start * strides[d]};
  g.sizes[d] = len;
  g.strides[d] = strides[d] * step;
  return g;
}

Geometry select_geometry(IntArrayRef sizes, IntArrayRef strides, int64_t offset, int64_t d, int64_t index) {
  Geometry g{DimVector(sizes), DimVector(strides), offset + index * strides[d]};
  g.sizes.erase(d);
  g.strides.erase(d);
  return g;
}

Geometry diagonal_geometry(IntArrayRef sizes, IntArrayRef strides, int64_t offset, int64_t diag, int64_t d1,
                           int64_t d2) {
  Geometry g;
  g.offset = offset;
  int64_t len;
  if (diag >= 0) {
    len = std::max<int64_t>(std::min(sizes[d1], sizes[d2] - diag), 0);
    if (len > 0) g.offset += diag * strides[d2];
  } else {
    len = std::max<int64_t>(std::min(sizes[d1] + diag, sizes[d2]), 0);
    if (len > 0) g.offset -= diag * strides[d1];
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (static_cast<int64_t>(d) == d1 || static_cast<int64_t>(d) == d2) continue;
    g.sizes.push_back(sizes[d]);
    g.strides.push_back(strides[d]);
  }
  g.sizes.push_back(len);
  g.strides.push_back(strides[d1] + strides[d2]);
  return g;
}

Tensor make_view(const Tensor& base, const Geometry& g) { return make_view(base, g.sizes, g.strides, g.offset); }

// ---- backward nodes ----

// view, reshape, squeeze: the gradient reshaped back to the input's shape.
struct ReshapeBackward final : autograd::Node {
  const char* node_name = "ViewBackward0";
  DimVector self_sizes;
  const char* name() const override { return node_name; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].reshape(self_sizes)};
  }
};

struct TransposeBackward final : autograd::Node {
  int64_t d0 = 0, d1 = 0;
  const char* name() const override { return "TransposeBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].transpose(d0, d1)};
  }
};

struct TBackward final : autograd::Node {
  const char* name() const override { return "TBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].t()};
  }
};

struct PermuteBackward final : autograd::Node {
  DimVector inverse;
  const char* name() const override { return "PermuteBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].permute(inverse)};
  }
};

struct UnsqueezeBackward final : autograd::Node {
  int64_t dim = 0;
  const char* name() const override { return "UnsqueezeBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].squeeze(dim)};
  }
};

struct ExpandBackward final : autograd::Node {
  DimVector self_sizes;
  const char* name() const override { return "ExpandBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {ops::sum_to_size(g[0], self_sizes)};
  }
};

// slice, select, diagonal: the gradient written into the same view of zeros
// of the input's shape (geometry relative to those contiguous zeros).
struct StridedViewBackward final : autograd::Node {
  const char* node_name = "";
  const char* backward_name = "";
  DimVector self_sizes;
  Geometry view;
  const char* name() const override { return node_name; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {ops::view_scatter_zeros(g[0], self_sizes, view.sizes, view.strides, view.offset, backward_name)};
  }
};

// split, split_with_sizes, chunk (one node, one output per piece): the
// pieces' gradients joined along dim, zeros for pieces that got none.
struct SplitBackward final : autograd::Node {
  const char* node_name = "SplitBackward0";
  DimVector self_sizes;
  int64_t dim = 0;
  DType dtype = kFloat32;
  DimVector lengths;
  const char* name() const override { return node_name; }
  // The gradients when they already lie side by side along dim in one
  // buffer, as the pieces of the forward did (fused attention writes q, k
  // and v's gradients into one [B, T, 3C] tensor): the view of that buffer
  // over the whole input, no copy. Undefined otherwise.
  Tensor already_joined(const TensorList& g) const {
    const Tensor& g0 = g[0];
    if (!g0.defined() || g0.dtype() != dtype) return Tensor();
    const int64_t es = g0.element_size();
    int64_t offset = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const Tensor& t = g[i];
      // A gradient with history (create_graph) keeps the copy: a view of g0 would carry g0's history only.
      if (!t.defined() || t.requires_grad() || t.dtype() != dtype || !t.is_alias_of(g0) ||
          t.strides() != g0.strides() || t.size(dim) != lengths[i] ||
          static_cast<const char*>(t.data_ptr()) !=
              static_cast<const char*>(g0.data_ptr()) + offset * g0.stride(dim) * es)
        return Tensor();
      for (int64_t d = 0; d < t.dim(); ++d)
        if (d != dim && t.size(d) != self_sizes[d]) return Tensor();
      offset += lengths[i];
    }
    return g0.as_strided(self_sizes, g0.strides(), g0.storage_offset());
  }
  TensorList apply(TensorList&& g) override {
    bool any = false;
    for (const Tensor& t : g) any |= t.defined();
    if (!any) return {Tensor()};
    if (g.size() == 1) return {g[0]};
    if (Tensor joined = already_joined(g); joined.defined()) return {joined};
    std::vector<Tensor> parts;
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i].defined()) {
        parts.push_back(g[i]);
      } else {
        DimVector sz(self_sizes);
        sz[dim] = lengths[i];
        parts.push_back(zeros(sz, dtype));
      }
    }
    return {cat(parts, dim)};
  }
};

struct UnbindBackward final : autograd::Node {
  DimVector self_sizes;
  int64_t dim = 0;
  DType dtype = kFloat32;
  const char* name() const override { return "UnbindBackward0"; }
  TensorList apply(TensorList&& g) override {
    bool any = false;
    for (const Tensor& t : g) any |= t.defined();
    if (!any) return {Tensor()};
    DimVector piece(self_sizes);
    piece.erase(dim);
    std::vector<Tensor> parts;
    for (const Tensor& t : g) parts.push_back(t.defined() ? t : zeros(piece, dtype));
    return {stack(parts, dim)};
  }
};

struct AsStridedBackward final : autograd::Node {
  ops::StridedGeometry input, output;
  bool input_is_view = false;
  const char* name() const override { return "AsStridedBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {ops::as_strided_backward(g[0], input, output, input_is_view)};
  }
};

// Views of floating tensors outside inference mode are tracked, as torch's
// differentiable views: an in-place write into one must reach its base's
// history even when only the written value requires grad (a KV cache).
bool tracks_views(const Tensor& base) {
  return base.is_floating_point() && !base.impl()->is_inference() && !inference_mode_enabled();
}

autograd::ViewCreation creation_mode() {
  return grad_mode_enabled() ? autograd::ViewCreation::kDefault : autograd::ViewCreation::kNoGradMode;
}

// Records `node` (filled by `fill`) as the history of `out`, a view of `base`,
// when base requires grad and grad mode is on; otherwise only marks the view.
template <typename NodeT, typename Fill>
Tensor record_view(Tensor out, const Tensor& base, const std::source_location& loc, Fill&& fill) {
  if (autograd::compute_requires_grad({&base})) {
    auto node = make_intrusive<NodeT>();
    fill(*node);
    autograd::set_view_history(out, node, base, CallSite::from(loc));
  } else if (tracks_views(base)) {
    autograd::mark_view(out, base, creation_mode());
  }
  return out;
}

// The multi-output form: views of `base` from one op (split, chunk, unbind),
// which torch does not let be written in place under grad mode. `node` is
// null when base needs no gradient.
void record_views(std::vector<Tensor>& views, const autograd::NodePtr& node, const Tensor& base,
                  const std::source_location& loc) {
  if (node) {
    autograd::set_history(views, node, TensorList{base}, CallSite::from(loc));
  } else if (!tracks_views(base)) {
    return;
  }
  const auto creation =
      node || grad_mode_enabled() ? autograd::ViewCreation::kMultipleOutput : autograd::ViewCreation::kNoGradMode;
  for (Tensor& v : views) autograd::mark_view(v, base, creation);
}

Tensor transpose_view(const Tensor& t, int64_t d0, int64_t d1) {
  if (t.dim() == 0) return make_view(t, t.sizes(), t.strides(), t.storage_offset());
  DimVector sz(t.sizes()), st(t.strides());
  std::swap(sz[d0], sz[d1]);
  std::swap(st[d0], st[d1]);
  return make_view(t, sz, st, t.storage_offset());
}

// Normalises slice arguments: wrapped dim, clamped start, length.
struct SliceArgs {
  int64_t dim, start, length;
};
SliceArgs slice_args(const Tensor& t, int64_t d, std::optional<int64_t> start, std::optional<int64_t> end,
                     int64_t step) {
  KILN_CHECK(t.dim() > 0, ShapeError, "slice: cannot be applied to a 0-dim tensor");
  KILN_CHECK(step > 0, ValueError, "slice: step must be positive, got ", step);
  d = wrap_dim(d, t.dim(), "slice");
  const int64_t n = t.sizes()[d];
  int64_t s = start.value_or(0), e = end.value_or(n);
  if (s < 0) s += n;
  if (e < 0) e += n;
  s = std::clamp<int64_t>(s, 0, n);
  e = std::clamp<int64_t>(e, s, n);
  return {d, s, (e - s + step - 1) / step};
}

Tensor record_slice(Tensor out, const Tensor& base, const SliceArgs& a, int64_t step, const std::source_location& loc) {
  return record_view<StridedViewBackward>(std::move(out), base, loc, [&](StridedViewBackward& n) {
    n.node_name = "SliceBackward0";
    n.backward_name = "SliceBackwardBackward0";
    n.self_sizes = DimVector(base.sizes());
    n.view = slice_geometry(base.sizes(), contiguous_strides(base.sizes()), 0, a.dim, a.start, a.length, step);
  });
}

// Pieces of `t` along dim d (lengths given), as views with no history.
std::vector<Tensor> split_views(const Tensor& t, int64_t d, IntArrayRef lengths) {
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t len : lengths) {
    out.push_back(make_view(t, slice_geometry(t.sizes(), t.strides(), t.storage_offset(), d, start, len, 1)));
    start += len;
  }
  return out;
}

std::vector<Tensor> record_split(std::vector<Tensor> views, const Tensor& base, int64_t d, IntArrayRef lengths,
                                 const char* node_name, const std::source_location& loc) {
  autograd::NodePtr recorded;
  if (autograd::compute_requires_grad({&base})) {
    auto node = make_intrusive<SplitBackward>();
    node->node_name = node_name;
    node->self_sizes = DimVector(base.sizes());
    node->dim = d;
    node->dtype = base.dtype();
    node->lengths = DimVector(lengths);
    recorded = node;
  }
  record_views(views, recorded, base, loc);
  return views;
}

}  // namespace

Tensor Tensor::view(IntArrayRef shape, std::source_location loc) const {
  ops::OpScope rs("view", {this});
  ops::check_defined(*this, "view", "self");
  const DimVector sz = infer_size(shape, numel(), "view", sizes());
  auto st = compute_view_strides(sizes(), strides(), sz);
  KILN_CHECK(st.has_value(), ShapeError, "view: shape ", shape, " is not compatible with the input's size ", sizes(),
             " and stride ", strides(), " (at least one dimension spans across two contiguous subspaces)",
             suggest_memory_format(*this) == MemoryFormat::ChannelsLast
                 ? ": the tensor is channels-last in memory, as kiln's conv2d, batch norm and max pooling return "
                   "their results (docs/decisions.md); use .reshape(...) or .flatten(...), which copy when they "
                   "must, or .contiguous() first"
                 : "; use .reshape(...) instead, which copies when it must");
  return record_view<ReshapeBackward>(make_view(*this, sz, *st, storage_offset()), *this, loc,
                                      [&](ReshapeBackward& n) { n.self_sizes = DimVector(sizes()); });
}

Tensor Tensor::reshape(IntArrayRef shape, std::source_location loc) const {
  ops::OpScope rs("reshape", {this});
  ops::check_defined(*this, "reshape", "self");
  const DimVector sz = infer_size(shape, numel(), "reshape", sizes());
  if (auto st = compute_view_strides(sizes(), strides(), sz)) {
    return record_view<ReshapeBackward>(make_view(*this, sz, *st, storage_offset()), *this, loc,
                                        [&](ReshapeBackward& n) {
                                          n.node_name = "ReshapeAliasBackward0";
                                          n.self_sizes = DimVector(sizes());
                                        });
  }
  // The copy path: a new tensor, not a view of the input.
  Tensor copy = ops::copy_no_grad(*this, dtype(), MemoryFormat::Contiguous);
  Tensor out = make_view(copy, sz, contiguous_strides(sz), 0);
  if (autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<ReshapeBackward>();
    node->node_name = "UnsafeViewBackward0";
    node->self_sizes = DimVector(sizes());
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1, std::source_location loc) const {
  ops::OpScope rs("transpose", {this});
  ops::check_defined(*this, "transpose", "self");
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  return record_view<TransposeBackward>(transpose_view(*this, d0, d1), *this, loc, [&](TransposeBackward& n) {
    n.d0 = d0;
    n.d1 = d1;
  });
}

Tensor Tensor::permute(IntArrayRef dims, std::source_location loc) const {
  ops::OpScope rs("permute", {this});
  ops::check_defined(*this, "permute", "self");
  KILN_CHECK(static_cast<int64_t>(dims.size()) == dim(), ShapeError, "permute: number of dims ", dims,
             " does not match the tensor's ", dim(), " dims (shape ", sizes(), ")");
  DimVector sz(dims.size()), st(dims.size()), inverse(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], dim(), "permute");
    KILN_CHECK(!seen[d], ShapeError, "permute: dim ", d, " appears more than once in ", dims);
    seen[d] = true;
    sz[i] = sizes()[d];
    st[i] = strides()[d];
    inverse[d] = static_cast<int64_t>(i);
  }
  return record_view<PermuteBackward>(make_view(*this, sz, st, storage_offset()), *this, loc,
                                      [&](PermuteBackward& n) { n.inverse = inverse; });
}

Tensor Tensor::t(std::source_location loc) const {
  ops::OpScope rs("t", {this});
  ops::check_defined(*this, "t", "self");
  KILN_CHECK(dim() <= 2, ShapeError, "t: expects a tensor with <= 2 dimensions, got ", dim(), " (shape ", sizes(),
             "); use transpose(dim0, dim1) or mT");
  Tensor out = dim() < 2 ? make_view(*this, sizes(), strides(), storage_offset()) : transpose_view(*this, 0, 1);
  return record_view<TBackward>(std::move(out), *this, loc, [](TBackward&) {});
}

Tensor Tensor::squeeze(std::source_location loc) const {
  ops::OpScope rs("squeeze", {this});
  ops::check_defined(*this, "squeeze", "self");
  DimVector sz, st;
  for (int64_t d = 0; d < dim(); ++d) {
    if (sizes()[d] != 1) {
      sz.push_back(sizes()[d]);
      st.push_back(strides()[d]);
    }
  }
  return record_view<ReshapeBackward>(make_view(*this, sz, st, storage_offset()), *this, loc, [&](ReshapeBackward& n) {
    n.node_name = "SqueezeBackward0";
    n.self_sizes = DimVector(sizes());
  });
}

Tensor Tensor::squeeze(int64_t d, std::source_location loc) const {
  ops::OpScope rs("squeeze", {this});
  ops::check_defined(*this, "squeeze", "self");
  d = wrap_dim(d, dim(), "squeeze");
  DimVector sz(sizes()), st(strides());
  if (dim() > 0 && sizes()[d] == 1) {
    sz.erase(d);
    st.erase(d);
  }
  return record_view<ReshapeBackward>(make_view(*this, sz, st, storage_offset()), *this, loc, [&](ReshapeBackward& n) {
    n.node_name = "SqueezeBackward1";
    n.self_sizes = DimVector(sizes());
  });
}

Tensor Tensor::unsqueeze(int64_t d, std::source_location loc) const {
  ops::OpScope rs("unsqueeze", {this});
  ops::check_defined(*this, "unsqueeze", "self");
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  DimVector sz(sizes()), st(strides());
  const int64_t new_stride = d >= dim() ? 1 : sizes()[d] * strides()[d];
  sz.insert(d, 1);
  st.insert(d, new_stride);
  return record_view<UnsqueezeBackward>(make_view(*this, sz, st, storage_offset()), *this, loc,
                                        [&](UnsqueezeBackward& n) { n.dim = d; });
}

Tensor Tensor::expand(IntArrayRef shape, std::source_location loc) const {
  ops::OpScope rs("expand", {this});
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
               ") must match the existing size (", have, ") at non-singleton dimension ", i, ": target shape ", shape,
               ", tensor shape ", sizes());
    sz[i] = want;
    st[i] = have == want ? strides()[src] : 0;
  }
  return record_view<ExpandBackward>(make_view(*this, sz, st, storage_offset()), *this, loc,
                                     [&](ExpandBackward& n) { n.self_sizes = DimVector(sizes()); });
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length, std::source_location loc) const {
  ops::OpScope rs("narrow", {this});
  ops::check_defined(*this, "narrow", "self");
  KILN_CHECK(dim() > 0, ShapeError, "narrow: cannot be applied to a 0-dim tensor");
  d = wrap_dim(d, dim(), "narrow");
  const int64_t n = sizes()[d];
  if (start < 0) start += n;
  KILN_CHECK(start >= 0 && length >= 0 && start + length <= n, IndexError, "narrow: start (", start, ") + length (",
             length, ") exceeds dimension ", d, " of size ", n, " (shape ", sizes(), ")");
  return slice(d, start, start + length, 1, loc);
}

Tensor Tensor::slice(int64_t d, std::optional<int64_t> start, std::optional<int64_t> end, int64_t step,
                     std::source_location loc) const {
  ops::OpScope rs("slice", {this});
  ops::check_defined(*this, "slice", "self");
  const SliceArgs a = slice_args(*this, d, start, end, step);
  Tensor out = make_view(*this, slice_geometry(sizes(), strides(), storage_offset(), a.dim, a.start, a.length, step));
  return record_slice(std::move(out), *this, a, step, loc);
}

Tensor Tensor::select(int64_t d, int64_t index, std::source_location loc) const {
  ops::OpScope rs("select", {this});
  ops::check_defined(*this, "select", "self");
  KILN_CHECK(dim() > 0, IndexError, "select: cannot index a 0-dim tensor");
  d = wrap_dim(d, dim(), "select");
  const int64_t n = sizes()[d];
  KILN_CHECK(index >= -n && index < n, IndexError, "select: index ", index, " is out of bounds for dimension ", d,
             " with size ", n);
  if (index < 0) index += n;
  Tensor out = make_view(*this, select_geometry(sizes(), strides(), storage_offset(), d, index));
  return record_view<StridedViewBackward>(std::move(out), *this, loc, [&](StridedViewBackward& node) {
    node.node_name = "SelectBackward0";
    node.backward_name = "SelectBackwardBackward0";
    node.self_sizes = DimVector(sizes());
    node.view = select_geometry(sizes(), contiguous_strides(sizes()), 0, d, index);
  });
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim, std::source_location loc) const {
  ops::OpScope rs("flatten", {this});
  ops::check_defined(*this, "flatten", "self");
  if (dim() == 0) return reshape({1}, loc);
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
  return reshape(sz, loc);
}

Tensor Tensor::unflatten(int64_t d, IntArrayRef shape, std::source_location loc) const {
  ops::OpScope rs("unflatten", {this});
  ops::check_defined(*this, "unflatten", "self");
  KILN_CHECK(dim() > 0, IndexError, "unflatten: dimension ", d, " specified but a 0-dim tensor has no dimensions");
  d = wrap_dim(d, dim(), "unflatten");
  KILN_CHECK(!shape.empty(), ShapeError, "unflatten: sizes must be non-empty");
  const DimVector inner = infer_size(shape, sizes()[d], "unflatten", sizes());
  DimVector sz;
  for (int64_t i = 0; i < d; ++i) sz.push_back(sizes()[i]);
  for (int64_t s : inner) sz.push_back(s);
  for (int64_t i = d + 1; i < dim(); ++i) sz.push_back(sizes()[i]);
  return view(sz, loc);
}

std::vector<Tensor> Tensor::split(int64_t split_size, int64_t d, std::source_location loc) const {
  ops::OpScope rs("split", {this});
  ops::check_defined(*this, "split", "self");
  KILN_CHECK(dim() > 0, ShapeError, "split: cannot split a 0-dim tensor");
  d = wrap_dim(d, dim(), "split");
  const int64_t n = sizes()[d];
  KILN_CHECK(split_size > 0 || (split_size == 0 && n == 0), ValueError, "split: split_size must be positive, got ",
             split_size);
  DimVector lengths;
  if (n == 0) lengths.push_back(0);
  for (int64_t s = 0; s < n; s += split_size) lengths.push_back(std::min(split_size, n - s));
  return record_split(split_views(*this, d, lengths), *this, d, lengths, "SplitBackward0", loc);
}

std::vector<Tensor> Tensor::split_with_sizes(IntArrayRef split_sizes, int64_t d, std::source_location loc) const {
  ops::OpScope rs("split_with_sizes", {this});
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
  return record_split(split_views(*this, d, split_sizes), *this, d, split_sizes, "SplitWithSizesBackward0", loc);
}

std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t d, std::source_location loc) const {
  ops::OpScope rs("chunk", {this});
  ops::check_defined(*this, "chunk", "self");
  KILN_CHECK(dim() > 0, ShapeError, "chunk: cannot chunk a 0-dim tensor");
  KILN_CHECK(chunks > 0, ValueError, "chunk: number of chunks must be positive, got ", chunks);
  d = wrap_dim(d, dim(), "chunk");
  const int64_t n = sizes()[d];
  const int64_t size = (n + chunks - 1) / chunks;
  if (size == 0) {  // torch.chunk of an empty dim: `chunks` empty pieces
    const DimVector lengths(static_cast<size_t>(chunks), 0);
    return record_split(split_views(*this, d, lengths), *this, d, lengths, "SplitBackward0", loc);
  }
  return split(size, d, loc);
}

std::vector<Tensor> Tensor::unbind(int64_t d, std::source_location loc) const {
  ops::OpScope rs("unbind", {this});
  ops::check_defined(*this, "unbind", "self");
  KILN_CHECK(dim() > 0, IndexError, "unbind: dimension ", d, " specified but a 0-dim tensor has no dimensions");
  d = wrap_dim(d, dim(), "unbind");
  std::vector<Tensor> out;
  for (int64_t i = 0; i < sizes()[d]; ++i) {
    out.push_back(make_view(*this, select_geometry(sizes(), strides(), storage_offset(), d, i)));
  }
  autograd::NodePtr recorded;
  if (!out.empty() && autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<UnbindBackward>();
    node->self_sizes = DimVector(sizes());
    node->dim = d;
    node->dtype = dtype();
    recorded = node;
  }
  record_views(out, recorded, *this, loc);
  return out;
}

Tensor Tensor::as_strided(IntArrayRef sz, IntArrayRef st, std::optional<int64_t> offset,
                          std::source_location loc) const {
  ops::OpScope rs("as_strided", {this});
  ops::check_defined(*this, "as_strided", "self");
  KILN_CHECK(sz.size() == st.size(), ShapeError, "as_strided: sizes ", sz, " and strides ", st,
             " must have the same length");
  const int64_t off = offset.value_or(storage_offset());
  KILN_CHECK(off >= 0, ValueError, "as_strided: storage offset must be non-negative, got ", off);
  int64_t max_index = off;
  bool empty_view = false;
  for (size_t i = 0; i < sz.size(); ++i) {
    KILN_CHECK(sz[i] >= 0 && st[i] >= 0, ShapeError,
               "as_strided: negative sizes or strides are not supported, got "
               "sizes ",
               sz, ", strides ", st);
    if (sz[i] == 0)
      empty_view = true;
    else
      max_index += (sz[i] - 1) * st[i];
  }
  const int64_t storage_elems = static_cast<int64_t>(storage()->nbytes()) / element_size();
  KILN_CHECK(empty_view || max_index < storage_elems, IndexError, "as_strided: sizes ", sz, ", strides ", st,
             " and offset ", off, " reach element ", max_index, ", beyond the storage's ", storage_elems, " elements");
  return record_view<AsStridedBackward>(make_view(*this, sz, st, off), *this, loc, [&](AsStridedBackward& n) {
    n.input = {DimVector(sizes()), DimVector(strides()), storage_offset()};
    n.output = {DimVector(sz), DimVector(st), off};
    const autograd::AutogradMeta* m = autograd::get_meta(*this);
    n.input_is_view = m && m->is_view;
  });
}

Tensor Tensor::diagonal(int64_t offset, int64_t d1, int64_t d2, std::source_location loc) const {
  ops::OpScope rs("diagonal", {this});
  ops::check_defined(*this, "diagonal", "self");
  KILN_CHECK(dim() >= 2, ShapeError, "diagonal: expects a tensor of at least 2 dims, got shape ", sizes());
  d1 = wrap_dim(d1, dim(), "diagonal");
  d2 = wrap_dim(d2, dim(), "diagonal");
  KILN_CHECK(d1 != d2, ValueError, "diagonal: dim1 and dim2 cannot be identical, got ", d1, " and ", d2);
  Tensor out = make_view(*this, diagonal_geometry(sizes(), strides(), storage_offset(), offset, d1, d2));
  return record_view<StridedViewBackward>(std::move(out), *this, loc, [&](StridedViewBackward& n) {
    n.node_name = "DiagonalBackward0";
    n.backward_name = "DiagonalBackwardBackward0";
    n.self_sizes = DimVector(sizes());
    n.view = diagonal_geometry(sizes(), contiguous_strides(sizes()), 0, offset, d1, d2);
  });
}

}  // namespace kiln
