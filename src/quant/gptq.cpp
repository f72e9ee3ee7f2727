// GPTQ (Frantar et al. 2022) for int4 weights (include/kiln/quant/int4.h):
// the damped inverse Hessian's Cholesky factor, and the column-by-column
// quantization with in-block and lazy (per-block) error updates. Everything is
// in double: the factors of a 1024-wide H lose too much in float32.
#include <algorithm>
#include <cmath>
#include <vector>

#include "int4_internal.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::quant {
namespace {

using Matrix = std::vector<double>;  // row-major n × n

// Lower Cholesky factor of the symmetric positive definite a (n × n); false if a pivot is not positive.
bool cholesky_lower(const Matrix& a, int64_t n, Matrix& l) {
  l.assign(static_cast<size_t>(n * n), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    const double* lj = &l[j * n];
    double s = a[j * n + j];
    for (int64_t k = 0; k < j; ++k) s -= lj[k] * lj[k];
    if (!(s > 0) || !std::isfinite(s)) return false;
    const double d = std::sqrt(s);
    l[j * n + j] = d;
    for (int64_t i = j + 1; i < n; ++i) {
      const double* li = &l[i * n];
      double t = a[i * n + j];
      for (int64_t k = 0; k < j; ++k) t -= li[k] * lj[k];
      l[i * n + j] = t / d;
    }
  }
  return true;
}

// The upper factor U of H⁻¹ = UᵀU, from H = LLᵀ: H⁻¹ = L⁻ᵀL⁻¹, whose own Cholesky factor transposed is U.
bool inverse_cholesky_upper(const Matrix& h, int64_t n, Matrix& u) {
  Matrix l;
  if (!cholesky_lower(h, n, l)) return false;
  // xt[c][k] = (L⁻¹)[k][c]: column c of L⁻¹ stored as a row, nonzero for k >= c.
  Matrix xt(static_cast<size_t>(n * n), 0.0);
  for (int64_t c = 0; c < n; ++c) {
    double* x = &xt[c * n];
    x[c] = 1.0 / l[c * n + c];
    for (int64_t i = c + 1; i < n; ++i) {
      const double* li = &l[i * n];
      double s = 0;
      for (int64_t k = c; k < i; ++k) s += li[k] * x[k];
      x[i] = -s / li[i];
    }
  }
  Matrix hinv(static_cast<size_t>(n * n));
  for (int64_t a = 0; a < n; ++a)
    for (int64_t b = a; b < n; ++b) {
      const double* xa = &xt[a * n];
      const double* xb = &xt[b * n];
      double s = 0;
      for (int64_t k = b; k < n; ++k) s += xa[k] * xb[k];
      hinv[a * n + b] = hinv[b * n + a] = s;
    }
  Matrix l2;
  if (!cholesky_lower(hinv, n, l2)) return false;
  u.assign(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) u[j * n + i] = l2[i * n + j];
  return true;
}

}  // namespace

