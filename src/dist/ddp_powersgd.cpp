// PowerSGD for DDP's buckets (ddp_powersgd.h).
//
// Note [PowerSGD in three exchanges]
// torch's powerSGD_hook chains three collectives per bucket through futures:
// the uncompressed gradients, then P, then Q. Here the first two start as soon
// as the bucket is ready, on the backward thread (P = M Q is one thin product
// per matrix, cheap beside backward), so they overlap the rest of backward as
// a plain allreduce does; Q needs the summed P, so the Q exchanges start when
// backward has ended, all buckets' at once, and are waited after. The
// steps are torch's:
//   - error feedback: M += e (e from the last step), M kept as `input`;
//   - Q: random (seeded, the same on every rank) at the first step, or the
//     last step's (warm start), orthonormalised either way;
//   - P = M Q, summed over ranks, orthonormalised;
//   - Q = Mᵀ P, averaged over ranks;
//   - the gradient becomes P Qᵀ, and e = input − P Qᵀ.
// One deliberate difference: torch's error covers the whole bucket, so an
// uncompressed gradient's error is this rank's value minus the average; over
// the ranks those sum to zero and only add rounding to the next average. Here
// the error is kept for the compressed matrices alone.
#include "ddp_powersgd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/linalg.h"

namespace kiln::dist::detail {

namespace {

// The [rows, cols] matrix at element `off` of a flat float32 buffer.
Tensor matrix_at(const Tensor& flat, int64_t off, int64_t rows, int64_t cols) {
  return flat.narrow(0, off, rows * cols).view({rows, cols});
}

// One modified Gram-Schmidt pass over the columns of row-major [n, r] `a`.
void gram_schmidt(float* a, int64_t n, int64_t r, double eps) {
  for (int64_t i = 0; i < r; ++i) {
    double ss = 0;
    for (int64_t k = 0; k < n; ++k) ss += static_cast<double>(a[k * r + i]) * a[k * r + i];
    // A column of zeros (a gradient of zeros, or fewer directions than r) stays zero, where torch's
    // division without epsilon makes it NaN.
    const double scale = ss > 0 || eps > 0 ? 1.0 / (std::sqrt(ss) + eps) : 0.0;
    for (int64_t k = 0; k < n; ++k) a[k * r + i] = static_cast<float>(a[k * r + i] * scale);
    for (int64_t j = i + 1; j < r; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += static_cast<double>(a[k * r + i]) * a[k * r + j];
      for (int64_t k = 0; k < n; ++k) a[k * r + j] = static_cast<float>(a[k * r + j] - dot * a[k * r + i]);
    }
  }
}

// The gradient as P Qᵀ ([n, r] by [m, r], row-major) into g [n, m], and, with
// error feedback, e = in − g in the same pass: row by row, each row of g the
// sum of Qᵀ's r rows scaled by P's, so the loop runs along contiguous memory.
void decompress(float* g, float* e, const float* in, const float* p, const float* q, int64_t n, int64_t m, int64_t r) {
  std::vector<float> qt(static_cast<size_t>(r * m));
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t k = 0; k < r; ++k) qt[static_cast<size_t>(k * m + j)] = q[j * r + k];
  }
  for (int64_t i = 0; i < n; ++i) {
    float* gi = g + i * m;
    const float p0 = p[i * r];
    const float* q0 = qt.data();
    for (int64_t j = 0; j < m; ++j) gi[j] = p0 * q0[j];
    for (int64_t k = 1; k < r; ++k) {
      const float pk = p[i * r + k];
      const float* qk = qt.data() + k * m;
      for (int64_t j = 0; j < m; ++j) gi[j] += pk * qk[j];
    }
    if (e) {
      float* ei = e + i * m;
      const float* ii = in + i * m;
      for (int64_t j = 0; j < m; ++j) ei[j] = ii[j] - gi[j];
    }
  }
}

}  // namespace

void orthogonalize_columns(float* a, int64_t n, int64_t r, double eps) {
  // Twice for more than one column: a gradient of lower rank than r leaves
  // columns that are rounding noise, which one Gram-Schmidt pass normalises
  // but does not make orthogonal to the others; the second pass does ("twice
  // is enough"). torch switches to a QR factorisation above rank 2 for the same reason.
  for (int pass = 0; pass < (r > 1 ? 2 : 1); ++pass) gram_schmidt(a, n, r, eps);
}

PowerSgdShape powersgd_shape(IntArrayRef shape, const PowerSGDOptions& o) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t n = shape.empty() ? 1 : shape[0];
  const int64_t m = n == 0 ? 0 : numel / n;
  const int64_t r = std::min({n, m, o.matrix_approximation_rank});
  // torch's _should_compress: worth it when the factors are min_compression_rate times smaller.
  const bool compress = r > 0 && static_cast<double>(n * m) > static_cast<double>((n + m) * r) * o.min_compression_rate;
  return {n, m, r, compress};
}

PowerSgdBucket plan_powersgd(const Tensor& flat, const std::vector<Tensor>& views, const PowerSGDOptions& o) {
  PowerSgdBucket b;
  int64_t p_len = 0, q_len = 0, plain_len = 0;
  for (size_t slot = 0; slot < views.size(); ++slot) {
    const Tensor& v = views[slot];
    const int64_t off = static_cast<const float*>(v.data_ptr()) - static_cast<const float*>(flat.data_ptr());
    const auto [n, m, r, compress] = powersgd_shape(v.sizes(), o);
    if (compress) {
      b.matrices.push_back({off, n, m, r, p_len, q_len, slot});
      p_len += n * r;
      q_len += m * r;
    } else {
      b.plain_spans.push_back({off, v.numel()});
      plain_len += v.numel();
    }
  }
  b.p = zeros({p_len});
  b.q = zeros({q_len});
  b.plain = zeros({plain_len});
  return b;
}

