// Internal to the elementwise op family (binary.cpp, unary.cpp, compare.cpp):
// operands that are a Tensor or a Scalar, their conversion to the compute
// dtype, the loop over (out, a, b), and the in-place checks PyTorch makes.
#pragma once

#include "iter.h"
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

/// One input of a kernel loop after conversion to the compute dtype: a tensor
/// of that dtype, or a single value in `buf` broadcast as a stride-0 operand.
/// Must outlive the loop it is part of.
struct Operand {
  const Tensor* tensor = nullptr;
  Tensor converted;                 // holds a converted copy when one was needed
  alignas(8) unsigned char buf[8];  // the value of a scalar operand, in the compute dtype
};

/// Prepares `arg` as an input in dtype `compute`. A tensor of another dtype
/// with one element becomes a scalar; one of the output's full shape is
/// converted straight into `out` when `out_free` (then cleared), so the op
/// runs in place there and needs no temporary; others are converted copies.
void prepare_operand(Operand& op, Arg arg, DType compute, const Tensor& out, bool& out_free);

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

}  // namespace kiln::ops::ew
