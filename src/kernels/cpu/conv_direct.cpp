// Note [Few-channel weight gradient]
// A stem convolution reads a few input channels (1 for grayscale, 3 for RGB)
// and writes many: its weight gradient dW[o, c, i, j] = Σ over images and
// output pixels of dY[n, y, x, o] · X[n, c, y s + i d - pad, x s + j d - pad]
// has few terms per output pixel but a full-size grad_output to read. oneDNN
// 2.6 runs it at a fraction of its speed elsewhere: cnn's first layer
// (1 → 32 channels, 3x3, 64 images of 28x28, float32) took 0.56-0.86 ms at 1
// thread for 29 MFLOP, where reading its 6.4 MB grad_output takes about a
// third of that. Here each output pixel loads its grad_output channels as
// vectors once and adds them, times each tap's input value (a broadcast),
// into one register accumulator per tap and vector: taps × vectors of 16
// channels, in groups that fit the registers (grad_output re-read from cache
// per group). The input is copied into a zero-padded plane per image first,
// so no tap needs a bounds test.
//
// Each pixel row's sums are float32 partials over its pixels in order, added
// into the image's double partials row by row (the bias's are double pixel
// by pixel: its one multiply-free sum is cheap); the images' partials are
// added in double, in image order, and rounded once (to float32, then to
// bfloat16 for a bfloat16 gradient). A float32 sum over a whole image drifted
// (a bias gradient of cnn's shape 8e-5 from the float64 sum, relative, where
// cancelling terms leave it small; Adam magnifies such errors, Note
// [Single-channel weight gradient] in dnnl_conv.cpp); flushing each row costs
// a few percent. Images are split across threads, so the bits do not depend
// on the thread count. The bias gradient is the same sum of grad_output
// alone, in the same pass.
//
// The pooled form is kiln::compile's rewrite of a max pool's backward
// followed by this weight gradient (docs/compile.md, "Rewrites"): the pool's
// backward writes a full-size gradient that is its output gradient at each
// window's maximum and zero elsewhere, and the weight gradient reads it back.
// The pooled form forms each pixel's vector from the pool's output gradient
// and workspace instead (the same masking, the same bits: the vector the
// pool's backward would have written), and adds it exactly as above.
//
// Note [Few-channel convolution]
// The forward of the same convolutions (one input channel, NHWC output,
// conv_forward_direct): per output pixel the bias, then each tap's 16-channel
// weight vectors times its input value (a broadcast), one FMA each in tap
// order, rounded to the dtype once at the store. A pixel's FMAs are one
// dependent chain per vector, so four pixels go side by side, and a 3x3
// window's weights stay in registers. cnn's first layer: 0.36 ms on oneDNN,
// 0.21 ms here, per step at 1 thread. The pooled form (kiln::compile's
// rewrite, conv2d_forward_pooled) computes the rows each band of a max pool's
// windows reads into a small scratch and pools them with the pool's own
// kernel, so the full-size output is never written.
#include "conv_direct.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "elementwise_math.h"
#include "kiln/core/capture_loop.h"
#include "kiln/core/error.h"
#include "kiln/core/half.h"
#include "kiln/core/parallel.h"
#include "pool_max_nhwc.h"

