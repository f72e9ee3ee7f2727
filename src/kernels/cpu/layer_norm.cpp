// LayerNorm's fused kernels (src/kernels/include/kiln/kernels/layer_norm.h):
// one pass per row forward, one pass per row backward (see the header).
#include "kiln/kernels/layer_norm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "elementwise_math.h"
#include "kiln/core/capture.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/loop.h"
#include "reduce_engine.h"

namespace kiln::kernels {

namespace {

// Rows per chunk of the weight/bias gradient sums: a fixed split, so sums do not depend on threads.
int64_t chunk_rows(int64_t rows, int64_t n) {
  const int64_t per = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, n));
  return std::max<int64_t>(per, (rows + 63) / 64);
}

// Row sums over 16 independent partials (detail::lane_sum): the sums of a
// row depend on its length alone.
constexpr int kLanes = 16;

// Note [Rows side by side]
// A row's sum is a chain of dependent vector adds (16 partials, one vector),
// and a [128, 256] norm's rows are short: one row at a time, each pass waited
// on the chain before it (gpt_infer's ln ran at 58 ns a row). Summing R rows
// in one loop runs R chains at once; each row's partials are the ones
// lane_sum<kLanes> forms, so its bits do not change.
template <int R, typename T, typename F>
[[gnu::always_inline]] inline void lane_sums(int64_t n, const F& f, T* out) {
  if constexpr (std::is_same_v<T, float> && kLanes == 16) {
    // f(q, i, count) returns row q's values i .. i + count as one vector (zeros
    // past count); GCC does not vectorise R rows of scalar lanes.
    detail::Vec16f acc[R] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int q = 0; q < R; ++q) acc[q] += f(q, i, kLanes);
    for (int q = 0; q < R; ++q) {
      if (i < n) acc[q] += f(q, i, n - i);
      out[q] = detail::sum_partials<kLanes>(reinterpret_cast<float*>(&acc[q]));
    }
  } else {
    T lanes[R][kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int q = 0; q < R; ++q)
        for (int k = 0; k < kLanes; ++k) lanes[q][k] += f(q, i + k);
    for (int q = 0; q < R; ++q) {
      for (int k = 0; i + k < n; ++k) lanes[q][k] += f(q, i + k);
      out[q] = detail::sum_partials<kLanes>(lanes[q]);
    }
  }
}

// Rows [r, r + R) of the forward (Y as in ln_forward; `row` holds R rows of float when Y is bf16).
template <int R, typename T, typename Y>
void ln_forward_rows(const T* x, const T* w, const T* b, Y* y, T* mean_out, T* rstd_out, int64_t r, int64_t n,
                     double eps, T* row) {
  constexpr bool kDirect = std::is_same_v<T, Y>;
  const T* xr = x + r * n;
  T m[R], var[R];
  if constexpr (std::is_same_v<T, float>) {
    // The 16 values from p, zeros past `count`.
    const auto load = [](const float* p, int64_t count) {
      detail::Vec16f v = {};
      std::memcpy(&v, p, static_cast<size_t>(count) * sizeof(float));
      return v;
    };
    lane_sums<R, T>(
        n, [&](int q, int64_t i, int64_t count) { return load(xr + q * n + i, count); }, m);
    for (int q = 0; q < R; ++q) m[q] /= static_cast<T>(n);
    lane_sums<R, T>(
        n,
        [&](int q, int64_t i, int64_t count) {
          // A short last vector's unused lanes are 0, so that they add 0 (the
          // same product-and-add as the full vectors: lane_sum's bits).
          detail::Vec16f d = load(xr + q * n + i, count) - m[q];
          for (int64_t k = count; k < kLanes; ++k) d[k] = 0;
          return d * d;
        },
        var);
  } else {
    lane_sums<R, T>(
        n, [&](int q, int64_t j) { return xr[q * n + j]; }, m);
    for (int q = 0; q < R; ++q) m[q] /= static_cast<T>(n);
    lane_sums<R, T>(
        n,
        [&](int q, int64_t j) {
          const T d = xr[q * n + j] - m[q];
          return d * d;
        },
        var);
  }
  for (int q = 0; q < R; ++q) {
    const T rs = static_cast<T>(1.0 / std::sqrt(static_cast<double>(var[q] / static_cast<T>(n)) + eps));
    const T* xq = xr + q * n;
    T* yr;
    if constexpr (kDirect) {
      yr = y + (r + q) * n;
    } else {
      yr = row;
    }
    for (int64_t j = 0; j < n; ++j) yr[j] = (xq[j] - m[q]) * rs * w[j] + b[j];
    if constexpr (!kDirect) vm::float_to_bf16_row(y + (r + q) * n, yr, n);
    if (mean_out != nullptr) {
      mean_out[r + q] = m[q];
      rstd_out[r + q] = rs;
    }
  }
}

