// Note [Channels-last max pooling]
// oneDNN's max pooling drops NaN where torch propagates it, so kiln scanned
// every channels-last max pool's input for NaN before handing it to oneDNN
// (and pooled NCHW when it found one): a second full read of the input. In
// cnn's step (1 thread) that scan and oneDNN's two pools and their backward
// took about 1.2 ms, against about 0.6 ms for the bytes they move at this
// machine's speed. Here one pass does both: each output pixel takes the
// window's channel vectors and keeps, per lane, the first maximum (a later
// equal value does not replace it) or a NaN, as torch's loop does, and writes
// the maximum's position in its window (a byte) for the backward.
//
// The backward routes each output gradient to that position. Where windows
// do not overlap (stride at least the window, as a 2x2 pool of stride 2)
// every input pixel is written once, with its window's gradient or zero, by
// masking bits (the same for float32 and bfloat16). Overlapping float32
// windows (resnet's 3x3 of stride 2) zero the image and add each window's
// gradient in output order, torch's order; bfloat16 ones stay on oneDNN.
//
// kiln::compile's ReLU-pooling rewrite runs a ReLU after the pool instead of
// before it (docs/compile.md, "Rewrites"): the forward then writes the ReLU
// of each maximum, and sets bit 7 of the position byte where the ReLU's
// backward would pass no gradient (maximum <= its threshold). No position
// equals such a byte, so both backward passes route nothing there: the
// gradient the ReLU's backward would have masked, with no pass of its own.
#include "pool_max_nhwc.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "intrinsics.h"
#include "kiln/core/half.h"
#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"

namespace kiln::kernels::detail {

namespace {

using F16 = float __attribute__((vector_size(64)));
using I16 = int32_t __attribute__((vector_size(64)));
using U32x16 = uint32_t __attribute__((vector_size(64)));
using U16x16 = uint16_t __attribute__((vector_size(32)));
using U8x16 = uint8_t __attribute__((vector_size(16)));

constexpr int64_t kLanes = 16;

// 16 workspace bytes widened to lanes of E (GCC 12 builds the generic
// conversion a byte at a time).
template <typename V>
V widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (sizeof(V) == 64) {
    return reinterpret_cast<V>(_mm512_cvtepu8_epi32(b));
  } else {
    return reinterpret_cast<V>(_mm256_cvtepu8_epi16(b));
  }
#else
  U8x16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, V);
#endif
}

// 16 lanes of an element's bits.
template <typename E>
struct Lanes;
template <>
struct Lanes<uint32_t> {
  using type = U32x16;
};
template <>
struct Lanes<uint16_t> {
  using type = U16x16;
};

template <typename T>
F16 load_lanes(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    F16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {
    U16x16 b;
    std::memcpy(&b, static_cast<const void*>(p), sizeof b);
    return reinterpret_cast<F16>(__builtin_convertvector(b, U32x16) << 16);  // exact
  }
}

template <typename T>
void store_lanes(T* p, F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    // Every lane holds a value read from bfloat16: its upper half is that value's bits.
    const U16x16 b = __builtin_convertvector(reinterpret_cast<U32x16>(v) >> 16, U16x16);
    std::memcpy(static_cast<void*>(p), &b, sizeof b);
  }
}

// The window of output (oy, ox) clipped to the input: rows [y0, y1), columns
// [x0, x1), and its top-left corner (ys, xs), which may lie in the padding.
struct Window {
  int64_t ys, xs, y0, y1, x0, x1;
};

Window window(const Pool2dParams& p, int64_t oy, int64_t ox) {
  Window wd;
  wd.ys = oy * p.stride[0] - p.pad[0];
  wd.xs = ox * p.stride[1] - p.pad[1];
  wd.y0 = std::max<int64_t>(wd.ys, 0);
  wd.y1 = std::min(wd.ys + p.kernel[0], p.h);
  wd.x0 = std::max<int64_t>(wd.xs, 0);
  wd.x1 = std::min(wd.xs + p.kernel[1], p.w);
  return wd;
}

