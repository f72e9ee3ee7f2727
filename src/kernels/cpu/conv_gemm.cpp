// conv2d forward and backward: oneDNN for float32/bfloat16 (dnnl_conv.cpp);
// im2col + gemm for float64 (OpenBLAS dgemm) and, forward only, integers
// (kernels::gemm's loop), the same scheme as torch's slow_conv2d, which is
// what torch runs for these dtypes. Backward-data is gemm + col2im (im2col's
// adjoint); backward-weights is im2col + gemm accumulated over the batch.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "conv_direct.h"
#include "dnnl_common.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

void dnnl_conv2d_forward(const Conv2dParams& p, const void* input, const void* weight, const void* bias, void* output);
void dnnl_conv2d_backward_input(const Conv2dParams& p, const void* grad_output, const void* weight, void* grad_input);
void dnnl_conv2d_backward_weight(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                                 void* grad_bias);
void dnnl_conv2d_backward(const Conv2dParams& p, const void* grad_output, const void* input, const void* weight,
                          void* grad_input, void* grad_weight, void* grad_bias);

namespace {

// oneDNN runs float32 and bfloat16; im2col + gemm the others: float64 and, forward only, the integers.
constexpr DTypeSet kConvTypes{kFloat32, kFloat64, kBFloat16, kInt64, kInt32, kUInt8};
constexpr DTypeSet kConvGradTypes{kFloat32, kFloat64, kBFloat16};
template <typename T>
constexpr bool on_dnnl = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;

// col[(ci * kh + ki) * kw + kj, oy * ow + ox] = img[ci, iy, ix] (0 in the padding),
// iy = oy * sh - pad_top + ki * dh, ix likewise. img is [cg, h, w] contiguous.
template <typename T>
void im2col(const Conv2dParams& p, int64_t cg, const T* img, T* col) {
  const int64_t ohw = p.oh * p.ow;
  for (int64_t ci = 0; ci < cg; ++ci) {
    const T* plane = img + ci * p.h * p.w;
    for (int64_t ki = 0; ki < p.kh; ++ki) {
      for (int64_t kj = 0; kj < p.kw; ++kj) {
        T* row = col + ((ci * p.kh + ki) * p.kw + kj) * ohw;
        for (int64_t oy = 0; oy < p.oh; ++oy) {
          T* dst = row + oy * p.ow;
          const int64_t iy = oy * p.stride[0] - p.pad_l[0] + ki * p.dilation[0];
          if (iy < 0 || iy >= p.h) {
            std::fill(dst, dst + p.ow, T{});
            continue;
          }
          const T* src = plane + iy * p.w;
          const int64_t x0 = kj * p.dilation[1] - p.pad_l[1];
          if (p.stride[1] == 1 && x0 >= 0 && x0 + p.ow <= p.w) {
            std::memcpy(dst, src + x0, static_cast<size_t>(p.ow) * sizeof(T));
            continue;
          }
          for (int64_t ox = 0; ox < p.ow; ++ox) {
            const int64_t ix = ox * p.stride[1] + x0;
            dst[ox] = (ix >= 0 && ix < p.w) ? src[ix] : T{};
          }
        }
      }
    }
  }
}

// The adjoint of im2col: img[ci, iy, ix] += every col entry im2col copied
// from it. img is [cg, h, w] contiguous, zeroed by the caller.
template <typename T>
void col2im(const Conv2dParams& p, int64_t cg, const T* col, T* img) {
  const int64_t ohw = p.oh * p.ow;
  for (int64_t ci = 0; ci < cg; ++ci) {
    T* plane = img + ci * p.h * p.w;
    for (int64_t ki = 0; ki < p.kh; ++ki) {
      for (int64_t kj = 0; kj < p.kw; ++kj) {
        const T* row = col + ((ci * p.kh + ki) * p.kw + kj) * ohw;
        for (int64_t oy = 0; oy < p.oh; ++oy) {
          const int64_t iy = oy * p.stride[0] - p.pad_l[0] + ki * p.dilation[0];
          if (iy < 0 || iy >= p.h) continue;
          const T* src = row + oy * p.ow;
          T* dst = plane + iy * p.w;
          const int64_t x0 = kj * p.dilation[1] - p.pad_l[1];
          for (int64_t ox = 0; ox < p.ow; ++ox) {
            const int64_t ix = ox * p.stride[1] + x0;
            if (ix >= 0 && ix < p.w) dst[ix] += src[ox];
          }
        }
      }
    }
  }
}

// A 1x1 kernel with unit stride and no padding reads the image as it is.
bool reads_image_directly(const Conv2dParams& p) {
  return p.kh == 1 && p.kw == 1 && p.stride[0] == 1 && p.stride[1] == 1 && p.pad_l[0] == 0 && p.pad_l[1] == 0 &&
         p.pad_r[0] == 0 && p.pad_r[1] == 0;
}

// Runs images(n0, n1) over the batch: one range per thread (single-threaded
// gemm inside: BLAS and our loops run serially inside an OpenMP region) when
// there are enough images, otherwise all images in turn, each gemm threaded.
template <typename F>
void for_image_ranges(const Conv2dParams& p, int64_t work_per_image, F&& images) {
  if (p.n >= omp_get_max_threads() && p.n > 1) {
    parallel_for(p.n, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(work_per_image, 1)),
                 [&](int64_t b, int64_t e) { images(b, e); });
  } else {
    images(0, p.n);
  }
}