// Y: T, or bf16 for a float T (each row computed in float, then rounded as Tensor::to rounds).
template <typename T, typename Y>
void ln_forward(const T* x, const T* w, const T* b, Y* y, T* mean_out, T* rstd_out, int64_t rows, int64_t n,
                double eps) {
  constexpr bool kDirect = std::is_same_v<T, Y>;
  constexpr int kRows = 4;  // Note [Rows side by side]
  // Half the usual grain: with two passes per element (sums, then the write) a
  // [128, 256] block (gpt_infer's) is worth two threads, and its input is
  // usually a product's output that both threads wrote (half of it in the
  // other core's cache when one thread reads it all).
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / (2 * n)), [&](int64_t r0, int64_t r1) {
    std::vector<T> row(kDirect ? 0 : static_cast<size_t>(n));
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows)
      ln_forward_rows<kRows, T, Y>(x, w, b, y, mean_out, rstd_out, r, n, eps, row.data());
    for (; r < r1; ++r) ln_forward_rows<1, T, Y>(x, w, b, y, mean_out, rstd_out, r, n, eps, row.data());
  });
}

#if defined(__AVX512F__)
// Note [Layer norm backward in two passes]
// One float row of the backward in two passes: the first reads x and g once
// (a bf16 g widened in the register) and forms x̂, g·w, the weight and bias
// partial sums and both row sums; the second forms x̂ and g·w again from the
// row it just read (in L1) and writes the input gradient, streamed straight
// from the register when the row fills whole lines. The loop it replaces
// made six passes over buffers of the row (widen, x̂ and g·w, the partial
// sums, two lane sums, the gradient) and then copied or streamed the row
// out. The row sums keep lane_sum<16>'s 16 partials; gpt's losses stay
// bitwise those of the old loop (float32 and bf16, 1 and 2 threads).
// Measured in gpt's step (KILN_COMPILE_PROFILE=1, layer_norm_backward per
// step, interleaved pairs, 2026-12-05): 1 thread float32 3.6-3.9 -> 2.3-2.8
// ms, bf16 4.9-5.6 -> 2.4-3.2 ms; 2 threads float32 2.1-2.3 -> 1.6-1.7 ms,
// bf16 2.6 -> 1.2-1.6 ms. Whole vectors use plain loads and stores: a first
// version that loaded and stored every vector under a mask ran at half this
// speed in the step (6.6 against 3.8 ms, float32, 1 thread), although not in
// isolation; only a row's short last vector takes the mask.
template <typename G>
[[gnu::always_inline]] inline void ln_backward_row_f32(const G* g, const float* xr, const float* w, float m, float rs,
                                                       float* pw, float* pb, float* out, bool stream, float* buf,
                                                       int64_t n) {
  const __m512 vmean = _mm512_set1_ps(m), vrs = _mm512_set1_ps(rs);
  // x̂ and g·w of the 16 values from i; a row's short last vector is loaded
  // under a mask, with zeros past the row's end.
  const auto terms = [&](int64_t i, __m512& gv, __m512& xh, __m512& dh) {
    if (i + 16 <= n) {
      if constexpr (std::is_same_v<G, float>) {
        gv = _mm512_loadu_ps(g + i);
      } else {
        gv = vm::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
      }
      xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + i), vmean), vrs);
      dh = _mm512_mul_ps(gv, _mm512_loadu_ps(w + i));
      return;
    }
    const __mmask16 k = vm::first_lanes16(n - i);
    if constexpr (std::is_same_v<G, float>) {
      gv = _mm512_maskz_loadu_ps(k, g + i);
    } else {
      gv = vm::bf16x16_to_float(_mm256_maskz_loadu_epi16(k, g + i));
    }
    xh = _mm512_maskz_mul_ps(k, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, xr + i), vmean), vrs);
    dh = _mm512_mul_ps(gv, _mm512_maskz_loadu_ps(k, w + i));
  };
  __m512 sa = _mm512_setzero_ps(), sb = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 gv, xh, dh;
    terms(i, gv, xh, dh);
    if (pw != nullptr) {
      if (i + 16 <= n) {
        _mm512_storeu_ps(pw + i, _mm512_fmadd_ps(gv, xh, _mm512_loadu_ps(pw + i)));
        _mm512_storeu_ps(pb + i, _mm512_add_ps(_mm512_loadu_ps(pb + i), gv));
      } else {
        const __mmask16 k = vm::first_lanes16(n - i);
        _mm512_mask_storeu_ps(pw + i, k, _mm512_fmadd_ps(gv, xh, _mm512_maskz_loadu_ps(k, pw + i)));
        _mm512_mask_storeu_ps(pb + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, pb + i), gv));
      }
    }
    sa = _mm512_add_ps(sa, dh);
    sb = _mm512_fmadd_ps(dh, xh, sb);
  }
  if (out == nullptr) return;
  alignas(64) float la[kLanes], lb[kLanes];
  _mm512_store_ps(la, sa);
  _mm512_store_ps(lb, sb);
  const __m512 ma = _mm512_set1_ps(detail::sum_partials<kLanes>(la) / static_cast<float>(n));
  const __m512 mb = _mm512_set1_ps(detail::sum_partials<kLanes>(lb) / static_cast<float>(n));
  // Streamed straight from the register when every vector fills a line; else through buf.
  const bool direct = stream && n % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  float* dst = stream && !direct ? buf : out;
  for (int64_t i = 0; i < n; i += 16) {
    __m512 gv, xh, dh;
    terms(i, gv, xh, dh);
    const __m512 d = _mm512_mul_ps(vrs, _mm512_fnmadd_ps(xh, mb, _mm512_sub_ps(dh, ma)));
    if (direct) {
      _mm512_stream_ps(out + i, d);
    } else if (i + 16 <= n) {
      _mm512_storeu_ps(dst + i, d);
    } else {
      _mm512_mask_storeu_ps(dst + i, vm::first_lanes16(n - i), d);
    }
  }
  if (stream && !direct) vm::stream_row(out, buf, n);
}
#endif

