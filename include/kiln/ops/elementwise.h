// Elementwise ops as free functions, mirroring torch's namespace functions
// (torch.add, torch.exp, torch.nn.functional.relu/gelu/silu, torch.clamp,
// torch.maximum, torch.result_type...). Each one is the Tensor method of the
// same name (declared in tensor.h): same broadcasting, same type promotion
// (Note [Result type] in kiln/ops/promotion.h), same errors.
#pragma once

#include <optional>
#include <string_view>

#include "kiln/core/tensor.h"
#include "kiln/ops/promotion.h"

namespace kiln {

// ---- arithmetic ----
inline Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha = 1) { return a.add(b, alpha); }
inline Tensor add(const Tensor& a, const Scalar& b, const Scalar& alpha = 1) { return a.add(b, alpha); }
inline Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha = 1) { return a.sub(b, alpha); }
inline Tensor sub(const Tensor& a, const Scalar& b, const Scalar& alpha = 1) { return a.sub(b, alpha); }
/// torch.rsub: other - alpha * self (what `2 - x` computes).
Tensor rsub(const Tensor& self, const Scalar& other, const Scalar& alpha = 1);
inline Tensor mul(const Tensor& a, const Tensor& b) { return a.mul(b); }
inline Tensor mul(const Tensor& a, const Scalar& b) { return a.mul(b); }
/// True division: integer and bool operands give the default float dtype.
inline Tensor div(const Tensor& a, const Tensor& b) { return a.div(b); }
inline Tensor div(const Tensor& a, const Scalar& b) { return a.div(b); }
/// Scalar / tensor (what `2 / x` computes).
Tensor div(const Scalar& a, const Tensor& b);
inline Tensor pow(const Tensor& a, const Tensor& exponent) { return a.pow(exponent); }
inline Tensor pow(const Tensor& a, const Scalar& exponent) { return a.pow(exponent); }
/// Scalar ** tensor (torch.pow(2, x)).
Tensor pow(const Scalar& self, const Tensor& exponent);
/// NaN-propagating elementwise max/min (torch.maximum/minimum).
inline Tensor maximum(const Tensor& a, const Tensor& b) { return a.maximum(b); }
inline Tensor minimum(const Tensor& a, const Tensor& b) { return a.minimum(b); }

// ---- unary ----
inline Tensor neg(const Tensor& x) { return x.neg(); }
inline Tensor abs(const Tensor& x) { return x.abs(); }
inline Tensor exp(const Tensor& x) { return x.exp(); }
inline Tensor log(const Tensor& x) { return x.log(); }
inline Tensor log1p(const Tensor& x) { return x.log1p(); }
inline Tensor sqrt(const Tensor& x) { return x.sqrt(); }
inline Tensor rsqrt(const Tensor& x) { return x.rsqrt(); }
inline Tensor sin(const Tensor& x) { return x.sin(); }
inline Tensor cos(const Tensor& x) { return x.cos(); }
inline Tensor tanh(const Tensor& x) { return x.tanh(); }
inline Tensor sigmoid(const Tensor& x) { return x.sigmoid(); }
inline Tensor relu(const Tensor& x) { return x.relu(); }
/// approximate: "none" (erf form) or "tanh"; anything else raises ValueError.
inline Tensor gelu(const Tensor& x, std::string_view approximate = "none") { return x.gelu(approximate); }
inline Tensor silu(const Tensor& x) { return x.silu(); }
inline Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt) {
  return x.clamp(min, max);
}

// ---- comparison and logic ----
inline Tensor eq(const Tensor& a, const Tensor& b) { return a.eq(b); }
inline Tensor eq(const Tensor& a, const Scalar& b) { return a.eq(b); }
inline Tensor ne(const Tensor& a, const Tensor& b) { return a.ne(b); }
inline Tensor ne(const Tensor& a, const Scalar& b) { return a.ne(b); }
inline Tensor lt(const Tensor& a, const Tensor& b) { return a.lt(b); }
inline Tensor lt(const Tensor& a, const Scalar& b) { return a.lt(b); }
inline Tensor le(const Tensor& a, const Tensor& b) { return a.le(b); }
inline Tensor le(const Tensor& a, const Scalar& b) { return a.le(b); }
inline Tensor gt(const Tensor& a, const Tensor& b) { return a.gt(b); }
inline Tensor gt(const Tensor& a, const Scalar& b) { return a.gt(b); }
inline Tensor ge(const Tensor& a, const Tensor& b) { return a.ge(b); }
inline Tensor ge(const Tensor& a, const Scalar& b) { return a.ge(b); }
inline Tensor logical_and(const Tensor& a, const Tensor& b) { return a.logical_and(b); }
inline Tensor logical_or(const Tensor& a, const Tensor& b) { return a.logical_or(b); }
inline Tensor logical_xor(const Tensor& a, const Tensor& b) { return a.logical_xor(b); }
inline Tensor logical_not(const Tensor& a) { return a.logical_not(); }
/// Bitwise on integer tensors, logical on bool; floating tensors raise DTypeError (the & | ^ ~ operators).
Tensor bitwise_and(const Tensor& a, const Tensor& b);
Tensor bitwise_or(const Tensor& a, const Tensor& b);
Tensor bitwise_xor(const Tensor& a, const Tensor& b);
Tensor bitwise_not(const Tensor& a);
inline bool equal(const Tensor& a, const Tensor& b) { return a.equal(b); }
inline bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8,
                     bool equal_nan = false) {
  return a.allclose(b, rtol, atol, equal_nan);
}

// ---- type promotion (torch.result_type / torch.can_cast) ----
inline DType result_type(const Tensor& a, const Tensor& b) { return ops::result_type(a, b); }
inline DType result_type(const Tensor& a, const Scalar& b) { return ops::result_type(a, b); }
inline DType result_type(const Scalar& a, const Tensor& b) { return ops::result_type(a, b); }
inline bool can_cast(DType from, DType to) { return ops::can_cast(from, to); }

}  // namespace kiln
