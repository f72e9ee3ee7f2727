// PyTorch's result_type (c10 ResultTypeState + combine_categories); see
// Note [Result type] in include/kiln/ops/promotion.h.
#include "kiln/ops/promotion.h"

namespace kiln::ops {

namespace {

constexpr int8_t kNone = -1;

int8_t promote_slot(int8_t slot, DType t) {
  if (slot == kNone) return static_cast<int8_t>(t);
  return static_cast<int8_t>(promote_types(static_cast<DType>(slot), t));
}

// c10's combine_categories: `higher` is the higher-priority class. A floating
// higher class wins outright; a bool higher class, or a floating lower one,
// promotes with the lower class; otherwise the higher class keeps its dtype.
int8_t combine_categories(int8_t higher, int8_t lower) {
  if (higher == kNone) return lower;
  if (lower == kNone) return higher;
  const DType h = static_cast<DType>(higher), l = static_cast<DType>(lower);
  if (is_floating_point(h)) return higher;
  if (h == kBool || is_floating_point(l)) return static_cast<int8_t>(promote_types(h, l));
  return higher;
}

}  // namespace

DType scalar_operand_dtype(const Scalar& s) {
  switch (s.kind()) {
    case Scalar::Kind::Bool: return kBool;
    case Scalar::Kind::Integral: return kInt64;
    case Scalar::Kind::Floating: return default_dtype();
  }
  return kInt64;
}

void ResultTypeState::update(const Tensor& t) {
  KILN_CHECK(t.defined(), ValueError, "result_type: got an undefined tensor");
  if (t.dim() == 0) {
    zero_dim_ = promote_slot(zero_dim_, t.dtype());
  } else {
    dim_ = promote_slot(dim_, t.dtype());
  }
}

void ResultTypeState::update(const Scalar& s) { wrapped_ = promote_slot(wrapped_, scalar_operand_dtype(s)); }

DType ResultTypeState::result() const {
  const int8_t r = combine_categories(dim_, combine_categories(zero_dim_, wrapped_));
  KILN_CHECK(r != kNone, ValueError, "result_type: expected at least one operand");
  return static_cast<DType>(r);
}

DType result_type(const Tensor& a, const Tensor& b) {
  // The common case (two dimensioned tensors of one dtype) needs no state.
  if (a.defined() && b.defined() && a.dtype() == b.dtype()) return a.dtype();
  ResultTypeState s;
  s.update(a);
  s.update(b);
  return s.result();
}

DType result_type(const Tensor& a, const Scalar& b) {
  ResultTypeState s;
  s.update(a);
  s.update(b);
  return s.result();
}

DType result_type(const Scalar& a, const Tensor& b) { return result_type(b, a); }

DType result_type(std::initializer_list<PromotionOperand> operands) {
  ResultTypeState s;
  for (const auto& op : operands) {
    if (op.tensor()) {
      s.update(*op.tensor());
    } else {
      s.update(*op.scalar());
    }
  }
  return s.result();
}

bool can_cast(DType from, DType to) {
  if (is_floating_point(from) && !is_floating_point(to)) return false;
  if (from != kBool && to == kBool) return false;
  return true;
}

}  // namespace kiln::ops