template <typename T>
void conv2d_im2col(const Conv2dParams& p, const T* input, const T* weight, const T* bias, T* output) {
  const int64_t cg = p.c / p.groups, og = p.o / p.groups;
  const int64_t ohw = p.oh * p.ow, kdim = cg * p.kh * p.kw;
  const bool direct = reads_image_directly(p);
  const size_t col_bytes = direct ? 0 : static_cast<size_t>(kdim * ohw) * sizeof(T);

  auto images = [&](int64_t n0, int64_t n1) {
    dnnl_detail::ScratchBlock col_block(col_bytes);
    T* col = reinterpret_cast<T*>(col_block.data());
    for (int64_t ni = n0; ni < n1; ++ni) {
      const T* img = input + ni * p.c * p.h * p.w;
      T* out = output + ni * p.o * ohw;
      if (bias) {
        for (int64_t oc = 0; oc < p.o; ++oc) std::fill(out + oc * ohw, out + (oc + 1) * ohw, bias[oc]);
      }
      for (int64_t g = 0; g < p.groups; ++g) {
        const T* img_g = img + g * cg * p.h * p.w;
        if (!direct) im2col(p, cg, img_g, col);
        // out_g [og, ohw] = W_g [og, kdim] · col [kdim, ohw]
        gemm(dtype_of_v<T>, false, false, og, ohw, kdim, weight + g * og * kdim, kdim, direct ? img_g : col, ohw,
             bias != nullptr, out + g * og * ohw, ohw);
      }
    }
  };
  for_image_ranges(p, p.o * ohw * std::max<int64_t>(kdim, 1), images);
}

template <typename T>
void conv2d_backward_input_gemm(const Conv2dParams& p, const T* grad_output, const T* weight, T* grad_input) {
  const int64_t cg = p.c / p.groups, og = p.o / p.groups;
  const int64_t ohw = p.oh * p.ow, kdim = cg * p.kh * p.kw, hw = p.h * p.w;
  const bool direct = reads_image_directly(p);
  const size_t col_bytes = direct ? 0 : static_cast<size_t>(kdim * ohw) * sizeof(T);
  auto images = [&](int64_t n0, int64_t n1) {
    dnnl_detail::ScratchBlock col_block(col_bytes);
    T* col = reinterpret_cast<T*>(col_block.data());
    for (int64_t ni = n0; ni < n1; ++ni) {
      T* img = grad_input + ni * p.c * hw;
      if (!direct) std::fill(img, img + p.c * hw, T{});
      for (int64_t g = 0; g < p.groups; ++g) {
        // col [kdim, ohw] = W_gᵀ [kdim, og] · grad_g [og, ohw]; a 1x1 kernel writes the image directly.
        const T* go = grad_output + (ni * p.o + g * og) * ohw;
        T* img_g = img + g * cg * hw;
        gemm(dtype_of_v<T>, true, false, kdim, ohw, og, weight + g * og * kdim, kdim, go, ohw, false,
             direct ? img_g : col, ohw);
        if (!direct) col2im(p, cg, col, img_g);
      }
    }
  };
  for_image_ranges(p, p.o * ohw * std::max<int64_t>(kdim, 1), images);
}

