// Note [Direct single-channel weight gradient]
// A convolution over one input channel (a grayscale first layer: cnn's conv1,
// 1 -> 32 channels, 3x3 over 28x28) has a weight gradient of kh·kw·o sums
// over every output pixel, dW[o][t] = Σ dY[pixel][o] · x[pixel + tap t], and
// no input channels for oneDNN to vectorise over: its NHWC backward-weights
// kernel took 0.68 ms per call at 1 thread for 29 MFLOP (cnn's step, 1 thread,
// ONEDNN_VERBOSE), and the blocked one (Note [Single-channel weight gradient]
// in dnnl_conv.cpp) needs grad_output reordered first. Here each output pixel
// loads its row of grad_output (the o channels, contiguous in NHWC) once and
// multiplies it by the kh·kw input values under the window, broadcast, into
// kh·kw·o/16 vector accumulators held in registers for a whole image: the
// pass reads grad_output once, at close to the speed memory delivers it.
//
// Sums: each image's terms are summed in float32 in pixel order, the images'
// sums then in float64 in image order and rounded once; the bias gradient is
// summed in float64 throughout. Images are split across threads whole, so the
// bits do not depend on the thread count. The input is copied per image into
// a zero-bordered plane, so every window reads the same way at any padding,
// stride or dilation.
#include "conv_weight_direct.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kiln/core/parallel.h"

namespace kiln::kernels::detail {

namespace {

using F16 = float __attribute__((vector_size(64)));
using D8 = double __attribute__((vector_size(64)));

inline F16 load16(const float* p) {
  F16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, F16 v) { __builtin_memcpy(p, &v, sizeof v); }

// A broadcast that keeps the value's bits (F16{} + s would turn -0 into +0, and costs an add).
inline F16 splat(float s) { return F16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

// acc[0..1] += v's lanes 0-7 and 8-15 in float64 (GCC 12 builds the generic
// conversion from four 128-bit pieces).
inline void add_wide(D8* acc, F16 v) {
#if defined(__AVX512F__)
  const __m512 x = reinterpret_cast<__m512>(v);
  acc[0] += reinterpret_cast<D8>(_mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  acc[1] += reinterpret_cast<D8>(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
#else
  acc[0] += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), D8);
  acc[1] += __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), D8);
#endif
}

// The input of one image in a plane with zero borders, and each window
// tap's offset in it.
struct Plane {
  std::vector<float> data;
  int64_t wp = 0;
  int64_t tap[25] = {};
};

void fill_plane(const Conv2dParams& p, const float* x, Plane& pl) {
  const int64_t hp = p.h + p.pad_l[0] + p.pad_r[0];
  pl.wp = p.w + p.pad_l[1] + p.pad_r[1];
  pl.data.assign(static_cast<size_t>(hp * pl.wp), 0.0f);
  for (int64_t y = 0; y < p.h; ++y)
    std::copy(x + y * p.w, x + (y + 1) * p.w, pl.data.data() + (y + p.pad_l[0]) * pl.wp + p.pad_l[1]);
  for (int64_t i = 0; i < p.kh; ++i)
    for (int64_t j = 0; j < p.kw; ++j) pl.tap[i * p.kw + j] = i * p.dilation[0] * pl.wp + j * p.dilation[1];
}

// One image's sums for channels [cb, cb + 16 NV): w[t * o + c] for each of
// the T taps, and (Bias) b[c] in float64.
template <int T, int NV, bool Bias>
void image_sums(const Conv2dParams& p, const Plane& pl, const float* dy, int64_t cb, float* w, double* b) {
  F16 acc[T][NV] = {};
  D8 bacc[2 * NV] = {};
  const float* xp = pl.data.data();
  for (int64_t oy = 0; oy < p.oh; ++oy) {
    const float* xrow = xp + oy * p.stride[0] * pl.wp;
    const float* drow = dy + oy * p.ow * p.o + cb;
    for (int64_t ox = 0; ox < p.ow; ++ox) {
      F16 d[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) d[v] = load16(drow + ox * p.o + 16 * v);
      if constexpr (Bias) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) add_wide(bacc + 2 * v, d[v]);
      }
      const float* xq = xrow + ox * p.stride[1];
#pragma GCC unroll 25
      for (int t = 0; t < T; ++t) {
        const F16 xv = splat(xq[pl.tap[t]]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[t][v] += xv * d[v];
      }
    }
  }
#pragma GCC unroll 25
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store16(w + t * p.o + cb + 16 * v, acc[t][v]);
  if constexpr (Bias) {
    for (int v = 0; v < 2 * NV; ++v)
      for (int l = 0; l < 8; ++l) b[cb + 8 * v + l] = bacc[v][l];
  }
}

