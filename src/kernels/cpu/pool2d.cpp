// 2-D pooling: dispatch between oneDNN (dnnl_pool.cpp) and our own loops,
// which follow torch's CPU kernels exactly (window clipping, divisors, NaN
// propagation, argmax ties) and serve float64, the cases oneDNN defines
// differently, divisor_override, indices, and non-uniform adaptive bins.
// The backward loops beside them scatter by indices and spread averages over
// the same windows, accumulating 16-bit types in float32. Channels-last max
// pooling runs kiln's own kernel in oneDNN's place (pool_max_nhwc.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"
#include "kiln/core/error.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kernels/loop.h"
#include "pool_max_nhwc.h"

namespace kiln::kernels {

size_t dnnl_pool2d_workspace_bytes(const Pool2dParams& p);
void dnnl_pool2d_forward(const Pool2dParams& p, const void* input, void* output, void* workspace);
void dnnl_pool2d_backward(const Pool2dParams& p, const void* grad_output, const void* workspace, void* grad_input);

namespace {

// Accumulator type: float for 16-bit floats, int64 for integers (torch sums
// uint8 averages in int64 too), T otherwise.
template <typename T>
using acc_t = std::conditional_t<std::is_integral_v<T>, int64_t, compute_t<T>>;

template <typename C>
bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

template <typename C>
C lowest() {
  if constexpr (std::numeric_limits<C>::has_infinity) {
    return -std::numeric_limits<C>::infinity();
  } else {
    return std::numeric_limits<C>::lowest();
  }
}

// Runs plane_fn(plane) for every n * c plane, planes split across threads.
template <typename F>
void for_each_plane(int64_t planes, int64_t work_per_plane, F&& plane_fn) {
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, work_per_plane));
  parallel_for(planes, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) plane_fn(i);
  });
}

template <typename T>
void max_pool_loop(const Pool2dParams& p, const T* input, T* output, int64_t* indices) {
  using C = acc_t<T>;
  const int64_t kh = p.kernel[0], kw = p.kernel[1], sh = p.stride[0], sw = p.stride[1];
  const int64_t dh = p.dilation[0], dw = p.dilation[1];
  for_each_plane(p.n * p.c, p.oh * p.ow * kh * kw, [&](int64_t plane) {
    const T* in = input + plane * p.h * p.w;
    T* out = output + plane * p.oh * p.ow;
    int64_t* idx = indices ? indices + plane * p.oh * p.ow : nullptr;
    for (int64_t oy = 0; oy < p.oh; ++oy) {
      int64_t y0 = oy * sh - p.pad[0];
      const int64_t y1 = std::min(y0 + (kh - 1) * dh + 1, p.h);
      while (y0 < 0) y0 += dh;
      for (int64_t ox = 0; ox < p.ow; ++ox) {
        int64_t x0 = ox * sw - p.pad[1];
        const int64_t x1 = std::min(x0 + (kw - 1) * dw + 1, p.w);
        while (x0 < 0) x0 += dw;
        // As torch: start at -inf with the first position in the window; NaN wins.
        C best = lowest<C>();
        int64_t best_i = y0 * p.w + x0;
        for (int64_t y = y0; y < y1; y += dh) {
          for (int64_t x = x0; x < x1; x += dw) {
            const C v = static_cast<C>(in[y * p.w + x]);
            if (v > best || is_nan(v)) {
              best = v;
              best_i = y * p.w + x;
            }
          }
        }
        out[oy * p.ow + ox] = static_cast<T>(best);
        if (idx) idx[oy * p.ow + ox] = best_i;
      }
    }
  });
}

