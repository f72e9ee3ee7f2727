// Internal to the elementwise op family (binary.cpp, pow_minmax.cpp,
// unary.cpp, compare.cpp, operators.cpp): operands that are a Tensor or a
// Scalar, their conversion to the compute dtype, the loop over (out, a, b),
// the in-place checks PyTorch makes, the autograd helpers the backward nodes
// share, and the arithmetic entry points that take a CallSite (the operators
// call them with none).
#pragma once

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/tensor.h"
#include "kiln/kernels/elementwise.h"
#include "kiln/ops/promotion.h"

namespace kiln::ops::ew {

/// A binary op's operand: a tensor, or a Scalar (a "wrapped number" to promotion).
struct Arg {
  const Tensor* tensor = nullptr;
  const Scalar* scalar = nullptr;

  Arg(const Tensor& t) : tensor(&t) {}  // NOLINT
  Arg(const Scalar& s) : scalar(&s) {}  // NOLINT

  IntArrayRef sizes() const { return tensor ? tensor->sizes() : IntArrayRef(); }
  DType dtype() const { return tensor ? tensor->dtype() : scalar_operand_dtype(*scalar); }
};

inline DType result_type(Arg a, Arg b) {
  if (a.tensor && b.tensor) return ops::result_type(*a.tensor, *b.tensor);
  if (a.tensor) return ops::result_type(*a.tensor, *b.scalar);
  if (b.tensor) return ops::result_type(*a.scalar, *b.tensor);
  return ops::result_type({*a.scalar, *b.scalar});
}

/// One input of a kernel loop computing in some dtype: a tensor (stored in
/// that dtype or another, which the kernel converts in the loop), or a single
/// value in `buf`, in the compute dtype, broadcast as a stride-0 operand. Must
/// outlive the loop it is part of.
struct Operand {
  const Tensor* tensor = nullptr;
  Tensor converted;                 // a converted copy, where the op cannot convert in the loop
  alignas(8) unsigned char buf[8];  // the value of a scalar operand, in the compute dtype
  DType stored = kFloat32;          // the dtype `tensor` holds (the compute dtype for a scalar)
};

/// Prepares `arg` as an input of a loop that converts in the loop
/// (kernels::binary / compare with stored dtypes) writing `out`: a tensor is
/// used as it is, whatever its dtype, and op.stored says which; a Scalar or a
/// one-element tensor of another dtype becomes a scalar in the compute dtype.
/// A tensor of another dtype is converted into op.converted first only when
/// it is broadcast (has fewer elements than `out`) or `in_loop` is false
/// (kernels::converts_in_loop). See Note [Mixed dtypes in the loop]
/// (src/kernels/cpu/elementwise_loop.h).
void prepare_operand_in_loop(Operand& op, Arg arg, DType compute, const Tensor& out, bool in_loop = true);

/// The loop {out, a, b} over `shape` (scalar operands get zero strides).
kernels::LoopSpec make_binary_loop(IntArrayRef shape, const Tensor& out, Operand& a, Operand& b);

/// The loop {out, in} over `shape`.
inline kernels::LoopSpec make_unary_loop(IntArrayRef shape, const Tensor& out, const Tensor& in) {
  return make_loop(shape, {&out, &in});
}

/// Raises DTypeError unless an op whose result type is `result` may write `self` in place.
void check_inplace_cast(const char* op, DType result, const Tensor& self);

/// Raises ShapeError unless broadcasting `self` with `other_sizes` leaves self's shape.
void check_inplace_shape(const char* op, const Tensor& self, IntArrayRef other_sizes);

/// Raises ValueError when some element of `self` is reachable through two
/// indices (an expanded tensor): writing it in place is ill-defined.
void check_no_internal_overlap(const char* op, const Tensor& self);

/// For an in-place op writing `self` and reading `input`: returns `input`, or
/// a clone of it when the two share memory in a way an elementwise loop can
/// not handle; raises ValueError where torch does (dense tensors that overlap
/// partially, such as x and x.t()). See Note [Elementwise aliasing].
Tensor resolve_input_overlap(const char* op, const Tensor& self, const Tensor& input);

/// Scalar equality with a double, as c10's Scalar::equal (pow's fast paths).
inline bool scalar_equals(const Scalar& s, double v) { return s.to_double() == v; }

/// op(a, b) computed in `compute` into a new tensor. Records nothing.
Tensor binary_out(const char* name, kernels::BinaryOp op, Arg a, Arg b, DType compute, const void* alpha = nullptr);

/// The checks of self = op(self, b) computed in `compute` (cast, shape, overlap).
/// Returns b, or a copy of b held in `holder` when b's memory overlaps self's
/// in a way the loop cannot handle (resolve_input_overlap).
Arg check_binary_inplace(const char* name, Tensor& self, Arg b, DType compute, Tensor& holder);

/// self = op(self, b) in `compute`, written back in self's dtype; bumps self's
/// version. Call after check_binary_inplace. Records nothing.
void run_binary_inplace(const char* name, kernels::BinaryOp op, Tensor& self, Arg b, DType compute,
                        const void* alpha = nullptr);

// ---- arithmetic with autograd, for the Tensor methods and the operators ----

Tensor add(Arg a, Arg b, const Scalar& alpha, autograd::CallSite site);
Tensor sub(const Tensor& a, Arg b, const Scalar& alpha, autograd::CallSite site);
/// other - alpha * self (`2 - x`).
Tensor rsub(const Tensor& self, const Scalar& other, const Scalar& alpha, autograd::CallSite site);
Tensor mul(const Tensor& a, Arg b, autograd::CallSite site);
/// True division; `a` may be a Scalar (`2 / x`).
Tensor div(Arg a, Arg b, autograd::CallSite site);
Tensor& add_(Tensor& self, Arg b, const Scalar& alpha, autograd::CallSite site);
Tensor& sub_(Tensor& self, Arg b, const Scalar& alpha, autograd::CallSite site);
Tensor& mul_(Tensor& self, Arg b, autograd::CallSite site);
Tensor& div_(Tensor& self, Arg b, autograd::CallSite site);
Tensor neg(const Tensor& x, autograd::CallSite site);

// ---- autograd helpers of the family ----

/// Whether backward must compute the gradient for the node's input `i`
/// (false for a Scalar operand or an input that needs no gradient).
inline bool needs_grad(const autograd::Node& node, size_t i) {
  return i < node.next_edges().size() && node.next_edges()[i].is_valid();
}

/// `g` in the dtype of the input it is for (torch's formulas cast before the
/// engine sums broadcast dims, so a float64 input's gradient is summed in float64).
inline Tensor grad_as(const Tensor& g, DType input_dtype) {
  return g.dtype() == input_dtype || !is_floating_point(input_dtype) ? g : g.to(input_dtype);
}

/// A copy of `self`'s current value for a backward formula that needs it
/// after an in-place op overwrites self (mul_'s d/dother, log_, pow_).
/// Differentiable where clone is, so double backward sees the old history.
inline Tensor old_value(const Tensor& self) { return self.clone(); }

/// gelu's backward: grad * gelu'(self), "none" (erf) or "tanh" form. Records
/// GeluBackwardBackward0 when an input requires grad (double backward).
Tensor gelu_backward(const Tensor& grad, const Tensor& self, bool tanh_form);
/// The same, written into `grad` itself when nothing else refers to it (the
/// engine hands each node its own incoming buffer): no fresh output, and the
/// gradient stays in the lines its producer just wrote (Note [GELU's gradient
/// over its incoming buffer] in unary.cpp).
Tensor gelu_backward(Tensor&& grad, const Tensor& self, bool tanh_form);

}  // namespace kiln::ops::ew
