// Reductions with a finishing step or two passes: var/std, vector norms, logsumexp.
#include <cmath>

#include "kiln/core/capture.h"
#include "kiln/kernels/reduce.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

// var accumulates in double for every float type, as PyTorch's CPU kernels do:
// a float32 tensor with a large mean and a small spread keeps its digits.
template <typename T>
struct SumDoubleOp {
  using in_t = T;
  using acc_t = double;
  double identity() const { return 0.0; }
  double map(T x, double) const { return static_cast<double>(static_cast<compute_t<T>>(x)); }
  double combine(double a, double b) const { return a + b; }
};

template <typename T>
struct SqDevOp {
  using in_t = T;
  using acc_t = double;
  double identity() const { return 0.0; }
  double map(T x, double mean) const {
    const double d = static_cast<double>(static_cast<compute_t<T>>(x)) - mean;
    return d * d;
  }
  double combine(double a, double b) const { return a + b; }
};

enum class NormKind { Zero, One, Two, Inf, NegInf, General };

template <typename T, NormKind K>
struct NormOp {
  using in_t = T;
  using acc_t = compute_t<T>;
  using A = acc_t;
  A p = 2;
  A identity() const { return K == NormKind::NegInf ? highest_value<A>() : A(0); }
  A map(T x, A) const {
    const A v = static_cast<A>(x);
    if constexpr (K == NormKind::Zero)
      return v != A(0) ? A(1) : A(0);
    else if constexpr (K == NormKind::Two)
      return v * v;
    else if constexpr (K == NormKind::General)
      return std::pow(std::abs(v), p);
    else
      return std::abs(v);
  }
  A combine(A a, A b) const {
    if constexpr (K == NormKind::Inf)
      return max_nan(a, b);
    else if constexpr (K == NormKind::NegInf)
      return min_nan(a, b);
    else
      return a + b;
  }
};

template <typename T, NormKind K>
void norm_impl(const ReduceLayout& l, double p) {
  using A = compute_t<T>;
  T* dst = reinterpret_cast<T*>(l.out);
  NormOp<T, K> op;
  op.p = static_cast<A>(p);
  const A inv_p = static_cast<A>(1.0 / p);
  run_reduce(l, op, nullptr, [dst, inv_p](int64_t o, A a) {
    if constexpr (K == NormKind::Two)
      dst[o] = static_cast<T>(std::sqrt(a));
    else if constexpr (K == NormKind::General)
      dst[o] = static_cast<T>(std::pow(a, inv_p));
    else
      dst[o] = static_cast<T>(a);
  });
}

}  // namespace

void var(const ReduceLayout& l, DType dt, int64_t correction, bool take_sqrt) {
  KILN_CAPTURE_KERNEL("var", var(l, dt, correction, take_sqrt));
  visit_dtype<kFloatingTypes>(dt, take_sqrt ? "std" : "var", [&]<typename T>() {
    const int64_t G = l.num_outputs(), R = l.reduce_numel();
    OutputScratch<double> means(G);
    double* m = means.data();
    const double count = static_cast<double>(R);
    run_reduce(l, SumDoubleOp<T>{}, nullptr, [m, count](int64_t o, double s) { m[o] = s / count; });
    // PyTorch clamps the degrees of freedom at 0: correction >= N gives inf (or NaN for 0/0).
    const double dof = static_cast<double>(std::max<int64_t>(0, R - correction));
    T* dst = reinterpret_cast<T*>(l.out);
    run_reduce(l, SqDevOp<T>{}, m, [dst, dof, take_sqrt](int64_t o, double s) {
      const double v = s / dof;
      dst[o] = static_cast<T>(static_cast<compute_t<T>>(take_sqrt ? std::sqrt(v) : v));
    });
  });
}

void norm(const ReduceLayout& l, DType dt, double p) {
  KILN_CAPTURE_KERNEL("norm", norm(l, dt, p));
  visit_dtype<kFloatingTypes>(dt, "norm", [&]<typename T>() {
    if (p == 0.0)
      norm_impl<T, NormKind::Zero>(l, p);
    else if (p == 1.0)
      norm_impl<T, NormKind::One>(l, p);
    else if (p == 2.0)
      norm_impl<T, NormKind::Two>(l, p);
    else if (std::isinf(p) && p > 0)
      norm_impl<T, NormKind::Inf>(l, p);
    else if (std::isinf(p))
      norm_impl<T, NormKind::NegInf>(l, p);
    else
      norm_impl<T, NormKind::General>(l, p);
  });
}

void logsumexp(const ReduceLayout& l, DType dt) {
  KILN_CAPTURE_KERNEL("logsumexp", logsumexp(l, dt));
  visit_dtype<kFloatingTypes>(dt, "logsumexp", [&]<typename T>() {
    using A = compute_t<T>;
    const int64_t G = l.num_outputs();
    OutputScratch<A> shifts(G);
    A* m = shifts.data();
    // An infinite max is not subtracted (as PyTorch): exp(-inf - -inf) would be NaN.
    // A NaN in the slice needs no care here: exp(NaN - m) makes the sum NaN.
    run_reduce(l, FastMaxOp<T>{}, nullptr, [m](int64_t o, A a) { m[o] = std::isinf(a) ? A(0) : a; });
    T* dst = reinterpret_cast<T*>(l.out);
    run_reduce(l, ExpShiftOp<T>{}, m, [dst, m](int64_t o, A s) { dst[o] = static_cast<T>(std::log(s) + m[o]); });
  });
}

}  // namespace kiln::kernels