namespace kiln::kernels::detail {

namespace {

constexpr int64_t kMaxChannels = 4;  // input channels
constexpr int kMaxVectors = 4;       // 16-channel vectors of output channels
constexpr int64_t kMaxPlaneBytes = int64_t{16} << 20;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KILN_CONV_DIRECT 1

using Acc = float __attribute__((vector_size(64)));
#define KILN_ALWAYS_INLINE_DIRECT inline __attribute__((always_inline))

// Taps a group holds for NV vectors: NV accumulators per tap, 2 NV for the
// bias (in double), NV for the pixel's grad_output and one broadcast within
// 32 registers.
constexpr int taps_per_group(int nv) { return std::min(26, (31 - 3 * nv) / nv); }

// 16 channels from p as floats, lanes outside `m` zero.
template <typename T>
Acc load16(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return reinterpret_cast<Acc>(_mm512_maskz_loadu_ps(m, p));
  } else {
    return reinterpret_cast<Acc>(vm::bf16x16_to_float(_mm256_maskz_loadu_epi16(m, p)));
  }
}

// The pixel vectors of grad_output, read where they lie.
template <typename T>
struct PlainSource {
  const T* dy;
  int64_t oh, ow, o;
  // Two rows ahead of the one summed (grad_output comes from memory).
  void row(int64_t n, int64_t y) {
    if (y + 2 >= oh) return;
    const char* p = reinterpret_cast<const char*>(dy + ((n * oh + y + 2) * ow) * o);
    for (int64_t b = 0; b < ow * o * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
  template <int NV>
  void load(int64_t n, int64_t y, int64_t x, __mmask16 last, Acc* g) const {
    const T* p = dy + ((n * oh + y) * ow + x) * o;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) g[v] = load16(p + 16 * v, v == NV - 1 ? last : __mmask16(0xffff));
  }
};

// The pixel vectors a disjoint-window max pool's backward writes: the
// window's output gradient in the lanes whose maximum lay at this pixel, zero
// in the others and at pixels no window covers (pool_max_nhwc.cpp's
// backward_disjoint, lane for lane).
template <typename T>
struct PooledSource {
  const T* go;
  const uint8_t* ws;
  const Pool2dParams* pool;
  // Per pixel column: its window's column, or -1 where no window covers it,
  // and its offset in the window.
  const int64_t* col_px;
  const int64_t* col_j;
  // This row's window row and offset in it (py < 0: no window covers the row).
  int64_t py = -1, i = 0;
  void row(int64_t n, int64_t y) {
    const int64_t ty = y + pool->pad[0];
    py = ty / pool->stride[0];
    i = ty % pool->stride[0];
    if (i >= pool->kernel[0] || py >= pool->oh) py = -1;
    // The next window rows' gradient and workspace, while this one is summed:
    // read long after the forward wrote them, they come from memory.
    if (py >= 0 && i == 0) {
      for (int64_t ahead = 1; ahead <= 2 && py + ahead < pool->oh; ++ahead) {
        const int64_t at = ((n * pool->oh + py + ahead) * pool->ow) * pool->c;
        const char* g = reinterpret_cast<const char*>(go + at);
        const char* w = reinterpret_cast<const char*>(ws + at);
        const int64_t row_elems = pool->ow * pool->c;
        for (int64_t b = 0; b < row_elems * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(g + b, _MM_HINT_T0);
        for (int64_t b = 0; b < row_elems; b += 64) _mm_prefetch(w + b, _MM_HINT_T0);
      }
    }
  }
  template <int NV>
  void load(int64_t n, int64_t, int64_t x, __mmask16 last, Acc* g) const {
    const int64_t px = col_px[x];
    if (py < 0 || px < 0) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) g[v] = Acc{};
      return;
    }
    const int64_t at = ((n * pool->oh + py) * pool->ow + px) * pool->c;
    const __m512i pos = _mm512_set1_epi32(static_cast<int>(i * pool->kernel[1] + col_j[x]));
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : __mmask16(0xffff);
      const __m512i where = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, ws + at + 16 * v));
      const __mmask16 hit = _mm512_mask_cmpeq_epi32_mask(m, where, pos);
      g[v] = load16(go + at + 16 * v, hit);
    }
  }
};

// Adds the 16 floats of x to the 16 doubles at d.
KILN_ALWAYS_INLINE_DIRECT void add_to_doubles(double* d, Acc x) {
  const __m512 v = reinterpret_cast<__m512>(x);
  _mm512_storeu_pd(d, _mm512_add_pd(_mm512_loadu_pd(d), _mm512_cvtps_pd(_mm512_castps512_ps256(v))));
  _mm512_storeu_pd(d + 8, _mm512_add_pd(_mm512_loadu_pd(d + 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1))));
}

// One image's sums for taps [t0, t0 + TG) (and the bias's when kBias): each
// pixel row summed in float32 registers, pixels in order, then added into
// the image's double partials part (taps x 16 NV), which start at zero; the
// bias's pixel by pixel in double registers, into bias_part (16 NV).
template <int NV, int TG, bool kBias, typename Src>
void image_group(Src src, int64_t n, const float* plane, const int64_t* tap_off, int64_t oh, int64_t ow, int64_t s0,
                 int64_t s1, int64_t wp, __mmask16 last, double* part, double* bias_part) {
  int64_t off[TG];
  for (int t = 0; t < TG; ++t) off[t] = tap_off[t];
  for (int64_t y = 0; y < oh; ++y) {
    Acc acc[TG][NV] = {};
    __m512d bias[2 * NV];
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NV; ++v) bias[v] = _mm512_loadu_pd(bias_part + 8 * v);
    src.row(n, y);
    const float* row = plane + y * s0 * wp;
    for (int64_t x = 0; x < ow; ++x) {
      Acc g[NV];
      src.template load<NV>(n, y, x, last, g);
      const float* base = row + x * s1;
#pragma GCC unroll 26
      for (int t = 0; t < TG; ++t) {
        const Acc b = reinterpret_cast<Acc>(_mm512_set1_ps(base[off[t]]));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[t][v] = reinterpret_cast<Acc>(_mm512_fmadd_ps(reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(g[v]),
                                                            reinterpret_cast<__m512>(acc[t][v])));
      }
      if constexpr (kBias) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          const __m512 x = reinterpret_cast<__m512>(g[v]);
          bias[2 * v] = _mm512_add_pd(bias[2 * v], _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
          bias[2 * v + 1] = _mm512_add_pd(bias[2 * v + 1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)));
        }
      }
    }
    // By value: taking the accumulators' addresses would keep them on the stack in the loop.
