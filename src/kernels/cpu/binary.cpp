// Binary arithmetic kernels (add, mul, div, pow, maximum, minimum, bitwise)
// and pow with a scalar exponent. Element functions work in compute_t<T>;
// elementwise_loop.h supplies dtypes, strides, scalar operands and threads.
#include <cmath>
#include <limits>
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
using ew::run_binary;
using ew::run_unary;

template <typename T>
inline constexpr bool is_int_v = std::is_integral_v<T> && !std::is_same_v<T, bool>;

// bool arithmetic is logical, as torch's (True + True is True, True * False is False).
template <typename T>
struct AddOp {
  using C = compute_t<T>;
  C operator()(C a, C b) const {
    if constexpr (std::is_same_v<T, bool>)
      return a || b;
    else if constexpr (is_int_v<T>)
      return vm::wrapping_add(a, b);
    else
      return a + b;
  }
};

template <typename T>
struct AddAlphaOp {
  using C = compute_t<T>;
  C alpha;
  C operator()(C a, C b) const {
    if constexpr (std::is_same_v<T, bool>)
      return a || (alpha && b);
    else if constexpr (is_int_v<T>)
      return vm::wrapping_add(a, vm::wrapping_mul(alpha, b));
    else
      return a + alpha * b;
  }
};

template <typename T>
struct MulOp {
  using C = compute_t<T>;
  C operator()(C a, C b) const {
    if constexpr (std::is_same_v<T, bool>)
      return a && b;
    else if constexpr (is_int_v<T>)
      return vm::wrapping_mul(a, b);
    else
      return a * b;
  }
};

// NaN-propagating on floats, as torch.maximum/minimum; ties return `a`.
template <typename T>
struct MaxOp {
  using C = compute_t<T>;
  C operator()(C a, C b) const {
    if constexpr (std::is_same_v<T, bool>) {
      return a || b;
    } else if constexpr (is_float_v<T>) {
      return (a != a || b != b) ? std::numeric_limits<C>::quiet_NaN() : (a < b ? b : a);
    } else {
      return a < b ? b : a;
    }
  }
};

template <typename T>
struct MinOp {
  using C = compute_t<T>;
  C operator()(C a, C b) const {
    if constexpr (std::is_same_v<T, bool>) {
      return a && b;
    } else if constexpr (is_float_v<T>) {
      return (a != a || b != b) ? std::numeric_limits<C>::quiet_NaN() : (b < a ? b : a);
    } else {
      return b < a ? b : a;
    }
  }
};

// gelu's derivative times the incoming gradient, as torch's GeluBackward kernels:
// erf form: dy * (cdf(x) + x * pdf(x)); tanh form: the derivative of
// 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).
constexpr double kSqrt1_2 = 0.70710678118654752440;      // 1/sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1/sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi)
constexpr double kGeluKappa = 0.044715;

template <typename C>
inline C gelu_erf_backward(C dy, C x) {
  const C cdf = C(0.5) * (C(1) + vm::erf(x * C(kSqrt1_2)));
  const C pdf = C(kInvSqrt2Pi) * vm::exp(C(-0.5) * x * x);
  return dy * (cdf + x * pdf);
}

// With s = sigmoid(2u) = 0.5 (1 + tanh(u)), torch's two terms 0.5 (1 + t) and
// 0.5 x (1 - t^2) u' are s and 2 x s (1 - s) u': one exp and one division, as
// the forward (unary.cpp), instead of a tanh.
template <typename C>
inline C gelu_tanh_backward(C dy, C x) {
  const C x_sq = x * x;
  const C inner = C(kSqrt2OverPi) * (x + C(kGeluKappa) * x_sq * x);
  const C sig = C(1) / (C(1) + vm::exp(C(-2) * inner));
  const C left_derivative = sig;
  const C right_derivative = C(2) * x * sig * (C(1) - sig) * C(kSqrt2OverPi) * (C(1) + C(3 * kGeluKappa) * x_sq);
  return dy * (left_derivative + right_derivative);
}

#ifdef KILN_GELU_ROWS
// Float rows of the tanh form's backward (Note [GELU rows]): the driver calls
// `row`, which gets the operands' steps, never the element operator.
struct GeluTanhBackwardRows {
  static void row(float* out, const float* dy, const float* x, int64_t n, bool dy_step, bool x_step) {
    vm::gelu_tanh_backward_row(out, dy, x, n, dy_step, x_step);
  }
};
#endif

[[noreturn]] void undefined_op(const char* what, int op, DType dt) {
  KILN_ASSERT(false, "elementwise ", what, " op #", op, " reached the kernel with dtype ", dtype_name(dt),
              "; the ops layer should have rejected it");
  __builtin_unreachable();
}

