// Binary arithmetic ops: add sub mul div pow maximum minimum and their in-place
// forms, with broadcasting and PyTorch's type promotion (Note [Result type]).
// Backward formulas will sit beside each forward (autograd issue).
//
// Also the family's shared plumbing (elementwise_common.h): operand
// preparation and the in-place checks.
#include <algorithm>
#include <cmath>
#include <limits>

#include "elementwise_common.h"
#include "kiln/kernels/copy.h"
#include "kiln/ops/elementwise.h"

namespace kiln {

namespace ops::ew {

void prepare_operand(Operand& op, Arg arg, DType compute, const Tensor& out, bool& out_free) {
  if (arg.scalar) {
    kernels::scalar_to_bytes(op.buf, compute, *arg.scalar);
    return;
  }
  const Tensor& t = *arg.tensor;
  if (t.dtype() == compute) {
    op.tensor = &t;
    return;
  }
  if (t.numel() == 1) {
    kernels::convert_element(op.buf, compute, t.data_ptr(), t.dtype());
    return;
  }
  if (out_free && out.dtype() == compute && t.sizes() == out.sizes()) {
    kernels::copy_cast(make_loop(out.sizes(), {&out, &t}), compute, t.dtype());
    op.tensor = &out;
    out_free = false;
    return;
  }
  op.converted = t.to(compute);
  op.tensor = &op.converted;
}

kernels::LoopSpec make_binary_loop(IntArrayRef shape, const Tensor& out, Operand& a, Operand& b) {
  kernels::LoopSpec s;
  if (a.tensor && b.tensor) return make_loop(shape, {&out, a.tensor, b.tensor});
  if (a.tensor) {
    s = make_loop(shape, {&out, a.tensor});
  } else if (b.tensor) {
    s = make_loop(shape, {&out, b.tensor});
    s.data[2] = s.data[1];
    for (int d = 0; d < s.ndim; ++d) {
      s.strides[2][d] = s.strides[1][d];
      s.strides[1][d] = 0;
    }
  } else {
    s = make_loop(shape, {&out});
  }
  s.nops = 3;
  if (!a.tensor) s.data[1] = reinterpret_cast<char*>(a.buf);
  if (!b.tensor) s.data[2] = reinterpret_cast<char*>(b.buf);
  return s;
}

void check_inplace_cast(const char* op, DType result, const Tensor& self) {
  KILN_CHECK(ops::can_cast(result, self.dtype()), DTypeError, op, ": result type ", dtype_name(result),
             " can't be cast to the desired output type ", dtype_name(self.dtype()),
             " (an in-place op keeps self's dtype; use the out-of-place op to get a ", dtype_name(result),
             " result)");
}

void check_inplace_shape(const char* op, const Tensor& self, IntArrayRef other_sizes) {
  const DimVector shape = broadcast_shapes(self.sizes(), other_sizes, op);
  KILN_CHECK(shape.ref() == self.sizes(), ShapeError, op, ": output with shape ", self.sizes(),
             " doesn't match the broadcast shape ", shape, " (other operand has shape ", other_sizes,
             "); an in-place op cannot change self's shape");
}

namespace {

// No two elements share memory and together they fill a dense block (in some dim order).
bool is_non_overlapping_and_dense(const Tensor& t) {
  if (t.is_contiguous()) return true;
  const int64_t nd = t.dim();
  DimVector order(static_cast<size_t>(nd));
  for (int64_t d = 0; d < nd; ++d) order[d] = d;
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return t.strides()[x] < t.strides()[y]; });
  int64_t expected = 1;
  for (int64_t d : order) {
    const int64_t size = t.sizes()[d];
    if (size == 1) continue;
    if (t.strides()[d] != expected) return false;
    expected *= size;
  }
  return true;
}

// [begin, end) byte extent of the memory a view can touch.
void byte_extent(const Tensor& t, const char*& begin, const char*& end) {
  const int64_t es = t.element_size();
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.sizes()[d] - 1) * t.strides()[d] * es;
    (span < 0 ? lo : hi) += span;
  }
  begin = static_cast<const char*>(t.data_ptr()) + lo;
  end = static_cast<const char*>(t.data_ptr()) + hi + es;
}

}  // namespace

void check_no_internal_overlap(const char* op, const Tensor& self) {
  if (self.numel() <= 1 || is_non_overlapping_and_dense(self)) return;
  bool overlap = false;
  for (int64_t d = 0; d < self.dim(); ++d) overlap = overlap || (self.sizes()[d] > 1 && self.strides()[d] == 0);
  KILN_CHECK(!overlap, ValueError, op, ": unsupported operation: more than one element of the written-to tensor "
             "(shape ", self.sizes(), ", strides ", self.strides(), ") refers to a single memory location. "
             "Please clone() the tensor before performing the operation.");
}

