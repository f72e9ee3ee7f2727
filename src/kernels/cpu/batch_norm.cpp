// BatchNorm training kernels (src/kernels/include/kiln/kernels/batch_norm.h).
//
// NCHW: a channel's values are n strips of `inner` contiguous elements;
// channels run on separate threads. Strip sums accumulate in vectors of the
// element type, folded into a double per strip, so long channels lose no
// accuracy.
//
// Channels-last (NHWC, s.channels_last): the values are n * inner rows of c
// contiguous channels. Rows are cut into fixed blocks of kRowBlock; each
// block sums all channels at once (a vector across channels, in the element
// type) and folds them into doubles, and the blocks' partial sums are added
// in block order, so the result does not depend on the thread count.
#include "kiln/kernels/batch_norm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "elementwise_math.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

namespace {

// Strip sums run on 64-byte vectors of T (GCC/Clang vector extensions: the
// plain lane-array loop was left scalar by the vectoriser), two vectors of
// accumulators per sum; each lane sums inner / (2 * kWidth) values in T, and
// the lanes fold into a double per strip.
template <typename T>
struct Lanes {
  typedef T V __attribute__((vector_size(64)));
  static constexpr int64_t kWidth = 64 / static_cast<int64_t>(sizeof(T));
  static V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
  }
  static double fold(V v) {
    double s = 0;
    for (int64_t j = 0; j < kWidth; ++j) s += static_cast<double>(v[j]);
    return s;
  }
};

// sum(f(p[i])) over a strip: f takes a vector of T (the lanes) or a double
// (the tail), e.g. the identity for a sum, (v - m)^2 for squared deviations.
template <typename T, typename F>
double strip_reduce(const T* p, int64_t n, F f) {
  using L = Lanes<T>;
  constexpr int64_t W = L::kWidth;
  int64_t i = 0;
  double s = 0;
  if (n >= W) {
    typename L::V a0 = {}, a1 = {};
    for (; i + 2 * W <= n; i += 2 * W) {
      a0 += f(L::load(p + i));
      a1 += f(L::load(p + i + W));
    }
    for (; i + W <= n; i += W) a0 += f(L::load(p + i));
    s = L::fold(a0 + a1);
  }
  for (; i < n; ++i) s += f(static_cast<double>(p[i]));
  return s;
}

template <typename T>
double strip_sum(const T* p, int64_t n) {
  return strip_reduce(p, n, [](auto v) { return v; });
}

template <typename T>
double strip_sqdev(const T* p, int64_t n, T m) {
  return strip_reduce(p, n, [m](auto v) {
    const auto d = v - m;
    return d * d;
  });
}

// sum(dy[i]) and sum(dy[i] * (x[i] - m)) over a strip, in one read.
template <typename T>
void strip_dy_sums(const T* dy, const T* x, int64_t n, T m, double& sdy, double& sdyx) {
  using L = Lanes<T>;
  constexpr int64_t W = L::kWidth;
  int64_t i = 0;
  if (n >= W) {
    typename L::V a = {}, b = {};
    for (; i + W <= n; i += W) {
      const typename L::V g = L::load(dy + i);
      a += g;
      b += g * (L::load(x + i) - m);
    }
    sdy += L::fold(a);
    sdyx += L::fold(b);
  }
  for (; i < n; ++i) {
    sdy += static_cast<double>(dy[i]);
    sdyx += static_cast<double>(dy[i]) * (static_cast<double>(x[i]) - static_cast<double>(m));
  }
}

// Channels per thread chunk: enough values that a chunk is worth a thread.
int64_t channel_grain(BatchNormShape s) {
  return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, s.n * s.inner));
}

template <typename T>
void forward_impl(BatchNormShape s, const T* x, const T* w, const T* b, double eps, T* y, T* mean, T* invstd, T* var) {
  const int64_t cs = s.c * s.inner;  // stride of dim 0
  const double count = static_cast<double>(s.n * s.inner);
  parallel_for(s.c, channel_grain(s), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const T* xc = x + c * s.inner;
      double sum = 0;
      for (int64_t i = 0; i < s.n; ++i) sum += strip_sum(xc + i * cs, s.inner);
      const double mu = sum / count;
      const T m = static_cast<T>(mu);
      double sq = 0;
      for (int64_t i = 0; i < s.n; ++i) sq += strip_sqdev(xc + i * cs, s.inner, m);
      const double v = sq / count;
      const double is = 1.0 / std::sqrt(v + eps);
      mean[c] = m;
      var[c] = static_cast<T>(v);
      invstd[c] = static_cast<T>(is);
      const T scale = static_cast<T>(w ? is * static_cast<double>(w[c]) : is);
      const T shift = b ? b[c] : T(0);
      T* yc = y + c * s.inner;
      for (int64_t i = 0; i < s.n; ++i) {
        const T* xi = xc + i * cs;
        T* yi = yc + i * cs;
        for (int64_t k = 0; k < s.inner; ++k) yi[k] = (xi[k] - m) * scale + shift;
      }
    }
  });
}