template <typename T>
void avg_pool_loop(const Pool2dParams& p, const T* input, T* output) {
  using C = acc_t<T>;
  const int64_t kh = p.kernel[0], kw = p.kernel[1], sh = p.stride[0], sw = p.stride[1];
  const bool include_pad = p.kind == PoolKind::AvgIncludePad;
  for_each_plane(p.n * p.c, p.oh * p.ow * kh * kw, [&](int64_t plane) {
    const T* in = input + plane * p.h * p.w;
    T* out = output + plane * p.oh * p.ow;
    for (int64_t oy = 0; oy < p.oh; ++oy) {
      for (int64_t ox = 0; ox < p.ow; ++ox) {
        // torch's window: clipped first to the padded input (that size is the
        // count_include_pad divisor), then to the input itself.
        int64_t y0 = oy * sh - p.pad[0], x0 = ox * sw - p.pad[1];
        int64_t y1 = std::min(y0 + kh, p.h + p.pad[0]), x1 = std::min(x0 + kw, p.w + p.pad[1]);
        const int64_t padded_size = (y1 - y0) * (x1 - x0);
        y0 = std::max<int64_t>(y0, 0);
        x0 = std::max<int64_t>(x0, 0);
        y1 = std::min(y1, p.h);
        x1 = std::min(x1, p.w);
        if (y0 >= y1 || x0 >= x1) {
          out[oy * p.ow + ox] = T{};
          continue;
        }
        C sum = 0;
        for (int64_t y = y0; y < y1; ++y) {
          for (int64_t x = x0; x < x1; ++x) sum += static_cast<C>(in[y * p.w + x]);
        }
        const int64_t divisor = p.divisor_override != 0 ? p.divisor_override
                                : include_pad           ? padded_size
                                                        : (y1 - y0) * (x1 - x0);
        out[oy * p.ow + ox] = static_cast<T>(sum / static_cast<C>(divisor));
      }
    }
  });
}

template <typename T>
void adaptive_avg_loop(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow, const T* input, T* output) {
  using C = acc_t<T>;
  for_each_plane(planes, h * w, [&](int64_t plane) {
    const T* in = input + plane * h * w;
    T* out = output + plane * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      const int64_t y0 = oy * h / oh, y1 = ((oy + 1) * h + oh - 1) / oh;
      for (int64_t ox = 0; ox < ow; ++ox) {
        const int64_t x0 = ox * w / ow, x1 = ((ox + 1) * w + ow - 1) / ow;
        C sum = 0;
        for (int64_t y = y0; y < y1; ++y) {
          for (int64_t x = x0; x < x1; ++x) sum += static_cast<C>(in[y * w + x]);
        }
        out[oy * ow + ox] = static_cast<T>(sum / static_cast<C>((y1 - y0) * (x1 - x0)));
      }
    }
  });
}

// torch's average-pooling window of output (oy, ox) clipped to the input,
// and its divisor (the same rules as avg_pool_loop).
struct AvgWindow {
  int64_t y0, y1, x0, x1, divisor;
};

AvgWindow avg_window(const Pool2dParams& p, int64_t oy, int64_t ox) {
  AvgWindow w;
  w.y0 = oy * p.stride[0] - p.pad[0];
  w.x0 = ox * p.stride[1] - p.pad[1];
  w.y1 = std::min(w.y0 + p.kernel[0], p.h + p.pad[0]);
  w.x1 = std::min(w.x0 + p.kernel[1], p.w + p.pad[1]);
  const int64_t padded_size = (w.y1 - w.y0) * (w.x1 - w.x0);
  w.y0 = std::max<int64_t>(w.y0, 0);
  w.x0 = std::max<int64_t>(w.x0, 0);
  w.y1 = std::min(w.y1, p.h);
  w.x1 = std::min(w.x1, p.w);
  w.divisor = p.divisor_override != 0             ? p.divisor_override
              : p.kind == PoolKind::AvgIncludePad ? padded_size
                                                  : (w.y1 - w.y0) * (w.x1 - w.x0);
  return w;
}

