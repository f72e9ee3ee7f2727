// softmax and log_softmax along one dim of a contiguous [outer, n, inner] block.
//
// Fused per row (or per block of columns): one pass for the max, one for the
// sum of exp(x - max), one to write. The row stays in cache between passes,
// so a large tensor is read from memory once. float and double store exp in
// the output during the second pass and scale it in the third (exp is the
// costly part); 16-bit outputs recompute exp in the third pass instead, so
// that they are rounded once. A NaN anywhere in a slice makes the whole slice
// NaN (through the sum), as in PyTorch, so the max need not propagate it.
//
// Backward is fused the same way: one pass for the row's sum (of g * y, or of
// g for log_softmax), one to write, the row in cache between them.
#include <cmath>
#include <type_traits>

#include "kiln/core/capture.h"
#include "kiln/kernels/reduce.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

template <typename T>
void softmax_rows(const DimLayout& l, const T* in, T* out, bool log) {
  using A = compute_t<T>;
  const int64_t n = l.n;
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* x = in + r * n;
      T* y = out + r * n;
      const char* xb = reinterpret_cast<const char*>(x);
      const A m = run_value(FastMaxOp<T>{}, xb, n, sizeof(T), A(0));
      if (log) {
        const A ls = std::log(run_value(ExpShiftOp<T>{}, xb, n, sizeof(T), m));
        for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>((static_cast<A>(x[i]) - m) - ls);
      } else if constexpr (std::is_same_v<T, A>) {
        for (int64_t i = 0; i < n; ++i) y[i] = exp_vec(x[i] - m);
        const A inv = A(1) / run_value(SumOp<T>{}, reinterpret_cast<const char*>(y), n, sizeof(T), A(0));
        for (int64_t i = 0; i < n; ++i) y[i] *= inv;
      } else {
        const A inv = A(1) / run_value(ExpShiftOp<T>{}, xb, n, sizeof(T), m);
        for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(exp_vec(static_cast<A>(x[i]) - m) * inv);
      }
    }
  };
  if (run_serial(l.outer * n))
    body(0, l.outer);
  else
    parallel_for(l.outer, std::max<int64_t>(1, kGrainSize / n), [&](int64_t b, int64_t e) { body(b, e); });
}

template <typename T>
void softmax_cols(const DimLayout& l, const T* in, T* out, bool log) {
  using A = compute_t<T>;
  const int64_t n = l.n, inner = l.inner;
  const int64_t blocks = (inner + kColWidth - 1) / kColWidth;
  const int64_t row_bytes = inner * static_cast<int64_t>(sizeof(T));
  auto row_off = [row_bytes](int64_t r) { return r * row_bytes; };
  auto body = [&](int64_t b, int64_t e) {
    const A zeros[kColWidth] = {};
    A m[kColWidth], s[kColWidth];
    for (int64_t u = b; u < e; ++u) {
      const int64_t q = u / blocks, j0 = (u % blocks) * kColWidth, w = std::min(kColWidth, inner - j0);
      const int64_t off = q * n * inner + j0;
      const char* base = reinterpret_cast<const char*>(in + off);
      col_value(FastMaxOp<T>{}, base, n, w, row_off, zeros, m);
      if (log) {
        col_value(ExpShiftOp<T>{}, base, n, w, row_off, m, s);
        for (int64_t j = 0; j < w; ++j) s[j] = std::log(s[j]);
        for (int64_t r = 0; r < n; ++r) {
          const T* x = in + off + r * inner;
          T* y = out + off + r * inner;
          for (int64_t j = 0; j < w; ++j) y[j] = static_cast<T>((static_cast<A>(x[j]) - m[j]) - s[j]);
        }
      } else if constexpr (std::is_same_v<T, A>) {
        for (int64_t r = 0; r < n; ++r) {
          const T* x = in + off + r * inner;
          T* y = out + off + r * inner;
          for (int64_t j = 0; j < w; ++j) y[j] = exp_vec(x[j] - m[j]);
        }
        col_value(SumOp<T>{}, reinterpret_cast<const char*>(out + off), n, w, row_off, zeros, s);
        for (int64_t j = 0; j < w; ++j) s[j] = A(1) / s[j];
        for (int64_t r = 0; r < n; ++r) {
          T* y = out + off + r * inner;
          for (int64_t j = 0; j < w; ++j) y[j] *= s[j];
        }
      } else {
        col_value(ExpShiftOp<T>{}, base, n, w, row_off, m, s);
        for (int64_t j = 0; j < w; ++j) s[j] = A(1) / s[j];
        for (int64_t r = 0; r < n; ++r) {
          const T* x = in + off + r * inner;
          T* y = out + off + r * inner;
          for (int64_t j = 0; j < w; ++j) y[j] = static_cast<T>(exp_vec(static_cast<A>(x[j]) - m[j]) * s[j]);
        }
      }
    }
  };
  const int64_t units = l.outer * blocks;
  if (run_serial(l.outer * n * inner))
    body(0, units);
  else
    parallel_for(units, std::max<int64_t>(1, kGrainSize / (n * kColWidth)), [&](int64_t b, int64_t e) { body(b, e); });
}

