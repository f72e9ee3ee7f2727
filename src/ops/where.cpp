// where (torch.where with tensors and Scalars) and masked_fill / masked_fill_,
// with their backward: where routes the gradient through cond to a or b (the
// engine sums it to each one's shape and casts it to its dtype); masked_fill
// zeroes it where the mask is set, and a Tensor fill value gets the sum of it
// over the filled positions.
#include <optional>

#include "grad_ops.h"
#include "iter.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/index.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;

namespace {

// torch.result_type over where's two value operands. Within the same
// category (bool < integer < floating) a dimensioned tensor decides over a
// 0-dim tensor, which decides over a Scalar: where(c, bf16 tensor, 2.5) is
// bfloat16, where(c, int32 tensor, 2.5) is float32.
struct ResultTypeState {
  std::optional<DType> dimensioned, zero_dim, wrapped;
};

void update(std::optional<DType>& slot, DType t) { slot = slot ? promote_types(*slot, t) : t; }
void update(ResultTypeState& st, const Tensor& t) { update(t.dim() > 0 ? st.dimensioned : st.zero_dim, t.dtype()); }
void update(ResultTypeState& st, const Scalar& s) { update(st.wrapped, s.natural_dtype()); }

std::optional<DType> combine(std::optional<DType> higher, std::optional<DType> lower) {
  if (!higher) return lower;
  if (!lower) return higher;
  if (is_floating_point(*higher)) return higher;
  if (*higher == kBool || is_floating_point(*lower)) return promote_types(*higher, *lower);
  return higher;
}

DType result_type(const ResultTypeState& st) {
  auto r = combine(st.dimensioned, combine(st.zero_dim, st.wrapped));
  KILN_ASSERT(r.has_value(), "result_type of no operands");
  return *r;
}

void check_cond(const Tensor& cond) {
  ops::check_defined(cond, "where", "condition");
  KILN_CHECK(cond.dtype() == kBool || cond.dtype() == kUInt8, DTypeError,
             "where: expected condition to be a bool tensor, got a tensor of dtype ", dtype_name(cond.dtype()));
}

// a and b already have dtype `dt`.
Tensor where_same_dtype(const Tensor& cond, const Tensor& a, const Tensor& b, DType dt) {
  const DimVector ab = broadcast_shapes(a.sizes(), b.sizes(), "where");
  const DimVector shape = broadcast_shapes(cond.sizes(), ab, "where");
  Tensor out = ops::new_output_like(shape, dt, {&a, &b, &cond});
  if (out.numel() == 0) return out;
  const auto loop = ops::make_loop(shape, {&out, &cond, &a, &b});
  kernels::where(loop, dt, cond.dtype());
  return out;
}

Tensor as_dtype(const Tensor& t, DType dt) { return t.dtype() == dt ? t : ops::copy_no_grad(t, dt); }

void check_mask(const Tensor& mask, const char* op) {
  ops::check_defined(mask, op, "mask");
  KILN_CHECK(mask.dtype() == kBool, DTypeError, op, ": expected a bool mask, got a mask of dtype ",
             dtype_name(mask.dtype()));
}

// Edges: the tensor operands among (a, b), in order.
struct WhereBackward final : autograd::Node {
  SavedVariable cond;
  bool has_a = true, has_b = true;
  const char* name() const override { return "WhereBackward0"; }
  TensorList apply(TensorList&& g) override {
    const Tensor c = cond.unpack(this);
    TensorList out((has_a ? 1 : 0) + (has_b ? 1 : 0));
    if (!g[0].defined()) return out;
    size_t k = 0;
    if (has_a) {
      if (next_edges()[k].is_valid()) out[k] = where(c, g[0], 0);
      ++k;
    }
    if (has_b && next_edges()[k].is_valid()) out[k] = where(c, 0, g[0]);
    return out;
  }
  void release_variables() override { cond.reset(); }
};

// masked_fill(_): edges {self} (Scalar value) or {self, value} (Tensor value).
struct MaskedFillBackward final : autograd::Node {
  SavedVariable mask;
  bool value_tensor = false;
  const char* name() const override { return value_tensor ? "MaskedFillBackward1" : "MaskedFillBackward0"; }
  TensorList apply(TensorList&& g) override {
    const Tensor m = mask.unpack(this);
    TensorList out(value_tensor ? 2 : 1);
    if (!g[0].defined()) return out;
    if (next_edges()[0].is_valid()) out[0] = g[0].masked_fill(m, 0);
    if (value_tensor && next_edges()[1].is_valid()) out[1] = where(m, g[0], 0).sum();
    return out;
  }
  void release_variables() override { mask.reset(); }
};

// Records where's node when a tensor operand requires grad. The result dtype
// is floating whenever a floating operand requires grad.
Tensor record_where(Tensor out, const Tensor& cond, const Tensor* a, const Tensor* b, CallSite site) {
  if (out.is_floating_point() && autograd::compute_requires_grad({a, b})) {
    auto node = make_intrusive<WhereBackward>();
    node->cond = SavedVariable(cond, false);
    node->has_a = a != nullptr;
    node->has_b = b != nullptr;
    if (a && b)
      autograd::set_history(out, node, {a, b}, site);
    else
      autograd::set_history(out, node, {a ? a : b}, site);
  }
  return out;
}

Tensor masked_fill_out(const Tensor& self, const Tensor& mask, const Scalar& value) {
  ops::check_defined(self, "masked_fill", "self");
  check_mask(mask, "masked_fill");
  ops::check_scalar_fits(value, self.dtype(), "masked_fill");
  const DimVector shape = broadcast_shapes(self.sizes(), mask.sizes(), "masked_fill");
  Tensor out = ops::new_output_like(shape, self.dtype(), {&self});
  if (out.numel() == 0) return out;
  const auto loop = ops::make_loop(shape, {&out, &self, &mask});
  kernels::masked_fill(loop, self.dtype(), value);
  return out;
}

}  // namespace

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b, std::source_location loc) {
  ops::OpScope rs("where", {&cond, &a, &b});
  check_cond(cond);
  ops::check_defined(a, "where", "input");
  ops::check_defined(b, "where", "other");
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  return record_where(where_same_dtype(cond, as_dtype(a, dt), as_dtype(b, dt), dt), cond, &a, &b, CallSite::from(loc));
}