// G: T, or bf16 for a float T (each gradient row widened exactly first).
template <typename T, typename G>
void ln_backward(const G* g_in, const T* x, const T* w, const T* mean, const T* rstd, T* gx, T* gw, T* gb, int64_t rows,
                 int64_t n) {
  constexpr bool kDirect = std::is_same_v<T, G>;
#if defined(__AVX512F__)
  constexpr bool kRowKernel = std::is_same_v<T, float>;  // Note [Layer norm backward in two passes]
#else
  constexpr bool kRowKernel = false;
#endif
  const int64_t per = chunk_rows(rows, n), chunks = (rows + per - 1) / per;
  const bool want_wb = gw != nullptr;
  // Each chunk's partial sums are zeroed by the thread that accumulates them:
  // zeroed here, every other chunk's lines would first travel from this core
  // to the worker's (at 2 threads, backward took longer than at 1).
  std::unique_ptr<T[]> part(want_wb ? new T[static_cast<size_t>(chunks * 2 * n)] : nullptr);
  parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    // A thread writing a large float input gradient streams it out (Note
    // [Streaming stores for fresh outputs]); only the float row kernel streams.
    const int64_t my_rows = std::min(rows, c1 * per) - c0 * per;
    // Written over the incoming gradient (the ops layer's Note [Layer norm's
    // input gradient over its incoming buffer]), the lines are in cache already.
    const bool in_place = static_cast<const void*>(gx) == static_cast<const void*>(g_in);
    const bool stream =
        kRowKernel && gx != nullptr && !in_place && my_rows * n * static_cast<int64_t>(sizeof(T)) >= vm::kStreamBytes;
    // The float row kernel needs only dxhat, whole vectors of it, to stage a
    // row whose lines it cannot stream straight from the registers.
    const auto padded = static_cast<size_t>((n + kLanes - 1) / kLanes * kLanes);
    std::vector<T> xhat(kRowKernel ? 0 : static_cast<size_t>(n)), dxhat(padded),
        wide(kDirect || kRowKernel ? 0 : static_cast<size_t>(n));
    for (int64_t c = c0; c < c1; ++c) {
      T* pw = want_wb ? part.get() + c * 2 * n : nullptr;
      T* pb = want_wb ? pw + n : nullptr;
      if (want_wb) std::fill(pw, pw + 2 * n, T(0));
      for (int64_t r = c * per, re = std::min(rows, (c + 1) * per); r < re; ++r) {
#if defined(__AVX512F__)
        if constexpr (kRowKernel) {
          ln_backward_row_f32(g_in + r * n, x + r * n, w, mean[r], rstd[r], pw, pb, gx ? gx + r * n : nullptr, stream,
                              dxhat.data(), n);
          continue;
        }
#endif
        const T* gr;
        if constexpr (kDirect) {
          gr = g_in + r * n;
        } else {
          vm::bf16_to_float_row(wide.data(), g_in + r * n, n);  // exact
          gr = wide.data();
        }
        const T* xr = x + r * n;
        const T m = mean[r], rs = rstd[r];
        for (int64_t j = 0; j < n; ++j) {
          xhat[j] = (xr[j] - m) * rs;
          dxhat[j] = gr[j] * w[j];
        }
        if (want_wb) {
          for (int64_t j = 0; j < n; ++j) {
            pw[j] += gr[j] * xhat[j];
            pb[j] += gr[j];
          }
        }
        if (gx != nullptr) {
          const T ma = detail::lane_sum<kLanes, T>(n, [&](int64_t j) { return dxhat[j]; }) / static_cast<T>(n);
          const T mb =
              detail::lane_sum<kLanes, T>(n, [&](int64_t j) { return dxhat[j] * xhat[j]; }) / static_cast<T>(n);
          T* out = gx + r * n;
          for (int64_t j = 0; j < n; ++j) out[j] = rs * (dxhat[j] - ma - xhat[j] * mb);
        }
      }
    }
    if (stream) vm::stream_fence();
  });
  if (!want_wb) return;
  for (int64_t j = 0; j < n; ++j) {
    double sw = 0, sb = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      sw += static_cast<double>(part[static_cast<size_t>(c * 2 * n + j)]);
      sb += static_cast<double>(part[static_cast<size_t>(c * 2 * n + n + j)]);
    }
    gw[j] = static_cast<T>(sw);
    gb[j] = static_cast<T>(sb);
  }
}

}  // namespace

