// Type promotion for ops with several operands: PyTorch's result_type rules,
// written once here so every op family (elementwise, where, index ops,
// reductions with a second operand...) promotes the same way.
//
// Note [Result type]
// Categories are ordered bool < integral < floating. Operands fall into three
// priority classes: dimensioned tensors, 0-dim tensors, and Scalars ("wrapped
// numbers"). Within a class, dtypes combine with promote_types. Across
// classes, a lower-priority class only matters when its category is higher:
//   int32 tensor + 2         -> int32     (same category: the tensor wins)
//   uint8 tensor + int64 0-d -> uint8
//   int64 tensor + 2.5       -> default float dtype (a float Scalar is the default dtype)
//   float16 tensor + 2.5     -> float16
//   uint8 tensor + float64 0-d -> float64 (a 0-dim tensor keeps its own dtype)
//   bool tensor + 1          -> int64;  bool tensor + True -> bool
// This is c10's ResultTypeState / combine_categories, operand for operand.
#pragma once

#include <initializer_list>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// One operand as promotion sees it: a tensor (dimensioned or 0-dim) or a Scalar.
class PromotionOperand {
 public:
  PromotionOperand(const Tensor& t) : tensor_(&t) {}  // NOLINT: implicit, for {a, b, 2.5} lists
  PromotionOperand(const Scalar& s) : scalar_(&s) {}  // NOLINT
  const Tensor* tensor() const { return tensor_; }
  const Scalar* scalar() const { return scalar_; }

 private:
  const Tensor* tensor_ = nullptr;
  const Scalar* scalar_ = nullptr;
};

/// Accumulates operands one at a time (as c10::ResultTypeState); result() gives the dtype.
class ResultTypeState {
 public:
  void update(const Tensor& t);
  void update(const Scalar& s);
  DType result() const;

 private:
  // -1: no operand of that class yet.
  int8_t dim_ = -1, zero_dim_ = -1, wrapped_ = -1;
};

/// torch.result_type over tensors and Scalars (Note [Result type]).
DType result_type(const Tensor& a, const Tensor& b);
DType result_type(const Tensor& a, const Scalar& b);
DType result_type(const Scalar& a, const Tensor& b);
DType result_type(std::initializer_list<PromotionOperand> operands);

/// torch.can_cast: whether an op whose result type is `from` may write into a
/// tensor of dtype `to` (in-place ops, out= arguments). Floating -> integral or
/// bool is refused, and so is integral -> bool; everything else is allowed.
bool can_cast(DType from, DType to);

/// The dtype a Scalar takes as an operand: bool, int64, or the default float dtype.
DType scalar_operand_dtype(const Scalar& s);

}  // namespace kiln::ops
