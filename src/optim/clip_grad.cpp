// clip_grad_norm_ and clip_grad_value_ with torch 1.13's semantics.
#include "kiln/optim/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/record.h"

namespace kiln::optim {

namespace {

// Sixteen running sums (lane l takes elements l, l + 16, ...), added in a
// fixed order at the end: one chain of dependent double additions ran at one
// element per add's latency (1.4 ms a step for configs/gpt_mobydick's 842k
// gradients), where independent lanes vectorise. A float32 square is exact in
// double, so only the sums' order changes, far below the float32 rounding of
// a norm.
template <typename T>
double squares(const T* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  double lanes[kLanes] = {};
  double s = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(x[i + l]) * static_cast<double>(x[i + l]);
  for (; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  for (const double l : lanes) s += l;
  return s;
}

template <typename T>
double norm_of(const T* x, int64_t n, double p) {
  if (std::isinf(p)) {
    double m = p > 0 ? 0.0 : std::numeric_limits<double>::infinity();
    bool nan = false;
    for (int64_t i = 0; i < n; ++i) {
      const double a = std::abs(static_cast<double>(x[i]));
      nan |= std::isnan(a);
      m = p > 0 ? std::max(m, a) : std::min(m, a);
    }
    return nan ? std::numeric_limits<double>::quiet_NaN() : m;
  }
  double s = 0;
  if (p == 0) {
    for (int64_t i = 0; i < n; ++i) s += x[i] != T(0);
    return s;
  }
  if (p == 2) return std::sqrt(squares(x, n));
  if (p == 1) {
    for (int64_t i = 0; i < n; ++i) s += std::abs(static_cast<double>(x[i]));
    return s;
  }
  for (int64_t i = 0; i < n; ++i) s += std::pow(std::abs(static_cast<double>(x[i])), p);
  return std::pow(s, 1.0 / p);
}

// Norm of a tensor's elements, rounded to its dtype (float32 grads give a float32 norm).
double tensor_norm(const Tensor& g, double p) {
  Tensor c = g.contiguous();
  if (c.dtype() == kFloat64) return norm_of(c.data_ptr<double>(), c.numel(), p);
  if (c.dtype() != kFloat32) c = c.to(kFloat32);
  return static_cast<float>(norm_of(c.data_ptr<float>(), c.numel(), p));
}

double norm_of_values(const std::vector<double>& v, double p, bool f32) {
  const double r = norm_of(v.data(), static_cast<int64_t>(v.size()), p);
  return f32 ? static_cast<double>(static_cast<float>(r)) : r;
}

}  // namespace

double detail::sum_of_squares(const float* x, int64_t n) { return squares(x, n); }

double clip_grad_norm_(const NamedParams& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  const record::Scope rs(record::Kind::Op, "clip_grad_norm_");
  // The norms are summed on the host, and the total (returned) scales the gradients as a constant.
  capture::graph_break_if_recording("clip_grad_norm_ reads the gradients' norm on the host (it returns a double)");
  KILN_CHECK(!std::isnan(norm_type) && norm_type >= 0, ValueError,
             "clip_grad_norm_: expected norm_type >= 0 or inf, got ", norm_type);
  NoGradGuard no_grad;
  std::vector<std::pair<const std::string*, Tensor>> grads;
  bool all_f64 = true;
  for (const auto& [n, p] : params) {
    const Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.emplace_back(&n, g);
    all_f64 &= g.dtype() == kFloat64;
  }
  if (grads.empty()) return 0.0;
  std::vector<double> norms;
  for (const auto& [n, g] : grads) norms.push_back(tensor_norm(g, norm_type));
  const bool f32 = !all_f64;
  const double total = norm_of_values(norms, norm_type, f32);
  if (error_if_nonfinite && !std::isfinite(total)) {
    std::ostringstream os;
    os << "clip_grad_norm_: the total norm of order " << norm_type << " of the gradients is non-finite (" << total
       << ") so it cannot be clipped";
    for (size_t i = 0; i < grads.size(); ++i)
      if (!std::isfinite(norms[i])) {
        os << "; parameter '" << *grads[i].first << "' has a non-finite gradient norm (" << norms[i] << ")";
        break;
      }
    os << ". To scale the gradients by the non-finite norm anyway, set error_if_nonfinite=false";
    throw ValueError(os.str());
  }
  // clip_coef = max_norm / (total + 1e-6), clamped to 1, in the norm's dtype.
  double coef;
  if (f32) {
    float c = static_cast<float>(max_norm) / (static_cast<float>(total) + 1e-6f);
    coef = std::isnan(c) ? c : std::min(c, 1.0f);
  } else {
    const double c = max_norm / (total + 1e-6);
    coef = std::isnan(c) ? c : std::min(c, 1.0);
  }
  for (auto& [n, g] : grads) {
    Tensor gg = g;
    gg.mul_(coef);
  }
  return total;
}

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  NamedParams named;
  for (size_t i = 0; i < params.size(); ++i) named.emplace_back("parameters[" + std::to_string(i) + "]", params[i]);
  return clip_grad_norm_(named, max_norm, norm_type, error_if_nonfinite);
}

void clip_grad_value_(const NamedParams& params, double clip_value) {
  const record::Scope rs(record::Kind::Op, "clip_grad_value_");
  KILN_CHECK(clip_value >= 0, ValueError, "clip_grad_value_: expected clip_value >= 0, got ", clip_value);
  NoGradGuard no_grad;
  for (const auto& [n, p] : params) {
    Tensor g = p.grad();
    if (g.defined()) g.clamp_(-clip_value, clip_value);
  }
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  NamedParams named;
  for (size_t i = 0; i < params.size(); ++i) named.emplace_back("parameters[" + std::to_string(i) + "]", params[i]);
  clip_grad_value_(named, clip_value);
}

}  // namespace kiln::optim