template <typename T>
void conv2d_backward_weight_gemm(const Conv2dParams& p, const T* grad_output, const T* input, T* grad_weight,
                                 T* grad_bias) {
  const int64_t cg = p.c / p.groups, og = p.o / p.groups;
  const int64_t ohw = p.oh * p.ow, kdim = cg * p.kh * p.kw, hw = p.h * p.w;
  const bool direct = reads_image_directly(p);
  std::fill(grad_weight, grad_weight + p.o * kdim, T{});
  dnnl_detail::ScratchBlock col_block(direct ? 0 : static_cast<size_t>(kdim * ohw) * sizeof(T));
  T* col = reinterpret_cast<T*>(col_block.data());
  // Images in turn, each gemm threaded: every image adds into the same grad_weight.
  for (int64_t ni = 0; ni < p.n; ++ni) {
    for (int64_t g = 0; g < p.groups; ++g) {
      const T* img_g = input + (ni * p.c + g * cg) * hw;
      if (!direct) im2col(p, cg, img_g, col);
      // W_g [og, kdim] += grad_g [og, ohw] · colᵀ [ohw, kdim]
      gemm(dtype_of_v<T>, false, true, og, kdim, ohw, grad_output + (ni * p.o + g * og) * ohw, ohw,
           direct ? img_g : col, ohw, true, grad_weight + g * og * kdim, kdim);
    }
  }
  if (!grad_bias) return;
  parallel_for(p.o, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, p.n * ohw)), [&](int64_t b, int64_t e) {
    for (int64_t oc = b; oc < e; ++oc) {
      T sum{};
      for (int64_t ni = 0; ni < p.n; ++ni) {
        const T* plane = grad_output + (ni * p.o + oc) * ohw;
        for (int64_t i = 0; i < ohw; ++i) sum += plane[i];
      }
      grad_bias[oc] = sum;
    }
  });
}

// The bias gradient where no kernel runs (empty input channels): grad_output
// summed over the batch and the plane, in float32 for bfloat16.
void bias_grad_loop(const Conv2dParams& p, const void* grad_output, void* grad_bias) {
  visit_dtype<kConvGradTypes>(p.dtype, "conv2d_backward (bias)", [&]<typename T>() {
    const T* go = static_cast<const T*>(grad_output);
    T* gb = static_cast<T*>(grad_bias);
    const int64_t ohw = p.oh * p.ow;
    for (int64_t oc = 0; oc < p.o; ++oc) {
      double sum = 0;
      for (int64_t ni = 0; ni < p.n; ++ni) {
        for (int64_t i = 0; i < ohw; ++i) sum += static_cast<compute_t<T>>(go[(ni * p.o + oc) * ohw + i]);
      }
      gb[oc] = static_cast<T>(static_cast<compute_t<T>>(sum));
    }
  });
}

}  // namespace