template <typename T>
void backward_impl(BatchNormShape s, const T* dy, const T* x, const T* mean, const T* invstd, const T* w, T* dx, T* dw,
                   T* db) {
  const int64_t cs = s.c * s.inner;
  const double count = static_cast<double>(s.n * s.inner);
  parallel_for(s.c, channel_grain(s), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const T* dyc = dy + c * s.inner;
      const T* xc = x + c * s.inner;
      const T m = mean[c];
      double sdy = 0, sdyx = 0;
      for (int64_t i = 0; i < s.n; ++i) strip_dy_sums(dyc + i * cs, xc + i * cs, s.inner, m, sdy, sdyx);
      const double is = static_cast<double>(invstd[c]);
      if (db) db[c] = static_cast<T>(sdy);
      if (dw) dw[c] = static_cast<T>(sdyx * is);
      if (!dx) continue;
      // dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * invstd:
      // dy * k1 + (x - mean) * k2 + k3.
      const double wc = w ? static_cast<double>(w[c]) : 1.0;
      const T k1 = static_cast<T>(wc * is);
      const T k2 = static_cast<T>(-wc * is * is * is * sdyx / count);
      const T k3 = static_cast<T>(-wc * is * sdy / count);
      T* dxc = dx + c * s.inner;
      for (int64_t i = 0; i < s.n; ++i) {
        const T* dyi = dyc + i * cs;
        const T* xi = xc + i * cs;
        T* dxi = dxc + i * cs;
        for (int64_t k = 0; k < s.inner; ++k) dxi[k] = dyi[k] * k1 + (xi[k] - m) * k2 + k3;
      }
    }
  });
}

// ---- channels-last ----

constexpr int64_t kRowBlock = 64;
constexpr int kLockstep = 4;  // Note [Blocks in lockstep]

// Sums over all rows, block by block: block_sum(r0, r1, acc) adds rows
// [r0, r1) into `acc` (`width` zeroed elements of T: one or more sums per
// channel); the blocks fold into `out` (`width` doubles) in block order.
// With `lockstep`, group_sum(r0, acc) does what block_sum does for
// kLockstep whole blocks from row r0, block i's sums at acc + i * width
// (Note [Blocks in lockstep]).
template <typename T, typename BlockSum, typename GroupSum>
void cl_block_sums(int64_t rows, int64_t width, double* out, bool lockstep, BlockSum&& block_sum,
                   GroupSum&& group_sum) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  std::vector<double> partial(static_cast<size_t>(blocks * width));
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, kRowBlock * width));
  parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<T> acc(static_cast<size_t>(kLockstep * width));
    for (int64_t b = b0; b < b1;) {
      const int64_t r0 = b * kRowBlock;
      const int group = lockstep && b + kLockstep <= b1 && r0 + kLockstep * kRowBlock <= rows ? kLockstep : 1;
      std::fill(acc.begin(), acc.end(), T(0));
      if (group == kLockstep) {
        group_sum(r0, acc.data());
      } else {
        block_sum(r0, std::min(rows, r0 + kRowBlock), acc.data());
      }
      for (int i = 0; i < group; ++i) {
        double* pb = partial.data() + (b + i) * width;
        for (int64_t k = 0; k < width; ++k) pb[k] = static_cast<double>(acc[i * width + k]);
      }
      b += group;
    }
  });
  std::fill(out, out + width, 0.0);
  for (int64_t b = 0; b < blocks; ++b) {
    const double* pb = partial.data() + b * width;
    for (int64_t k = 0; k < width; ++k) out[k] += pb[k];
  }
}

// f(r0, r1) over blocks of kRowBlock rows, split over threads: the
// elementwise passes walk a block channel vector by channel vector, keeping
// that vector's per-channel constants in registers.
template <typename F>
void cl_row_blocks(int64_t rows, int64_t c, F&& f) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, kRowBlock * c));
  parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b * kRowBlock, std::min(rows, (b + 1) * kRowBlock));
  });
}

// Per channel chunk of one vector (c a multiple of the vector width) or per
// channel: each helper below has both forms, the vector one keeping its
// accumulators in registers.
template <typename T>
void store(T* p, typename Lanes<T>::V v) {
  std::memcpy(p, &v, sizeof(v));
}