// Runs body(plane, acc) for every plane, acc being a zeroed buffer of the
// accumulator type with plane_size elements, then stores acc into `out`'s
// plane (directly when T is its own accumulator type).
template <typename T, typename Body>
void accumulate_planes(int64_t planes, int64_t plane_size, int64_t work_per_plane, T* out, Body&& body) {
  using C = acc_t<T>;
  for_each_plane(planes, work_per_plane, [&](int64_t plane) {
    T* dst = out + plane * plane_size;
    if constexpr (std::is_same_v<T, C>) {
      std::fill(dst, dst + plane_size, T{});
      body(plane, dst);
    } else {
      thread_local std::vector<C> acc;
      acc.assign(static_cast<size_t>(plane_size), C{});
      body(plane, acc.data());
      for (int64_t i = 0; i < plane_size; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T>
void avg_pool_backward_loop(const Pool2dParams& p, const T* grad_output, T* grad_input) {
  using C = acc_t<T>;
  accumulate_planes(p.n * p.c, p.h * p.w, p.oh * p.ow * p.kernel[0] * p.kernel[1], grad_input,
                    [&](int64_t plane, C* acc) {
                      const T* go = grad_output + plane * p.oh * p.ow;
                      for (int64_t oy = 0; oy < p.oh; ++oy) {
                        for (int64_t ox = 0; ox < p.ow; ++ox) {
                          const AvgWindow w = avg_window(p, oy, ox);
                          if (w.y0 >= w.y1 || w.x0 >= w.x1) continue;
                          const C g = static_cast<C>(go[oy * p.ow + ox]) / static_cast<C>(w.divisor);
                          for (int64_t y = w.y0; y < w.y1; ++y) {
                            for (int64_t x = w.x0; x < w.x1; ++x) acc[y * p.w + x] += g;
                          }
                        }
                      }
                    });
}

template <typename T>
void max_pool_backward_loop(const Pool2dParams& p, const T* grad_output, const int64_t* indices, T* grad_input) {
  using C = acc_t<T>;
  const int64_t hw = p.h * p.w, ohw = p.oh * p.ow;
  accumulate_planes(p.n * p.c, hw, ohw, grad_input, [&](int64_t plane, C* acc) {
    const T* go = grad_output + plane * ohw;
    const int64_t* idx = indices + plane * ohw;
    for (int64_t o = 0; o < ohw; ++o) {
      KILN_ASSERT(idx[o] >= 0 && idx[o] < hw, "max_pool2d backward: index ", idx[o], " outside a plane of ", hw);
      acc[idx[o]] += static_cast<C>(go[o]);
    }
  });
}

template <typename T>
void adaptive_avg_backward_loop(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow, const T* grad_output,
                                T* grad_input) {
  using C = acc_t<T>;
  accumulate_planes(planes, h * w, h * w, grad_input, [&](int64_t plane, C* acc) {
    const T* go = grad_output + plane * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      const int64_t y0 = oy * h / oh, y1 = ((oy + 1) * h + oh - 1) / oh;
      for (int64_t ox = 0; ox < ow; ++ox) {
        const int64_t x0 = ox * w / ow, x1 = ((ox + 1) * w + ow - 1) / ow;
        const C g = static_cast<C>(go[oy * ow + ox]) / static_cast<C>((y1 - y0) * (x1 - x0));
        for (int64_t y = y0; y < y1; ++y) {
          for (int64_t x = x0; x < x1; ++x) acc[y * w + x] += g;
        }
      }
    }
  });
}

// Any NaN among n elements? A branch-free count the compiler vectorises;
// memory-bound like the pooling itself.
bool has_nan(DType dt, const void* data, int64_t n) {
  int64_t found = 0;
  if (dt == DType::Float32) {
    const float* x = static_cast<const float*>(data);
    parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) {
      int32_t count = 0;
      for (int64_t i = b; i < e; ++i) count += x[i] != x[i];
      if (count) __atomic_fetch_add(&found, 1, __ATOMIC_RELAXED);
    });
  } else {
    const uint16_t* x = static_cast<const uint16_t*>(data);  // bfloat16 bits
    parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) {
      int32_t count = 0;
      for (int64_t i = b; i < e; ++i) count += (x[i] & 0x7fff) > 0x7f80;
      if (count) __atomic_fetch_add(&found, 1, __ATOMIC_RELAXED);
    });
  }
  return found != 0;
}