void layer_norm_forward(DType dt, int64_t rows, int64_t n, const void* x, const void* weight, const void* bias,
                        double eps, void* y, void* mean, void* rstd, DType y_dt) {
  KILN_CAPTURE_KERNEL("layer_norm_forward", layer_norm_forward(dt, rows, n, x, weight, bias, eps, y, mean, rstd, y_dt));
  KILN_ASSERT(y_dt == dt || (dt == kFloat32 && y_dt == kBFloat16), "layer_norm: a ", dtype_name(dt),
              " norm cannot write ", dtype_name(y_dt));
  visit_dtype<DTypeSet{kFloat32, kFloat64}>(dt, "layer_norm", [&]<typename T>() {
    const auto run = [&]<typename Y>() {
      ln_forward<T, Y>(static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias),
                       static_cast<Y*>(y), static_cast<T*>(mean), static_cast<T*>(rstd), rows, n, eps);
    };
    if constexpr (std::is_same_v<T, float>) {
      if (y_dt == kBFloat16) return run.template operator()<BFloat16>();
    }
    run.template operator()<T>();
  });
}

void layer_norm_backward(DType dt, int64_t rows, int64_t n, const void* g, const void* x, const void* weight,
                         const void* mean, const void* rstd, void* gx, void* gw, void* gb, DType g_dt) {
  KILN_CAPTURE_KERNEL("layer_norm_backward",
                      layer_norm_backward(dt, rows, n, g, x, weight, mean, rstd, gx, gw, gb, g_dt));
  KILN_ASSERT(g_dt == dt || (dt == kFloat32 && g_dt == kBFloat16), "layer_norm backward: a ", dtype_name(dt),
              " norm cannot read a ", dtype_name(g_dt), " gradient");
  visit_dtype<DTypeSet{kFloat32, kFloat64}>(dt, "layer_norm backward", [&]<typename T>() {
    const auto run = [&]<typename G>() {
      ln_backward<T, G>(static_cast<const G*>(g), static_cast<const T*>(x), static_cast<const T*>(weight),
                        static_cast<const T*>(mean), static_cast<const T*>(rstd), static_cast<T*>(gx),
                        static_cast<T*>(gw), static_cast<T*>(gb), rows, n);
    };
    if constexpr (std::is_same_v<T, float>) {
      if (g_dt == kBFloat16) return run.template operator()<BFloat16>();
    }
    run.template operator()<T>();
  });
}

}  // namespace kiln::kernels