// Activation access. x, y, dy, dx and the residual are arrays of A; the
// per-channel constants and all arithmetic are T. A == T for float32/float64;
// bf16 activations (A = BFloat16, T = float) widen 16 lanes on load and round
// to nearest even on store, a NaN to the quiet 0x7fc0 as BFloat16 does, so a
// vector lane and the scalar tail round alike.
template <typename A, typename T>
struct Act {
  using V = typename Lanes<T>::V;
  static V load(const A* p) { return Lanes<T>::load(p); }
  static void put(A* p, V v) { store(p, v); }
  static T get(A v) { return v; }
};

// With AVX-512 both directions are the elementwise kernels' (vm::): one
// widening move on load, and VCVTNEPS2BF16 on store where it rounds as
// BFloat16 does (no NaN or subnormal lane); the same bits. The vector-extension
// form, kept for CPUs without AVX-512, was compiled by GCC 12 into two 8-lane
// widenings per load and a word permute per store, and bf16 batch norm ran
// slower than float32 over twice the bytes: resnet's [32, 16, 32, 32] forward
// 176 us against 108, forward + backward 375 against 263; now 115 and 254
// (`BM_NormBatchNorm2dChannelsLast/channels:16`, 1 thread, AMD EPYC family 25).
template <>
struct Act<BFloat16, float> {
  using V = Lanes<float>::V;
#if defined(__AVX512F__)
  static V load(const BFloat16* p) {
    return reinterpret_cast<V>(vm::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void put(BFloat16* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vm::float_to_bf16x16(reinterpret_cast<__m512>(v)));
  }
#else
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
  static V load(const BFloat16* p) {
    H h;
    std::memcpy(&h, p, sizeof(H));
    const U u = __builtin_convertvector(h, U) << 16;
    V v;
    std::memcpy(&v, &u, sizeof(V));
    return v;
  }
  static void put(BFloat16* p, V v) {
    U u;
    std::memcpy(&u, &v, sizeof(U));
    const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const U r = (u & 0x7fffffffu) > 0x7f800000u ? U{} + 0x7fc0u : rounded;
    const H h = __builtin_convertvector(r, H);
    std::memcpy(static_cast<void*>(p), &h, sizeof(H));
  }
#endif
  static float get(BFloat16 v) { return v; }
};

// acc[k] += sum over rows of x[r, k].
template <typename A, typename T>
void cl_sum(const A* x, int64_t c, int64_t r0, int64_t r1, T* acc) {
  using X = Act<A, T>;
  constexpr int64_t W = Lanes<T>::kWidth;
  if (c % W == 0) {
    for (int64_t j = 0; j < c; j += W) {
      typename X::V a0 = {}, a1 = {};
      int64_t r = r0;
      for (; r + 1 < r1; r += 2) {
        a0 += X::load(x + r * c + j);
        a1 += X::load(x + (r + 1) * c + j);
      }
      if (r < r1) a0 += X::load(x + r * c + j);
      store(acc + j, a0 + a1);
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < c; ++k) acc[k] += X::get(x[r * c + k]);
  }
}

// The fused ReLU's mask: y = (x - m) * scale + shift before the ReLU, written
// once here and used by the forward and by the backward's recomputation, so
// both round alike and the backward's mask is exactly the forward's y > 0.
template <typename V>
inline V pre_relu(V x, V m, V scale, V shift) {
  return (x - m) * scale + shift;
}

// A channel vector's mean and, with Relu, the scale and shift that recompute
// the fused ReLU's input.
template <typename T, bool Relu>
struct ChannelVector {
  typename Lanes<T>::V m{}, scale{}, shift{};
  ChannelVector(const T* mp, const T* sp, const T* hp, int64_t j) : m(Lanes<T>::load(mp + j)) {
    if constexpr (Relu) {
      scale = Lanes<T>::load(sp + j);
      shift = Lanes<T>::load(hp + j);
    }
  }
};

// The vector forms' gradient at element `at` (xv gets x there): dy, or with
// Relu dy where pre_relu(x) (+ res, when not null) > 0, else 0.
template <typename A, typename T, bool Relu>
inline typename Lanes<T>::V masked_dy(const A* dy, const A* x, const A* res, int64_t at, typename Lanes<T>::V mv,
                                      typename Lanes<T>::V sc, typename Lanes<T>::V sh, typename Lanes<T>::V& xv) {
  using X = Act<A, T>;
  xv = X::load(x + at);
  typename Lanes<T>::V g = X::load(dy + at);
  if constexpr (Relu) {
    typename Lanes<T>::V pre = pre_relu(xv, mv, sc, sh);
    if (res) pre += X::load(res + at);
    g = pre > 0 ? g : typename Lanes<T>::V{};
  }
  return g;
}

// acc[k] += sum g[r, k], acc[c + k] += sum g[r, k] * (x[r, k] - m[k]), where g is
// dy, or with `relu` (scale and shift given) dy where pre_relu(x) (+ res, the
// residual added before the ReLU, when not null) > 0, else 0.
template <typename A, typename T, bool Relu>
void cl_dy_sums(const A* dy, const A* x, const T* m, const T* scale, const T* shift, const A* res, int64_t c,
                int64_t r0, int64_t r1, T* acc) {
  using L = Lanes<T>;
  using X = Act<A, T>;
  using V = typename L::V;
  constexpr int64_t W = L::kWidth;
  if (c % W == 0) {
    for (int64_t j = 0; j < c; j += W) {
      const ChannelVector<T, Relu> cv(m, scale, shift, j);
      V a = {}, b = {};
      for (int64_t r = r0; r < r1; ++r) {
        V xv;
        const V g = masked_dy<A, T, Relu>(dy, x, res, r * c + j, cv.m, cv.scale, cv.shift, xv);
        a += g;
        b += g * (xv - cv.m);
      }
      store(acc + j, a);
      store(acc + c + j, b);
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < c; ++k) {
      const T xv = X::get(x[r * c + k]);
      T g = X::get(dy[r * c + k]);
      if constexpr (Relu) {
        T pre = pre_relu(xv, m[k], scale[k], shift[k]);
        if (res) pre += X::get(res[r * c + k]);
        g = pre > 0 ? g : T(0);
      }
      acc[k] += g;
      acc[c + k] += g * (xv - m[k]);
    }
  }
}

// cl_dy_sums of kLockstep whole blocks from row r0 (c a multiple of the
// vector width): block i's sums at acc + i * 2 * c.
template <typename A, typename T, bool Relu>
void cl_dy_sums_lockstep(const A* dy, const A* x, const T* m, const T* scale, const T* shift, const A* res, int64_t c,
                         int64_t r0, T* acc) {
  using L = Lanes<T>;
  using V = typename L::V;
  constexpr int64_t W = L::kWidth;
  constexpr int64_t B = kRowBlock;
  for (int64_t j = 0; j < c; j += W) {
    const ChannelVector<T, Relu> cv(m, scale, shift, j);
    V a[kLockstep] = {}, b[kLockstep] = {};
    for (int64_t r = 0; r < B; ++r) {
      for (int i = 0; i < kLockstep; ++i) {
        V xv;
        const V g = masked_dy<A, T, Relu>(dy, x, res, (r0 + i * B + r) * c + j, cv.m, cv.scale, cv.shift, xv);
        a[i] += g;
        b[i] += g * (xv - cv.m);
      }
    }
    for (int i = 0; i < kLockstep; ++i) {
      store(acc + i * 2 * c + j, a[i]);
      store(acc + i * 2 * c + c + j, b[i]);
    }
  }
}

// Rows [r0, r1): out = pre_relu(x), or with Relu relu(pre_relu(x) + res) (res may be null).
template <typename A, typename T, bool Relu>
void cl_affine(const A* x, const T* m, const T* scale, const T* shift, const A* res, int64_t c, int64_t r0, int64_t r1,
               A* out) {
  using L = Lanes<T>;
  using X = Act<A, T>;
  using V = typename L::V;
  constexpr int64_t W = L::kWidth;
  if (c % W == 0) {
    for (int64_t k = 0; k < c; k += W) {
      const V mv = L::load(m + k), sv = L::load(scale + k), hv = L::load(shift + k);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r * c + k;
        V y = pre_relu(X::load(x + i), mv, sv, hv);
        if constexpr (Relu) {
          if (res) y += X::load(res + i);
          y = y > 0 ? y : V{};
        }
        X::put(out + i, y);
      }
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < c; ++k) {
      const int64_t i = r * c + k;
      T y = pre_relu(X::get(x[i]), m[k], scale[k], shift[k]);
      if constexpr (Relu) {
        if (res) y += X::get(res[i]);
        y = y > 0 ? y : T(0);
      }
      out[i] = static_cast<A>(y);
    }
  }
}