// True when oneDNN computes exactly torch's result for p (max pooling also
// needs a NaN-free input: oneDNN's max drops NaN, torch's propagates it, and
// a swallowed NaN would hide the op that produced it).
bool use_dnnl(const Pool2dParams& p) {
  KILN_ASSERT(!p.nhwc || (p.dtype == DType::Float32 || p.dtype == DType::BFloat16), "pool2d: NHWC needs oneDNN");
  if (p.dtype != DType::Float32 && p.dtype != DType::BFloat16) return false;
  if (p.divisor_override != 0) return false;
  // oneDNN 2.6 runs dilated pooling only in its reference implementation:
  // our loop is as fast and needs no primitive.
  if (p.dilation[0] != 1 || p.dilation[1] != 1) return false;
  if (p.n * p.c * p.oh * p.ow == 0) return false;
  if (p.kind == PoolKind::AvgIncludePad) {
    // oneDNN divides by the whole kernel; torch by the window clipped to the
    // padded input, smaller when a ceil_mode window runs past the padding.
    for (int d = 0; d < 2; ++d) {
      const int64_t in = d == 0 ? p.h : p.w, out = d == 0 ? p.oh : p.ow;
      if ((out - 1) * p.stride[d] - p.pad[d] + p.kernel[d] > in + p.pad[d]) return false;
    }
  }
  return true;
}

// The floating types the backward kernels take (the ops layer converts float16).
constexpr DTypeSet kPoolGradTypes{kFloat32, kFloat64, kBFloat16};
// The forward kernels take every dtype but bool.
constexpr DTypeSet kPoolTypes{kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8};

// Uniform adaptive bins are an ordinary average pool with kernel = stride = in / out.
Pool2dParams uniform_bins(DType dtype, int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow) {
  Pool2dParams p;
  p.dtype = dtype;
  p.kind = PoolKind::AvgExcludePad;
  p.n = 1;
  p.c = planes;
  p.h = h;
  p.w = w;
  p.oh = oh;
  p.ow = ow;
  p.kernel[0] = p.stride[0] = h / oh;
  p.kernel[1] = p.stride[1] = w / ow;
  return p;
}

// kiln::compile's ReLU-pooling rewrite (docs/compile.md, "Rewrites") moves the
// channels-last max pool to other buffers: it is described by its operands.
bool nhwc_max_pool_operands(const Pool2dParams& p) {
  return p.kind == PoolKind::Max && use_dnnl(p) && detail::max_pool_nhwc_applies(p);
}

int64_t pool_bytes(const Pool2dParams& p, bool output) {
  return p.n * p.c * (output ? p.oh * p.ow : p.h * p.w) * static_cast<int64_t>(element_size(p.dtype));
}

}  // namespace

size_t pool2d_workspace_bytes(const Pool2dParams& p) {
  if (p.kind != PoolKind::Max || !use_dnnl(p)) return 0;
  return detail::max_pool_nhwc_applies(p) ? detail::max_pool_nhwc_workspace_bytes(p) : dnnl_pool2d_workspace_bytes(p);
}

bool pool2d_uses_dnnl(const Pool2dParams& p) { return use_dnnl(p); }

namespace {

bool pool2d_forward_impl(const Pool2dParams& p, const void* input, void* output, void* workspace) {
  if (p.n * p.c * p.oh * p.ow == 0) return false;
  if (use_dnnl(p) && detail::max_pool_nhwc_applies(p)) {  // NaN included: no scan
    detail::max_pool_nhwc_forward(p, input, output, static_cast<uint8_t*>(workspace));
    return true;
  }
  if (use_dnnl(p) && !(p.kind == PoolKind::Max && has_nan(p.dtype, input, p.n * p.c * p.h * p.w))) {
    dnnl_pool2d_forward(p, input, output, workspace);
    return true;
  }
  if (p.nhwc) return false;  // our loops are NCHW: the caller retries so
  visit_dtype<kPoolTypes>(p.dtype, "pooling", [&]<typename T>() {
    if (p.kind == PoolKind::Max) {
      max_pool_loop(p, static_cast<const T*>(input), static_cast<T*>(output), nullptr);
    } else {
      avg_pool_loop(p, static_cast<const T*>(input), static_cast<T*>(output));
    }
  });
  return false;
}

}  // namespace

