// The C++ operators declared at the bottom of tensor.h, with Python's meaning
// for torch tensors: + - * / are add sub mul div (true division), a Scalar on
// the left is rsub/div as in `2 - x`, `2 / x`; comparisons give bool tensors;
// & | ^ ~ are bitwise on integers and logical on bool.
//
// An operator cannot take a std::source_location argument, so the arithmetic
// ones call the family's entry points (elementwise_common.h) with an unknown
// call site: the same code and backward nodes as the methods, without file:line.
#include "elementwise_common.h"
#include "kiln/ops/elementwise.h"

namespace kiln {

namespace ew = ops::ew;

Tensor operator+(const Tensor& a, const Tensor& b) { return ew::add(a, b, 1, {}); }
Tensor operator-(const Tensor& a, const Tensor& b) { return ew::sub(a, b, 1, {}); }
Tensor operator*(const Tensor& a, const Tensor& b) { return ew::mul(a, b, {}); }
Tensor operator/(const Tensor& a, const Tensor& b) { return ew::div(a, b, {}); }
Tensor operator+(const Tensor& a, const Scalar& b) { return ew::add(a, b, 1, {}); }
Tensor operator-(const Tensor& a, const Scalar& b) { return ew::sub(a, b, 1, {}); }
Tensor operator*(const Tensor& a, const Scalar& b) { return ew::mul(a, b, {}); }
Tensor operator/(const Tensor& a, const Scalar& b) { return ew::div(a, b, {}); }
// Addition and multiplication commute exactly in IEEE arithmetic, so b + a is a + b.
Tensor operator+(const Scalar& a, const Tensor& b) { return ew::add(b, a, 1, {}); }
Tensor operator-(const Scalar& a, const Tensor& b) { return ew::rsub(b, a, 1, {}); }
Tensor operator*(const Scalar& a, const Tensor& b) { return ew::mul(b, a, {}); }
Tensor operator/(const Scalar& a, const Tensor& b) {
  ops::check_defined(b, "div", "other");
  return ew::div(a, b, {});
}
Tensor operator-(const Tensor& a) { return ew::neg(a, {}); }

Tensor& operator+=(Tensor& a, const Tensor& b) { return ew::add_(a, b, 1, {}); }
Tensor& operator-=(Tensor& a, const Tensor& b) { return ew::sub_(a, b, 1, {}); }
Tensor& operator*=(Tensor& a, const Tensor& b) { return ew::mul_(a, b, {}); }
Tensor& operator/=(Tensor& a, const Tensor& b) { return ew::div_(a, b, {}); }
Tensor& operator+=(Tensor& a, const Scalar& b) { return ew::add_(a, b, 1, {}); }
Tensor& operator-=(Tensor& a, const Scalar& b) { return ew::sub_(a, b, 1, {}); }
Tensor& operator*=(Tensor& a, const Scalar& b) { return ew::mul_(a, b, {}); }
Tensor& operator/=(Tensor& a, const Scalar& b) { return ew::div_(a, b, {}); }

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