// The first maximum (or a NaN) of channels [c, c + 16) over the window's
// positions, and its position. KH and KW > 0: a whole window of that size,
// unrolled; 0: the clipped window wd.
template <int KH, int KW, typename T>
inline void window_lanes(const Pool2dParams& p, const T* image, const Window& wd, int64_t c, int32_t first, F16& best,
                         I16& idx) {
  const int64_t C = p.c, kw = p.kernel[1];
  best = F16{} - std::numeric_limits<float>::infinity();
  idx = I16{} + first;
  auto visit = [&](int64_t y, int64_t x, int32_t pos) {
    const F16 v = load_lanes(image + (y * p.w + x) * C + c);
    const I16 take = (v > best) | (v != v);
    best = take ? v : best;
    idx = take ? I16{} + pos : idx;
  };
  if constexpr (KH == 2 && KW == 2) {
    // A tree (rows, then the two rows' winners): combine(a, b) with a first
    // keeps the last NaN, else the first maximum, as the sequential scan.
    // Shorter dependency chains than the scan: cnn's two pools forward 15.3
    // -> 10.9 ms over 40 steps at 1 thread (best of four interleaved runs).
    const T* p00 = image + (wd.ys * p.w + wd.xs) * C + c;
    const T* p10 = p00 + p.w * C;
    const F16 a = load_lanes(p00), b = load_lanes(p00 + C), d = load_lanes(p10), e = load_lanes(p10 + C);
    const I16 tb = (b > a) | (b != b), te = (e > d) | (e != e);
    const F16 top = tb ? b : a, bottom = te ? e : d;
    const I16 itop = tb ? I16{} + 1 : I16{}, ibottom = te ? I16{} + 3 : I16{} + 2;
    const I16 tl = (bottom > top) | (bottom != bottom);
    // The window's -inf start: a lane whose four values are all -inf keeps position 0, as the scan.
    best = tl ? bottom : top;
    idx = tl ? ibottom : itop;
  } else if constexpr (KH > 0) {
#pragma GCC unroll 4
    for (int i = 0; i < KH; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < KW; ++j) visit(wd.ys + i, wd.xs + j, i * KW + j);
  } else {
    for (int64_t y = wd.y0; y < wd.y1; ++y)
      for (int64_t x = wd.x0; x < wd.x1; ++x) visit(y, x, static_cast<int32_t>((y - wd.ys) * kw + (x - wd.xs)));
  }
}