Tensor where(const Tensor& cond, const Scalar& a, const Tensor& b, std::source_location loc) {
  ops::OpScope rs("where", {&cond, &b});
  check_cond(cond);
  ops::check_defined(b, "where", "other");
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  ops::check_scalar_fits(a, dt, "where");
  return record_where(where_same_dtype(cond, scalar_tensor(a, dt), as_dtype(b, dt), dt), cond, nullptr, &b,
                      CallSite::from(loc));
}

Tensor where(const Tensor& cond, const Tensor& a, const Scalar& b, std::source_location loc) {
  ops::OpScope rs("where", {&cond, &a});
  check_cond(cond);
  ops::check_defined(a, "where", "input");
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  ops::check_scalar_fits(b, dt, "where");
  return record_where(where_same_dtype(cond, as_dtype(a, dt), scalar_tensor(b, dt), dt), cond, &a, nullptr,
                      CallSite::from(loc));
}

Tensor where(const Tensor& cond, const Scalar& a, const Scalar& b, std::source_location) {
  ops::OpScope rs("where", {&cond});
  check_cond(cond);
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  ops::check_scalar_fits(a, dt, "where");
  ops::check_scalar_fits(b, dt, "where");
  return where_same_dtype(cond, scalar_tensor(a, dt), scalar_tensor(b, dt), dt);
}

Tensor Tensor::masked_fill(const Tensor& mask, const Scalar& value, std::source_location loc) const {
  ops::OpScope rs("masked_fill", {this, &mask});
  Tensor out = masked_fill_out(*this, mask, value);
  if (is_floating_point() && autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<MaskedFillBackward>();
    node->mask = SavedVariable(mask, false);
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

Tensor& Tensor::masked_fill_(const Tensor& mask, const Scalar& value, std::source_location loc) {
  ops::OpScope rs("masked_fill_", {this, &mask});
  const CallSite site = CallSite::from(loc);
  ops::check_defined(*this, "masked_fill_", "self");
  check_mask(mask, "masked_fill_");
  ops::check_scalar_fits(value, dtype(), "masked_fill_");
  const DimVector shape = broadcast_shapes(sizes(), mask.sizes(), "masked_fill_");
  KILN_CHECK(shape.ref() == sizes(), ShapeError, "masked_fill_: a mask of shape ", mask.sizes(),
             " does not broadcast to self's shape ", sizes(), " (the broadcast shape is ", shape,
             "); an in-place op cannot change self's shape");
  autograd::check_inplace(*this, "masked_fill_", site);
  // A mask that shares memory with self would see the fill's own writes.
  const Tensor m = mask.is_alias_of(*this) ? mask.clone() : mask;
  if (numel() > 0) {
    const auto loop = ops::make_loop(sizes(), {this, this, &m});
    kernels::masked_fill(loop, dtype(), value);
  }
  bump_version();
  if (is_floating_point() && autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<MaskedFillBackward>();
    node->mask = SavedVariable(m, false);
    autograd::rebase_history(*this, node, {}, site);
  }
  return *this;
}

Tensor masked_fill(const Tensor& self, const Tensor& mask, const Scalar& value, std::source_location loc) {
  return self.masked_fill(mask, value, loc);
}

Tensor masked_fill(const Tensor& self, const Tensor& mask, const Tensor& value, std::source_location loc) {
  ops::OpScope rs("masked_fill", {&self, &mask, &value});
  ops::check_defined(value, "masked_fill", "value");
  KILN_CHECK(value.dim() == 0, ShapeError,
             "masked_fill: only supports a 0-dimensional value tensor, but got a tensor of shape ", value.sizes(), " (",
             value.dim(), " dimension(s))");
  // The fill value goes to the kernel as a host Scalar: a replay would fill with this one.
  capture::graph_break_if_recording("masked_fill with a tensor value reads the value on the host");
  const Scalar v = visit_dtype(value.dtype(), [&]<typename T>() {  // item_scalar(), without its own graph break
    return Scalar(*static_cast<const T*>(value.data_ptr()));
  });
  Tensor out = masked_fill_out(self, mask, v);
  if (self.is_floating_point() && autograd::compute_requires_grad({&self, &value})) {
    auto node = make_intrusive<MaskedFillBackward>();
    node->mask = SavedVariable(mask, false);
    node->value_tensor = true;
    autograd::set_history(out, node, {&self, &value}, CallSite::from(loc));
  }
  return out;
}

}  // namespace kiln