// dx[k] = g[k] * k1[k] + (x[k] - m[k]) * k2[k] + k3[k] and dres[k] = g[k], g
// masked as in cl_dy_sums; dx and dres may each be null (not wanted).
template <typename A, typename T, bool Relu>
void cl_dx(const A* dy, const A* x, const T* m, const T* scale, const T* shift, const A* res, const T* k1, const T* k2,
           const T* k3, int64_t c, int64_t r0, int64_t r1, A* out, A* dres) {
  using L = Lanes<T>;
  using X = Act<A, T>;
  using V = typename L::V;
  constexpr int64_t W = L::kWidth;
  if (c % W == 0) {
    for (int64_t k = 0; k < c; k += W) {
      const V mv = L::load(m + k), k1v = L::load(k1 + k), k2v = L::load(k2 + k), k3v = L::load(k3 + k);
      V sv = {}, hv = {};
      if constexpr (Relu) {
        sv = L::load(scale + k);
        hv = L::load(shift + k);
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r * c + k;
        V xv;
        const V g = masked_dy<A, T, Relu>(dy, x, res, i, mv, sv, hv, xv);
        if (dres) X::put(dres + i, g);
        if (out) X::put(out + i, g * k1v + (xv - mv) * k2v + k3v);
      }
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < c; ++k) {
      const int64_t i = r * c + k;
      const T xv = X::get(x[i]);
      T g = X::get(dy[i]);
      if constexpr (Relu) {
        T pre = pre_relu(xv, m[k], scale[k], shift[k]);
        if (res) pre += X::get(res[i]);
        g = pre > 0 ? g : T(0);
      }
      if (dres) dres[i] = static_cast<A>(g);
      if (out) out[i] = static_cast<A>(g * k1[k] + (xv - m[k]) * k2[k] + k3[k]);
    }
  }
}