// relu: null for the pool alone; else the ReLU's backward threshold, for
// kiln::compile's ReLU-pooling rewrite (pool_max_nhwc.h).
template <int KH, int KW, typename T>
void forward(const Pool2dParams& p, const T* in, T* out, uint8_t* ws, const float* relu) {
  const int64_t C = p.c, kw = p.kernel[1];
  const int64_t work = std::max<int64_t>(1, p.ow * C * p.kernel[0] * kw);
  parallel_for(p.n * p.oh, std::max<int64_t>(1, kGrainSize / work), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r / p.oh, oy = r % p.oh;
      const T* image = in + n * p.h * p.w * C;
      {
        // The rows this output row reads, asked for up front: read side by side (two or
        // three rows at once, a few KiB apart) they missed the hardware prefetcher here, and
        // the pool ran at half the speed of oneDNN's after the NaN scan had brought them in.
        const Window w0 = window(p, oy, 0);
        const char* a = reinterpret_cast<const char*>(image + w0.y0 * p.w * C);
        const char* e = reinterpret_cast<const char*>(image + w0.y1 * p.w * C);
        for (; a < e; a += 64) __builtin_prefetch(a);
      }
      for (int64_t ox = 0; ox < p.ow; ++ox) {
        const Window wd = window(p, oy, ox);
        const bool whole = KH > 0 && wd.y0 == wd.ys && wd.x0 == wd.xs && wd.y1 == wd.ys + KH && wd.x1 == wd.xs + KW;
        const int64_t at = (r * p.ow + ox) * C;
        const int32_t first = static_cast<int32_t>((wd.y0 - wd.ys) * kw + (wd.x0 - wd.xs));
        int64_t c = 0;
        for (; c + kLanes <= C; c += kLanes) {
          F16 best;
          I16 idx;
          if (whole) {
            window_lanes<KH, KW>(p, image, wd, c, first, best, idx);
          } else {
            window_lanes<0, 0>(p, image, wd, c, first, best, idx);
          }
          if (relu) {
            idx |= (best <= *relu) & 0x80;      // the ReLU's backward passes no gradient
            best = best < 0.0f ? F16{} : best;  // kiln's ReLU: keeps -0.0 and NaN
          }
          store_lanes(out + at + c, best);
          if (ws) {
            const U8x16 b = __builtin_convertvector(idx, U8x16);
            std::memcpy(ws + at + c, &b, sizeof b);
          }
        }
        for (; c < C; ++c) {
          float best = -std::numeric_limits<float>::infinity();
          int32_t pos = first;
          T best_t = static_cast<T>(best);
          for (int64_t y = wd.y0; y < wd.y1; ++y) {
            for (int64_t x = wd.x0; x < wd.x1; ++x) {
              const T vt = image[(y * p.w + x) * C + c];
              const float v = static_cast<float>(vt);
              if (v > best || v != v) {
                best = v;
                best_t = vt;
                pos = static_cast<int32_t>((y - wd.ys) * kw + (x - wd.xs));
              }
            }
          }
          if (relu) {
            if (best <= *relu) pos |= 0x80;
            if (best < 0.0f) best_t = static_cast<T>(0.0f);
          }
          out[at + c] = best_t;
          if (ws) ws[at + c] = static_cast<uint8_t>(pos);
        }
      }
    }
  });
}

// The window sizes with an unrolled kernel (windows clipped by the edges take the loop).
template <typename T>
void forward_any(const Pool2dParams& p, const T* in, T* out, uint8_t* ws, const float* relu) {
  if (p.kernel[0] == 2 && p.kernel[1] == 2) return forward<2, 2>(p, in, out, ws, relu);
  if (p.kernel[0] == 3 && p.kernel[1] == 3) return forward<3, 3>(p, in, out, ws, relu);
  forward<0, 0>(p, in, out, ws, relu);
}

// Windows that do not overlap: every input pixel is written once. E is the
// element's bits (uint32_t for float32, uint16_t for bfloat16).
template <typename E>
void backward_disjoint(const Pool2dParams& p, const E* go, const uint8_t* ws, E* gi) {
  using V = typename Lanes<E>::type;
  const int64_t C = p.c, sw = p.stride[1];
  parallel_for(p.n * p.h, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, p.w * C)),
               [&](int64_t r0, int64_t r1) {
                 for (int64_t r = r0; r < r1; ++r) {
                   const int64_t n = r / p.h, y = r % p.h;
                   const int64_t ty = y + p.pad[0], oy = ty / p.stride[0], i = ty % p.stride[0];
                   E* row = gi + r * p.w * C;
                   if (i >= p.kernel[0] || oy >= p.oh) {  // a row no window covers
                     std::fill(row, row + p.w * C, E(0));
                     continue;
                   }
                   // Column x lies at offset j of window ox (ox, j counted along the row, no division per pixel).
                   int64_t ox = p.pad[1] / sw, j = p.pad[1] % sw;
                   for (int64_t x = 0; x < p.w; ++x) {
                     E* g = row + x * C;
                     if (j >= p.kernel[1] || ox >= p.ow) {
                       std::fill(g, g + C, E(0));
                     } else {
                       const int64_t at = ((n * p.oh + oy) * p.ow + ox) * C;
                       const E* src = go + at;
                       const uint8_t* w = ws + at;
                       const E pos = static_cast<E>(i * p.kernel[1] + j);
                       int64_t c = 0;
                       for (; c + kLanes <= C; c += kLanes) {
                         V v;
                         std::memcpy(&v, src + c, sizeof v);
                         v &= reinterpret_cast<V>(widen_bytes<V>(w + c) == pos);
                         std::memcpy(g + c, &v, sizeof v);
                       }
                       for (; c < C; ++c) g[c] = w[c] == pos ? src[c] : E(0);
                     }
                     if (++j == sw) {
                       j = 0;
                       ++ox;
                     }
                   }
                 }
               });
}

