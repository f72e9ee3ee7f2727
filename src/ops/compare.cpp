// Comparison and logic ops: eq ne lt le gt ge (bool results, operands compared
// in their promoted dtype), logical_and/or/xor/not, bitwise and/or/xor/not
// (integral and bool only), torch.equal and torch.allclose.
#include "elementwise_common.h"
#include "kiln/core/capture.h"
#include "kiln/ops/elementwise.h"
#include "op_record.h"

namespace kiln {

namespace {

using kernels::CompareOp;
using ops::ew::Arg;
using ops::ew::Operand;

// out (bool) = op(a, b), with a and b compared in their result type, as torch
// (converted inside the loop: Note [Mixed dtypes in the loop]).
Tensor compare_out(const char* name, CompareOp op, Arg a, Arg b) {
  ops::OpScope rs(ops::NamePtr{name}, {a.tensor, b.tensor});
  if (a.tensor) ops::check_defined(*a.tensor, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DType rt = ops::ew::result_type(a, b);
  const DimVector shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  Tensor out = ops::new_output(shape, kBool);
  if (out.numel() == 0) return out;
  Operand oa, ob;
  ops::ew::prepare_operand_in_loop(oa, a, rt, out);
  ops::ew::prepare_operand_in_loop(ob, b, rt, out);
  kernels::compare(ops::ew::make_binary_loop(shape, out, oa, ob), op, rt, oa.stored, ob.stored);
  return out;
}

DType bitwise_type(const char* name, const Tensor& a, const Tensor& b) {
  ops::check_defined(a, name, "self");
  ops::check_defined(b, name, "other");
  const DType rt = ops::result_type(a, b);
  KILN_CHECK(!is_floating_point(rt), DTypeError, name, ": expected integral or bool tensors, got ",
             dtype_name(a.dtype()), " and ", dtype_name(b.dtype()), " (result type ", dtype_name(rt), ")");
  return rt;
}

Tensor bitwise_out(const char* name, kernels::BinaryOp op, const Tensor& a, const Tensor& b) {
  ops::OpScope rs(ops::NamePtr{name}, {&a, &b});
  const DType rt = bitwise_type(name, a, b);
  const DimVector shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  Tensor out = ops::new_output(shape, rt);
  if (out.numel() == 0) return out;
  Operand oa, ob;
  ops::ew::prepare_operand_in_loop(oa, a, rt, out);
  ops::ew::prepare_operand_in_loop(ob, b, rt, out);
  kernels::binary(ops::ew::make_binary_loop(shape, out, oa, ob), op, rt, {rt, oa.stored, ob.stored});
  return out;
}

}  // namespace

Tensor Tensor::eq(const Tensor& other) const { return compare_out("eq", CompareOp::Eq, *this, other); }
Tensor Tensor::eq(const Scalar& other) const { return compare_out("eq", CompareOp::Eq, *this, other); }
Tensor Tensor::ne(const Tensor& other) const { return compare_out("ne", CompareOp::Ne, *this, other); }
Tensor Tensor::ne(const Scalar& other) const { return compare_out("ne", CompareOp::Ne, *this, other); }
Tensor Tensor::lt(const Tensor& other) const { return compare_out("lt", CompareOp::Lt, *this, other); }
Tensor Tensor::lt(const Scalar& other) const { return compare_out("lt", CompareOp::Lt, *this, other); }
Tensor Tensor::le(const Tensor& other) const { return compare_out("le", CompareOp::Le, *this, other); }
Tensor Tensor::le(const Scalar& other) const { return compare_out("le", CompareOp::Le, *this, other); }
Tensor Tensor::gt(const Tensor& other) const { return compare_out("gt", CompareOp::Gt, *this, other); }
Tensor Tensor::gt(const Scalar& other) const { return compare_out("gt", CompareOp::Gt, *this, other); }
Tensor Tensor::ge(const Tensor& other) const { return compare_out("ge", CompareOp::Ge, *this, other); }
Tensor Tensor::ge(const Scalar& other) const { return compare_out("ge", CompareOp::Ge, *this, other); }

Tensor Tensor::logical_and(const Tensor& other) const {
  return compare_out("logical_and", CompareOp::LogicalAnd, *this, other);
}
Tensor Tensor::logical_or(const Tensor& other) const {
  return compare_out("logical_or", CompareOp::LogicalOr, *this, other);
}
Tensor Tensor::logical_xor(const Tensor& other) const {
  return compare_out("logical_xor", CompareOp::LogicalXor, *this, other);
}

Tensor Tensor::logical_not() const {
  ops::OpScope rs("logical_not", {this});
  ops::check_defined(*this, "logical_not", "self");
  Tensor out = ops::new_output(sizes(), kBool);
  if (out.numel() > 0) kernels::logical_not(ops::make_loop(sizes(), {&out, this}), dtype());
  return out;
}

bool Tensor::equal(const Tensor& other) const {
  ops::OpScope rs("equal", {this, &other});
  capture::graph_break_if_recording("torch.equal reads tensors' values on the host");
  ops::check_defined(*this, "equal", "self");
  ops::check_defined(other, "equal", "other");
  if (sizes() != other.sizes()) return false;
  if (numel() == 0) return true;
  // Compared in the promoted dtype (torch.equal(x, x.float()) is True); |a - b| <= 0 is a == b.
  const DType rt = ops::result_type(*this, other);
  const Tensor a = to(rt), b = other.to(rt);
  return kernels::all_close(ops::make_loop(sizes(), {&a, &b}), rt, 0.0, 0.0, false);
}

bool Tensor::allclose(const Tensor& other, double rtol, double atol, bool equal_nan) const {
  ops::OpScope rs("allclose", {this, &other});
  capture::graph_break_if_recording("torch.allclose reads tensors' values on the host");
  ops::check_defined(*this, "allclose", "self");
  ops::check_defined(other, "allclose", "other");
  KILN_CHECK(dtype() == other.dtype(), DTypeError, "allclose: expected both tensors to have the same dtype, got ",
             dtype_name(dtype()), " and ", dtype_name(other.dtype()), "; convert one with .to() first");
  KILN_CHECK(rtol >= 0, ValueError, "allclose: rtol must be greater than or equal to zero, but got ", rtol);
  KILN_CHECK(atol >= 0, ValueError, "allclose: atol must be greater than or equal to zero, but got ", atol);
  const DimVector shape = broadcast_shapes(sizes(), other.sizes(), "allclose");
  if (shape_numel(shape) == 0) return true;
  return kernels::all_close(ops::make_loop(shape, {this, &other}), dtype(), rtol, atol, equal_nan);
}

// ---- bitwise (& | ^ ~): logical on bool, bitwise on integers ----

Tensor bitwise_and(const Tensor& a, const Tensor& b) {
  return bitwise_out("bitwise_and", kernels::BinaryOp::BitwiseAnd, a, b);
}
Tensor bitwise_or(const Tensor& a, const Tensor& b) {
  return bitwise_out("bitwise_or", kernels::BinaryOp::BitwiseOr, a, b);
}
Tensor bitwise_xor(const Tensor& a, const Tensor& b) {
  return bitwise_out("bitwise_xor", kernels::BinaryOp::BitwiseXor, a, b);
}

Tensor bitwise_not(const Tensor& a) {
  ops::OpScope rs("bitwise_not", {&a});
  ops::check_defined(a, "bitwise_not", "self");
  KILN_CHECK(!a.is_floating_point(), DTypeError, "bitwise_not: ~ is only implemented on integer and bool tensors, got ",
             dtype_name(a.dtype()));
  Tensor out = ops::new_output(a.sizes(), a.dtype());
  if (out.numel() > 0) kernels::unary(ops::make_loop(a.sizes(), {&out, &a}), kernels::UnaryOp::BitwiseNot, a.dtype());
  return out;
}

}  // namespace kiln
