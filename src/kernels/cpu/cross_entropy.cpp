// Fused cross-entropy forward and backward over [rows, classes] (see kiln/kernels/loss.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/kernels/loop.h"
#include "kiln/kernels/loss.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

template <typename T>
int64_t forward_impl(const CrossEntropyRows& a, const T* x_all, double* lse_out, double* nll, double* wrow,
                     double* smooth) {
  using A = compute_t<T>;
  const int64_t C = a.classes;
  const T* w = static_cast<const T*>(a.weight);
  A wsum = A(0);
  if (smooth) {
    if (w)
      for (int64_t c = 0; c < C; ++c) wsum += static_cast<A>(w[c]);
    else
      wsum = static_cast<A>(C);
  }
  int64_t bad = std::numeric_limits<int64_t>::max();
  auto body = [&](int64_t b, int64_t e) {
    int64_t local_bad = std::numeric_limits<int64_t>::max();
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = a.target[r];
      if (t == a.ignore_index) {
        lse_out[r] = nll[r] = wrow[r] = 0;
        if (smooth) smooth[r] = 0;
        continue;
      }
      if (t < 0 || t >= C) {
        local_bad = std::min(local_bad, r);
        continue;
      }
      const T* x = x_all + r * C;
      // Multi-lane max and sum of exp(x - max) (the softmax kernels' reductions).
      const char* xb = reinterpret_cast<const char*>(x);
      A m = run_value(FastMaxOp<T>{}, xb, C, sizeof(T), A(0));
      if (!std::isfinite(m)) m = A(0);  // all -inf (or a NaN/inf row): let the sum carry it
      const A lse = m + std::log(run_value(ExpShiftOp<T>{}, xb, C, sizeof(T), m));
      const A wt = w ? static_cast<A>(w[t]) : A(1);
      lse_out[r] = lse;
      nll[r] = -wt * (static_cast<A>(x[t]) - lse);
      wrow[r] = wt;
      if (smooth) {
        A sx = A(0);
        if (w)
          for (int64_t c = 0; c < C; ++c) sx += static_cast<A>(w[c]) * static_cast<A>(x[c]);
        else
          sx = run_value(SumOp<T>{}, xb, C, sizeof(T), A(0));
        smooth[r] = -(sx - wsum * lse);
      }
    }
    if (local_bad != std::numeric_limits<int64_t>::max()) {
#pragma omp critical(kiln_ce_bad)
      bad = std::min(bad, local_bad);
    }
  };
  if (a.rows * C < kGrainSize || get_num_threads() == 1)
    body(0, a.rows);
  else
    parallel_for(a.rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(C, 1)), body);
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

template <typename T>
void backward_impl(const CrossEntropyRows& a, const T* x_all, const double* lse_in, const double* ca, const double* cb,
                   T* g_all) {
  using A = compute_t<T>;
  const int64_t C = a.classes;
  const T* w = static_cast<const T*>(a.weight);
  A wsum = A(0);
  if (w)
    for (int64_t c = 0; c < C; ++c) wsum += static_cast<A>(w[c]);
  else
    wsum = static_cast<A>(C);
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* g = g_all + r * C;
      const int64_t t = a.target[r];
      if (t == a.ignore_index || t < 0 || t >= C) {
        std::fill(g, g + C, static_cast<T>(A(0)));
        continue;
      }
      const T* x = x_all + r * C;
      const A lse = static_cast<A>(lse_in[r]);
      const A wt = w ? static_cast<A>(w[t]) : A(1);
      const A k1 = static_cast<A>(ca[r]) * wt;
      const A kb = cb ? static_cast<A>(cb[r]) : A(0);
      const A kp = k1 + kb * wsum;  // coefficient of p
      if (w && cb) {
        for (int64_t c = 0; c < C; ++c)
          g[c] = static_cast<T>(kp * exp_vec(static_cast<A>(x[c]) - lse) - kb * static_cast<A>(w[c]));
      } else {
        for (int64_t c = 0; c < C; ++c) g[c] = static_cast<T>(kp * exp_vec(static_cast<A>(x[c]) - lse) - kb);
      }
      g[t] = static_cast<T>(static_cast<A>(g[t]) - k1);
    }
  };
  if (a.rows * C < kGrainSize || get_num_threads() == 1)
    body(0, a.rows);
  else
    parallel_for(a.rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(C, 1)), body);
}

// The dtypes the kernels take.
constexpr DTypeSet kCrossEntropyTypes{kFloat32, kFloat64, kBFloat16};

}  // namespace

int64_t cross_entropy_forward(DType dtype, const CrossEntropyRows& a, const void* logits, double* lse, double* nll,
                              double* wrow, double* smooth) {
  // The result (the first bad target, or -1) decides on the host whether the op raises, and the
  // caller goes on to reduce the per-row losses on the host.
  KILN_CAPTURE_KERNEL_NOW("cross_entropy_forward",
                          (void)cross_entropy_forward(dtype, a, logits, lse, nll, wrow, smooth));
  return visit_dtype<kCrossEntropyTypes>(dtype, "cross_entropy_forward", [&]<typename T>() {
    return forward_impl(a, static_cast<const T*>(logits), lse, nll, wrow, smooth);
  });
}

void cross_entropy_backward(DType dtype, const CrossEntropyRows& a, const void* logits, const double* lse,
                            const double* ca, const double* cb, void* grad) {
  // ca and cb are host arrays of the caller (src/ops/loss.cpp), gone after the call: the replay keeps copies.
  const bool rec = capture::recording();
  const std::vector<double> ca_copy = rec ? std::vector<double>(ca, ca + a.rows) : std::vector<double>();
  const std::vector<double> cb_copy = rec && cb ? std::vector<double>(cb, cb + a.rows) : std::vector<double>();
  KILN_CAPTURE_KERNEL("cross_entropy_backward", cross_entropy_backward(dtype, a, logits, lse, ca_copy.data(),
                                                                       cb ? cb_copy.data() : nullptr, grad));
  visit_dtype<kCrossEntropyTypes>(dtype, "cross_entropy_backward", [&]<typename T>() {
    backward_impl(a, static_cast<const T*>(logits), lse, ca, cb, static_cast<T*>(grad));
  });
}

}  // namespace kiln::kernels