// Overlapping float32 windows: per image, zeros, then each window's gradient
// added at its maximum in output order.
void backward_overlapping(const Pool2dParams& p, const float* go, const uint8_t* ws, float* gi) {
  const int64_t C = p.c, kw = p.kernel[1];
  parallel_for(p.n, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* image = gi + n * p.h * p.w * C;
      std::fill(image, image + p.h * p.w * C, 0.0f);
      for (int64_t oy = 0; oy < p.oh; ++oy) {
        for (int64_t ox = 0; ox < p.ow; ++ox) {
          const Window wd = window(p, oy, ox);
          const int64_t at = ((n * p.oh + oy) * p.ow + ox) * C;
          for (int64_t y = wd.y0; y < wd.y1; ++y) {
            for (int64_t x = wd.x0; x < wd.x1; ++x) {
              const int32_t pos = static_cast<int32_t>((y - wd.ys) * kw + (x - wd.xs));
              float* g = image + (y * p.w + x) * C;
              int64_t c = 0;
              for (; c + kLanes <= C; c += kLanes) {
                F16 v, a;
                std::memcpy(&v, go + at + c, sizeof v);
                std::memcpy(&a, g + c, sizeof a);
                const I16 hit = reinterpret_cast<I16>(widen_bytes<U32x16>(ws + at + c)) == pos;
                a = hit ? a + v : a;
                std::memcpy(g + c, &a, sizeof a);
              }
              for (; c < C; ++c)
                if (ws[at + c] == pos) g[c] += go[at + c];
            }
          }
        }
      }
    }
  });
}

bool disjoint(const Pool2dParams& p) { return p.stride[0] >= p.kernel[0] && p.stride[1] >= p.kernel[1]; }

}  // namespace

bool max_pool_nhwc_applies(const Pool2dParams& p) {
  if (!p.nhwc || p.kind != PoolKind::Max || (p.dtype != DType::Float32 && p.dtype != DType::BFloat16)) return false;
  if (p.dilation[0] != 1 || p.dilation[1] != 1 || p.kernel[0] * p.kernel[1] > 255) return false;
  return p.dtype == DType::Float32 || disjoint(p);
}

size_t max_pool_nhwc_workspace_bytes(const Pool2dParams& p) { return static_cast<size_t>(p.n * p.oh * p.ow * p.c); }

void max_pool_nhwc_forward(const Pool2dParams& p, const void* input, void* output, uint8_t* workspace,
                           const float* relu_threshold) {
  if (p.dtype == DType::Float32)
    return forward_any(p, static_cast<const float*>(input), static_cast<float*>(output), workspace, relu_threshold);
  forward_any(p, static_cast<const BFloat16*>(input), static_cast<BFloat16*>(output), workspace, relu_threshold);
}

bool max_pool_nhwc_relu_applies(const Pool2dParams& p) {
  return max_pool_nhwc_applies(p) && p.kernel[0] * p.kernel[1] <= 128;
}

void max_pool_nhwc_backward(const Pool2dParams& p, const void* grad_output, const uint8_t* workspace,
                            void* grad_input) {
  if (!disjoint(p))
    return backward_overlapping(p, static_cast<const float*>(grad_output), workspace, static_cast<float*>(grad_input));
  if (p.dtype == DType::Float32)
    return backward_disjoint(p, static_cast<const uint32_t*>(grad_output), workspace,
                             static_cast<uint32_t*>(grad_input));
  backward_disjoint(p, static_cast<const uint16_t*>(grad_output), workspace, static_cast<uint16_t*>(grad_input));
}

}  // namespace kiln::kernels::detail
