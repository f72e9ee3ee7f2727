// LayerNorm's fused kernel: the composite (mean, var, sub, rsqrt, mul, mul,
// add) reads and writes the [rows, N] activation about eight times forward and
// twice that backward; here forward is one pass per row (statistics, then the
// normalised, scaled and shifted row while it is still in cache) and backward
// one pass per row that forms grad_input and the weight and bias gradients.
//
// Forward saves x, weight, bias (the arguments, for create_graph), and per-row
// mean and rstd = 1 / sqrt(var + eps).
// Backward, with xhat = (x - mean) * rstd and dxhat = g * w:
//   grad_x = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
//   grad_w = Σ_rows g * xhat, grad_b = Σ_rows g.
// Row sums run over 16 independent lanes in the input's dtype (vectorised;
// pairwise at the end). The weight and bias gradients are summed per fixed
// chunk of rows (at most 64 chunks) and then over chunks in double, so the
// result does not depend on the thread count. Under create_graph (grad mode on in backward) it
// differentiates the composite form instead, so higher orders stay exact.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kiln/autograd/custom_function.h"
#include "kiln/autograd/engine.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/loop.h"

namespace kiln::nn::detail {

// y = (x - mean) / sqrt(var + eps) * w + b over the last `n_dims` dims, as kiln ops.
Tensor layer_norm_composite(const Tensor& x, int64_t n_dims, const Tensor& weight, const Tensor& bias, double eps) {
  std::vector<int64_t> dims;
  for (int64_t i = -n_dims; i < 0; ++i) dims.push_back(i);
  Tensor mean = x.mean(dims, true);
  Tensor var = x.var(dims, 0, true);
  Tensor y = (x - mean) * (var + eps).rsqrt();
  return weight.defined() ? y * weight + bias : y;
}

namespace {

struct LnArgs {
  int64_t n_dims = 1;
  double eps = 1e-5;
};

// Rows per chunk of the weight/bias gradient sums: a fixed split, so sums do not depend on threads.
int64_t chunk_rows(int64_t rows, int64_t n) {
  const int64_t per = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, n));
  return std::max<int64_t>(per, (rows + 63) / 64);
}

// Row sums over kLanes independent partial sums: the compiler vectorises the
// lanes (one serial chain of adds would be latency-bound), and pairing the
// lanes at the end keeps float32 rounding close to a tree sum.
constexpr int64_t kLanes = 16;

template <typename T, typename F>
T lane_sum(int64_t n, F&& term) {
  T acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t u = 0; u < kLanes; ++u) acc[u] += term(j + u);
  }
  for (int64_t u = 0; j < n; ++j, ++u) acc[u] += term(j);
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t u = 0; u < w; ++u) acc[u] += acc[u + w];
  }
  return acc[0];
}

template <typename T>
void ln_forward(const T* x, const T* w, const T* b, T* y, T* mean_out, T* rstd_out, int64_t rows, int64_t n,
                double eps) {
  // Half the usual grain: with two passes per element (sums, then the write) a
  // [128, 256] block (gpt_infer's) is worth two threads, and its input is
  // usually a product's output that both threads wrote (half of it in the
  // other core's cache when one thread reads it all).
  kernels::parallel_for(rows, std::max<int64_t>(1, kGrainSize / (2 * n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      const T m = lane_sum<T>(n, [&](int64_t j) { return xr[j]; }) / static_cast<T>(n);
      const T var = lane_sum<T>(n, [&](int64_t j) { return (xr[j] - m) * (xr[j] - m); }) / static_cast<T>(n);
      const T rs = static_cast<T>(1.0 / std::sqrt(static_cast<double>(var) + eps));
      for (int64_t j = 0; j < n; ++j) yr[j] = (xr[j] - m) * rs * w[j] + b[j];
      mean_out[r] = m;
      rstd_out[r] = rs;
    }
  });
}

template <typename T>
void ln_backward(const T* g, const T* x, const T* w, const T* mean, const T* rstd, T* gx, T* gw, T* gb, int64_t rows,
                 int64_t n) {
  const int64_t per = chunk_rows(rows, n), chunks = (rows + per - 1) / per;
  const bool want_wb = gw != nullptr;
  std::vector<T> part(want_wb ? static_cast<size_t>(chunks * 2 * n) : 0, T(0));
  kernels::parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<T> xhat(static_cast<size_t>(n)), dxhat(static_cast<size_t>(n));
    for (int64_t c = c0; c < c1; ++c) {
      T* pw = want_wb ? part.data() + c * 2 * n : nullptr;
      T* pb = want_wb ? pw + n : nullptr;
      for (int64_t r = c * per, re = std::min(rows, (c + 1) * per); r < re; ++r) {
        const T* gr = g + r * n;
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
          const T ma = lane_sum<T>(n, [&](int64_t j) { return dxhat[j]; }) / static_cast<T>(n);
          const T mb = lane_sum<T>(n, [&](int64_t j) { return dxhat[j] * xhat[j]; }) / static_cast<T>(n);
          T* out = gx + r * n;
          for (int64_t j = 0; j < n; ++j) out[j] = rs * (dxhat[j] - ma - xhat[j] * mb);
        }
      }
    }
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