void powersgd_launch(PowerSgdBucket& b, const Tensor& flat, ProcessGroup& g, const PowerSGDOptions& o, Generator& rng,
                     int64_t& wire_bytes) {
  NoGradGuard no_grad;
  // With error feedback the matrices compressed are this step's gradients
  // plus the error, kept in `input` (one pass) until finish() takes the new error from it.
  if (o.use_error_feedback) b.input = b.error.defined() ? flat + b.error : flat.clone();
  const Tensor& m_of = o.use_error_feedback ? b.input : flat;
  // Q: fresh at a matrix's first step (or every step without warm start), in
  // the bucket's order, then orthonormal columns.
  for (auto& mt : b.matrices) {
    if (mt.has_q && o.warm_start) continue;
    matrix_at(b.q, mt.q_off, mt.m, mt.r).copy_(randn({mt.m, mt.r}, {}, &rng));
    mt.has_q = true;
  }
  for (const auto& mt : b.matrices)
    orthogonalize_columns(b.q.data_ptr<float>() + mt.q_off, mt.m, mt.r, o.orthogonalization_epsilon);
  for (const auto& mt : b.matrices) {
    Tensor p = matrix_at(b.p, mt.p_off, mt.n, mt.r);
    p.copy_(mm(matrix_at(m_of, mt.off, mt.n, mt.m), matrix_at(b.q, mt.q_off, mt.m, mt.r)));
  }
  int64_t at = 0;
  for (const auto& sp : b.plain_spans) {
    b.plain.narrow(0, at, sp.len).copy_(m_of.narrow(0, sp.off, sp.len));
    at += sp.len;
  }
  if (b.plain.numel() > 0) {
    b.plain_work = g.allreduce(b.plain, ReduceOp::Avg);
    wire_bytes += b.plain.nbytes();
  }
  if (b.p.numel() > 0) {
    b.p_work = g.allreduce(b.p, ReduceOp::Sum);
    wire_bytes += b.p.nbytes();
  }
}

void powersgd_exchange_q(PowerSgdBucket& b, Tensor& flat, ProcessGroup& g, const PowerSGDOptions& o,
                         int64_t& wire_bytes) {
  NoGradGuard no_grad;
  if (b.plain_work) {
    std::exchange(b.plain_work, nullptr)->wait();
    int64_t at = 0;
    for (const auto& sp : b.plain_spans) {
      flat.narrow(0, sp.off, sp.len).copy_(b.plain.narrow(0, at, sp.len));
      at += sp.len;
    }
  }
  if (!b.p_work) return;
  std::exchange(b.p_work, nullptr)->wait();
  for (const auto& mt : b.matrices)
    orthogonalize_columns(b.p.data_ptr<float>() + mt.p_off, mt.n, mt.r, o.orthogonalization_epsilon);
  const Tensor& m_of = o.use_error_feedback ? b.input : flat;
  for (const auto& mt : b.matrices) {
    Tensor q = matrix_at(b.q, mt.q_off, mt.m, mt.r);
    q.copy_(mm(matrix_at(m_of, mt.off, mt.n, mt.m).t(), matrix_at(b.p, mt.p_off, mt.n, mt.r)));
  }
  b.q_work = g.allreduce(b.q, ReduceOp::Avg);
  wire_bytes += b.q.nbytes();
}

void powersgd_finish(PowerSgdBucket& b, Tensor& flat, const PowerSGDOptions& o) {
  NoGradGuard no_grad;
  if (!b.q_work) return;
  std::exchange(b.q_work, nullptr)->wait();
  const bool feedback = o.use_error_feedback;
  if (feedback && !b.error.defined()) b.error = zeros({flat.numel()});
  // The compressed matrices' error; the averaged ones keep none (Note [PowerSGD in three exchanges]).
  for (const auto& mt : b.matrices) {
    decompress(flat.data_ptr<float>() + mt.off, feedback ? b.error.data_ptr<float>() + mt.off : nullptr,
               feedback ? b.input.data_ptr<float>() + mt.off : nullptr, b.p.data_ptr<float>() + mt.p_off,
               b.q.data_ptr<float>() + mt.q_off, mt.n, mt.m, mt.r);
  }
  b.input = Tensor();
}

PowerSgdMatrixState powersgd_matrix_state(const PowerSgdBucket& b, const PowerSgdBucket::Matrix& mt) {
  PowerSgdMatrixState st;
  if (mt.has_q) st.q = matrix_at(b.q, mt.q_off, mt.m, mt.r).clone();
  if (b.error.defined()) st.error = matrix_at(b.error, mt.off, mt.n, mt.m).clone();
  return st;
}

void powersgd_restore(PowerSgdBucket& b, PowerSgdBucket::Matrix& mt, const PowerSgdMatrixState& st,
                      int64_t bucket_numel) {
  NoGradGuard no_grad;
  if (st.q.defined()) {
    matrix_at(b.q, mt.q_off, mt.m, mt.r).copy_(st.q);
    mt.has_q = true;
  }
  if (st.error.defined()) {
    if (!b.error.defined()) b.error = zeros({bucket_numel});
    matrix_at(b.error, mt.off, mt.n, mt.m).copy_(st.error);
  }
}

void powersgd_drain(PowerSgdBucket& b) {
  for (WorkPtr* w : {&b.plain_work, &b.p_work, &b.q_work}) {
    if (*w) std::exchange(*w, nullptr)->wait();
  }
  b.input = Tensor();
}

}  // namespace kiln::dist::detail
