// Unary elementwise kernels and clamp. Each op is one element function; the
// drivers in elementwise_loop.h supply dtypes, strides, blocks and threads.
#include <cmath>
#include <type_traits>

#include "elementwise_loop.h"
#include "elementwise_math.h"
#include "gelu_rows.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/elementwise.h"
#include "loop_capture.h"

namespace kiln::kernels {

namespace {

using ew::map;
using ew::map_vm;
using ew::run_unary;

constexpr double kSqrt1_2 = 0.70710678118654752440;      // 1/sqrt(2)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi), gelu's tanh form
constexpr double kGeluKappa = 0.044715;

[[noreturn]] void undefined_op(UnaryOp op, DType dt) {
  KILN_ASSERT(false, "elementwise unary op #", static_cast<int>(op), " reached the kernel with dtype ", dtype_name(dt),
              "; the ops layer should have rejected it");
  __builtin_unreachable();
}

template <typename T>
void unary_integral(const LoopSpec& s, UnaryOp op) {
  if constexpr (std::is_same_v<T, bool>) {
    if (op == UnaryOp::BitwiseNot) return map<T>(s, [](bool x) { return !x; });
  } else {
    constexpr bool kUnsigned = std::is_unsigned_v<T>;
    switch (op) {
      case UnaryOp::Neg: return map<T>(s, [](T x) { return vm::wrapping_neg(x); });
      case UnaryOp::Abs:
        if constexpr (kUnsigned)
          return map<T>(s, [](T x) { return x; });
        else
          return map<T>(s, [](T x) { return x < 0 ? vm::wrapping_neg(x) : x; });
      case UnaryOp::Relu:
        if constexpr (kUnsigned)
          return map<T>(s, [](T x) { return x; });
        else
          return map<T>(s, [](T x) { return x < 0 ? T(0) : x; });
      case UnaryOp::BitwiseNot: return map<T>(s, [](T x) { return static_cast<T>(~x); });
      default: break;
    }
  }
  undefined_op(op, dtype_of_v<T>);
}

template <typename T>
void unary_floating(const LoopSpec& s, UnaryOp op) {
  using C = compute_t<T>;
  switch (op) {
    case UnaryOp::Neg: return map<T>(s, [](C x) { return -x; });
    case UnaryOp::Abs: return map<T>(s, [](C x) { return std::abs(x); });
    // x < 0 ? 0 : x keeps -0.0 and NaN as they are, as torch's relu (clamp_min) does.
    case UnaryOp::Relu: return map<T>(s, [](C x) { return x < C(0) ? C(0) : x; });
    case UnaryOp::Exp: return map_vm<T>(s, [](C x) { return vm::exp(x); });
    case UnaryOp::Log: return map_vm<T>(s, [](C x) { return vm::log(x); });
    case UnaryOp::Log1p: return map_vm<T>(s, [](C x) { return vm::log1p(x); });
    case UnaryOp::Sin: return map_vm<T>(s, [](C x) { return vm::sin(x); });
    case UnaryOp::Cos: return map_vm<T>(s, [](C x) { return vm::cos(x); });
    case UnaryOp::Tanh: return map_vm<T>(s, [](C x) { return vm::tanh(x); });
    case UnaryOp::Sqrt: return run_unary<T, T>(s, [](C* o, const C* in, int64_t n) { vm::sqrt_row(o, in, n); });
    case UnaryOp::Rsqrt: return run_unary<T, T>(s, [](C* o, const C* in, int64_t n) { vm::rsqrt_row(o, in, n); });
    case UnaryOp::Sigmoid: return map_vm<T>(s, [](C x) { return C(1) / (C(1) + vm::exp(-x)); });
    case UnaryOp::GeluErf: return map_vm<T>(s, [](C x) { return x * C(0.5) * (C(1) + vm::erf(x * C(kSqrt1_2))); });
    // 0.5 x (1 + tanh(u)) written as x sigmoid(2u), the same function: one exp
    // and one division instead of the tanh that bound it (float32 GELU now runs
    // near memory speed), and no cancellation in 1 + tanh(u) where x is very negative.
    case UnaryOp::GeluTanh:
#ifdef KILN_GELU_ROWS
      if constexpr (std::is_same_v<C, float>)  // Note [GELU rows]
        return run_unary<T, T>(s, [](float* o, const float* in, int64_t n) { vm::gelu_tanh_row(o, in, n); });
#endif
      return map_vm<T>(s, [](C x) {
        const C inner = C(kSqrt2OverPi) * (x + C(kGeluKappa) * x * x * x);
        return x / (C(1) + vm::exp(C(-2) * inner));
      });
    case UnaryOp::Silu: return map_vm<T>(s, [](C x) { return x / (C(1) + vm::exp(-x)); });
    case UnaryOp::Sign: return map<T>(s, [](C x) { return C(x > C(0)) - C(x < C(0)); });
    case UnaryOp::BitwiseNot: break;
  }
  undefined_op(op, dtype_of_v<T>);
}

}  // namespace

void unary(const LoopSpec& s, UnaryOp op, DType dt) {
  KILN_CAPTURE_LOOP("unary", s, ew::sizes_all(static_cast<int>(element_size(dt))), unary(t, op, dt));
  visit_dtype(dt, [&]<typename T>() {
    if constexpr (is_float_v<T>) {
      unary_floating<T>(s, op);
    } else {
      unary_integral<T>(s, op);
    }
  });
}

void clamp(const LoopSpec& s, DType dt, const void* lo, const void* hi) {
  // The bounds point at the caller's stack: the record keeps copies (made only when recording).
  const capture::KernelScope cap("clamp", capture::kDeferrable);
  if (cap.recording()) {
    const int es = static_cast<int>(element_size(dt));
    if (ew::record_loop(cap, s, ew::sizes_all(es),
                        [=, l = capture::ScalarBytes(lo, es), h = capture::ScalarBytes(hi, es)](const LoopSpec& t) {
                          clamp(t, dt, l.ptr(), h.ptr());
                        }))
      return;
  }
  KILN_ASSERT(lo || hi, "clamp kernel called without bounds");
  visit_dtype(dt, [&]<typename T>() {
    using C = compute_t<T>;
    // torch's std::min(std::max(x, lo), hi): a NaN x stays NaN, lo > hi gives hi.
    if (lo && hi) {
      const C l = static_cast<C>(*static_cast<const T*>(lo)), h = static_cast<C>(*static_cast<const T*>(hi));
      map<T>(s, [l, h](C x) {
        const C t = x < l ? l : x;
        return h < t ? h : t;
      });
    } else if (lo) {
      const C l = static_cast<C>(*static_cast<const T*>(lo));
      map<T>(s, [l](C x) { return x < l ? l : x; });
    } else {
      const C h = static_cast<C>(*static_cast<const T*>(hi));
      map<T>(s, [h](C x) { return h < x ? h : x; });
    }
  });
}

}  // namespace kiln::kernels