void conv2d_forward(const Conv2dParams& p, const void* input, const void* weight, const void* bias, void* output) {
  KILN_CAPTURE_KERNEL("conv2d_forward", conv2d_forward(p, input, weight, bias, output));
  if (p.n == 0 || p.o == 0 || p.oh == 0 || p.ow == 0) return;
  if (detail::conv_forward_direct(p)) {
    // For kiln::compile's rewrite of it and the max pool after it (conv2d_forward_pooled).
    if (kiln_capture_.recording()) detail::note_forward_operands(p, input, weight, bias, output);
    return detail::conv_forward_direct_run(p, input, weight, bias, output);
  }
  const bool done = visit_dtype<kConvTypes>(p.dtype, "conv2d_forward", [&]<typename T>() {
    if constexpr (on_dnnl<T>) {
      if (p.c == 0) return false;  // oneDNN cannot take empty channels; the result is the bias
      dnnl_conv2d_forward(p, input, weight, bias, output);
    } else {
      conv2d_im2col(p, static_cast<const T*>(input), static_cast<const T*>(weight), static_cast<const T*>(bias),
                    static_cast<T*>(output));
    }
    return true;
  });
  if (done) return;
  // Empty channels on the oneDNN types: bias or zero.
  const int64_t es = element_size(p.dtype), ohw = p.oh * p.ow;
  char* out = static_cast<char*>(output);
  for (int64_t ni = 0; ni < p.n; ++ni) {
    for (int64_t oc = 0; oc < p.o; ++oc) {
      char* plane = out + (ni * p.o + oc) * ohw * es;
      if (!bias) {
        std::memset(plane, 0, static_cast<size_t>(ohw * es));
        continue;
      }
      for (int64_t i = 0; i < ohw; ++i) std::memcpy(plane + i * es, static_cast<const char*>(bias) + oc * es, es);
    }
  }
}

void conv2d_backward_input(const Conv2dParams& p, const void* grad_output, const void* weight, void* grad_input) {
  KILN_CAPTURE_KERNEL("conv2d_backward_input", conv2d_backward_input(p, grad_output, weight, grad_input));
  const int64_t es = element_size(p.dtype);
  if (p.n * p.c * p.h * p.w == 0) return;
  if (p.o == 0) {  // no output channel reads the input
    std::memset(grad_input, 0, static_cast<size_t>(p.n * p.c * p.h * p.w * es));
    return;
  }
  visit_dtype<kConvGradTypes>(p.dtype, "conv2d_backward_input", [&]<typename T>() {
    if constexpr (on_dnnl<T>)
      dnnl_conv2d_backward_input(p, grad_output, weight, grad_input);
    else
      conv2d_backward_input_gemm(p, static_cast<const T*>(grad_output), static_cast<const T*>(weight),
                                 static_cast<T*>(grad_input));
  });
}

void conv2d_backward_weight(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                            void* grad_bias) {
  KILN_CAPTURE_KERNEL("conv2d_backward_weight", conv2d_backward_weight(p, grad_output, input, grad_weight, grad_bias));
  const int64_t es = element_size(p.dtype);
  // For kiln::compile's rewrite of a max pool's backward into it (conv2d_backward_weight_pooled).
  if (kiln_capture_.recording() && conv2d_backward_weight_direct(p))
    detail::note_weight_grad_operands(p, grad_output, input, grad_weight, grad_bias);
  if (p.n == 0 || p.c == 0 || p.o == 0) {  // nothing to multiply: zero weights, the bias sums what there is
    std::memset(grad_weight, 0, static_cast<size_t>(p.o * (p.c / p.groups) * p.kh * p.kw * es));
    if (grad_bias) bias_grad_loop(p, grad_output, grad_bias);
    return;
  }
  visit_dtype<kConvGradTypes>(p.dtype, "conv2d_backward_weight", [&]<typename T>() {
    if constexpr (on_dnnl<T>)
      dnnl_conv2d_backward_weight(p, grad_output, input, grad_weight, grad_bias);
    else
      conv2d_backward_weight_gemm(p, static_cast<const T*>(grad_output), static_cast<const T*>(input),
                                  static_cast<T*>(grad_weight), static_cast<T*>(grad_bias));
  });
}

void conv2d_backward(const Conv2dParams& p, const void* grad_output, const void* input, const void* weight,
                     void* grad_input, void* grad_weight, void* grad_bias) {
  KILN_CAPTURE_KERNEL("conv2d_backward",
                      conv2d_backward(p, grad_output, input, weight, grad_input, grad_weight, grad_bias));
  const bool dnnl = p.dtype == DType::Float32 || p.dtype == DType::BFloat16;
  if (dnnl && p.n > 0 && p.c > 0 && p.o > 0) {
    dnnl_conv2d_backward(p, grad_output, input, weight, grad_input, grad_weight, grad_bias);
    return;
  }
  conv2d_backward_input(p, grad_output, weight, grad_input);
  conv2d_backward_weight(p, grad_output, input, grad_weight, grad_bias);
}

}  // namespace kiln::kernels