// The forward's scale, from the stored (rounded) invstd so that the backward
// recomputes it exactly: invstd * weight in double, rounded once.
template <typename T>
T bn_scale(T invstd, const T* w, int64_t k) {
  return static_cast<T>(w ? static_cast<double>(invstd) * static_cast<double>(w[k]) : static_cast<double>(invstd));
}

// acc[k] += sum (x[r, k] - m[k]), acc[c + k] += sum (x[r, k] - m[k])^2.
template <typename A, typename T>
void cl_dev_moments(const A* x, const T* m, int64_t c, int64_t r0, int64_t r1, T* acc) {
  using X = Act<A, T>;
  constexpr int64_t W = Lanes<T>::kWidth;
  if (c % W == 0) {
    for (int64_t j = 0; j < c; j += W) {
      const typename X::V mv = Lanes<T>::load(m + j);
      typename X::V d1 = {}, d2 = {};
      for (int64_t r = r0; r < r1; ++r) {
        const typename X::V d = X::load(x + r * c + j) - mv;
        d1 += d;
        d2 += d * d;
      }
      store(acc + j, d1);
      store(acc + c + j, d2);
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < c; ++k) {
      const T d = X::get(x[r * c + k]) - m[k];
      acc[k] += d;
      acc[c + k] += d * d;
    }
  }
}

// Note [Blocks in lockstep]
// A block's sums run down its rows in a chain of dependent vector adds, so
// with few channels (16 float32: one vector per row) a block waits on the
// add's latency, not on memory. kLockstep whole blocks advance together, each
// with its own accumulators fed its rows in the same order as alone: the
// chains overlap and every sum keeps its bits (resnet's losses after 45
// steps are unchanged to the last digit). Measured on resnet's [32, 16, 32, 32]
// channels-last batch norm, float32, 1 thread (kiln_micro_bench
// --benchmark_filter=BatchNorm2dChannelsLast): forward 157-168 us one block
// at a time, 109-130 us in lockstep; forward + backward 284-315 us before,
// 260-313 us after: the backward's passes were already at the speed of the
// cache they read from, and its sums alone gained (about 30 us).

// cl_sum of kLockstep whole blocks, the first at row r0: block i's sums go to acc + i * stride.
template <typename A, typename T>
void cl_sum_lockstep(const A* x, int64_t c, int64_t r0, T* acc, int64_t stride) {
  using X = Act<A, T>;
  constexpr int64_t W = Lanes<T>::kWidth;
  constexpr int64_t B = kRowBlock;
  for (int64_t j = 0; j < c; j += W) {
    typename X::V a0[kLockstep] = {}, a1[kLockstep] = {};
    for (int64_t r = 0; r < B; r += 2) {
      for (int i = 0; i < kLockstep; ++i) {
        const A* p = x + (r0 + i * B + r) * c + j;
        a0[i] += X::load(p);
        a1[i] += X::load(p + c);
      }
    }
    for (int i = 0; i < kLockstep; ++i) store(acc + i * stride + j, a0[i] + a1[i]);
  }
}

