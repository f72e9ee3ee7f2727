// Elementwise ops as free functions, mirroring torch's namespace functions
// (torch.add, torch.exp, torch.nn.functional.relu/gelu/silu, torch.clamp,
// torch.maximum, torch.result_type...). Each one is the Tensor method of the
// same name (declared in tensor.h): same broadcasting, same type promotion
// (Note [Result type] in kiln/ops/promotion.h), same errors.
#pragma once

#include <optional>
#include <source_location>
#include <string_view>

#include "kiln/core/tensor.h"
#include "kiln/ops/promotion.h"

namespace kiln {

// ---- arithmetic ----
// `loc` is the caller's file:line for autograd's messages (tensor.h).
inline Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha = 1,
                  std::source_location loc = std::source_location::current()) {
  return a.add(b, alpha, loc);
}
inline Tensor add(const Tensor& a, const Scalar& b, const Scalar& alpha = 1,
                  std::source_location loc = std::source_location::current()) {
  return a.add(b, alpha, loc);
}
inline Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha = 1,
                  std::source_location loc = std::source_location::current()) {
  return a.sub(b, alpha, loc);
}
inline Tensor sub(const Tensor& a, const Scalar& b, const Scalar& alpha = 1,
                  std::source_location loc = std::source_location::current()) {
  return a.sub(b, alpha, loc);
}
/// torch.rsub: other - alpha * self (what `2 - x` computes).
Tensor rsub(const Tensor& self, const Scalar& other, const Scalar& alpha = 1,
            std::source_location loc = std::source_location::current());
inline Tensor mul(const Tensor& a, const Tensor& b, std::source_location loc = std::source_location::current()) {
  return a.mul(b, loc);
}
inline Tensor mul(const Tensor& a, const Scalar& b, std::source_location loc = std::source_location::current()) {
  return a.mul(b, loc);
}
/// True division: integer and bool operands give the default float dtype.
inline Tensor div(const Tensor& a, const Tensor& b, std::source_location loc = std::source_location::current()) {
  return a.div(b, loc);
}
inline Tensor div(const Tensor& a, const Scalar& b, std::source_location loc = std::source_location::current()) {
  return a.div(b, loc);
}
/// Scalar / tensor (what `2 / x` computes).
Tensor div(const Scalar& a, const Tensor& b, std::source_location loc = std::source_location::current());
inline Tensor pow(const Tensor& a, const Tensor& exponent, std::source_location loc = std::source_location::current()) {
  return a.pow(exponent, loc);
}
inline Tensor pow(const Tensor& a, const Scalar& exponent, std::source_location loc = std::source_location::current()) {
  return a.pow(exponent, loc);
}
/// Scalar ** tensor (torch.pow(2, x)).
Tensor pow(const Scalar& self, const Tensor& exponent, std::source_location loc = std::source_location::current());
/// NaN-propagating elementwise max/min (torch.maximum/minimum); equal inputs share the gradient.
inline Tensor maximum(const Tensor& a, const Tensor& b, std::source_location loc = std::source_location::current()) {
  return a.maximum(b, loc);
}
inline Tensor minimum(const Tensor& a, const Tensor& b, std::source_location loc = std::source_location::current()) {
  return a.minimum(b, loc);
}

// ---- unary ----
inline Tensor neg(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.neg(loc); }
inline Tensor abs(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.abs(loc); }
inline Tensor exp(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.exp(loc); }
inline Tensor log(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.log(loc); }
inline Tensor log1p(const Tensor& x, std::source_location loc = std::source_location::current()) {
  return x.log1p(loc);
}
inline Tensor sqrt(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.sqrt(loc); }
inline Tensor rsqrt(const Tensor& x, std::source_location loc = std::source_location::current()) {
  return x.rsqrt(loc);
}
inline Tensor sin(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.sin(loc); }
inline Tensor cos(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.cos(loc); }
inline Tensor tanh(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.tanh(loc); }
inline Tensor sigmoid(const Tensor& x, std::source_location loc = std::source_location::current()) {
  return x.sigmoid(loc);
}
inline Tensor relu(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.relu(loc); }
/// approximate: "none" (erf form) or "tanh"; anything else raises ValueError.
inline Tensor gelu(const Tensor& x, std::string_view approximate = "none",
                   std::source_location loc = std::source_location::current()) {
  return x.gelu(approximate, loc);
}
inline Tensor silu(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.silu(loc); }
inline Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt,
                    std::source_location loc = std::source_location::current()) {
  return x.clamp(min, max, loc);
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
inline bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8, bool equal_nan = false) {
  return a.allclose(b, rtol, atol, equal_nan);
}

// ---- type promotion (torch.result_type / torch.can_cast) ----
inline DType result_type(const Tensor& a, const Tensor& b) { return ops::result_type(a, b); }
inline DType result_type(const Tensor& a, const Scalar& b) { return ops::result_type(a, b); }
inline DType result_type(const Scalar& a, const Tensor& b) { return ops::result_type(a, b); }
inline bool can_cast(DType from, DType to) { return ops::can_cast(from, to); }

}  // namespace kiln
