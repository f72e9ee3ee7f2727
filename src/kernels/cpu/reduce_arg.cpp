// max/min with indices along one dim (and argmax/argmin).
//
// Comparisons are exact, so the result does not depend on how the work is
// split; what matters is PyTorch's rule for which element wins: the first
// of equal values, and the first NaN over any number.
#include <algorithm>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/kernels/reduce.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

// True when x should replace the current best v (x comes later in the dim).
template <typename A, bool IsMax>
inline bool better(A x, A v) {
  if constexpr (std::is_floating_point_v<A>)
    return (IsMax ? x > v : x < v) || (x != x && v == v);
  else
    return IsMax ? x > v : x < v;
}

// First index in [0, n) where pred(x[i]) holds; blocks of 64 are tested with
// a vectorised OR before the scalar scan pins the position.
template <typename T, typename Pred>
int64_t find_first_if(const T* x, int64_t n, Pred pred) {
  constexpr int64_t B = 64;
  int64_t i = 0;
  for (; i + B <= n; i += B) {
    int hit = 0;
    for (int64_t k = 0; k < B; ++k) hit |= pred(x[i + k]) ? 1 : 0;
    if (hit) break;
  }
  for (; i < n; ++i)
    if (pred(x[i])) return i;
  return -1;
}

// First index whose value equals m (or is NaN when m is NaN).
template <typename T>
int64_t find_first(const T* x, int64_t n, compute_t<T> m) {
  using A = compute_t<T>;
  if constexpr (std::is_floating_point_v<A>) {
    if (m != m) return find_first_if(x, n, [](T v) { return static_cast<A>(v) != static_cast<A>(v); });
  }
  return find_first_if(x, n, [m](T v) { return static_cast<A>(v) == m; });
}

// One row: the extreme value by the vectorised reduction, then its first position.
template <typename T, bool IsMax>
int64_t row_arg(const T* x, int64_t n) {
  using A = compute_t<T>;
  const A m = run_value(MaxOp<T, IsMax>{}, reinterpret_cast<const char*>(x), n, sizeof(T), A(0));
  return find_first(x, n, m);
}

template <typename T, bool IsMax>
void arg_rows(const DimLayout& l, const T* in, T* values, int64_t* indices) {
  using A = compute_t<T>;
  const int64_t rows = l.outer, n = l.n;
  auto emit = [&](int64_t r, int64_t i) {
    indices[r] = i;
    if (values) values[r] = in[r * n + i];
  };
  if (!run_serial(rows * n) && rows < 2 * get_num_threads() && n > kReducePiece) {
    // Few long rows: best of each fixed piece in parallel, then the first best piece.
    const int64_t pieces = (n + kReducePiece - 1) / kReducePiece;
    std::vector<int64_t> best(static_cast<size_t>(pieces));
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = in + r * n;
      parallel_for(pieces, 1, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c)
          best[c] =
              c * kReducePiece + row_arg<T, IsMax>(x + c * kReducePiece, std::min(kReducePiece, n - c * kReducePiece));
      });
      int64_t i = best[0];
      for (int64_t c = 1; c < pieces; ++c)
        if (better<A, IsMax>(static_cast<A>(x[best[c]]), static_cast<A>(x[i]))) i = best[c];
      emit(r, i);
    }
    return;
  }
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) emit(r, row_arg<T, IsMax>(in + r * n, n));
  };
  if (run_serial(rows * n))
    body(0, rows);
  else
    parallel_for(rows, std::max<int64_t>(1, kGrainSize / n), [&](int64_t b, int64_t e) { body(b, e); });
}

// inner > 1: blocks of contiguous columns walk the rows of the dim together.
template <typename T, bool IsMax>
void arg_cols(const DimLayout& l, const T* in, T* values, int64_t* indices) {
  using A = compute_t<T>;
  const int64_t n = l.n, inner = l.inner;
  const int64_t blocks = (inner + kColWidth - 1) / kColWidth;
  auto body = [&](int64_t b, int64_t e) {
    A v[kColWidth];
    int64_t id[kColWidth];
    for (int64_t u = b; u < e; ++u) {
      const int64_t q = u / blocks, j0 = (u % blocks) * kColWidth, w = std::min(kColWidth, inner - j0);
      const T* base = in + q * n * inner + j0;
      for (int64_t j = 0; j < w; ++j) {
        v[j] = static_cast<A>(base[j]);
        id[j] = 0;
      }
      for (int64_t r = 1; r < n; ++r) {
        const T* x = base + r * inner;
        for (int64_t j = 0; j < w; ++j) {
          const A xv = static_cast<A>(x[j]);
          const bool take = better<A, IsMax>(xv, v[j]);
          v[j] = take ? xv : v[j];
          id[j] = take ? r : id[j];
        }
      }
      const int64_t o0 = q * inner + j0;
      for (int64_t j = 0; j < w; ++j) {
        indices[o0 + j] = id[j];
        if (values) values[o0 + j] = base[id[j] * inner + j];
      }
    }
  };
  const int64_t units = l.outer * blocks;
  if (run_serial(l.outer * n * inner))
    body(0, units);
  else
    parallel_for(units, std::max<int64_t>(1, kGrainSize / (n * kColWidth)), [&](int64_t b, int64_t e) { body(b, e); });
}

}  // namespace

void arg_reduce(const DimLayout& l, DType dt, const void* in, void* values, int64_t* indices, bool is_max) {
  KILN_CAPTURE_KERNEL("arg_reduce", arg_reduce(l, dt, in, values, indices, is_max));
  KILN_ASSERT(l.n >= 1, "arg_reduce: reduction over an empty dim must be rejected by the caller");
  if (l.outer * l.inner == 0) return;
  visit_dtype(dt, [&]<typename T>() {
    const T* x = static_cast<const T*>(in);
    T* v = static_cast<T*>(values);
    if (l.inner == 1) {
      if (is_max)
        arg_rows<T, true>(l, x, v, indices);
      else
        arg_rows<T, false>(l, x, v, indices);
    } else {
      if (is_max)
        arg_cols<T, true>(l, x, v, indices);
      else
        arg_cols<T, false>(l, x, v, indices);
    }
  });
}

}  // namespace kiln::kernels