template <typename T>
void binary_typed(const LoopSpec& s, BinaryOp op, const void* alpha,
                  const ew::BinaryConverters<compute_t<T>, compute_t<T>>* conv) {
  using C = compute_t<T>;
  switch (op) {
    case BinaryOp::Add:
      if (alpha) return run_binary<T, T>(s, AddAlphaOp<T>{static_cast<C>(*static_cast<const T*>(alpha))}, conv);
      return run_binary<T, T>(s, AddOp<T>{}, conv);
    case BinaryOp::Mul: return run_binary<T, T>(s, MulOp<T>{}, conv);
    case BinaryOp::Div:
      if constexpr (is_float_v<T>)
        return run_binary<T, T>(
            s, [](C a, C b) { return a / b; }, conv);
      break;
    case BinaryOp::Pow:
      if constexpr (is_float_v<T>)
        return run_binary<T, T, true>(
            s, [](C a, C b) { return vm::pow(a, b); }, conv);
      else if constexpr (is_int_v<T>)
        return run_binary<T, T>(
            s, [](T a, T b) { return vm::int_pow(a, b); }, conv);
      break;
    case BinaryOp::Maximum: return run_binary<T, T>(s, MaxOp<T>{}, conv);
    case BinaryOp::Minimum: return run_binary<T, T>(s, MinOp<T>{}, conv);
    case BinaryOp::BitwiseAnd:
      if constexpr (std::is_integral_v<T>)
        return run_binary<T, T>(
            s, [](T a, T b) { return static_cast<T>(a & b); }, conv);
      break;
    case BinaryOp::BitwiseOr:
      if constexpr (std::is_integral_v<T>)
        return run_binary<T, T>(
            s, [](T a, T b) { return static_cast<T>(a | b); }, conv);
      break;
    case BinaryOp::BitwiseXor:
      if constexpr (std::is_integral_v<T>)
        return run_binary<T, T>(
            s, [](T a, T b) { return static_cast<T>(a ^ b); }, conv);
      break;
    case BinaryOp::GeluErfBackward:
      if constexpr (is_float_v<T>)
        return run_binary<T, T, true>(
            s, [](C g, C x) { return gelu_erf_backward(g, x); }, conv);
      break;
    case BinaryOp::GeluTanhBackward:
#ifdef KILN_GELU_ROWS
      if constexpr (std::is_same_v<C, float>) return run_binary<T, T>(s, GeluTanhBackwardRows{}, conv);
#endif
      if constexpr (is_float_v<T>)
        return run_binary<T, T, true>(
            s, [](C g, C x) { return gelu_tanh_backward(g, x); }, conv);
      break;
  }
  undefined_op("binary", static_cast<int>(op), dtype_of_v<T>);
}

// torch's pow_tensor_scalar_optimized_kernel: the common exponents avoid pow().
template <typename T>
void pow_scalar_floating(const LoopSpec& s, const Scalar& exponent) {
  using C = compute_t<T>;
  const double e = exponent.to_double();
  if (e == 0.5) return run_unary<T, T>(s, [](C* o, const C* in, int64_t n) { vm::sqrt_row(o, in, n); });
  if (e == -0.5) return run_unary<T, T>(s, [](C* o, const C* in, int64_t n) { vm::rsqrt_row(o, in, n); });
  if (e == 2.0) return map<T>(s, [](C x) { return x * x; });
  if (e == 3.0) return map<T>(s, [](C x) { return x * x * x; });
  if (e == -1.0) return map<T>(s, [](C x) { return C(1) / x; });
  if (e == -2.0) return map<T>(s, [](C x) { return C(1) / (x * x); });
  const C ec = static_cast<C>(exponent.to<T>());  // rounded to the tensor's dtype first, as torch
  ew::map_vm<T>(s, [ec](C x) { return vm::pow(x, ec); });
}

}  // namespace

void binary(const LoopSpec& s, BinaryOp op, DType dt, const void* alpha) {
  // alpha points at the caller's stack: the record keeps a copy (made only when recording).
  const capture::KernelScope cap("binary", capture::kDeferrable);
  if (cap.recording()) {
    const int es = static_cast<int>(element_size(dt));
    if (ew::record_loop(cap, s, ew::sizes_all(es),
                        [=, a = capture::ScalarBytes(alpha, es)](const LoopSpec& t) { binary(t, op, dt, a.ptr()); }))
      return;
  }
  visit_dtype(dt, [&]<typename T>() { binary_typed<T>(s, op, alpha, nullptr); });
}

void binary(const LoopSpec& s, BinaryOp op, DType dt, const StoredDTypes& stored, const void* alpha) {
  const capture::KernelScope cap("binary", capture::kDeferrable);
  if (cap.recording()) {
    auto es = [](DType d) { return static_cast<int>(element_size(d)); };
    if (ew::record_loop(
            cap, s, {es(stored.out), es(stored.a), es(stored.b), 0},
            [=, a = capture::ScalarBytes(alpha, es(dt))](const LoopSpec& t) { binary(t, op, dt, stored, a.ptr()); }))
      return;
  }
  visit_dtype(dt, [&]<typename T>() {
    const ew::BinaryConverters<compute_t<T>, compute_t<T>> conv{
        ew::load_converter<T>(stored.a), ew::load_converter<T>(stored.b), ew::store_converter<T>(stored.out)};
    binary_typed<T>(s, op, alpha, &conv);
  });
}

void pow_scalar(const LoopSpec& s, DType dt, const Scalar& exponent) {
  KILN_CAPTURE_LOOP("pow_scalar", s, ew::sizes_all(static_cast<int>(element_size(dt))), pow_scalar(t, dt, exponent));
  visit_dtype(dt, [&]<typename T>() {
    if constexpr (is_float_v<T>) {
      pow_scalar_floating<T>(s, exponent);
    } else if constexpr (is_int_v<T>) {
      const T e = exponent.to<T>();
      if (e == 2) return map<T>(s, [](T x) { return vm::wrapping_mul(x, x); });
      if (e == 3) return map<T>(s, [](T x) { return vm::wrapping_mul(vm::wrapping_mul(x, x), x); });
      map<T>(s, [e](T x) { return vm::int_pow(x, e); });
    } else {
      undefined_op("pow_scalar", 0, dt);
    }
  });
}

void scalar_to_bytes(void* dst, DType dt, const Scalar& value) {
  visit_dtype(dt, [&]<typename T>() { *static_cast<T*>(dst) = value.to<T>(); });
}

void convert_element(void* dst, DType to, const void* src, DType from) {
  visit_dtype(to, [&]<typename O>() {
    visit_dtype(from, [&]<typename I>() { *static_cast<O*>(dst) = ew::cast<O>(*static_cast<const I*>(src)); });
  });
}

}  // namespace kiln::kernels