template <typename F>
void visit_float(DType dt, F&& f) {
  if (dt == kFloat32) {
    f.template operator()<float>();
  } else {
    f.template operator()<double>();
  }
}

struct FusedLayerNorm : autograd::Function<FusedLayerNorm> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const LnArgs& a) {
    const Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias.contiguous();
    const int64_t n = wc.numel(), rows = xc.numel() / n;
    Tensor y = empty(xc.sizes(), TensorOptions(xc.dtype()));
    Tensor mean = empty({rows}, TensorOptions(xc.dtype())), rstd = empty({rows}, TensorOptions(xc.dtype()));
    visit_float(xc.dtype(), [&]<typename T>() {
      ln_forward<T>(xc.data_ptr<T>(), wc.data_ptr<T>(), bc.data_ptr<T>(), y.data_ptr<T>(), mean.data_ptr<T>(),
                    rstd.data_ptr<T>(), rows, n, a.eps);
    });
    // The arguments themselves, not xc/wc/bc: those copies (of a transposed,
    // sliced or expanded argument) are made under the no-grad guard, and the
    // create_graph branch would see them as constants without a gradient.
    // Backward makes them contiguous again (free when they already are).
    ctx.save_for_backward({x, weight, bias, mean, rstd});
    ctx.saved_data["args"] = a;
    return y;
  }

  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    TensorList saved = ctx.get_saved_variables();
    const auto a = std::any_cast<LnArgs>(ctx.saved_data["args"]);
    if (grad_mode_enabled()) {
      // create_graph: differentiate the composite so the gradients carry their own history.
      return ctx.differentiate_composite({saved[0], saved[1], saved[2]}, grads, [&](const TensorList& in) {
        return TensorList{layer_norm_composite(in[0], a.n_dims, in[1], in[2], a.eps)};
      });
    }
    const auto& need = ctx.needs_input_grad();
    const Tensor x = saved[0].contiguous(), w = saved[1].contiguous(), b = saved[2];
    const Tensor &mean = saved[3], &rstd = saved[4];
    const Tensor g = grads[0].contiguous();
    const int64_t n = w.numel(), rows = x.numel() / n;
    Tensor gx = need[0] ? empty(x.sizes(), TensorOptions(x.dtype())) : Tensor();
    const bool want_wb = need[1] || need[2];
    Tensor gw = want_wb ? empty(w.sizes(), TensorOptions(w.dtype())) : Tensor();
    Tensor gb = want_wb ? empty(b.sizes(), TensorOptions(b.dtype())) : Tensor();
    visit_float(x.dtype(), [&]<typename T>() {
      ln_backward<T>(g.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<T>(), mean.data_ptr<T>(), rstd.data_ptr<T>(),
                     need[0] ? gx.data_ptr<T>() : nullptr, want_wb ? gw.data_ptr<T>() : nullptr,
                     want_wb ? gb.data_ptr<T>() : nullptr, rows, n);
    });
    return {gx, need[1] ? gw : Tensor(), need[2] ? gb : Tensor()};
  }
};

}  // namespace

Tensor layer_norm(const Tensor& x, int64_t n_dims, const Tensor& weight, const Tensor& bias, double eps) {
  // The fused kernel covers the affine float32/float64 case with a non-empty input; the rest is the composite.
  const bool fused = weight.defined() && bias.defined() && (x.dtype() == kFloat32 || x.dtype() == kFloat64) &&
                     weight.dtype() == x.dtype() && bias.dtype() == x.dtype() && x.numel() > 0 &&
                     weight.numel() > 0 && weight.dim() == n_dims && bias.sizes() == weight.sizes();
  if (!fused) return layer_norm_composite(x, n_dims, weight, bias, eps);
  return FusedLayerNorm::apply(x, weight, bias, LnArgs{.n_dims = n_dims, .eps = eps});
}

}  // namespace kiln::nn::detail
