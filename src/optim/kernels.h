// Fused per-parameter update kernels over contiguous float/double data: one
// pass, no temporaries, loops the compiler vectorises. Scalars are cast to the
// element type as ATen does for its tensor-scalar ops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kiln::optim::kernels {

// torch 1.13 _single_tensor_sgd. `buf` is null without momentum; `first` means
// the buffer is initialised to d (torch.clone(d_p)).
template <typename T>
void sgd(T* __restrict p, const T* __restrict g, T* __restrict buf, int64_t n, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, bool first) {
  const T wd = static_cast<T>(weight_decay), mom = static_cast<T>(momentum);
  const T damp = static_cast<T>(1 - dampening), neg_lr = static_cast<T>(-lr);
  if (!buf) {
    for (int64_t i = 0; i < n; ++i) p[i] += neg_lr * (g[i] + wd * p[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const T d = weight_decay != 0 ? g[i] + wd * p[i] : g[i];
    const T b = first ? d : buf[i] * mom + damp * d;
    buf[i] = b;
    const T step = nesterov ? d + mom * b : b;
    p[i] += neg_lr * step;
  }
}

// torch 1.13 _single_tensor_adam / _single_tensor_adamw. `vmax` is null without amsgrad.
template <typename T>
void adam(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax,
          int64_t n, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool decoupled) {
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
  const T neg_step_size = static_cast<T>(-(lr / bc1));
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T b1 = static_cast<T>(beta1), omb1 = static_cast<T>(1 - beta1);
  const T b2 = static_cast<T>(beta2), omb2 = static_cast<T>(1 - beta2);
  const T e = static_cast<T>(eps);
  const T l2 = decoupled ? T(0) : static_cast<T>(weight_decay);
  const T decay = static_cast<T>(1 - lr * weight_decay);
  const bool apply_decay = decoupled && weight_decay != 0;
  for (int64_t i = 0; i < n; ++i) {
    T pi = p[i];
    if (apply_decay) pi *= decay;
    const T gi = l2 != T(0) ? g[i] + l2 * pi : g[i];
    const T mi = m[i] * b1 + omb1 * gi;
    const T vi = v[i] * b2 + omb2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    T vv = vi;
    if (vmax) {
      vv = std::max(vmax[i], vi);
      vmax[i] = vv;
    }
    const T denom = std::sqrt(vv) / bc2_sqrt + e;
    p[i] = pi + neg_step_size * (mi / denom);
  }
}

// torch 1.13 _single_tensor_rmsprop. `gavg` null unless centered, `buf` null without momentum.
template <typename T>
void rmsprop(T* __restrict p, const T* __restrict g, T* __restrict sq, T* __restrict gavg, T* __restrict buf,
             int64_t n, double lr, double alpha, double eps, double weight_decay, double momentum) {
  const T a = static_cast<T>(alpha), oma = static_cast<T>(1 - alpha), e = static_cast<T>(eps);
  const T wd = static_cast<T>(weight_decay), mom = static_cast<T>(momentum), neg_lr = static_cast<T>(-lr);
  for (int64_t i = 0; i < n; ++i) {
    const T gi = weight_decay != 0 ? g[i] + wd * p[i] : g[i];
    const T si = sq[i] * a + oma * (gi * gi);
    sq[i] = si;
    T avg;
    if (gavg) {
      const T ga = gavg[i] * a + oma * gi;
      gavg[i] = ga;
      avg = std::sqrt(si - ga * ga) + e;
    } else {
      avg = std::sqrt(si) + e;
    }
    if (buf) {
      const T b = buf[i] * mom + gi / avg;
      buf[i] = b;
      p[i] += neg_lr * b;
    } else {
      p[i] += neg_lr * (gi / avg);
    }
  }
}

}  // namespace kiln::optim::kernels
