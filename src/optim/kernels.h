// Fused per-parameter update kernels over contiguous float/double data: one
// pass, no temporaries, loops the compiler vectorises. Scalars are cast to the
// element type as ATen does for its tensor-scalar ops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

// Loops with sqrt vectorise only without errno semantics, so the kernels are
// instantiated in kernels.cpp, compiled with "no-math-errno" (they never rely
// on errno); other files see the extern declarations at the end.

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
template <typename T, bool kAmsgrad, bool kL2, bool kDecay>
void adam_loop(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax, int64_t n,
               T neg_step_size, T bc2_sqrt, T b1, T omb1, T b2, T omb2, T e, T wd, T decay) {
  for (int64_t i = 0; i < n; ++i) {
    T pi = p[i];
    if constexpr (kDecay) pi *= decay;
    T gi = g[i];
    if constexpr (kL2) gi = gi + wd * pi;
    const T mi = m[i] * b1 + omb1 * gi;
    const T vi = v[i] * b2 + omb2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    T vv = vi;
    if constexpr (kAmsgrad) {
      vv = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = vv;
    }
    const T denom = std::sqrt(vv) / bc2_sqrt + e;
    p[i] = pi + neg_step_size * (mi / denom);
  }
}

template <typename T>
void adam(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax, int64_t n,
          int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled) {
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
  const T neg_step_size = static_cast<T>(-(lr / bc1));
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T b1 = static_cast<T>(beta1), omb1 = static_cast<T>(1 - beta1);
  const T b2 = static_cast<T>(beta2), omb2 = static_cast<T>(1 - beta2);
  const T e = static_cast<T>(eps);
  const T decay = static_cast<T>(1 - lr * weight_decay);
  const bool apply_decay = decoupled && weight_decay != 0, l2 = !decoupled && weight_decay != 0;
  const T wd = static_cast<T>(weight_decay);
  auto loop = [&]<bool kAmsgrad, bool kL2, bool kDecay>() {
    adam_loop<T, kAmsgrad, kL2, kDecay>(p, g, m, v, vmax, n, neg_step_size, bc2_sqrt, b1, omb1, b2, omb2, e, wd, decay);
  };
  if (vmax) {
    if (l2)
      loop.template operator()<true, true, false>();
    else if (apply_decay)
      loop.template operator()<true, false, true>();
    else
      loop.template operator()<true, false, false>();
  } else {
    if (l2)
      loop.template operator()<false, true, false>();
    else if (apply_decay)
      loop.template operator()<false, false, true>();
    else
      loop.template operator()<false, false, false>();
  }
}

// torch 1.13 _single_tensor_rmsprop. `gavg` null unless centered, `buf` null without momentum.
template <typename T, bool kCentered, bool kMomentum, bool kL2>
void rmsprop_loop(T* __restrict p, const T* __restrict g, T* __restrict sq, T* __restrict gavg, T* __restrict buf,
                  int64_t n, T a, T oma, T e, T wd, T mom, T neg_lr) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i];
    if constexpr (kL2) gi = gi + wd * p[i];
    const T si = sq[i] * a + oma * (gi * gi);
    sq[i] = si;
    T avg;
    if constexpr (kCentered) {
      const T ga = gavg[i] * a + oma * gi;
      gavg[i] = ga;
      avg = std::sqrt(si - ga * ga) + e;
    } else {
      avg = std::sqrt(si) + e;
    }
    if constexpr (kMomentum) {
      const T b = buf[i] * mom + gi / avg;
      buf[i] = b;
      p[i] += neg_lr * b;
    } else {
      p[i] += neg_lr * (gi / avg);
    }
  }
}

template <typename T>
void rmsprop(T* __restrict p, const T* __restrict g, T* __restrict sq, T* __restrict gavg, T* __restrict buf, int64_t n,
             double lr, double alpha, double eps, double weight_decay, double momentum) {
  const T a = static_cast<T>(alpha), oma = static_cast<T>(1 - alpha), e = static_cast<T>(eps);
  const T wd = static_cast<T>(weight_decay), mom = static_cast<T>(momentum), neg_lr = static_cast<T>(-lr);
  const int which = (gavg ? 4 : 0) | (buf ? 2 : 0) | (weight_decay != 0 ? 1 : 0);
  auto loop = [&]<bool kCentered, bool kMomentum, bool kL2>() {
    rmsprop_loop<T, kCentered, kMomentum, kL2>(p, g, sq, gavg, buf, n, a, oma, e, wd, mom, neg_lr);
  };
  switch (which) {
    case 0: loop.template operator()<false, false, false>(); break;
    case 1: loop.template operator()<false, false, true>(); break;
    case 2: loop.template operator()<false, true, false>(); break;
    case 3: loop.template operator()<false, true, true>(); break;
    case 4: loop.template operator()<true, false, false>(); break;
    case 5: loop.template operator()<true, false, true>(); break;
    case 6: loop.template operator()<true, true, false>(); break;
    default: loop.template operator()<true, true, true>(); break;
  }
}

// Instantiated for float and double in kernels.cpp alone (see the top of this file).
extern template void sgd<float>(float*, const float*, float*, int64_t, double, double, double, double, bool, bool);
extern template void sgd<double>(double*, const double*, double*, int64_t, double, double, double, double, bool, bool);
extern template void adam<float>(float*, const float*, float*, float*, float*, int64_t, int64_t, double, double, double,
                                 double, double, bool);
extern template void adam<double>(double*, const double*, double*, double*, double*, int64_t, int64_t, double, double,
                                  double, double, double, bool);
extern template void rmsprop<float>(float*, const float*, float*, float*, float*, int64_t, double, double, double,
                                    double, double);
extern template void rmsprop<double>(double*, const double*, double*, double*, double*, int64_t, double, double, double,
                                     double, double);

}  // namespace kiln::optim::kernels
