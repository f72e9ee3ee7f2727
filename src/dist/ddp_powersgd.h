#pragma once
// PowerSGD for DDP's buckets (internal to src/dist; CommHook::PowerSGD in
// kiln/dist/ddp.h, torch's powerSGD_hook). A bucket's matrices (each gradient
// viewed as [shape[0], rest]) that compress well travel as two thin factors:
// P = M Q is summed over ranks and orthonormalised, Q = Mᵀ P averaged, and
// the gradient becomes P Qᵀ, a rank-r approximation of the average. With error
// feedback each rank adds back what the last approximation left out of its own
// gradient. Vectors and matrices that would not shrink by min_compression_rate
// are averaged as they are. Note [PowerSGD in three exchanges] in ddp_powersgd.cpp.
#include <cstdint>
#include <vector>

#include "kiln/core/generator.h"
#include "kiln/core/tensor.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/process_group.h"

namespace kiln::dist::detail {

struct PowerSgdBucket {
  /// A compressed gradient: the n x m matrix at element `off` of the bucket,
  /// its factors P [n, r] and Q [m, r] at these offsets of p and q.
  struct Matrix {
    int64_t off, n, m, r, p_off, q_off;
    size_t slot;         // its gradient's index among the bucket's views
    bool has_q = false;  // Q holds a last step's (or a restored) value: warm start may use it
  };
  /// A gradient averaged as it is: `len` elements at `off` of the bucket, packed into `plain`.
  struct Span {
    int64_t off, len;
  };
  std::vector<Matrix> matrices;
  std::vector<Span> plain_spans;
  Tensor p, q, plain;  // flat float32 buffers, exchanged whole
  Tensor error;        // error feedback: what the last step left out, per value of the bucket
  Tensor input;        // this step's gradient plus error, kept until decompressed
  WorkPtr plain_work, p_work, q_work;
};

/// One gradient's PowerSGD state outside a bucket (kept across a bucket
/// rebuild, or loaded from a checkpoint): its last Q [m, r] and this rank's
/// error [n, m], each undefined when there is none yet.
struct PowerSgdMatrixState {
  Tensor q, error;
};

/// Copies of compressed gradient `mt`'s state in bucket b.
PowerSgdMatrixState powersgd_matrix_state(const PowerSgdBucket& b, const PowerSgdBucket::Matrix& mt);
/// Puts a gradient's saved state into b, whose matrix it is (its Q then
/// usable by warm start). Shapes must be the plan's (the caller checked them).
void powersgd_restore(PowerSgdBucket& b, PowerSgdBucket::Matrix& mt, const PowerSgdMatrixState& st,
                      int64_t bucket_numel);

/// How PowerSGD takes a gradient of `shape`: viewed as [n, m] (n = shape[0]),
/// compressed to rank r when that shrinks it min_compression_rate times (torch's _should_compress).
struct PowerSgdShape {
  int64_t n, m, r;
  bool compress;
};
PowerSgdShape powersgd_shape(IntArrayRef shape, const PowerSGDOptions& o);

/// The layout of bucket `flat`, whose parameter-shaped views are `views`.
PowerSgdBucket plan_powersgd(const Tensor& flat, const std::vector<Tensor>& views, const PowerSGDOptions& o);

/// When the bucket's gradients are ready: error feedback in, P = M Q, and the
/// exchanges of P (sum) and of the plain gradients (average) launched.
/// Adds the bytes handed to them to `wire_bytes`.
void powersgd_launch(PowerSgdBucket& b, const Tensor& flat, ProcessGroup& g, const PowerSGDOptions& o, Generator& rng,
                     int64_t& wire_bytes);

/// After backward: the plain gradients back in place, P orthonormalised,
/// Q = Mᵀ P computed and its average launched.
void powersgd_exchange_q(PowerSgdBucket& b, Tensor& flat, ProcessGroup& g, const PowerSGDOptions& o,
                         int64_t& wire_bytes);

/// The gradients as P Qᵀ, and the new error.
void powersgd_finish(PowerSgdBucket& b, Tensor& flat, const PowerSGDOptions& o);

/// Waits for whatever the bucket has in flight, without starting more (an error path).
void powersgd_drain(PowerSgdBucket& b);

/// Gram-Schmidt over the r columns of the row-major [n, r] matrix at `a`
/// (each normalised by its norm + eps, then removed from the later ones), as
/// torch's PowerSGD does for ranks up to 2; sums in double, two passes above
/// rank 1, and a column of zeros left zero.
void orthogonalize_columns(float* a, int64_t n, int64_t r, double eps);

}  // namespace kiln::dist::detail
