// Comparison and logical kernels (bool results) and the allclose test.
#include <atomic>
#include <cmath>
#include <type_traits>

#include "elementwise_loop.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/elementwise.h"
#include "loop_capture.h"

namespace kiln::kernels {

namespace {

using ew::run_binary;
using ew::run_unary;

template <typename T>
void compare_typed(const LoopSpec& s, CompareOp op, const ew::BinaryConverters<compute_t<T>, bool>* conv) {
  using C = compute_t<T>;
  const C zero = C(0);
  switch (op) {
    case CompareOp::Eq:
      return run_binary<bool, T>(
          s, [](C a, C b) { return a == b; }, conv);
    case CompareOp::Ne:
      return run_binary<bool, T>(
          s, [](C a, C b) { return a != b; }, conv);
    case CompareOp::Lt:
      return run_binary<bool, T>(
          s, [](C a, C b) { return a < b; }, conv);
    case CompareOp::Le:
      return run_binary<bool, T>(
          s, [](C a, C b) { return a <= b; }, conv);
    case CompareOp::Gt:
      return run_binary<bool, T>(
          s, [](C a, C b) { return a > b; }, conv);
    case CompareOp::Ge:
      return run_binary<bool, T>(
          s, [](C a, C b) { return a >= b; }, conv);
    case CompareOp::LogicalAnd:
      return run_binary<bool, T>(
          s, [zero](C a, C b) { return (a != zero) && (b != zero); }, conv);
    case CompareOp::LogicalOr:
      return run_binary<bool, T>(
          s, [zero](C a, C b) { return (a != zero) || (b != zero); }, conv);
    case CompareOp::LogicalXor:
      return run_binary<bool, T>(
          s, [zero](C a, C b) { return (a != zero) != (b != zero); }, conv);
  }
  KILN_ASSERT(false, "compare: unknown op #", static_cast<int>(op));
}

}  // namespace

void compare(const LoopSpec& s, CompareOp op, DType dt) {
  const int esz = static_cast<int>(element_size(dt));
  KILN_CAPTURE_LOOP("compare", s, (ew::ElemSizes{1, esz, esz, 0}), compare(t, op, dt));
  visit_dtype(dt, [&]<typename T>() { compare_typed<T>(s, op, nullptr); });
}

void compare(const LoopSpec& s, CompareOp op, DType dt, DType a_dt, DType b_dt) {
  KILN_CAPTURE_LOOP("compare", s,
                    (ew::ElemSizes{1, static_cast<int>(element_size(a_dt)), static_cast<int>(element_size(b_dt)), 0}),
                    compare(t, op, dt, a_dt, b_dt));
  visit_dtype(dt, [&]<typename T>() {
    const ew::BinaryConverters<compute_t<T>, bool> conv{ew::load_converter<T>(a_dt), ew::load_converter<T>(b_dt)};
    compare_typed<T>(s, op, &conv);
  });
}

void logical_not(const LoopSpec& s, DType dt) {
  KILN_CAPTURE_LOOP("logical_not", s, (ew::ElemSizes{1, static_cast<int>(element_size(dt)), 0, 0}), logical_not(t, dt));
  visit_dtype(dt, [&]<typename T>() {
    using C = compute_t<T>;
    run_unary<bool, T>(s, [](bool* out, const C* in, int64_t n) {
      for (int64_t i = 0; i < n; ++i) out[i] = in[i] == C(0);
    });
  });
}

bool all_close(const LoopSpec& s, DType dt, double rtol, double atol, bool equal_nan) {
  // Tensor::equal and allclose report the graph break (their result steers the host).
  std::atomic<bool> ok{true};
  visit_dtype(dt, [&]<typename T>() {
    // torch.isclose computes in the tensors' dtype; integers and bool through the default float dtype.
    using C = std::conditional_t<is_float_v<T>, compute_t<T>, float>;
    const C r = static_cast<C>(rtol), a = static_cast<C>(atol);
    ew::elementwise_for(s, [&](char* const* p, const int64_t* st, int64_t n) {
      bool all = true;
      for (int64_t i = 0; i < n; ++i) {
        const T xt = *reinterpret_cast<const T*>(p[0] + i * st[0]);
        const T yt = *reinterpret_cast<const T*>(p[1] + i * st[1]);
        const C x = ew::cast<C>(xt), y = ew::cast<C>(yt);
        bool close = x == y;
        if constexpr (is_float_v<T>) {
          if (equal_nan && std::isnan(x) && std::isnan(y)) close = true;
        }
        if (!close) {
          C diff;
          if constexpr (std::is_unsigned_v<T> && !std::is_same_v<T, bool>) {
            // torch takes |a - b| in the tensor's dtype: for uint8, 3 - 5 wraps to 254.
            diff = static_cast<C>(static_cast<T>(xt - yt));
          } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
            const int64_t d = static_cast<int64_t>(xt) - static_cast<int64_t>(yt);
            diff = static_cast<C>(d < 0 ? -static_cast<double>(d) : static_cast<double>(d));
          } else {
            diff = std::abs(x - y);
          }
          close = std::isfinite(diff) && diff <= a + std::abs(r * y);
        }
        all = all && close;
      }
      if (!all) ok.store(false, std::memory_order_relaxed);
    });
  });
  return ok.load();
}

}  // namespace kiln::kernels
