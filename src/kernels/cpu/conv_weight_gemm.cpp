// Note [Weight gradient by unfolding]
// A convolution's weight gradient is one product: with the input unfolded
// into rows of every window (col [n·oh·ow, kh·kw·c], zeros where a window
// hangs over the padding), dWᵀ [kh·kw·c, o] = colᵀ · dY [n·oh·ow, o], dY
// being the NHWC grad_output as it lies. oneDNN 2.6's bfloat16
// backward-weights kernel runs strided convolutions at a third of its
// backward-data speed (resnet's 3x3 stride-2 convolutions at 2 threads:
// 0.46-0.51 ms against 0.12-0.15 ms for their backward data), where the
// unfold writes a few MiB and the product runs at the matmul's rate.
// The product accumulates in float32 and rounds each gradient element to
// the dtype once, as oneDNN's kernel does; only the order of the terms in
// each sum differs.
#include "conv_weight_gemm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "conv_direct.h"
#include "dnnl_common.h"
#include "kiln/core/half.h"
#include "kiln/core/parallel.h"

namespace kiln::kernels::detail {

namespace {

std::atomic<ConvWeightGradPath> g_path{ConvWeightGradPath::Auto};

constexpr int64_t kMaxUnfoldBytes = int64_t{64} << 20;

// n bytes from src, or zeros when src is null. Window rows are short (32 to
// a few hundred bytes): a library memcpy call would cost more than the copy.
void copy_bytes(char* dst, const char* src, int64_t n) {
  int64_t i = 0;
  if (src) {
    for (; i + 32 <= n; i += 32) __builtin_memcpy(dst + i, src + i, 32);
    for (; i < n; ++i) dst[i] = src[i];
  } else {
    for (; i + 32 <= n; i += 32) __builtin_memset(dst + i, 0, 32);
    for (; i < n; ++i) dst[i] = 0;
  }
}

// The product's [kh][kw][c][o] into the weight's [o][c][kh][kw] (a copy of
// bits), and the bias gradient, each element's sum in float32 rounded once.
template <typename T>
void finish(const Conv2dParams& p, const T* wt, const T* dy, T* gw, T* gb, int64_t rows) {
  for (int64_t o = 0; o < p.o; ++o)
    for (int64_t ci = 0; ci < p.c; ++ci)
      for (int64_t i = 0; i < p.kh; ++i)
        for (int64_t j = 0; j < p.kw; ++j)
          gw[((o * p.c + ci) * p.kh + i) * p.kw + j] = wt[((i * p.kw + j) * p.c + ci) * p.o + o];
  if (!gb) return;
  std::vector<float> acc(static_cast<size_t>(p.o), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < p.o; ++o) acc[static_cast<size_t>(o)] += static_cast<float>(dy[r * p.o + o]);
  for (int64_t o = 0; o < p.o; ++o) gb[o] = static_cast<T>(acc[static_cast<size_t>(o)]);
}

}  // namespace

bool conv_weight_grad_by_product(const Conv2dParams& p) {
  const ConvWeightGradPath path = g_path.load(std::memory_order_relaxed);
  if (path == ConvWeightGradPath::Primitive) return false;
  if ((p.dtype != DType::BFloat16 && p.dtype != DType::Float32) || p.groups != 1 || !p.input_nhwc || !p.output_nhwc)
    return false;
  if (p.n == 0 || p.c == 0 || p.o == 0 || p.oh == 0 || p.ow == 0) return false;
  if (path == ConvWeightGradPath::Product) return true;
  // Measured (bench/micro/bench_conv.cpp, batch 32): the product wins for
  // strided bfloat16 windows of 16 channels at 2 threads and of 32 or more
  // at 1 and 2; it loses on 1x1 kernels and on few channels (a 3-channel
  // stem), whose unfolding is many short copies.
  const bool strided = p.stride[0] > 1 || p.stride[1] > 1;
  const bool wide = p.c >= 32 || (p.c >= 16 && dnnl_detail::max_threads() >= 2);
  // The unfolded input is scratch the primitive does not need: capped, so
  // that a large convolution does not trade memory for the speed-up.
  const int64_t col_bytes = p.n * p.oh * p.ow * p.kh * p.kw * p.c * element_size(p.dtype);
  return p.dtype == DType::BFloat16 && strided && p.kh * p.kw > 1 && wide && col_bytes <= kMaxUnfoldBytes;
}

void conv_weight_grad_product(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                              void* grad_bias) {
  const int64_t rows = p.n * p.oh * p.ow, window = p.kh * p.kw * p.c, es = element_size(p.dtype);
  const size_t col_bytes = dnnl_detail::align64(static_cast<size_t>(rows * window * es));
  const dnnl_detail::ScratchBlock block(col_bytes + static_cast<size_t>(window * p.o * es));
  char* col = block.data();
  char* wt = block.data() + col_bytes;
  const char* x = static_cast<const char*>(input);
  const int64_t pixel = p.c * es;
  // A window row's kw taps are consecutive pixels of one input row when the
  // kernel is dense (dilation 1): one copy of kw·c elements unless the
  // window hangs over the left or right padding.
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, window)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t ni = r / (p.oh * p.ow), oy = r / p.ow % p.oh, ox = r % p.ow;
      char* dst = col + r * window * es;
      const int64_t ix0 = ox * p.stride[1] - p.pad_l[1];
      const bool inside = p.dilation[1] == 1 && ix0 >= 0 && ix0 + p.kw <= p.w;
      for (int64_t i = 0; i < p.kh; ++i) {
        const int64_t iy = oy * p.stride[0] - p.pad_l[0] + i * p.dilation[0];
        if (iy < 0 || iy >= p.h) {
          copy_bytes(dst, nullptr, p.kw * pixel);
          dst += p.kw * pixel;
          continue;
        }
        const char* row = x + (ni * p.h + iy) * p.w * pixel;
        if (inside) {
          copy_bytes(dst, row + ix0 * pixel, p.kw * pixel);
        } else {
          for (int64_t j = 0; j < p.kw; ++j) {
            const int64_t ix = ix0 + j * p.dilation[1];
            copy_bytes(dst + j * pixel, ix >= 0 && ix < p.w ? row + ix * pixel : nullptr, pixel);
          }
        }
        dst += p.kw * pixel;
      }
    }
  });
  MatmulArgs g;
  g.dtype = p.dtype;
  g.m = window;
  g.n = p.o;
  g.k = rows;
  g.a = {col, {0, 1, window}, 0};
  g.b = {grad_output, {0, p.o, 1}, 0};
  g.c = wt;
  matmul(g);
  if (es == 2) {
    finish<BFloat16>(p, reinterpret_cast<const BFloat16*>(wt), static_cast<const BFloat16*>(grad_output),
                     static_cast<BFloat16*>(grad_weight), static_cast<BFloat16*>(grad_bias), rows);
  } else {
    finish<float>(p, reinterpret_cast<const float*>(wt), static_cast<const float*>(grad_output),
                  static_cast<float*>(grad_weight), static_cast<float*>(grad_bias), rows);
  }
}

}  // namespace kiln::kernels::detail

namespace kiln::kernels {

bool conv2d_backward_weight_direct(const Conv2dParams& p) {
  const ConvWeightGradPath path = detail::g_path.load(std::memory_order_relaxed);
  if (path == ConvWeightGradPath::Primitive || path == ConvWeightGradPath::Product) return false;
  return detail::conv_weight_direct_fits(p) && (path == ConvWeightGradPath::Direct || p.c == 1);
}

void set_conv_weight_grad_path(ConvWeightGradPath path) { detail::g_path.store(path, std::memory_order_relaxed); }
ConvWeightGradPath conv_weight_grad_path() { return detail::g_path.load(std::memory_order_relaxed); }

}  // namespace kiln::kernels