// Not KILN_CAPTURE_KERNEL: the result depends on the input's values (a NaN in
// a max pool's input turns oneDNN down), and the caller picks the backward
// (workspace or indices) and, for p.nhwc, whether to retry in NCHW by it. So
// the recorded call remembers what it returned at capture, and a replay that
// would no longer run oneDNN (so would write no workspace and, for p.nhwc, no
// output) fails rather than leave stale results behind.
bool pool2d_forward(const Pool2dParams& p, const void* input, void* output, void* workspace) {
  const capture::KernelScope scope("pool2d_forward");
  const bool ran_dnnl = pool2d_forward_impl(p, input, output, workspace);
  if (scope.recording()) {
    scope.record([=] {
      const bool now = pool2d_forward(p, input, output, workspace);
      KILN_CHECK(now || !ran_dnnl, ValueError,
                 "pool2d_forward: a replayed step found a NaN in a max pool's input that oneDNN pooled when the step "
                 "was captured; the captured step cannot take the NaN path (run this step eagerly)");
    });
    // The rewrite's scalar is the threshold of a ReLU run on each maximum (pool_max_nhwc.h).
    if (workspace && nhwc_max_pool_operands(p) && detail::max_pool_nhwc_relu_applies(p)) {
      capture::Operands o{"max_pool_nhwc_forward", 3, {const_cast<void*>(input), output, workspace}, {}};
      o.bytes[0] = pool_bytes(p, false);
      o.bytes[1] = pool_bytes(p, true);
      o.bytes[2] = static_cast<int64_t>(detail::max_pool_nhwc_workspace_bytes(p));
      o.params = std::make_shared<const Pool2dParams>(p);
      capture::note_operands(o, [p](const capture::Operands& t) {
        const float relu = static_cast<float>(t.scalar);
        detail::max_pool_nhwc_forward(p, t.ptr[0], t.ptr[1], static_cast<uint8_t*>(t.ptr[2]),
                                      t.has_scalar ? &relu : nullptr);
      });
    }
  }
  return ran_dnnl;
}

void max_pool2d_with_indices(const Pool2dParams& p, const void* input, void* output, int64_t* indices) {
  KILN_CAPTURE_KERNEL("max_pool2d_with_indices", max_pool2d_with_indices(p, input, output, indices));
  if (p.n * p.c * p.oh * p.ow == 0) return;
  visit_dtype<kPoolTypes>(p.dtype, "pooling", [&]<typename T>() {
    max_pool_loop(p, static_cast<const T*>(input), static_cast<T*>(output), indices);
  });
}

void adaptive_avg_pool2d(DType dtype, int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow, const void* input,
                         void* output) {
  KILN_CAPTURE_KERNEL("adaptive_avg_pool2d", adaptive_avg_pool2d(dtype, planes, h, w, oh, ow, input, output));
  if (planes * oh * ow == 0) return;
  if (h % oh == 0 && w % ow == 0 && (dtype == DType::Float32 || dtype == DType::BFloat16)) {
    dnnl_pool2d_forward(uniform_bins(dtype, planes, h, w, oh, ow), input, output, nullptr);
    return;
  }
  visit_dtype<kPoolTypes>(dtype, "pooling", [&]<typename T>() {
    adaptive_avg_loop(planes, h, w, oh, ow, static_cast<const T*>(input), static_cast<T*>(output));
  });
}

void avg_pool2d_backward(const Pool2dParams& p, const void* grad_output, void* grad_input) {
  KILN_CAPTURE_KERNEL("avg_pool2d_backward", avg_pool2d_backward(p, grad_output, grad_input));
  if (p.n * p.c * p.h * p.w == 0) return;
  if (use_dnnl(p)) {
    dnnl_pool2d_backward(p, grad_output, nullptr, grad_input);
    return;
  }
  visit_dtype<kPoolGradTypes>(p.dtype, "pooling backward", [&]<typename T>() {
    avg_pool_backward_loop(p, static_cast<const T*>(grad_output), static_cast<T*>(grad_input));
  });
}