Tensor resolve_input_overlap(const char* op, const Tensor& self, const Tensor& input) {
  if (self.is_same(input) || self.numel() == 0 || input.numel() == 0) return input;
  if (self.storage().get() != input.storage().get()) return input;
  const char *a0, *a1, *b0, *b1;
  byte_extent(self, a0, a1);
  byte_extent(input, b0, b1);
  if (a1 <= b0 || b1 <= a0) return input;  // disjoint memory
  const bool same_view = self.data_ptr() == input.data_ptr() && self.strides() == input.strides() &&
                         self.sizes() == input.sizes() && self.dtype() == input.dtype();
  if (same_view) return input;  // element i reads what element i writes: safe
  // Dense tensors over overlapping memory: torch reports a partial overlap; we do the same.
  KILN_CHECK(!(is_non_overlapping_and_dense(self) && is_non_overlapping_and_dense(input)), ValueError, op,
             ": unsupported operation: some elements of the input tensor (shape ", input.sizes(), ", strides ",
             input.strides(), ") and the written-to tensor (shape ", self.sizes(), ", strides ", self.strides(),
             ") refer to a single memory location. Please clone() the tensor before performing the operation.");
  // Strided views whose extents interleave (x[::2] and x[1::2]): reading a copy is always right.
  return input.clone();
}

}  // namespace ops::ew