// cl_dev_moments of kLockstep whole blocks from row r0, block i about m + i * stride.
template <typename A, typename T>
void cl_dev_moments_lockstep(const A* x, const T* m, int64_t c, int64_t r0, T* acc, int64_t stride) {
  using X = Act<A, T>;
  constexpr int64_t W = Lanes<T>::kWidth;
  constexpr int64_t B = kRowBlock;
  for (int64_t j = 0; j < c; j += W) {
    typename X::V mv[kLockstep], d1[kLockstep] = {}, d2[kLockstep] = {};
    for (int i = 0; i < kLockstep; ++i) mv[i] = Lanes<T>::load(m + i * stride + j);
    for (int64_t r = 0; r < B; ++r) {
      for (int i = 0; i < kLockstep; ++i) {
        const typename X::V d = X::load(x + (r0 + i * B + r) * c + j) - mv[i];
        d1[i] += d;
        d2[i] += d * d;
      }
    }
    for (int i = 0; i < kLockstep; ++i) {
      store(acc + i * stride + j, d1[i]);
      store(acc + i * stride + c + j, d2[i]);
    }
  }
}

// Per-channel mean and sum of squared deviations (M2) over all rows in one
// pass over memory: each block of kRowBlock rows is summed for a provisional
// centre m_b (its mean, rounded to T), then (in L1 by now) its deviations
// from m_b give D_b = sum (x - m_b) and Q_b = sum (x - m_b)^2, small numbers
// that float arithmetic keeps accurate however large the mean. The blocks
// combine in double, in block order: mu = sum_b (n_b m_b + D_b) / n and
//   M2 = sum_b [Q_b + 2 (m_b - mu) D_b + n_b (m_b - mu)^2],
// the exact expansion of sum (x - mu)^2 over block b. Two global passes (the
// NCHW kernel's) would read x twice.
template <typename A, typename T>
void cl_moments(const A* x, int64_t rows, int64_t c, double* mu, double* m2) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  std::vector<double> part(static_cast<size_t>(blocks * 3 * c));  // per block: m_b, D_b, Q_b
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, kRowBlock * c));
  const bool vectors = c % Lanes<T>::kWidth == 0;
  parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) {
    // kLockstep blocks' sums and their provisional centres, 2 * c apart (a centre uses the first c).
    std::vector<T> acc(static_cast<size_t>(kLockstep * 2 * c)), bm(static_cast<size_t>(kLockstep * 2 * c));
    for (int64_t b = b0; b < b1;) {
      const int64_t r0 = b * kRowBlock;
      // Whole blocks only: the last block may be short.
      const int group = vectors && b + kLockstep <= b1 && r0 + kLockstep * kRowBlock <= rows ? kLockstep : 1;
      std::fill(acc.begin(), acc.end(), T(0));
      if (group == kLockstep) {
        cl_sum_lockstep<A, T>(x, c, r0, acc.data(), 2 * c);
      } else {
        cl_sum<A, T>(x, c, r0, std::min(rows, r0 + kRowBlock), acc.data());
      }
      for (int i = 0; i < group; ++i) {
        const int64_t ri = r0 + i * kRowBlock;
        const double nb = static_cast<double>(std::min(rows, ri + kRowBlock) - ri);
        for (int64_t k = 0; k < c; ++k)
          bm[i * 2 * c + k] = static_cast<T>(static_cast<double>(acc[i * 2 * c + k]) / nb);
      }
      std::fill(acc.begin(), acc.end(), T(0));
      if (group == kLockstep) {
        cl_dev_moments_lockstep<A, T>(x, bm.data(), c, r0, acc.data(), 2 * c);
      } else {
        cl_dev_moments<A, T>(x, bm.data(), c, r0, std::min(rows, r0 + kRowBlock), acc.data());
      }
      for (int i = 0; i < group; ++i) {
        double* pb = part.data() + (b + i) * 3 * c;
        for (int64_t k = 0; k < c; ++k) {
          pb[k] = static_cast<double>(bm[i * 2 * c + k]);
          pb[c + k] = static_cast<double>(acc[i * 2 * c + k]);
          pb[2 * c + k] = static_cast<double>(acc[i * 2 * c + c + k]);
        }
      }
      b += group;
    }
  });
  // Each channel's sums fold in block order, as before; the channels side by
  // side (k innermost) so that the independent folds share each step.
  const double n = static_cast<double>(rows);
  std::vector<double> sum(static_cast<size_t>(c), 0.0), q(static_cast<size_t>(c), 0.0);
  for (int64_t b = 0; b < blocks; ++b) {
    const double* pb = part.data() + b * 3 * c;
    const double nb = static_cast<double>(std::min(rows, (b + 1) * kRowBlock) - b * kRowBlock);
    for (int64_t k = 0; k < c; ++k) sum[k] += nb * pb[k] + pb[c + k];
  }
  for (int64_t k = 0; k < c; ++k) mu[k] = sum[k] / n;
  for (int64_t b = 0; b < blocks; ++b) {
    const double* pb = part.data() + b * 3 * c;
    const double nb = static_cast<double>(std::min(rows, (b + 1) * kRowBlock) - b * kRowBlock);
    for (int64_t k = 0; k < c; ++k) {
      const double d = pb[k] - mu[k];
      q[k] += pb[2 * c + k] + 2 * d * pb[c + k] + nb * d * d;
    }
  }
  for (int64_t k = 0; k < c; ++k) m2[k] = std::max(q[k], 0.0);
}