template <typename T>
void softmax_backward_rows(const DimLayout& l, const T* y, const T* g, T* out, bool log) {
  using A = compute_t<T>;
  const int64_t n = l.n;
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* yr = y + r * n;
      const T* gr = g + r * n;
      T* o = out + r * n;
      if (log) {
        const A s = lane_sum<kLanes, A>(n, [&](int64_t i) { return static_cast<A>(gr[i]); });
        for (int64_t i = 0; i < n; ++i)
          o[i] = static_cast<T>(static_cast<A>(gr[i]) - exp_vec(static_cast<A>(yr[i])) * s);
      } else {
        const A s = lane_sum<kLanes, A>(n, [&](int64_t i) { return static_cast<A>(gr[i]) * static_cast<A>(yr[i]); });
        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<A>(yr[i]) * (static_cast<A>(gr[i]) - s));
      }
    }
  };
  if (run_serial(l.outer * n))
    body(0, l.outer);
  else
    parallel_for(l.outer, std::max<int64_t>(1, kGrainSize / n), [&](int64_t b, int64_t e) { body(b, e); });
}

template <typename T>
void softmax_backward_cols(const DimLayout& l, const T* y, const T* g, T* out, bool log) {
  using A = compute_t<T>;
  const int64_t n = l.n, inner = l.inner;
  const int64_t blocks = (inner + kColWidth - 1) / kColWidth;
  auto body = [&](int64_t b, int64_t e) {
    A s[kColWidth];
    for (int64_t u = b; u < e; ++u) {
      const int64_t q = u / blocks, j0 = (u % blocks) * kColWidth, w = std::min(kColWidth, inner - j0);
      const int64_t off = q * n * inner + j0;
      for (int64_t j = 0; j < w; ++j) s[j] = A(0);
      for (int64_t r = 0; r < n; ++r) {
        const T* yr = y + off + r * inner;
        const T* gr = g + off + r * inner;
        if (log) {
          for (int64_t j = 0; j < w; ++j) s[j] += static_cast<A>(gr[j]);
        } else {
          for (int64_t j = 0; j < w; ++j) s[j] += static_cast<A>(gr[j]) * static_cast<A>(yr[j]);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        const T* yr = y + off + r * inner;
        const T* gr = g + off + r * inner;
        T* o = out + off + r * inner;
        if (log) {
          for (int64_t j = 0; j < w; ++j)
            o[j] = static_cast<T>(static_cast<A>(gr[j]) - exp_vec(static_cast<A>(yr[j])) * s[j]);
        } else {
          for (int64_t j = 0; j < w; ++j) o[j] = static_cast<T>(static_cast<A>(yr[j]) * (static_cast<A>(gr[j]) - s[j]));
        }
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

void softmax(const DimLayout& l, DType dt, const void* in, void* out, bool log) {
  KILN_CAPTURE_KERNEL("softmax", softmax(l, dt, in, out, log));
  if (l.outer * l.n * l.inner == 0) return;
  visit_dtype<kFloatingTypes>(dt, log ? "log_softmax" : "softmax", [&]<typename T>() {
    const T* x = static_cast<const T*>(in);
    T* y = static_cast<T*>(out);
    if (l.inner == 1)
      softmax_rows(l, x, y, log);
    else
      softmax_cols(l, x, y, log);
  });
}

void softmax_backward(const DimLayout& l, DType dt, const void* y, const void* g, void* out, bool log) {
  KILN_CAPTURE_KERNEL("softmax_backward", softmax_backward(l, dt, y, g, out, log));
  if (l.outer * l.n * l.inner == 0) return;
  visit_dtype<kFloatingTypes>(dt, log ? "log_softmax_backward" : "softmax_backward", [&]<typename T>() {
    const T* yp = static_cast<const T*>(y);
    const T* gp = static_cast<const T*>(g);
    T* o = static_cast<T*>(out);
    if (l.inner == 1)
      softmax_backward_rows(l, yp, gp, o, log);
    else
      softmax_backward_cols(l, yp, gp, o, log);
  });
}

}  // namespace kiln::kernels