#pragma GCC unroll 26
    for (int t = 0; t < TG; ++t)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) add_to_doubles(part + t * 16 * NV + 16 * v, acc[t][v]);
    if constexpr (kBias)
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NV; ++v) _mm512_storeu_pd(bias_part + 8 * v, bias[v]);
  }
}

template <typename Src>
using GroupFn = void (*)(Src, int64_t, const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                         __mmask16, double*, double*);

// image_group for every TG up to taps_per_group(NV), indexed [TG - 1].
template <typename Src, int NV, bool kBias>
struct GroupTable {
  template <int... I>
  static constexpr auto make(std::integer_sequence<int, I...>) {
    return std::array<GroupFn<Src>, sizeof...(I)>{&image_group<NV, I + 1, kBias, Src>...};
  }
  static constexpr auto kFns = make(std::make_integer_sequence<int, taps_per_group(NV)>{});
};

template <typename Src, int NV>
GroupFn<Src> group_fn(int tg, bool bias) {
  return bias ? GroupTable<Src, NV, true>::kFns[tg - 1] : GroupTable<Src, NV, false>::kFns[tg - 1];
}

template <typename Src>
GroupFn<Src> group_fn(int nv, int tg, bool bias) {
  switch (nv) {
    case 1: return group_fn<Src, 1>(tg, bias);
    case 2: return group_fn<Src, 2>(tg, bias);
    case 3: return group_fn<Src, 3>(tg, bias);
    default: return group_fn<Src, 4>(tg, bias);
  }
}

// The input plane of one image: channels one after another, each [hp, wp]
// with the padding's zeros around the image (and past it, where the last
// windows reach).
struct Plane {
  int64_t hp, wp;
};

Plane plane_of(const Conv2dParams& p) {
  return {std::max(p.h + p.pad_l[0], (p.oh - 1) * p.stride[0] + (p.kh - 1) * p.dilation[0] + 1),
          std::max(p.w + p.pad_l[1], (p.ow - 1) * p.stride[1] + (p.kw - 1) * p.dilation[1] + 1)};
}

// What both directions derive from p: the plane, the 16-channel vectors of
// output channels (the last masked by `last`), and each tap's offset in the
// plane from its window's origin, taps in weight order (c, kh, kw).
struct Layout {
  Plane pl;
  int nv;
  int64_t taps;
  std::vector<int64_t> tap_off;
  __mmask16 last;
};

Layout layout_of(const Conv2dParams& p) {
  Layout l{plane_of(p), static_cast<int>((p.o + 15) / 16), p.c * p.kh * p.kw, {}, 0};
  l.tap_off.resize(static_cast<size_t>(l.taps));
  for (int64_t ci = 0; ci < p.c; ++ci)
    for (int64_t i = 0; i < p.kh; ++i)
      for (int64_t j = 0; j < p.kw; ++j)
        l.tap_off[static_cast<size_t>((ci * p.kh + i) * p.kw + j)] =
            (ci * l.pl.hp + i * p.dilation[0]) * l.pl.wp + j * p.dilation[1];
  l.last = vm::first_lanes16(p.o - 16 * (l.nv - 1));
  return l;
}

template <typename T>
void fill_plane(const Conv2dParams& p, const Plane& pl, const T* x, int64_t n, float* plane) {
  std::fill(plane, plane + p.c * pl.hp * pl.wp, 0.0f);
  for (int64_t ci = 0; ci < p.c; ++ci)
    for (int64_t y = 0; y < p.h; ++y) {
      float* dst = plane + (ci * pl.hp + y + p.pad_l[0]) * pl.wp + p.pad_l[1];
      for (int64_t xx = 0; xx < p.w; ++xx) {
        const int64_t at = p.input_nhwc ? ((n * p.h + y) * p.w + xx) * p.c + ci : ((n * p.c + ci) * p.h + y) * p.w + xx;
        dst[xx] = static_cast<float>(x[at]);
      }
    }
}