using ImageFn = void (*)(const Conv2dParams&, const Plane&, const float*, int64_t, float*, double*);

template <int T, int NV>
ImageFn pick_bias(bool bias) {
  return bias ? image_sums<T, NV, true> : image_sums<T, NV, false>;
}

// The kernel for p's window and channel count, or null. Registers bound the
// choice: T·NV float accumulators and 2·NV double ones, with room for the
// grad_output row and the broadcast input value, within AVX-512's 32.
ImageFn pick(const Conv2dParams& p, bool bias) {
  const int64_t taps = p.kh * p.kw;
  const bool two = p.o % 32 == 0;
  if (taps == 4) return two ? pick_bias<4, 2>(bias) : pick_bias<4, 1>(bias);
  if (taps == 9) return two ? pick_bias<9, 2>(bias) : pick_bias<9, 1>(bias);
  if (taps == 25) return pick_bias<25, 1>(bias);
  return nullptr;
}

}  // namespace

bool conv_weight_grad_direct_applies(const Conv2dParams& p) {
  if (conv_weight_grad_path() != ConvWeightGradPath::Auto) return false;
  if (p.dtype != DType::Float32 || p.c != 1 || p.groups != 1 || !p.output_nhwc) return false;
  if (p.n <= 0 || p.oh <= 0 || p.ow <= 0 || p.o <= 0 || p.o % 16 != 0) return false;
  const int64_t taps = p.kh * p.kw;
  return (taps == 4 && p.kh == 2) || (taps == 9 && p.kh == 3) || (taps == 25 && p.kh == 5);
}

void conv_weight_grad_direct(const Conv2dParams& p, const float* grad_output, const float* input, float* grad_weight,
                             float* grad_bias) {
  const ImageFn fn = pick(p, grad_bias != nullptr);
  const int64_t taps = p.kh * p.kw, per_image = taps * p.o, plane = p.oh * p.ow * p.o;
  const int64_t block = p.o % 32 == 0 && taps <= 9 ? 32 : 16;
  std::vector<float> wsum(static_cast<size_t>(p.n * per_image));
  std::vector<double> bsum(grad_bias ? static_cast<size_t>(p.n * p.o) : 0);
  parallel_for(p.n, 1, [&](int64_t i0, int64_t i1) {
    Plane pl;
    for (int64_t img = i0; img < i1; ++img) {
      fill_plane(p, input + img * p.h * p.w, pl);
      for (int64_t cb = 0; cb < p.o; cb += block)
        fn(p, pl, grad_output + img * plane, cb, wsum.data() + img * per_image,
           grad_bias ? bsum.data() + img * p.o : nullptr);
    }
  });
  // Images in order, in float64: the weight [o][1][kh][kw] from the sums' [tap][o].
  for (int64_t t = 0; t < taps; ++t)
    for (int64_t c = 0; c < p.o; ++c) {
      double s = 0;
      for (int64_t img = 0; img < p.n; ++img) s += wsum[static_cast<size_t>(img * per_image + t * p.o + c)];
      grad_weight[c * taps + t] = static_cast<float>(s);
    }
  if (!grad_bias) return;
  for (int64_t c = 0; c < p.o; ++c) {
    double s = 0;
    for (int64_t img = 0; img < p.n; ++img) s += bsum[static_cast<size_t>(img * p.o + c)];
    grad_bias[c] = static_cast<float>(s);
  }
}

}  // namespace kiln::kernels::detail