Int4Tensor quantize_int4_gptq(const Tensor& weight, const Tensor& hessian, const Int4Options& o) {
  detail::check_int4_weight("quantize_int4_gptq", weight, o.group_size);
  const int64_t out = weight.size(0), n = weight.size(1), gs = o.group_size;
  KILN_CHECK(hessian.defined() && is_floating_point(hessian.dtype()) && hessian.dim() == 2 && hessian.size(0) == n &&
                 hessian.size(1) == n,
             ValueError, "quantize_int4_gptq: expected a float Hessian [", n, ", ", n, "], got ",
             hessian.defined() ? hessian.shape_string() : std::string("an undefined tensor"));
  KILN_CHECK(o.block_size > 0 && o.block_size % gs == 0, ValueError,
             "quantize_int4_gptq: expected a block size that is a multiple of the group size ", gs, ", got ",
             o.block_size);
  KILN_CHECK(o.damp >= 0 && std::isfinite(o.damp), ValueError,
             "quantize_int4_gptq: expected a non-negative damping fraction, got ", o.damp);
  const NoGradGuard ng;
  const Tensor hc = hessian.detach().to(kFloat64).contiguous();
  const Tensor wc = weight.detach().to(kFloat64).contiguous();
  Matrix h(hc.data_ptr<double>(), hc.data_ptr<double>() + n * n);
  std::vector<double> w(wc.data_ptr<double>(), wc.data_ptr<double>() + out * n);
  for (double v : w) KILN_CHECK(std::isfinite(v), ValueError, "quantize_int4_gptq: expected finite weights, got ", v);

  // Inputs that never fired carry no information: their weights are set to 0 (and quantize exactly).
  double mean_diag = 0;
  for (int64_t i = 0; i < n; ++i) {
    KILN_CHECK(std::isfinite(h[i * n + i]) && h[i * n + i] >= 0, ValueError,
               "quantize_int4_gptq: expected a Hessian with a finite non-negative diagonal, got ", h[i * n + i], " at ",
               i);
    if (h[i * n + i] == 0) {
      h[i * n + i] = 1;
      for (int64_t r = 0; r < out; ++r) w[r * n + i] = 0;
    }
    mean_diag += h[i * n + i];
  }
  mean_diag /= static_cast<double>(std::max<int64_t>(n, 1));
  for (int64_t i = 0; i < n; ++i) h[i * n + i] += o.damp * mean_diag;
  Matrix u;
  KILN_CHECK(inverse_cholesky_upper(h, n, u), ValueError,
             "quantize_int4_gptq: the damped Hessian is not positive definite (raise the damping, now ", o.damp, ")");

  const int64_t groups = n / gs;
  Tensor codes = empty({out, n}, TensorOptions(kUInt8));
  Tensor scales = empty({out, groups}, TensorOptions(kFloat32));
  Tensor zeros = empty({out, groups}, TensorOptions(kUInt8));
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  uint8_t* zp = zeros.data_ptr<uint8_t>();
  const int64_t bs = o.block_size;
  std::vector<double> err(static_cast<size_t>(out * bs));
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    const int64_t b1 = std::min(n, b0 + bs), width = b1 - b0;
    for (int64_t j = b0; j < b1; ++j) {
      const int64_t g = j / gs;
      if (j % gs == 0) {
        // The group's parameters from its weights as updated so far.
        for (int64_t r = 0; r < out; ++r) {
          const double* wr = &w[r * n + j];
          double lo = wr[0], hi = wr[0];
          for (int64_t i = 1; i < gs; ++i) {
            lo = std::min(lo, wr[i]);
            hi = std::max(hi, wr[i]);
          }
          const detail::Int4GroupParams p = detail::int4_group_params(static_cast<float>(lo), static_cast<float>(hi));
          sp[r * groups + g] = p.scale;
          zp[r * groups + g] = p.zero;
        }
      }
      const double d = u[j * n + j];
      const double* uj = &u[j * n];
      for (int64_t r = 0; r < out; ++r) {
        const detail::Int4GroupParams p{sp[r * groups + g], zp[r * groups + g]};
        double* wr = &w[r * n];
        const uint8_t q = detail::int4_code(static_cast<float>(wr[j]), p);
        c[r * n + j] = q;
        const double deq = (static_cast<double>(q) - p.zero) * static_cast<double>(p.scale);
        const double e = (wr[j] - deq) / d;
        err[r * bs + (j - b0)] = e;
        for (int64_t k = j + 1; k < b1; ++k) wr[k] -= e * uj[k];
      }
    }
    // The block's errors reach the later columns in one pass: W[:, b1:] -= Err · U[b0:b1, b1:].
    if (b1 < n) {
      for (int64_t r = 0; r < out; ++r) {
        double* wr = &w[r * n];
        for (int64_t jj = 0; jj < width; ++jj) {
          const double e = err[r * bs + jj];
          const double* uj = &u[(b0 + jj) * n];
          for (int64_t k = b1; k < n; ++k) wr[k] -= e * uj[k];
        }
      }
    }
  }
  return detail::make_int4(out, n, gs, codes, scales, zeros);
}

}  // namespace kiln::quant
