// where (torch.where with tensors and Scalars) and masked_fill / masked_fill_.
// Backward (autograd issue): where routes the gradient through cond to a or
// b; masked_fill zeroes it where the mask is set.
#include <optional>

#include "iter.h"
#include "kiln/kernels/index.h"
#include "kiln/core/factory.h"
#include "kiln/ops/index.h"

namespace kiln {

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
  Tensor out = ops::new_output(shape, dt);
  if (out.numel() == 0) return out;
  const auto loop = ops::make_loop(shape, {&out, &cond, &a, &b});
  kernels::where(loop, dt, cond.dtype());
  return out;
}

Tensor as_dtype(const Tensor& t, DType dt) { return t.dtype() == dt ? t : t.to(dt); }

void check_mask(const Tensor& mask, const char* op) {
  ops::check_defined(mask, op, "mask");
  KILN_CHECK(mask.dtype() == kBool, DTypeError, op, ": expected a bool mask, got a mask of dtype ",
             dtype_name(mask.dtype()));
}

}  // namespace

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_cond(cond);
  ops::check_defined(a, "where", "input");
  ops::check_defined(b, "where", "other");
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  return where_same_dtype(cond, as_dtype(a, dt), as_dtype(b, dt), dt);
}

Tensor where(const Tensor& cond, const Scalar& a, const Tensor& b) {
  check_cond(cond);
  ops::check_defined(b, "where", "other");
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  ops::check_scalar_fits(a, dt, "where");
  return where_same_dtype(cond, scalar_tensor(a, dt), as_dtype(b, dt), dt);
}

Tensor where(const Tensor& cond, const Tensor& a, const Scalar& b) {
  check_cond(cond);
  ops::check_defined(a, "where", "input");
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  ops::check_scalar_fits(b, dt, "where");
  return where_same_dtype(cond, as_dtype(a, dt), scalar_tensor(b, dt), dt);
}

Tensor where(const Tensor& cond, const Scalar& a, const Scalar& b) {
  check_cond(cond);
  ResultTypeState st;
  update(st, a);
  update(st, b);
  const DType dt = result_type(st);
  ops::check_scalar_fits(a, dt, "where");
  ops::check_scalar_fits(b, dt, "where");
  return where_same_dtype(cond, scalar_tensor(a, dt), scalar_tensor(b, dt), dt);
}

Tensor Tensor::masked_fill(const Tensor& mask, const Scalar& value) const {
  ops::check_defined(*this, "masked_fill", "self");
  check_mask(mask, "masked_fill");
  ops::check_scalar_fits(value, dtype(), "masked_fill");
  const DimVector shape = broadcast_shapes(sizes(), mask.sizes(), "masked_fill");
  Tensor out = ops::new_output(shape, dtype());
  if (out.numel() == 0) return out;
  const auto loop = ops::make_loop(shape, {&out, this, &mask});
  kernels::masked_fill(loop, dtype(), value);
  return out;
}

Tensor& Tensor::masked_fill_(const Tensor& mask, const Scalar& value) {
  ops::check_defined(*this, "masked_fill_", "self");
  check_mask(mask, "masked_fill_");
  ops::check_scalar_fits(value, dtype(), "masked_fill_");
  const DimVector shape = broadcast_shapes(sizes(), mask.sizes(), "masked_fill_");
  KILN_CHECK(shape.ref() == sizes(), ShapeError, "masked_fill_: a mask of shape ", mask.sizes(),
             " does not broadcast to self's shape ", sizes(), " (the broadcast shape is ", shape,
             "); an in-place op cannot change self's shape");
  if (numel() > 0) {
    // A mask that shares memory with self would see the fill's own writes.
    const Tensor m = mask.is_alias_of(*this) ? mask.clone() : mask;
    const auto loop = ops::make_loop(sizes(), {this, this, &m});
    kernels::masked_fill(loop, dtype(), value);
  }
  bump_version();
  return *this;
}

Tensor masked_fill(const Tensor& self, const Tensor& mask, const Scalar& value) { return self.masked_fill(mask, value); }

Tensor masked_fill(const Tensor& self, const Tensor& mask, const Tensor& value) {
  ops::check_defined(value, "masked_fill", "value");
  KILN_CHECK(value.dim() == 0, ShapeError,
             "masked_fill: only supports a 0-dimensional value tensor, but got a tensor of shape ", value.sizes(),
             " (", value.dim(), " dimension(s))");
  return self.masked_fill(mask, value.item_scalar());
}

}  // namespace kiln