// Every image's partials, then their double sums rounded into the gradients.
template <typename T, typename Src>
void run(const Conv2dParams& p, const T* x, Src src, T* grad_weight, T* grad_bias) {
  const Layout l = layout_of(p);
  const Plane pl = l.pl;
  const int nv = l.nv;
  const int64_t taps = l.taps, width = 16 * nv;
  const int max_tg = taps_per_group(nv);
  const int64_t groups = (taps + max_tg - 1) / max_tg;
  const bool bias = grad_bias != nullptr;
  // Kept between calls: 164 KiB at cnn's shape, which a fresh allocation would map and zero every step.
  // (A thread_local: the worker threads below reach it through this pointer, not by name.)
  thread_local std::vector<double> kept;
  kept.assign(static_cast<size_t>(p.n * (taps + 1) * width), 0.0);
  double* const parts = kept.data();
  parallel_for(p.n, 1, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> plane;
    plane.resize(static_cast<size_t>(p.c * pl.hp * pl.wp));
    for (int64_t n = n0; n < n1; ++n) {
      fill_plane(p, pl, x, n, plane.data());
      double* part = parts + n * (taps + 1) * width;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t t0 = g * taps / groups, t1 = (g + 1) * taps / groups;
        group_fn<Src>(nv, static_cast<int>(t1 - t0), bias && g == 0)(src, n, plane.data(), l.tap_off.data() + t0, p.oh,
                                                                     p.ow, p.stride[0], p.stride[1], pl.wp, l.last,
                                                                     part + t0 * width, part + taps * width);
      }
    }
  });
  for (int64_t o = 0; o < p.o; ++o) {
    for (int64_t t = 0; t <= taps; ++t) {
      if (t == taps && !bias) break;
      double sum = 0;
      for (int64_t n = 0; n < p.n; ++n) sum += parts[(n * (taps + 1) + t) * width + o];
      const T r = static_cast<T>(static_cast<float>(sum));
      if (t < taps) {
        grad_weight[o * taps + t] = r;
      } else {
        grad_bias[o] = r;
      }
    }
  }
}

// ---- forward (Note [Few-channel convolution]) ----

// Stores PX pixels' NV vectors (the last under `last`), rounded to T.
template <int NV, int PX, typename T>
KILN_ALWAYS_INLINE_DIRECT void store_pixels(const Acc (&acc)[PX][NV], int64_t o, __mmask16 last, T* out) {
#pragma GCC unroll 4
  for (int q = 0; q < PX; ++q)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : __mmask16(0xffff);
      T* dst = out + q * o + 16 * v;
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(dst, m, reinterpret_cast<__m512>(acc[q][v]));
      } else {
        _mm256_mask_storeu_epi16(dst, m, vm::float_to_bf16x16(reinterpret_cast<__m512>(acc[q][v])));
      }
    }
}

// Output row y of image n (ow pixels of o channels, at dst): per pixel the
// bias, then each tap's weight vectors times its input value, in tap order,
// one FMA each, rounded to T once at the store. W: taps x 16 NV floats. A
// pixel's FMAs form one dependent chain per vector, so PX pixels go side by
// side (each still in its own order).
template <int NV, int PX, typename T>
KILN_ALWAYS_INLINE_DIRECT void forward_pixels(const float* base, int64_t s1, const int64_t* tap_off, int64_t taps,
                                              const float* w, const Acc* b0, int64_t o, __mmask16 last, T* out) {
  Acc acc[PX][NV];
#pragma GCC unroll 4
  for (int q = 0; q < PX; ++q)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[q][v] = b0[v];
  for (int64_t t = 0; t < taps; ++t) {
    const int64_t off = tap_off[t];
#pragma GCC unroll 4
    for (int q = 0; q < PX; ++q) {
      const __m512 xv = _mm512_set1_ps(base[q * s1 + off]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[q][v] = reinterpret_cast<Acc>(
            _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + (t * NV + v) * 16), reinterpret_cast<__m512>(acc[q][v])));
    }
  }
  store_pixels<NV, PX>(acc, o, last, out);
}

