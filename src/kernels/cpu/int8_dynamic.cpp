// The per-row pieces of dynamic int8 linears (kiln/kernels/int8.h): row
// quantization and the epilogue around oneDNN's int8 product. Single-threaded:
// the rows of one sequence are a few hundred KiB (splitting them was not tried).
#include <cmath>

#include "elementwise_math.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/int8.h"

namespace kiln::kernels {

namespace {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluKappa = 0.044715f;

template <FusedActivation Act, bool Bias, bool Residual>
void epilogue_rows(int64_t m, int64_t n, const float* rows, const float* bias, const float* residual, float* y) {
  for (int64_t t = 0; t < m; ++t) {
    const float a = rows[t];
    float* yr = y + t * n;
    const float* rr = Residual ? residual + t * n : nullptr;
#pragma omp simd
    for (int64_t o = 0; o < n; ++o) {
      float v = a * yr[o];
      if constexpr (Bias) v += bias[o];
      if constexpr (Act == FusedActivation::Relu) v = v < 0.0f ? 0.0f : v;
      if constexpr (Act == FusedActivation::GeluTanh)
        v = 0.5f * v * (1.0f + vm::tanh(kSqrt2OverPi * (v + kGeluKappa * v * v * v)));
      if constexpr (Act == FusedActivation::GeluErf) v = v * 0.5f * (1.0f + vm::erf(v * kSqrt1_2));
      if constexpr (Residual) v += rr[o];
      yr[o] = v;
    }
  }
}

template <FusedActivation Act>
void epilogue_act(int64_t m, int64_t n, const float* rows, const float* bias, const float* residual, float* y) {
  if (bias && residual) return epilogue_rows<Act, true, true>(m, n, rows, bias, residual, y);
  if (bias) return epilogue_rows<Act, true, false>(m, n, rows, bias, residual, y);
  if (residual) return epilogue_rows<Act, false, true>(m, n, rows, bias, residual, y);
  epilogue_rows<Act, false, false>(m, n, rows, bias, residual, y);
}

}  // namespace

void int8_dynamic_epilogue(int64_t m, int64_t n, const float* row_scales, const float* bias, FusedActivation act,
                           const float* residual, float* y) {
  KILN_CAPTURE_KERNEL("int8_dynamic_epilogue", int8_dynamic_epilogue(m, n, row_scales, bias, act, residual, y));
  switch (act) {
    case FusedActivation::None: return epilogue_act<FusedActivation::None>(m, n, row_scales, bias, residual, y);
    case FusedActivation::Relu: return epilogue_act<FusedActivation::Relu>(m, n, row_scales, bias, residual, y);
    case FusedActivation::GeluTanh: return epilogue_act<FusedActivation::GeluTanh>(m, n, row_scales, bias, residual, y);
    case FusedActivation::GeluErf: return epilogue_act<FusedActivation::GeluErf>(m, n, row_scales, bias, residual, y);
  }
}

void quantize_rows_absmax_u8(const float* x, int64_t rows, int64_t k, uint8_t* out, float* scales) {
  // Not recorded: the scales it writes are what its caller (ops::Int8DynamicLinear) reads back on the host
  // to reject a non-finite input, a check a replay would skip.
  capture::graph_break_if_recording("quantize_rows_absmax_u8: its row scales are read on the host");
  constexpr float kMagic = 12582912.0f;  // round half to even, as quantize_u8
  for (int64_t t = 0; t < rows; ++t) {
    const float* r = x + t * k;
    uint8_t* q = out + t * k;
    float m = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < k; ++i) {
      const float v = r[i] < 0.0f ? -r[i] : r[i];
      m = v > m ? v : m;  // NaN never wins
    }
    const float scale = m > 0.0f ? m / 127.0f : 1.0f;
    scales[t] = scale;
    const float inv = 1.0f / scale;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      float v = r[i] * inv;
      v = v >= -127.0f ? (v <= 127.0f ? v : 127.0f) : -127.0f;
      v = r[i] == r[i] ? v : 0.0f;  // NaN codes as zero
      q[i] = static_cast<uint8_t>(static_cast<int32_t>((v + kMagic) - kMagic) + 128);
    }
  }
}

}  // namespace kiln::kernels
