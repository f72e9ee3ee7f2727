// Elementwise kernels (kernels layer: raw strided loops, no Tensor).
//
// Every entry takes a LoopSpec whose operand 0 is the output and whose other
// operands all have one dtype `dt` (the ops layer promotes; binary and compare
// also take operands stored in other dtypes and convert them in the loop). An
// operand with all-zero strides is a broadcast scalar; kernels detect it and
// keep it in a register. Contiguous rows take loops the compiler
// vectorises (transcendentals through glibc's libmvec); bfloat16/float16 rows
// are converted to float in blocks, computed in float and rounded on store;
// strided rows are gathered through the same blocks. Large loops run on
// OpenMP threads above kGrainSize, split at sizes only (deterministic).
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"
#include "kiln/core/scalar.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

enum class UnaryOp : uint8_t {
  Neg,
  Abs,
  Relu,
  BitwiseNot,  // every dtype they are defined for (the ops layer checks)
  Exp,
  Log,
  Log1p,
  Sqrt,
  Rsqrt,
  Sin,
  Cos,
  Tanh,
  Sigmoid,
  GeluErf,
  GeluTanh,
  Silu,  // floating only
  Sign,  // floating only: -1, 0 or 1; 0 for +-0 and NaN (torch.sign; abs's backward)
};

/// Operand 0 = op(operand 1); both of dtype `dt`. The two may be the same memory.
void unary(const LoopSpec& s, UnaryOp op, DType dt);

/// Operand 0 = min(max(operand 1, lo), hi), both of dtype `dt`; `lo`/`hi` point
/// at a value of dtype `dt`, or are null when that bound is absent. A NaN input
/// stays NaN; a NaN bound is the caller's business (torch fills NaN).
void clamp(const LoopSpec& s, DType dt, const void* lo, const void* hi);

enum class BinaryOp : uint8_t {
  Add,  // a + alpha * b (alpha optional); sub is add with -alpha
  Mul,
  Div,  // Div: floating dtypes only (true division)
  Pow,  // integers: exact, negative exponents give 0, 1 or -1 (torch's powi)
  Maximum,
  Minimum,  // NaN-propagating on floats
  BitwiseAnd,
  BitwiseOr,
  BitwiseXor,  // integral and bool only
  // Floating only: operand 1 (the incoming gradient) * gelu'(operand 2), as torch's gelu_backward.
  GeluErfBackward,
  GeluTanhBackward,
};

/// Operand 0 = op(operand 1, operand 2), all of dtype `dt`. `alpha` (Add only)
/// points at a value of dtype `dt`, or is null for 1.
void binary(const LoopSpec& s, BinaryOp op, DType dt, const void* alpha = nullptr);

/// The dtypes a binary loop's operands are stored in when they are not all the
/// compute dtype: operand 0 (the output) `out`, operand 1 `a`, operand 2 `b`.
struct StoredDTypes {
  DType out, a, b;
};

/// As binary(), with operands stored in other dtypes: each input element is
/// converted to `dt` and the result to `stored.out` as copy_ converts, a block
/// of a few hundred elements at a time inside the loop, so the results are
/// bitwise those of converting the operands first, without a converted copy
/// or another pass over memory. An in-place op whose self is not of dtype `dt`
/// passes self as both operand 0 and 1.
void binary(const LoopSpec& s, BinaryOp op, DType dt, const StoredDTypes& stored, const void* alpha = nullptr);

/// Whether binary() with stored dtypes gives op's results bitwise those of
/// converting the operands first. False for the ops whose element function
/// calls libmvec (pow, the gelu backwards): its SIMD and scalar variants may
/// differ in the last bit, and which one a loop gets depends on how the
/// compiler vectorised that loop, so the ops layer converts their operands first.
constexpr bool converts_in_loop(BinaryOp op) {
  return op != BinaryOp::Pow && op != BinaryOp::GeluErfBackward && op != BinaryOp::GeluTanhBackward;
}

/// Operand 0 = operand 1 ** exponent, dtype `dt`, with torch's special cases
/// (2 and 3 multiply, 0.5 is sqrt, -0.5 rsqrt, -1 reciprocal, -2 1/(x*x)).
/// The exponent is converted to `dt` first, as torch does.
void pow_scalar(const LoopSpec& s, DType dt, const Scalar& exponent);

enum class CompareOp : uint8_t { Eq, Ne, Lt, Le, Gt, Ge, LogicalAnd, LogicalOr, LogicalXor };

/// Operand 0 (bool) = op(operand 1, operand 2); operands 1 and 2 of dtype `dt`.
void compare(const LoopSpec& s, CompareOp op, DType dt);
/// As compare(), operand 1 stored as `a_dt` and operand 2 as `b_dt`, each
/// converted to `dt` inside the loop as binary(..., StoredDTypes) does.
void compare(const LoopSpec& s, CompareOp op, DType dt, DType a_dt, DType b_dt);

/// Operand 0 (bool) = (operand 1 == 0), operand 1 of dtype `dt`.
void logical_not(const LoopSpec& s, DType dt);

/// Whether every element pair of operands 0 and 1 (dtype `dt`) satisfies
/// |a - b| <= atol + rtol * |b| (torch.isclose), or a == b, or both are NaN
/// when equal_nan. Integers and bool compare in float, as torch does.
bool all_close(const LoopSpec& s, DType dt, double rtol, double atol, bool equal_nan);

/// Writes `value` converted to dtype `dt` (Scalar::to) into `dst`.
void scalar_to_bytes(void* dst, DType dt, const Scalar& value);

/// Writes the element at `src` (dtype `from`) converted to dtype `to` into `dst`,
/// with the conversion copy_ uses.
void convert_element(void* dst, DType to, const void* src, DType from);

}  // namespace kiln::kernels
