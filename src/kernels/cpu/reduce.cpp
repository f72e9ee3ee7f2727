// Single-pass reductions: sum, mean, prod, amax/amin, all/any.
#include "kiln/kernels/reduce.h"

#include "kiln/core/capture.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

template <typename T, typename A = sum_acc_t<T>>
struct ProdOp {
  using in_t = T;
  using acc_t = A;
  A identity() const { return A(1); }
  A map(T x, A) const { return static_cast<A>(x); }
  A combine(A a, A b) const { return mul_wrap(a, b); }
};

template <typename T, bool IsAll>
struct AllAnyOp {
  using in_t = T;
  using acc_t = uint8_t;
  uint8_t identity() const { return IsAll ? 1 : 0; }
  uint8_t map(T x, uint8_t) const { return static_cast<compute_t<T>>(x) != compute_t<T>(0) ? 1 : 0; }
  uint8_t combine(uint8_t a, uint8_t b) const { return IsAll ? (a & b) : (a | b); }
};

// Writes acc to out[o] as O; out is `in` (the common case) or int64 (integral sums).
template <typename T, typename Op>
void reduce_store(const ReduceLayout& l, const Op& op, DType in, DType out, const char* name) {
  using A = typename Op::acc_t;
  auto go = [&]<typename O>() {
    O* dst = reinterpret_cast<O*>(l.out);
    run_reduce(l, op, nullptr, [dst](int64_t o, A a) { dst[o] = static_cast<O>(a); });
  };
  if (out == in) {
    go.template operator()<T>();
  } else {
    KILN_ASSERT(out == kInt64, name, ": unsupported output dtype ", dtype_name(out), " for input ", dtype_name(in));
    go.template operator()<int64_t>();
  }
}

}  // namespace

void sum(const ReduceLayout& l, DType in, DType out) {
  KILN_CAPTURE_KERNEL("sum", sum(l, in, out));
  visit_dtype(in, [&]<typename T>() { reduce_store<T>(l, SumOp<T>{}, in, out, "sum"); });
}

void prod(const ReduceLayout& l, DType in, DType out) {
  KILN_CAPTURE_KERNEL("prod", prod(l, in, out));
  visit_dtype(in, [&]<typename T>() { reduce_store<T>(l, ProdOp<T>{}, in, out, "prod"); });
}

void mean(const ReduceLayout& l, DType dt) {
  KILN_CAPTURE_KERNEL("mean", mean(l, dt));
  visit_dtype<kFloatingTypes>(dt, "mean", [&]<typename T>() {
    using A = sum_acc_t<T>;
    const A count = static_cast<A>(l.reduce_numel());
    T* dst = reinterpret_cast<T*>(l.out);
    // Divide in the accumulator type, then round once (16-bit sums never overflow early).
    run_reduce(l, SumOp<T>{}, nullptr, [dst, count](int64_t o, A a) { dst[o] = static_cast<T>(a / count); });
  });
}

void amax_amin(const ReduceLayout& l, DType dt, bool is_max) {
  KILN_CAPTURE_KERNEL("amax_amin", amax_amin(l, dt, is_max));
  visit_dtype(dt, [&]<typename T>() {
    if (is_max)
      reduce_store<T>(l, MaxOp<T, true>{}, dt, dt, "amax");
    else
      reduce_store<T>(l, MaxOp<T, false>{}, dt, dt, "amin");
  });
}

void all_any(const ReduceLayout& l, DType in, DType out, bool is_all) {
  KILN_CAPTURE_KERNEL("all_any", all_any(l, in, out, is_all));
  KILN_ASSERT(out == kBool || out == kUInt8, "all/any: output must be bool or uint8, got ", dtype_name(out));
  visit_dtype(in, [&]<typename T>() {
    auto go = [&]<bool IsAll>() {
      if (out == kBool) {
        bool* dst = reinterpret_cast<bool*>(l.out);
        run_reduce(l, AllAnyOp<T, IsAll>{}, nullptr, [dst](int64_t o, uint8_t a) { dst[o] = a != 0; });
      } else {
        uint8_t* dst = reinterpret_cast<uint8_t*>(l.out);
        run_reduce(l, AllAnyOp<T, IsAll>{}, nullptr, [dst](int64_t o, uint8_t a) { dst[o] = a; });
      }
    };
    if (is_all)
      go.template operator()<true>();
    else
      go.template operator()<false>();
  });
}

}  // namespace kiln::kernels