void max_pool2d_backward_workspace(const Pool2dParams& p, const void* grad_output, const void* workspace,
                                   void* grad_input) {
  KILN_CAPTURE_KERNEL("max_pool2d_backward_workspace",
                      max_pool2d_backward_workspace(p, grad_output, workspace, grad_input));
  if (kiln_capture_.recording() && nhwc_max_pool_operands(p)) {
    capture::Operands o{
        "max_pool_nhwc_backward", 3, {const_cast<void*>(grad_output), const_cast<void*>(workspace), grad_input}, {}};
    o.bytes[0] = pool_bytes(p, true);
    o.bytes[1] = static_cast<int64_t>(detail::max_pool_nhwc_workspace_bytes(p));
    o.bytes[2] = pool_bytes(p, false);
    o.params = std::make_shared<const Pool2dParams>(p);
    o.join_next = &conv2d_backward_weight_pooled_fusion;
    capture::note_operands(o, [p](const capture::Operands& t) {
      detail::max_pool_nhwc_backward(p, t.ptr[0], static_cast<const uint8_t*>(t.ptr[1]), t.ptr[2]);
    });
  }
  if (p.n * p.c * p.h * p.w == 0) return;
  KILN_ASSERT(use_dnnl(p), "max_pool2d backward: a workspace for a pool oneDNN does not run");
  if (detail::max_pool_nhwc_applies(p))
    return detail::max_pool_nhwc_backward(p, grad_output, static_cast<const uint8_t*>(workspace), grad_input);
  dnnl_pool2d_backward(p, grad_output, workspace, grad_input);
}

void max_pool2d_backward_indices(const Pool2dParams& p, const void* grad_output, const int64_t* indices,
                                 void* grad_input) {
  KILN_CAPTURE_KERNEL("max_pool2d_backward_indices", max_pool2d_backward_indices(p, grad_output, indices, grad_input));
  if (p.n * p.c * p.h * p.w == 0) return;
  visit_dtype<kPoolGradTypes>(p.dtype, "pooling backward", [&]<typename T>() {
    max_pool_backward_loop(p, static_cast<const T*>(grad_output), indices, static_cast<T*>(grad_input));
  });
}

void max_pool2d_gather(const Pool2dParams& p, const void* src, const int64_t* indices, void* out) {
  KILN_CAPTURE_KERNEL("max_pool2d_gather", max_pool2d_gather(p, src, indices, out));
  const int64_t hw = p.h * p.w, ohw = p.oh * p.ow;
  if (p.n * p.c * ohw == 0) return;
  visit_dtype<kPoolGradTypes>(p.dtype, "pooling backward", [&]<typename T>() {
    const T* in = static_cast<const T*>(src);
    T* o = static_cast<T*>(out);
    for_each_plane(p.n * p.c, ohw, [&](int64_t plane) {
      for (int64_t i = plane * ohw; i < (plane + 1) * ohw; ++i) {
        KILN_ASSERT(indices[i] >= 0 && indices[i] < hw, "max_pool2d gather: index ", indices[i], " outside a plane");
        o[i] = in[plane * hw + indices[i]];
      }
    });
  });
}

void adaptive_avg_pool2d_backward(DType dtype, int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                  const void* grad_output, void* grad_input) {
  KILN_CAPTURE_KERNEL("adaptive_avg_pool2d_backward",
                      adaptive_avg_pool2d_backward(dtype, planes, h, w, oh, ow, grad_output, grad_input));
  if (planes * h * w == 0) return;
  if (oh * ow == 0) {
    std::memset(grad_input, 0, static_cast<size_t>(planes * h * w * element_size(dtype)));
    return;
  }
  if (h % oh == 0 && w % ow == 0 && (dtype == DType::Float32 || dtype == DType::BFloat16)) {
    dnnl_pool2d_backward(uniform_bins(dtype, planes, h, w, oh, ow), grad_output, nullptr, grad_input);
    return;
  }
  visit_dtype<kPoolGradTypes>(dtype, "pooling backward", [&]<typename T>() {
    adaptive_avg_backward_loop(planes, h, w, oh, ow, static_cast<const T*>(grad_output), static_cast<T*>(grad_input));
  });
}

}  // namespace kiln::kernels