template <typename A, typename T>
void forward_cl(BatchNormShape s, const A* x, const T* w, const T* b, const A* res, double eps, A* y, T* mean,
                T* invstd, T* var) {
  const int64_t rows = s.n * s.inner, c = s.c;
  const double count = static_cast<double>(rows);
  std::vector<double> mu(static_cast<size_t>(c)), sq(static_cast<size_t>(c));
  cl_moments<A, T>(x, rows, c, mu.data(), sq.data());
  std::vector<T> m(static_cast<size_t>(c)), scale(static_cast<size_t>(c)), shift(static_cast<size_t>(c));
  for (int64_t k = 0; k < c; ++k) m[k] = static_cast<T>(mu[k]);
  for (int64_t k = 0; k < c; ++k) {
    const double v = sq[k] / count;
    mean[k] = m[k];
    var[k] = static_cast<T>(v);
    invstd[k] = static_cast<T>(1.0 / std::sqrt(v + eps));
    scale[k] = bn_scale(invstd[k], w, k);
    shift[k] = b ? b[k] : T(0);
  }
  const T *mp = m.data(), *sp = scale.data(), *hp = shift.data();
  if (s.relu) {
    cl_row_blocks(rows, c, [&](int64_t r0, int64_t r1) { cl_affine<A, T, true>(x, mp, sp, hp, res, c, r0, r1, y); });
  } else {
    cl_row_blocks(rows, c,
                  [&](int64_t r0, int64_t r1) { cl_affine<A, T, false>(x, mp, sp, hp, nullptr, c, r0, r1, y); });
  }
}

template <typename A, typename T, bool Relu>
void backward_cl_impl(BatchNormShape s, const A* dy, const A* x, const T* mean, const T* invstd, const T* w, const T* b,
                      const A* res, A* dx, T* dw, T* db, A* dres) {
  const int64_t rows = s.n * s.inner, c = s.c;
  const double count = static_cast<double>(rows);
  std::vector<T> scale(static_cast<size_t>(c)), shift(static_cast<size_t>(c));
  for (int64_t k = 0; k < c; ++k) {
    scale[k] = bn_scale(invstd[k], w, k);
    shift[k] = b ? b[k] : T(0);
  }
  const T *sp = scale.data(), *hp = shift.data();
  // sums[k] = sum(g), sums[c + k] = sum(g * (x - mean)): one read of dy and x.
  std::vector<double> sums(static_cast<size_t>(2 * c));
  cl_block_sums<T>(
      rows, 2 * c, sums.data(), c % Lanes<T>::kWidth == 0,
      [&](int64_t r0, int64_t r1, T* acc) { cl_dy_sums<A, T, Relu>(dy, x, mean, sp, hp, res, c, r0, r1, acc); },
      [&](int64_t r0, T* acc) { cl_dy_sums_lockstep<A, T, Relu>(dy, x, mean, sp, hp, res, c, r0, acc); });
  const double* sdy = sums.data();
  const double* sdyx = sums.data() + c;
  std::vector<T> k1(static_cast<size_t>(c)), k2(static_cast<size_t>(c)), k3(static_cast<size_t>(c));
  for (int64_t k = 0; k < c; ++k) {
    const double is = static_cast<double>(invstd[k]);
    if (db) db[k] = static_cast<T>(sdy[k]);
    if (dw) dw[k] = static_cast<T>(sdyx[k] * is);
    const double wc = w ? static_cast<double>(w[k]) : 1.0;
    k1[k] = static_cast<T>(wc * is);
    k2[k] = static_cast<T>(-wc * is * is * is * sdyx[k] / count);
    k3[k] = static_cast<T>(-wc * is * sdy[k] / count);
  }
  if (!dx && !dres) return;
  cl_row_blocks(rows, c, [&](int64_t r0, int64_t r1) {
    cl_dx<A, T, Relu>(dy, x, mean, sp, hp, res, k1.data(), k2.data(), k3.data(), c, r0, r1, dx, dres);
  });
}

