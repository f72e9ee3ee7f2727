// Clipping by the global norm of sharded gradients. See shard_norm.h.
#include "shard_norm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/clip_grad.h"

namespace kiln::dist::detail {

namespace {

// Doubles travel as their bits in int64 tensors (the process groups move
// float32, bfloat16 and int64).
int64_t bits_of(double d) {
  int64_t i;
  std::memcpy(&i, &d, sizeof d);
  return i;
}
double double_of(int64_t i) {
  double d;
  std::memcpy(&d, &i, sizeof d);
  return d;
}

}  // namespace

double clip_sharded_grad_norm(ProcessGroup& group, size_t num_params, const std::vector<GradPiece>& pieces,
                              double max_norm, double norm_type, const std::string& who) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  KILN_CHECK(norm_type == 2.0 || inf, ValueError, who, ": norm_type must be 2 or inf, got ", norm_type);
  NoGradGuard no_grad;
  const auto P = static_cast<int64_t>(num_params);
  const int64_t n = group.size();
  // Per parameter: this rank's sum of squares (or max |g|) in double, and
  // whether this rank has a gradient for it.
  std::vector<double> partial(P, 0.0);
  std::vector<int64_t> has(P, 0);
  for (const GradPiece& piece : pieces) {
    const Tensor& g = piece.grad;
    if (!g.defined()) continue;
    KILN_CHECK(g.dtype() == kFloat32 && g.is_contiguous(), DTypeError, who,
               ": expected contiguous float32 gradient shards, got ", dtype_name(g.dtype()));
    const float* x = g.data_ptr<float>();
    if (inf) {
      double s = 0;
      bool nan = false;
      for (int64_t j = 0; j < g.numel(); ++j) {
        const double a = std::abs(static_cast<double>(x[j]));
        nan |= std::isnan(a);
        s = std::max(s, a);
      }
      if (nan) s = std::numeric_limits<double>::quiet_NaN();
      partial[piece.param] = std::isnan(s) || std::isnan(partial[piece.param])
                                 ? std::numeric_limits<double>::quiet_NaN()
                                 : std::max(partial[piece.param], s);
    } else {
      partial[piece.param] += optim::detail::sum_of_squares(x, g.numel());
    }
    has[piece.param] = 1;
  }
  Tensor mine = empty({2 * P}, kInt64);
  int64_t* m = mine.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) {
    m[i] = bits_of(partial[i]);
    m[P + i] = has[i];
  }
  Tensor all = empty({n * 2 * P}, kInt64);
  if (n > 1) {
    group.allgather_into_tensor(all, mine)->wait();
  } else {
    all.copy_(mine);
  }
  const int64_t* a = all.data_ptr<int64_t>();
  // The per-parameter norms, rounded to float32 (as optim::clip_grad_norm_
  // does for float32 gradients), then their norm, accumulated in the same
  // order and rounded alike. Parameters no rank has a gradient for are left
  // out (they would add an exact 0 anyway).
  double acc = 0;
  bool nan = false;
  bool any = false;
  for (int64_t i = 0; i < P; ++i) {
    double s = 0;
    bool defined = false;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t* row = a + r * 2 * P;
      if (!row[P + i]) continue;
      defined = true;
      const double v = double_of(row[i]);
      s = inf ? (std::isnan(v) || std::isnan(s) ? std::numeric_limits<double>::quiet_NaN() : std::max(s, v)) : s + v;
    }
    if (!defined) continue;
    any = true;
    const double norm = static_cast<float>(inf ? s : std::sqrt(s));
    if (inf) {
      nan |= std::isnan(norm);
      acc = std::max(acc, std::abs(norm));
    } else {
      acc += norm * norm;
    }
  }
  if (!any) return 0.0;
  const double total =
      static_cast<float>(inf ? (nan ? std::numeric_limits<double>::quiet_NaN() : acc) : std::sqrt(acc));
  float c = static_cast<float>(max_norm) / (static_cast<float>(total) + 1e-6f);
  const double coef = std::isnan(c) ? c : std::min(c, 1.0f);
  for (const GradPiece& piece : pieces) {
    Tensor g = piece.grad;
    if (g.defined()) g.mul_(coef);
  }
  return total;
}

}  // namespace kiln::dist::detail