// The same with TAPS known and the weights in registers (3x3 over one
// channel): TAPS x NV weight vectors, PX x NV accumulators and a broadcast.
template <int NV, int PX, int TAPS, typename T>
KILN_ALWAYS_INLINE_DIRECT void forward_pixels_w(const float* base, int64_t s1, const int64_t* off, const __m512* wr,
                                                const Acc* b0, int64_t o, __mmask16 last, T* out) {
  Acc acc[PX][NV];
#pragma GCC unroll 4
  for (int q = 0; q < PX; ++q)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[q][v] = b0[v];
#pragma GCC unroll 9
  for (int t = 0; t < TAPS; ++t) {
#pragma GCC unroll 4
    for (int q = 0; q < PX; ++q) {
      const __m512 xv = _mm512_set1_ps(base[q * s1 + off[t]]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[q][v] = reinterpret_cast<Acc>(_mm512_fmadd_ps(xv, wr[t * NV + v], reinterpret_cast<__m512>(acc[q][v])));
    }
  }
  store_pixels<NV, PX>(acc, o, last, out);
}

template <int NV, typename T>
void forward_row(const float* plane, const int64_t* tap_off, int64_t taps, const float* w, const float* bias, int64_t y,
                 int64_t ow, int64_t s0, int64_t s1, int64_t wp, int64_t o, __mmask16 last, T* dst) {
  constexpr int kPx = NV <= 2 ? 4 : 2;
  if constexpr (NV <= 2) {
    if (taps == 9) {
      const float* row = plane + y * s0 * wp;
      __m512 wr[9 * NV];
      int64_t off[9];
#pragma GCC unroll 18
      for (int i = 0; i < 9 * NV; ++i) wr[i] = _mm512_loadu_ps(w + 16 * i);
      for (int t = 0; t < 9; ++t) off[t] = tap_off[t];
      Acc b0[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b0[v] = reinterpret_cast<Acc>(_mm512_loadu_ps(bias + 16 * v));
      int64_t x = 0;
      for (; x + kPx <= ow; x += kPx) forward_pixels_w<NV, kPx, 9>(row + x * s1, s1, off, wr, b0, o, last, dst + x * o);
      for (; x < ow; ++x) forward_pixels_w<NV, 1, 9>(row + x * s1, s1, off, wr, b0, o, last, dst + x * o);
      return;
    }
  }
  const float* row = plane + y * s0 * wp;
  Acc b0[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) b0[v] = reinterpret_cast<Acc>(_mm512_loadu_ps(bias + 16 * v));
  int64_t x = 0;
  for (; x + kPx <= ow; x += kPx) forward_pixels<NV, kPx>(row + x * s1, s1, tap_off, taps, w, b0, o, last, dst + x * o);
  for (; x < ow; ++x) forward_pixels<NV, 1>(row + x * s1, s1, tap_off, taps, w, b0, o, last, dst + x * o);
}

template <typename T>
using RowFn = void (*)(const float*, const int64_t*, int64_t, const float*, const float*, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, __mmask16, T*);

template <typename T>
RowFn<T> row_fn(int nv) {
  switch (nv) {
    case 1: return &forward_row<1, T>;
    case 2: return &forward_row<2, T>;
    case 3: return &forward_row<3, T>;
    default: return &forward_row<4, T>;
  }
}

// The layout, the weights as taps x 16 NV floats (zeros past o) and the bias as 16 NV.
struct ForwardPlan {
  Layout l;
  std::vector<float> w, bias;
};

template <typename T>
ForwardPlan forward_plan(const Conv2dParams& p, const T* weight, const T* bias) {
  ForwardPlan f{layout_of(p), {}, {}};
  const int64_t width = 16 * f.l.nv;
  f.w.assign(static_cast<size_t>(f.l.taps * width), 0.0f);
  f.bias.assign(static_cast<size_t>(width), 0.0f);
  for (int64_t oc = 0; oc < p.o; ++oc) {
    for (int64_t t = 0; t < f.l.taps; ++t)
      f.w[static_cast<size_t>(t * width + oc)] = static_cast<float>(weight[oc * f.l.taps + t]);
    if (bias) f.bias[static_cast<size_t>(oc)] = static_cast<float>(bias[oc]);
  }
  return f;
}

template <typename T>
void forward_rows(const Conv2dParams& p, const ForwardPlan& f, const float* plane, int64_t y0, int64_t y1, T* dst) {
  const RowFn<T> fn = row_fn<T>(f.l.nv);
  for (int64_t y = y0; y < y1; ++y)
    fn(plane, f.l.tap_off.data(), f.l.taps, f.w.data(), f.bias.data(), y, p.ow, p.stride[0], p.stride[1], f.l.pl.wp,
       p.o, f.l.last, dst + (y - y0) * p.ow * p.o);
}

template <typename T>
void forward(const Conv2dParams& p, const T* input, const T* weight, const T* bias, T* output) {
  const ForwardPlan f = forward_plan(p, weight, bias);
  parallel_for(p.n, 1, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> plane;
    plane.resize(static_cast<size_t>(p.c * f.l.pl.hp * f.l.pl.wp));
    for (int64_t n = n0; n < n1; ++n) {
      fill_plane(p, f.l.pl, input, n, plane.data());
      forward_rows(p, f, plane.data(), 0, p.oh, output + n * p.oh * p.ow * p.o);
    }
  });
}

// The forward into a max pool with disjoint windows and no padding: per pool
// output row, the convolution rows its windows read into a small scratch,
// then the pool's own kernel on those rows (so every pooled value and
// workspace byte is the one the two kernels in turn give).
template <typename T>
void forward_pooled(const Conv2dParams& p, const Pool2dParams& q, const T* input, const T* weight, const T* bias,
                    T* pooled, uint8_t* ws, const float* relu) {
  const ForwardPlan f = forward_plan(p, weight, bias);
  const int64_t kh = q.kernel[0], sh = q.stride[0];
  parallel_for(p.n, 1, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> plane;
    thread_local std::vector<T> rows;
    plane.resize(static_cast<size_t>(p.c * f.l.pl.hp * f.l.pl.wp));
    rows.resize(static_cast<size_t>(kh * p.ow * p.o));
    Pool2dParams one = q;
    one.n = 1;
    one.h = kh;
    one.oh = 1;
    for (int64_t n = n0; n < n1; ++n) {
      fill_plane(p, f.l.pl, input, n, plane.data());
      for (int64_t py = 0; py < q.oh; ++py) {
        forward_rows(p, f, plane.data(), py * sh, py * sh + kh, rows.data());
        const int64_t at = (n * q.oh + py) * q.ow * q.c;
        max_pool_nhwc_forward(one, rows.data(), pooled + at, ws + at, relu);
      }
    }
  });
}

