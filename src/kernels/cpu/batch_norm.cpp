// BatchNorm training kernels (include/kiln/kernels/batch_norm.h). A channel's
// values are n strips of `inner` contiguous elements; channels run on
// separate threads. Strip sums accumulate in vectors of the element type,
// folded into a double per strip, so long channels lose no accuracy.
#include "kiln/kernels/batch_norm.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

// sum(p[i]) over a strip.
template <typename T>
double strip_sum(const T* p, int64_t n) {
  using L = Lanes<T>;
  constexpr int64_t W = L::kWidth;
  int64_t i = 0;
  double s = 0;
  if (n >= W) {
    typename L::V a0 = {}, a1 = {};
    for (; i + 2 * W <= n; i += 2 * W) {
      a0 += L::load(p + i);
      a1 += L::load(p + i + W);
    }
    for (; i + W <= n; i += W) a0 += L::load(p + i);
    s = L::fold(a0 + a1);
  }
  for (; i < n; ++i) s += static_cast<double>(p[i]);
  return s;
}

// sum((p[i] - m)^2) over a strip.
template <typename T>
double strip_sqdev(const T* p, int64_t n, T m) {
  using L = Lanes<T>;
  constexpr int64_t W = L::kWidth;
  int64_t i = 0;
  double s = 0;
  if (n >= W) {
    typename L::V a0 = {}, a1 = {};
    for (; i + 2 * W <= n; i += 2 * W) {
      const typename L::V d0 = L::load(p + i) - m, d1 = L::load(p + i + W) - m;
      a0 += d0 * d0;
      a1 += d1 * d1;
    }
    for (; i + W <= n; i += W) {
      const typename L::V d = L::load(p + i) - m;
      a0 += d * d;
    }
    s = L::fold(a0 + a1);
  }
  for (; i < n; ++i) {
    const double d = static_cast<double>(p[i]) - static_cast<double>(m);
    s += d * d;
  }
  return s;
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
int64_t channel_grain(BatchNormShape s) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, s.n * s.inner)); }

template <typename T>
void forward_impl(BatchNormShape s, const T* x, const T* w, const T* b, double eps, T* y, T* mean, T* invstd,
                  T* var) {
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
void backward_impl(BatchNormShape s, const T* dy, const T* x, const T* mean, const T* invstd, const T* w, T* dx,
                   T* dw, T* db) {
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

}  // namespace

void batch_norm_train_forward(DType dt, BatchNormShape s, const void* x, const void* weight, const void* bias,
                              double eps, void* y, void* mean, void* invstd, void* var) {
  KILN_ASSERT(dt == kFloat32 || dt == kFloat64, "batch_norm kernel called with dtype ", dtype_name(dt));
  if (dt == kFloat32) {
    forward_impl(s, static_cast<const float*>(x), static_cast<const float*>(weight), static_cast<const float*>(bias),
                 eps, static_cast<float*>(y), static_cast<float*>(mean), static_cast<float*>(invstd),
                 static_cast<float*>(var));
  } else {
    forward_impl(s, static_cast<const double*>(x), static_cast<const double*>(weight),
                 static_cast<const double*>(bias), eps, static_cast<double*>(y), static_cast<double*>(mean),
                 static_cast<double*>(invstd), static_cast<double*>(var));
  }
}

void batch_norm_train_backward(DType dt, BatchNormShape s, const void* dy, const void* x, const void* mean,
                               const void* invstd, const void* weight, void* dx, void* dweight, void* dbias) {
  KILN_ASSERT(dt == kFloat32 || dt == kFloat64, "batch_norm backward kernel called with dtype ", dtype_name(dt));
  if (dt == kFloat32) {
    backward_impl(s, static_cast<const float*>(dy), static_cast<const float*>(x), static_cast<const float*>(mean),
                  static_cast<const float*>(invstd), static_cast<const float*>(weight), static_cast<float*>(dx),
                  static_cast<float*>(dweight), static_cast<float*>(dbias));
  } else {
    backward_impl(s, static_cast<const double*>(dy), static_cast<const double*>(x), static_cast<const double*>(mean),
                  static_cast<const double*>(invstd), static_cast<const double*>(weight), static_cast<double*>(dx),
                  static_cast<double*>(dweight), static_cast<double*>(dbias));
  }
}

}  // namespace kiln::kernels
