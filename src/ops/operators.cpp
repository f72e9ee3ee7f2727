// The C++ operators declared at the bottom of tensor.h, with Python's meaning
// for torch tensors: + - * / are add sub mul div (true division), a Scalar on
// the left is rsub/div as in `2 - x`, `2 / x`; comparisons give bool tensors;
// & | ^ ~ are bitwise on integers and logical on bool.
#include "kiln/ops/elementwise.h"

namespace kiln {

Tensor operator+(const Tensor& a, const Tensor& b) { return a.add(b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return a.sub(b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return a.mul(b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return a.div(b); }
Tensor operator+(const Tensor& a, const Scalar& b) { return a.add(b); }
Tensor operator-(const Tensor& a, const Scalar& b) { return a.sub(b); }
Tensor operator*(const Tensor& a, const Scalar& b) { return a.mul(b); }
Tensor operator/(const Tensor& a, const Scalar& b) { return a.div(b); }
// Addition and multiplication commute exactly in IEEE arithmetic, so b + a is a + b.
Tensor operator+(const Scalar& a, const Tensor& b) { return b.add(a); }
Tensor operator-(const Scalar& a, const Tensor& b) { return rsub(b, a); }
Tensor operator*(const Scalar& a, const Tensor& b) { return b.mul(a); }
Tensor operator/(const Scalar& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return a.neg(); }

Tensor& operator+=(Tensor& a, const Tensor& b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, const Tensor& b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, const Tensor& b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, const Tensor& b) { return a.div_(b); }
Tensor& operator+=(Tensor& a, const Scalar& b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, const Scalar& b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, const Scalar& b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, const Scalar& b) { return a.div_(b); }

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