#endif

}  // namespace

bool conv_weight_direct_fits(const Conv2dParams& p) {
#ifdef KILN_CONV_DIRECT
  if ((p.dtype != DType::Float32 && p.dtype != DType::BFloat16) || p.groups != 1 || !p.output_nhwc) return false;
  if (p.n <= 0 || p.c <= 0 || p.c > kMaxChannels || p.o <= 0 || p.o > 16 * kMaxVectors || p.oh <= 0 || p.ow <= 0)
    return false;
  const Plane pl = plane_of(p);
  return p.c * pl.hp * pl.wp * static_cast<int64_t>(sizeof(float)) <= kMaxPlaneBytes;
#else
  (void)p;
  return false;
#endif
}

void conv_weight_direct(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                        void* grad_bias) {
  KILN_ASSERT(conv_weight_direct_fits(p), "conv_weight_direct: a convolution the direct sum does not take");
#ifdef KILN_CONV_DIRECT
  if (p.dtype == DType::Float32) {
    run(p, static_cast<const float*>(input),
        PlainSource<float>{static_cast<const float*>(grad_output), p.oh, p.ow, p.o}, static_cast<float*>(grad_weight),
        static_cast<float*>(grad_bias));
  } else {
    run(p, static_cast<const BFloat16*>(input),
        PlainSource<BFloat16>{static_cast<const BFloat16*>(grad_output), p.oh, p.ow, p.o},
        static_cast<BFloat16*>(grad_weight), static_cast<BFloat16*>(grad_bias));
  }
#else
  (void)grad_output, (void)input, (void)grad_weight, (void)grad_bias;
#endif
}

bool conv_forward_direct(const Conv2dParams& p) {
  // Note [Few-channel convolution]: one input channel into NHWC output, as the weight gradient.
  return conv_weight_direct_fits(p) && p.c == 1;
}

void conv_forward_direct_run(const Conv2dParams& p, const void* input, const void* weight, const void* bias,
                             void* output) {
  KILN_ASSERT(conv_forward_direct(p), "conv_forward_direct_run: a convolution the direct forward does not take");
#ifdef KILN_CONV_DIRECT
  if (p.dtype == DType::Float32) {
    forward(p, static_cast<const float*>(input), static_cast<const float*>(weight), static_cast<const float*>(bias),
            static_cast<float*>(output));
  } else {
    forward(p, static_cast<const BFloat16*>(input), static_cast<const BFloat16*>(weight),
            static_cast<const BFloat16*>(bias), static_cast<BFloat16*>(output));
  }
#else
  (void)input, (void)weight, (void)bias, (void)output;
#endif
}

