// cat and stack. Each input is copied (with dtype conversion) straight into
// its slab of the output through a strided loop over the output's memory, so
// no intermediate views or copies are made. Backward: each input's gradient
// is the matching narrow (cat) or select (stack) of the output gradient; the
// engine casts it back to the input's dtype.
#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/index.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/index.h"
#include "op_record.h"

namespace kiln {

namespace {

// torch keeps accepting 1-D tensors of shape [0] in cat whatever the other
// inputs' shapes are (a legacy of older releases); they contribute nothing.
bool is_legacy_empty(const Tensor& t) { return t.dim() == 1 && t.sizes()[0] == 0; }

// Copies `src` into out's memory at byte offset `offset`, walking `src`'s
// shape with out's `out_strides` (elements) for the destination.
void copy_into(const Tensor& out, int64_t offset, IntArrayRef out_strides, const Tensor& src) {
  if (src.numel() == 0) return;
  char* dst = static_cast<char*>(out.data_ptr()) + offset;
  const auto loop = kernels::make_strided_loop(
      src.sizes(), {{dst, out_strides, out.element_size()},
                    {static_cast<char*>(src.data_ptr()), src.strides(), src.element_size()}});
  kernels::copy_cast(loop, out.dtype(), src.dtype());
}

// lengths[i]: input i's size along dim, -1 for a skipped legacy empty input.
struct CatBackward final : autograd::Node {
  int64_t dim = 0;
  std::vector<int64_t> lengths;
  const char* name() const override { return "CatBackward0"; }
  TensorList apply(TensorList&& g) override {
    TensorList out(lengths.size());
    if (!g[0].defined()) return out;
    int64_t offset = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      if (lengths[i] < 0) continue;
      if (next_edges()[i].is_valid()) out[i] = g[0].narrow(dim, offset, lengths[i]);
      offset += lengths[i];
    }
    return out;
  }
};

struct StackBackward final : autograd::Node {
  int64_t dim = 0;
  const char* name() const override { return "StackBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return TensorList(next_edges().size());
    return g[0].unbind(dim);
  }
};

void record_join(Tensor& out, const autograd::NodePtr& node, const std::vector<Tensor>& inputs,
                 std::source_location loc) {
  TensorList outs{out};
  autograd::set_history(outs, node, inputs, autograd::CallSite::from(loc));
}

}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim, std::source_location loc) {
  ops::OpScope rs("cat", {ops::nth_input(tensors, 0), ops::nth_input(tensors, 1), ops::nth_input(tensors, 2),
                          ops::nth_input(tensors, 3)});
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::cat, [&](const std::vector<Tensor>& ts) { return cat(ts, dim, loc); }, tensors);
  KILN_CHECK(!tensors.empty(), ValueError, "cat: expected a non-empty list of tensors");
  DType dt = DType::Bool;
  const Tensor* ref = nullptr;
  size_t ref_i = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    KILN_CHECK(t.defined(), ValueError, "cat: tensor ", i, " in the list is undefined");
    KILN_CHECK(t.dim() > 0, ShapeError, "cat: zero-dimensional tensor (at position ", i,
               ") cannot be concatenated; unsqueeze it or use stack");
    dt = i == 0 ? t.dtype() : promote_types(dt, t.dtype());
    if (!ref && !is_legacy_empty(t)) {
      ref = &t;
      ref_i = i;
    }
  }
  if (!ref) {
    Tensor out = ops::new_output({0}, dt);
    if (is_floating_point(dt) && autograd::compute_requires_grad(tensors)) {
      auto node = make_intrusive<CatBackward>();
      node->lengths.assign(tensors.size(), -1);
      record_join(out, node, tensors, loc);
    }
    return out;
  }
  const int64_t nd = ref->dim();
  const int64_t d = wrap_dim(dim, nd, "cat");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (is_legacy_empty(t)) continue;
    KILN_CHECK(t.dim() == nd, ShapeError, "cat: tensors must have the same number of dimensions: tensor ", ref_i,
               " has shape ", ref->sizes(), " (", nd, " dims) but tensor ", i, " has shape ", t.sizes(), " (", t.dim(),
               " dims)");
    for (int64_t k = 0; k < nd; ++k) {
      KILN_CHECK(k == d || t.sizes()[k] == ref->sizes()[k], ShapeError,
                 "cat: sizes of tensors must match except in dimension ", d, ": tensor ", ref_i, " has shape ",
                 ref->sizes(), " but tensor ", i, " has shape ", t.sizes(), " (size ", t.sizes()[k], " vs ",
                 ref->sizes()[k], " at dimension ", k, ")");
    }
    total += t.sizes()[d];
  }
  DimVector out_sizes(ref->sizes());
  out_sizes[d] = total;
  Tensor out = ops::new_output(out_sizes, dt);
  if (out.numel() > 0) {
    const int64_t slab = out.strides()[d] * out.element_size();
    int64_t offset = 0;
    for (const Tensor& t : tensors) {
      if (is_legacy_empty(t)) continue;
      copy_into(out, offset * slab, out.strides(), t);
      offset += t.sizes()[d];
    }
  }
  if (is_floating_point(dt) && autograd::compute_requires_grad(tensors)) {
    auto node = make_intrusive<CatBackward>();
    node->dim = d;
    for (const Tensor& t : tensors) node->lengths.push_back(is_legacy_empty(t) ? -1 : t.sizes()[d]);
    record_join(out, node, tensors, loc);
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim, std::source_location loc) {
  ops::OpScope rs("stack", {ops::nth_input(tensors, 0), ops::nth_input(tensors, 1), ops::nth_input(tensors, 2),
                            ops::nth_input(tensors, 3)});
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::stack, [&](const std::vector<Tensor>& ts) { return stack(ts, dim, loc); }, tensors);
  KILN_CHECK(!tensors.empty(), ValueError, "stack: expected a non-empty list of tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    KILN_CHECK(tensors[i].defined(), ValueError, "stack: tensor ", i, " in the list is undefined");
  }
  const Tensor& ref = tensors[0];
  const int64_t d = wrap_dim(dim, ref.dim() + 1, "stack");
  DType dt = ref.dtype();
  for (size_t i = 1; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    KILN_CHECK(t.sizes() == ref.sizes(), ShapeError, "stack: expects each tensor to be equal size, but got ",
               ref.sizes(), " at entry 0 and ", t.sizes(), " at entry ", i);
    dt = promote_types(dt, t.dtype());
  }
  DimVector out_sizes(ref.sizes());
  out_sizes.insert(static_cast<size_t>(d), static_cast<int64_t>(tensors.size()));
  Tensor out = ops::new_output(out_sizes, dt);
  if (out.numel() > 0) {
    // Entry i lands at index i along the new dim: out's strides without that dim.
    DimVector sub_strides(out.strides());
    sub_strides.erase(static_cast<size_t>(d));
    const int64_t slab = out.strides()[d] * out.element_size();
    for (size_t i = 0; i < tensors.size(); ++i) {
      copy_into(out, static_cast<int64_t>(i) * slab, sub_strides, tensors[i]);
    }
  }
  if (is_floating_point(dt) && autograd::compute_requires_grad(tensors)) {
    auto node = make_intrusive<StackBackward>();
    node->dim = d;
    record_join(out, node, tensors, loc);
  }
  return out;
}

}  // namespace kiln