namespace {

using kernels::BinaryOp;
using ops::ew::Arg;
using ops::ew::Operand;

// Runs op over (a, b) in dtype `compute`, into a new tensor of that dtype.
Tensor binary_out(const char* name, BinaryOp op, Arg a, Arg b, DType compute, const void* alpha = nullptr) {
  if (a.tensor) ops::check_defined(*a.tensor, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DimVector shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  Tensor out = ops::new_output(shape, compute);
  if (out.numel() == 0) return out;
  Operand oa, ob;
  bool out_free = true;
  ops::ew::prepare_operand(oa, a, compute, out, out_free);
  ops::ew::prepare_operand(ob, b, compute, out, out_free);
  kernels::binary(ops::ew::make_binary_loop(shape, out, oa, ob), op, compute, alpha);
  return out;
}

// self = op(self, b), computed in `compute` and written back in self's dtype.
Tensor& binary_inplace(const char* name, BinaryOp op, Tensor& self, Arg b, DType compute,
                       const void* alpha = nullptr) {
  ops::check_defined(self, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  ops::ew::check_inplace_cast(name, compute, self);
  ops::ew::check_inplace_shape(name, self, b.sizes());
  ops::ew::check_no_internal_overlap(name, self);
  Tensor other;
  if (b.tensor) {
    other = ops::ew::resolve_input_overlap(name, self, *b.tensor);
    b = Arg(other);
  }
  if (self.numel() > 0) {
    if (self.dtype() == compute) {
      Operand oa, ob;
      oa.tensor = &self;
      bool out_free = false;
      ops::ew::prepare_operand(ob, b, compute, self, out_free);
      kernels::binary(ops::ew::make_binary_loop(self.sizes(), self, oa, ob), op, compute, alpha);
    } else {
      // e.g. float16 self += float32 other: compute in float32, round once into self.
      Tensor tmp = binary_out(name, op, Arg(self), b, compute, alpha);
      kernels::copy_cast(ops::make_loop(self.sizes(), {&self, &tmp}), self.dtype(), compute);
    }
  }
  self.bump_version();
  return self;
}

// torch's alpha_check: alpha's category must fit the result's.
void check_alpha(const char* name, DType result, const Scalar& alpha) {
  KILN_CHECK(!alpha.is_bool() || result == kBool, DTypeError, name,
             ": a bool alpha is only supported for bool results, got a ", dtype_name(result), " result");
  KILN_CHECK(is_floating_point(result) || !alpha.is_floating_point(), DTypeError, name,
             ": for integral input tensors, argument alpha must not be a floating point number (got alpha=",
             alpha.to_double(), ", result dtype ", dtype_name(result), ")");
}

// torch's sub_check: subtraction is undefined on bool.
void check_sub(const char* name, Arg a, Arg b) {
  KILN_CHECK(a.dtype() != kBool || b.dtype() != kBool, DTypeError, name,
             ": subtraction, the `-` operator, with two bool tensors is not supported; use the `^` or "
             "logical_xor() operator instead");
  KILN_CHECK(a.dtype() != kBool && b.dtype() != kBool, DTypeError, name,
             ": subtraction, the `-` operator, with a bool tensor is not supported; to invert a mask, use "
             "the `~` or logical_not() operator instead");
}

// alpha in dtype `dt` in `buf`, or null when it is 1 (the kernel's plain a + b).
const void* alpha_arg(const Scalar& alpha, DType dt, unsigned char* buf) {
  if (!alpha.is_bool() && alpha.to_double() == 1.0) return nullptr;
  if (alpha.is_bool() && alpha.to_bool()) return nullptr;
  kernels::scalar_to_bytes(buf, dt, alpha);
  return buf;
}

Scalar negate(const Scalar& s) {
  if (s.is_floating_point()) return Scalar(-s.to_double());
  return Scalar(static_cast<int64_t>(0ull - static_cast<uint64_t>(s.to_int64())));
}

// a + alpha * b, or a - alpha * b when `subtract` (alpha is checked before negation, as torch).
Tensor add_impl(const char* name, Arg a, Arg b, const Scalar& alpha, bool subtract = false) {
  if (a.tensor) ops::check_defined(*a.tensor, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DType rt = ops::ew::result_type(a, b);
  check_alpha(name, rt, alpha);
  alignas(8) unsigned char buf[8];
  return binary_out(name, BinaryOp::Add, a, b, rt, alpha_arg(subtract ? negate(alpha) : alpha, rt, buf));
}

Tensor& add_inplace_impl(const char* name, Tensor& self, Arg b, const Scalar& alpha, bool subtract = false) {
  ops::check_defined(self, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DType rt = ops::ew::result_type(Arg(self), b);
  check_alpha(name, rt, alpha);
  alignas(8) unsigned char buf[8];
  return binary_inplace(name, BinaryOp::Add, self, b, rt, alpha_arg(subtract ? negate(alpha) : alpha, rt, buf));
}

// torch.div (true division): integer and bool results become the default float dtype.
DType div_type(Arg a, Arg b) {
  const DType rt = ops::ew::result_type(a, b);
  return is_floating_point(rt) ? rt : default_dtype();
}

DType pow_type(const char* name, Arg a, Arg b) {
  const DType rt = ops::ew::result_type(a, b);
  KILN_CHECK(rt != kBool, DTypeError, name, ": pow is not implemented for bool (the operands promote to bool); "
             "convert to an integer or floating dtype first");
  return rt;
}

void check_int_pow_exponent(const char* name, const Tensor& self, const Scalar& exponent) {
  KILN_CHECK(!(is_integral(self.dtype(), /*include_bool=*/true) && !exponent.is_floating_point() &&
               exponent.to_int64() < 0),
             ValueError, name, ": Integers to negative integer powers are not allowed (", dtype_name(self.dtype()),
             " tensor ** ", exponent.to_int64(), "); use a floating-point tensor or exponent");
}

Tensor minmax(const char* name, BinaryOp op, const Tensor& a, const Tensor& b) {
  ops::check_defined(a, name, "self");
  ops::check_defined(b, name, "other");
  return binary_out(name, op, Arg(a), Arg(b), ops::result_type(a, b));
}

}  // namespace

// ---- add / sub: a + alpha * b; sub is add with -alpha, as torch's kernel ----

Tensor Tensor::add(const Tensor& other, const Scalar& alpha) const { return add_impl("add", *this, other, alpha); }
Tensor Tensor::add(const Scalar& other, const Scalar& alpha) const { return add_impl("add", *this, other, alpha); }
Tensor& Tensor::add_(const Tensor& other, const Scalar& alpha) { return add_inplace_impl("add_", *this, other, alpha); }
Tensor& Tensor::add_(const Scalar& other, const Scalar& alpha) { return add_inplace_impl("add_", *this, other, alpha); }

Tensor Tensor::sub(const Tensor& other, const Scalar& alpha) const {
  ops::check_defined(*this, "sub", "self");
  ops::check_defined(other, "sub", "other");
  check_sub("sub", *this, other);
  return add_impl("sub", *this, other, alpha, true);
}
Tensor Tensor::sub(const Scalar& other, const Scalar& alpha) const {
  ops::check_defined(*this, "sub", "self");
  check_sub("sub", *this, other);
  return add_impl("sub", *this, other, alpha, true);
}
Tensor& Tensor::sub_(const Tensor& other, const Scalar& alpha) {
  ops::check_defined(*this, "sub_", "self");
  ops::check_defined(other, "sub_", "other");
  check_sub("sub_", *this, other);
  return add_inplace_impl("sub_", *this, other, alpha, true);
}
Tensor& Tensor::sub_(const Scalar& other, const Scalar& alpha) {
  ops::check_defined(*this, "sub_", "self");
  check_sub("sub_", *this, other);
  return add_inplace_impl("sub_", *this, other, alpha, true);
}

// ---- mul / div ----

Tensor Tensor::mul(const Tensor& other) const {
  ops::check_defined(*this, "mul", "self");
  ops::check_defined(other, "mul", "other");
  return binary_out("mul", BinaryOp::Mul, *this, other, ops::result_type(*this, other));
}
Tensor Tensor::mul(const Scalar& other) const {
  ops::check_defined(*this, "mul", "self");
  return binary_out("mul", BinaryOp::Mul, *this, other, ops::result_type(*this, other));
}
Tensor& Tensor::mul_(const Tensor& other) {
  ops::check_defined(*this, "mul_", "self");
  ops::check_defined(other, "mul_", "other");
  return binary_inplace("mul_", BinaryOp::Mul, *this, other, ops::result_type(*this, other));
}
Tensor& Tensor::mul_(const Scalar& other) {
  ops::check_defined(*this, "mul_", "self");
  return binary_inplace("mul_", BinaryOp::Mul, *this, other, ops::result_type(*this, other));
}

Tensor Tensor::div(const Tensor& other) const {
  ops::check_defined(*this, "div", "self");
  ops::check_defined(other, "div", "other");
  return binary_out("div", BinaryOp::Div, *this, other, div_type(*this, other));
}
Tensor Tensor::div(const Scalar& other) const {
  ops::check_defined(*this, "div", "self");
  return binary_out("div", BinaryOp::Div, *this, other, div_type(*this, other));
}
Tensor& Tensor::div_(const Tensor& other) {
  ops::check_defined(*this, "div_", "self");
  ops::check_defined(other, "div_", "other");
  return binary_inplace("div_", BinaryOp::Div, *this, other, div_type(*this, other));
}
Tensor& Tensor::div_(const Scalar& other) {
  ops::check_defined(*this, "div_", "self");
  return binary_inplace("div_", BinaryOp::Div, *this, other, div_type(*this, other));
}

// ---- pow ----

Tensor Tensor::pow(const Tensor& exponent) const {
  ops::check_defined(*this, "pow", "self");
  ops::check_defined(exponent, "pow", "exponent");
  return binary_out("pow", BinaryOp::Pow, *this, exponent, pow_type("pow", *this, exponent));
}

Tensor Tensor::pow(const Scalar& exponent) const {
  ops::check_defined(*this, "pow", "self");
  const DType rt = pow_type("pow", *this, exponent);
  check_int_pow_exponent("pow", *this, exponent);
  Tensor out = ops::new_output(sizes(), rt);
  if (out.numel() == 0) return out;
  const auto loop = ops::make_loop(sizes(), {&out, this});
  if (ops::ew::scalar_equals(exponent, 0.0)) {  // x ** 0 is 1, even for NaN (torch fills)
    kernels::fill(loop, rt, 1);
  } else if (ops::ew::scalar_equals(exponent, 1.0)) {
    kernels::copy_cast(loop, rt, dtype());
  } else if (rt == dtype()) {
    kernels::pow_scalar(loop, rt, exponent);
  } else {  // int tensor ** 2.5: convert into out, then raise in place
    kernels::copy_cast(loop, rt, dtype());
    kernels::pow_scalar(ops::make_loop(sizes(), {&out, &out}), rt, exponent);
  }
  return out;
}

Tensor& Tensor::pow_(const Scalar& exponent) {
  ops::check_defined(*this, "pow_", "self");
  const DType rt = pow_type("pow_", *this, exponent);
  check_int_pow_exponent("pow_", *this, exponent);
  ops::ew::check_inplace_cast("pow_", rt, *this);
  ops::ew::check_no_internal_overlap("pow_", *this);
  if (numel() > 0 && !ops::ew::scalar_equals(exponent, 1.0)) {
    const auto loop = ops::make_loop(sizes(), {this, this});
    if (ops::ew::scalar_equals(exponent, 0.0)) {
      kernels::fill(loop, dtype(), 1);
    } else if (rt == dtype()) {
      kernels::pow_scalar(loop, rt, exponent);
    } else {
      Tensor tmp = pow(exponent);
      kernels::copy_cast(ops::make_loop(sizes(), {this, &tmp}), dtype(), rt);
    }
  }
  bump_version();
  return *this;
}

// ---- maximum / minimum (NaN-propagating) ----

Tensor Tensor::maximum(const Tensor& other) const { return minmax("maximum", BinaryOp::Maximum, *this, other); }
Tensor Tensor::minimum(const Tensor& other) const { return minmax("minimum", BinaryOp::Minimum, *this, other); }

// ---- free functions without a method ----

Tensor rsub(const Tensor& self, const Scalar& other, const Scalar& alpha) {
  ops::check_defined(self, "rsub", "self");
  check_sub("rsub", other, self);
  return add_impl("rsub", other, self, alpha, true);
}

Tensor div(const Scalar& self, const Tensor& other) {
  ops::check_defined(other, "div", "other");
  return binary_out("div", BinaryOp::Div, self, other, div_type(self, other));
}

Tensor pow(const Scalar& self, const Tensor& exponent) {
  ops::check_defined(exponent, "pow", "exponent");
  return binary_out("pow", BinaryOp::Pow, self, exponent, pow_type("pow", self, exponent));
}

}  // namespace kiln