void note_forward_operands(const Conv2dParams& p, const void* input, const void* weight, const void* bias,
                           void* output) {
  const int64_t es = element_size(p.dtype);
  capture::Operands o{
      "conv2d_forward_direct",
      4,
      {const_cast<void*>(input), const_cast<void*>(weight), const_cast<void*>(bias), output},
      {p.n * p.c * p.h * p.w * es, p.o * p.c * p.kh * p.kw * es, bias ? p.o * es : 0, p.n * p.oh * p.ow * p.o * es}};
  o.params = std::make_shared<const Conv2dParams>(p);
  o.join_next = &conv2d_forward_pooled_fusion;
  capture::note_operands(
      o, [p](const capture::Operands& t) { conv_forward_direct_run(p, t.ptr[0], t.ptr[1], t.ptr[2], t.ptr[3]); });
}

void note_weight_grad_operands(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                               void* grad_bias) {
  const int64_t es = element_size(p.dtype);
  capture::Operands o{"conv2d_backward_weight",
                      4,
                      {const_cast<void*>(grad_output), const_cast<void*>(input), grad_weight, grad_bias},
                      {p.n * p.oh * p.ow * p.o * es, p.n * p.c * p.h * p.w * es, p.o * p.c * p.kh * p.kw * es,
                       grad_bias ? p.o * es : 0}};
  o.params = std::make_shared<const Conv2dParams>(p);
  capture::note_operands(
      o, [p](const capture::Operands& t) { conv_weight_direct(p, t.ptr[0], t.ptr[1], t.ptr[2], t.ptr[3]); });
}

}  // namespace kiln::kernels::detail

