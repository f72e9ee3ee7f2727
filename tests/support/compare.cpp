#include "support/compare.h"

#include <cmath>
#include <sstream>
#include <vector>

#include "support/test_util.h"

namespace kiln::test {

namespace {

std::string index_str(int64_t flat, IntArrayRef sizes) {
  std::vector<int64_t> idx(sizes.size());
  for (size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] == 0) break;
    idx[d] = flat % sizes[d];
    flat /= sizes[d];
  }
  return shape_str(idx);
}

// Exact int64 values, so integers above 2^53 compare correctly.
std::vector<int64_t> to_int64s(const Tensor& t) {
  const Tensor c = t.contiguous();
  std::vector<int64_t> out(static_cast<size_t>(c.numel()));
  visit_dtype(c.dtype(), [&]<typename T>() {
    const T* p = static_cast<const T*>(c.data_ptr());
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (is_float_v<T>) out[i] = static_cast<int64_t>(static_cast<compute_t<T>>(p[i]));
      else out[i] = static_cast<int64_t>(p[i]);
    }
  });
  return out;
}

}  // namespace

Comparison compare_tensors(const Tensor& got, const Tensor& want, double rtol, double atol, bool check_dtype) {
  Comparison r;
  std::ostringstream os;
  if (!got.defined() || !want.defined()) {
    r.ok = got.defined() == want.defined();
    if (!r.ok) r.message = got.defined() ? "expected an undefined tensor" : "got an undefined tensor";
    return r;
  }
  if (check_dtype && got.dtype() != want.dtype()) {
    os << "dtype: got " << dtype_name(got.dtype()) << ", want " << dtype_name(want.dtype()) << "; ";
  }
  if (check_dtype ? got.sizes() != want.sizes() : got.numel() != want.numel()) {
    os << "shape: got " << got.sizes() << ", want " << want.sizes();
    return {false, os.str()};
  }
  const bool exact = (!is_floating_point(got.dtype()) && !is_floating_point(want.dtype()));
  int64_t bad = 0, worst = -1;
  double worst_ratio = -1, max_abs = 0, max_rel = 0;
  std::string worst_got, worst_want;
  if (exact) {
    const auto g = to_int64s(got), w = to_int64s(want);
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i] == w[i]) continue;
      ++bad;
      const double a = std::fabs(static_cast<double>(g[i]) - static_cast<double>(w[i]));
      if (a > max_abs || worst < 0) {
        max_abs = a;
        worst = static_cast<int64_t>(i);
        worst_got = std::to_string(g[i]);
        worst_want = std::to_string(w[i]);
      }
    }
  } else {
    const auto g = to_doubles(got), w = to_doubles(want);
    for (size_t i = 0; i < g.size(); ++i) {
      const double a = g[i], b = w[i];
      bool close;
      double ratio;
      if (std::isnan(a) || std::isnan(b)) {
        close = std::isnan(a) && std::isnan(b);
        ratio = close ? 0 : INFINITY;
      } else if (std::isinf(a) || std::isinf(b)) {
        close = a == b;
        ratio = close ? 0 : INFINITY;
      } else {
        const double err = std::fabs(a - b), allowed = atol + rtol * std::fabs(b);
        close = err <= allowed;
        ratio = allowed > 0 ? err / allowed : (err > 0 ? INFINITY : 0);
        max_abs = std::max(max_abs, err);
        if (b != 0) max_rel = std::max(max_rel, err / std::fabs(b));
      }
      if (!close) ++bad;
      if (!close && ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = static_cast<int64_t>(i);
        std::ostringstream ga, wa;
        ga.precision(9);
        wa.precision(9);
        ga << a;
        wa << b;
        worst_got = ga.str();
        worst_want = wa.str();
      }
    }
  }
  if (bad == 0 && os.str().empty()) return r;
  if (bad > 0) {
    os << bad << " of " << got.numel() << " elements differ (rtol " << rtol << ", atol " << atol
       << "); max abs err " << max_abs;
    if (!exact) os << ", max rel err " << max_rel;
    os << "; worst at index " << index_str(worst, want.sizes()) << ": got " << worst_got << ", want " << worst_want;
  }
  return {false, os.str()};
}

}  // namespace kiln::test
