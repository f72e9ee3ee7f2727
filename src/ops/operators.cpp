// The C++ operators declared at the bottom of tensor.h, with Python's meaning
// for torch tensors: + - * / are add sub mul div (true division), a Scalar on
// the left is rsub/div as in `2 - x`, `2 / x`; comparisons give bool tensors;
// & | ^ ~ are bitwise on integers and logical on bool.
//
// The arithmetic ones get their caller's line through TensorAt/ScalarAt
// (tensor.h) and call the family's entry points (elementwise_common.h): the
// same code, backward nodes and file:line as the methods.
#include "elementwise_common.h"
#include "kiln/ops/elementwise.h"

namespace kiln {

namespace ew = ops::ew;
using autograd::CallSite;

Tensor operator+(const Tensor& a, TensorAt b) { return ew::add(a, b.t, 1, CallSite::from(b.loc)); }
Tensor operator-(const Tensor& a, TensorAt b) { return ew::sub(a, b.t, 1, CallSite::from(b.loc)); }
Tensor operator*(const Tensor& a, TensorAt b) { return ew::mul(a, b.t, CallSite::from(b.loc)); }
Tensor operator/(const Tensor& a, TensorAt b) { return ew::div(a, b.t, CallSite::from(b.loc)); }
Tensor operator+(const Tensor& a, ScalarAt b) { return ew::add(a, b.s, 1, CallSite::from(b.loc)); }
Tensor operator-(const Tensor& a, ScalarAt b) { return ew::sub(a, b.s, 1, CallSite::from(b.loc)); }
Tensor operator*(const Tensor& a, ScalarAt b) { return ew::mul(a, b.s, CallSite::from(b.loc)); }
Tensor operator/(const Tensor& a, ScalarAt b) { return ew::div(a, b.s, CallSite::from(b.loc)); }
// Addition and multiplication commute exactly in IEEE arithmetic, so b + a is a + b.
Tensor operator+(const Scalar& a, TensorAt b) { return ew::add(b.t, a, 1, CallSite::from(b.loc)); }
Tensor operator-(const Scalar& a, TensorAt b) { return ew::rsub(b.t, a, 1, CallSite::from(b.loc)); }
Tensor operator*(const Scalar& a, TensorAt b) { return ew::mul(b.t, a, CallSite::from(b.loc)); }
Tensor operator/(const Scalar& a, TensorAt b) {
  ops::check_defined(b.t, "div", "other");
  return ew::div(a, b.t, CallSite::from(b.loc));
}
Tensor operator-(TensorAt a) { return ew::neg(a.t, CallSite::from(a.loc)); }

Tensor& operator+=(Tensor& a, TensorAt b) { return ew::add_(a, b.t, 1, CallSite::from(b.loc)); }
Tensor& operator-=(Tensor& a, TensorAt b) { return ew::sub_(a, b.t, 1, CallSite::from(b.loc)); }
Tensor& operator*=(Tensor& a, TensorAt b) { return ew::mul_(a, b.t, CallSite::from(b.loc)); }
Tensor& operator/=(Tensor& a, TensorAt b) { return ew::div_(a, b.t, CallSite::from(b.loc)); }
Tensor& operator+=(Tensor& a, ScalarAt b) { return ew::add_(a, b.s, 1, CallSite::from(b.loc)); }
Tensor& operator-=(Tensor& a, ScalarAt b) { return ew::sub_(a, b.s, 1, CallSite::from(b.loc)); }
Tensor& operator*=(Tensor& a, ScalarAt b) { return ew::mul_(a, b.s, CallSite::from(b.loc)); }
Tensor& operator/=(Tensor& a, ScalarAt b) { return ew::div_(a, b.s, CallSite::from(b.loc)); }

Tensor operator==(const Tensor& a, const Tensor& b) { return a.eq(b); }
Tensor operator!=(const Tensor& a, const Tensor& b) { return a.ne(b); }
Tensor operator<(const Tensor& a, const Tensor& b) { return a.lt(b); }
Tensor operator<=(const Tensor& a, const Tensor& b) { return a.le(b); }
Tensor operator>(const Tensor& a, const Tensor& b) { return a.gt(b); }
Tensor operator>=(const Tensor& a, const Tensor& b) { return a.ge(b); }
Tensor operator==(const Tensor& a, const Scalar& b) { return a.eq(b); }
Tensor operator!=(const Tensor& a, const Scalar& b) { return a.ne(b); }
Tensor operator<(const Tensor& a, const Scalar& b) { return a.lt(b); }
Tensor operator<=(const Tensor& a, const Scalar& b) { return a.le(b); }
Tensor operator>(const Tensor& a, const Scalar& b) { return a.gt(b); }
Tensor operator>=(const Tensor& a, const Scalar& b) { return a.ge(b); }

Tensor operator&(const Tensor& a, const Tensor& b) { return bitwise_and(a, b); }
Tensor operator|(const Tensor& a, const Tensor& b) { return bitwise_or(a, b); }
Tensor operator^(const Tensor& a, const Tensor& b) { return bitwise_xor(a, b); }
Tensor operator~(const Tensor& a) { return bitwise_not(a); }

}  // namespace kiln