template <typename A, typename T>
void backward_cl(BatchNormShape s, const A* dy, const A* x, const T* mean, const T* invstd, const T* w, const T* b,
                 const A* res, A* dx, T* dw, T* db, A* dres) {
  if (s.relu) {
    backward_cl_impl<A, T, true>(s, dy, x, mean, invstd, w, b, res, dx, dw, db, dres);
  } else {
    backward_cl_impl<A, T, false>(s, dy, x, mean, invstd, w, b, res, dx, dw, db, dres);
  }
}

template <typename T>
void forward_any(BatchNormShape s, const T* x, const T* w, const T* b, const T* res, double eps, T* y, T* mean,
                 T* invstd, T* var) {
  if (s.channels_last) {
    forward_cl(s, x, w, b, res, eps, y, mean, invstd, var);
  } else {
    forward_impl(s, x, w, b, eps, y, mean, invstd, var);
  }
}

template <typename T>
void backward_any(BatchNormShape s, const T* dy, const T* x, const T* mean, const T* invstd, const T* w, const T* b,
                  const T* res, T* dx, T* dw, T* db, T* dres) {
  if (s.channels_last) {
    backward_cl(s, dy, x, mean, invstd, w, b, res, dx, dw, db, dres);
  } else {
    backward_impl(s, dy, x, mean, invstd, w, dx, dw, db);
  }
}

// The dtypes the kernels take (ops computes the others with ordinary ops).
constexpr DTypeSet kBatchNormTypes{kFloat32, kFloat64};

}  // namespace

void batch_norm_train_forward(DType dt, BatchNormShape s, const void* x, const void* weight, const void* bias,
                              double eps, void* y, void* mean, void* invstd, void* var, const void* residual) {
  KILN_CAPTURE_KERNEL("batch_norm_train_forward",
                      batch_norm_train_forward(dt, s, x, weight, bias, eps, y, mean, invstd, var, residual));
  KILN_ASSERT(s.channels_last || !s.relu, "batch_norm kernel: the fused ReLU is channels-last only");
  KILN_ASSERT(s.relu || !residual, "batch_norm kernel: a residual comes with the ReLU");
  if (dt == kBFloat16) {
    KILN_ASSERT(s.channels_last, "batch_norm kernel: bf16 is channels-last only");
    forward_cl(s, static_cast<const BFloat16*>(x), static_cast<const float*>(weight), static_cast<const float*>(bias),
               static_cast<const BFloat16*>(residual), eps, static_cast<BFloat16*>(y), static_cast<float*>(mean),
               static_cast<float*>(invstd), static_cast<float*>(var));
    return;
  }
  visit_dtype<kBatchNormTypes>(dt, "batch_norm kernel", [&]<typename T>() {
    forward_any(s, static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias),
                static_cast<const T*>(residual), eps, static_cast<T*>(y), static_cast<T*>(mean),
                static_cast<T*>(invstd), static_cast<T*>(var));
  });
}

void batch_norm_train_backward(DType dt, BatchNormShape s, const void* dy, const void* x, const void* mean,
                               const void* invstd, const void* weight, void* dx, void* dweight, void* dbias,
                               const void* bias, const void* residual, void* dresidual) {
  KILN_CAPTURE_KERNEL(
      "batch_norm_train_backward",
      batch_norm_train_backward(dt, s, dy, x, mean, invstd, weight, dx, dweight, dbias, bias, residual, dresidual));
  KILN_ASSERT(s.channels_last || !s.relu, "batch_norm backward kernel: the fused ReLU is channels-last only");
  KILN_ASSERT(s.relu || (!residual && !dresidual), "batch_norm backward kernel: a residual comes with the ReLU");
  if (dt == kBFloat16) {
    KILN_ASSERT(s.channels_last, "batch_norm backward kernel: bf16 is channels-last only");
    backward_cl(s, static_cast<const BFloat16*>(dy), static_cast<const BFloat16*>(x), static_cast<const float*>(mean),
                static_cast<const float*>(invstd), static_cast<const float*>(weight), static_cast<const float*>(bias),
                static_cast<const BFloat16*>(residual), static_cast<BFloat16*>(dx), static_cast<float*>(dweight),
                static_cast<float*>(dbias), static_cast<BFloat16*>(dresidual));
    return;
  }
  visit_dtype<kBatchNormTypes>(dt, "batch_norm backward kernel", [&]<typename T>() {
    backward_any(s, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(mean),
                 static_cast<const T*>(invstd), static_cast<const T*>(weight), static_cast<const T*>(bias),
                 static_cast<const T*>(residual), static_cast<T*>(dx), static_cast<T*>(dweight), static_cast<T*>(dbias),
                 static_cast<T*>(dresidual));
  });
}

}  // namespace kiln::kernels