namespace kiln::kernels {

namespace {

// The two kernels' parameters when `first` and `second` are the kernels named
// and `second` reads exactly `first`'s operand `written` as its operand `read`.
template <typename A, typename B>
std::optional<std::pair<const A*, const B*>> joinable(const capture::Operands& first, const char* first_what,
                                                      int written, const capture::Operands& second,
                                                      const char* second_what, int read) {
  if (!first.what || !second.what || std::strcmp(first.what, first_what) != 0 ||
      std::strcmp(second.what, second_what) != 0 || !first.params || !second.params ||
      second.ptr[read] != first.ptr[written] || second.bytes[read] != first.bytes[written])
    return std::nullopt;
  return std::make_pair(static_cast<const A*>(first.params.get()), static_cast<const B*>(second.params.get()));
}

// An Operands of the buffers picked, in order, from the two kernels'.
capture::Operands pick(const char* what, std::initializer_list<std::pair<const capture::Operands*, int>> from) {
  capture::Operands o;
  o.what = what;
  for (const auto& [ops, i] : from) {
    o.ptr[o.n] = ops->ptr[i];
    o.bytes[o.n] = ops->bytes[i];
    ++o.n;
  }
  return o;
}

}  // namespace

std::optional<std::pair<capture::Operands, capture::OperandsRun>> conv2d_backward_weight_pooled_fusion(
    const capture::Operands& pool_backward, const capture::Operands& weight_grad) {
  const auto params = joinable<Pool2dParams, Conv2dParams>(pool_backward, "max_pool_nhwc_backward", 2, weight_grad,
                                                           "conv2d_backward_weight", 0);
  if (!params || !conv2d_backward_weight_pooled_applies(*params->second, *params->first)) return std::nullopt;
  const Pool2dParams pool = *params->first;
  const Conv2dParams conv = *params->second;
  capture::Operands o =
      pick("conv2d_backward_weight_pooled",
           {{&pool_backward, 0}, {&pool_backward, 1}, {&weight_grad, 1}, {&weight_grad, 2}, {&weight_grad, 3}});
  o.params = weight_grad.params;
  capture::OperandsRun run = [conv, pool](const capture::Operands& t) {
    conv2d_backward_weight_pooled(conv, pool, t.ptr[0], static_cast<const uint8_t*>(t.ptr[1]), t.ptr[2], t.ptr[3],
                                  t.ptr[4]);
  };
  return std::make_pair(o, std::move(run));
}

bool conv2d_backward_weight_pooled_applies(const Conv2dParams& conv, const Pool2dParams& pool) {
  return conv2d_backward_weight_direct(conv) && detail::max_pool_nhwc_applies(pool) && pool.kind == PoolKind::Max &&
         pool.stride[0] >= pool.kernel[0] && pool.stride[1] >= pool.kernel[1] && pool.dtype == conv.dtype &&
         pool.n == conv.n && pool.c == conv.o && pool.h == conv.oh && pool.w == conv.ow;
}

void conv2d_backward_weight_pooled(const Conv2dParams& conv, const Pool2dParams& pool, const void* grad_pooled,
                                   const uint8_t* workspace, const void* input, void* grad_weight, void* grad_bias) {
  KILN_ASSERT(conv2d_backward_weight_pooled_applies(conv, pool),
              "conv2d_backward_weight_pooled: a convolution and pool the pooled form does not take");
#ifdef KILN_CONV_DIRECT
  std::vector<int64_t> px(static_cast<size_t>(pool.w)), j(static_cast<size_t>(pool.w));
  for (int64_t x = 0; x < pool.w; ++x) {
    const int64_t tx = x + pool.pad[1], c = tx / pool.stride[1], o = tx % pool.stride[1];
    px[static_cast<size_t>(x)] = o < pool.kernel[1] && c < pool.ow ? c : -1;
    j[static_cast<size_t>(x)] = o;
  }
  if (conv.dtype == DType::Float32) {
    detail::run(
        conv, static_cast<const float*>(input),
        detail::PooledSource<float>{static_cast<const float*>(grad_pooled), workspace, &pool, px.data(), j.data()},
        static_cast<float*>(grad_weight), static_cast<float*>(grad_bias));
  } else {
    detail::run(conv, static_cast<const BFloat16*>(input),
                detail::PooledSource<BFloat16>{static_cast<const BFloat16*>(grad_pooled), workspace, &pool, px.data(),
                                               j.data()},
                static_cast<BFloat16*>(grad_weight), static_cast<BFloat16*>(grad_bias));
  }
#else
  (void)grad_pooled, (void)workspace, (void)input, (void)grad_weight, (void)grad_bias;
#endif
}

bool conv2d_forward_pooled_applies(const Conv2dParams& conv, const Pool2dParams& pool) {
  return detail::conv_forward_direct(conv) && detail::max_pool_nhwc_relu_applies(pool) && pool.kind == PoolKind::Max &&
         pool.stride[0] >= pool.kernel[0] && pool.stride[1] >= pool.kernel[1] && pool.pad[0] == 0 && pool.pad[1] == 0 &&
         pool.dtype == conv.dtype && pool.n == conv.n && pool.c == conv.o && pool.h == conv.oh && pool.w == conv.ow &&
         (pool.oh - 1) * pool.stride[0] + pool.kernel[0] <= pool.h &&
         (pool.ow - 1) * pool.stride[1] + pool.kernel[1] <= pool.w;
}

void conv2d_forward_pooled(const Conv2dParams& conv, const Pool2dParams& pool, const void* input, const void* weight,
                           const void* bias, void* pooled, uint8_t* workspace, const float* relu_threshold) {
  KILN_ASSERT(conv2d_forward_pooled_applies(conv, pool),
              "conv2d_forward_pooled: a convolution and pool the pooled forward does not take");
#ifdef KILN_CONV_DIRECT
  if (conv.dtype == DType::Float32) {
    detail::forward_pooled(conv, pool, static_cast<const float*>(input), static_cast<const float*>(weight),
                           static_cast<const float*>(bias), static_cast<float*>(pooled), workspace, relu_threshold);
  } else {
    detail::forward_pooled(conv, pool, static_cast<const BFloat16*>(input), static_cast<const BFloat16*>(weight),
                           static_cast<const BFloat16*>(bias), static_cast<BFloat16*>(pooled), workspace,
                           relu_threshold);
  }
#else
  (void)input, (void)weight, (void)bias, (void)pooled, (void)workspace, (void)relu_threshold;
#endif
}

std::optional<std::pair<capture::Operands, capture::OperandsRun>> conv2d_forward_pooled_fusion(
    const capture::Operands& conv_forward, const capture::Operands& pool_forward) {
  const auto params = joinable<Conv2dParams, Pool2dParams>(conv_forward, "conv2d_forward_direct", 3, pool_forward,
                                                           "max_pool_nhwc_forward", 0);
  if (!params || !conv2d_forward_pooled_applies(*params->first, *params->second)) return std::nullopt;
  const Conv2dParams conv = *params->first;
  const Pool2dParams pool = *params->second;
  capture::Operands o =
      pick("conv2d_forward_pooled",
           {{&conv_forward, 0}, {&conv_forward, 1}, {&conv_forward, 2}, {&pool_forward, 1}, {&pool_forward, 2}});
  o.has_scalar = pool_forward.has_scalar;
  o.scalar = pool_forward.scalar;
  o.params = conv_forward.params;
  capture::OperandsRun run = [conv, pool](const capture::Operands& t) {
    const float relu = static_cast<float>(t.scalar);
    conv2d_forward_pooled(conv, pool, t.ptr[0], t.ptr[1], t.ptr[2], t.ptr[3], static_cast<uint8_t*>(t.ptr[4]),
                          t.has_scalar ? &relu : nullptr);
  };
  return std::make_pair(o, std::move(run));
}

}  // namespace kiln::kernels
