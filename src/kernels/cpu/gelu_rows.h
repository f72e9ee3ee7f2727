// Internal to the elementwise kernels: GELU's tanh form (forward and
// backward) as float rows on 16-lane vectors.
//
// Note [GELU rows]
// gpt's GELU runs on 2M elements per call. Through the generic row loop each
// 16 lanes call libmvec's expf, and that call clobbers every vector register:
// the loop spills and reloads its constants and live values around it, and
// bf16 GELU (half the bytes of float32) ran slower than float32. These rows
// compute exp(-2u) inline with everything in registers, as 2^v: log2(e) and
// GELU's constants fold into the exponent's two coefficients, so there is no
// ln 2 reduction, and 2^f takes a degree-6 polynomial scaled by 2^n with
// VSCALEFPS (about 1 ulp). The backward reuses x^2 and s = sigmoid(2u). Per
// 16 lanes on 1 thread (L1-resident, 2026-12-05) this took the forward from
// 0.24-0.26 to 0.18 ns per element and the backward from 0.34 to 0.23,
// against the natural exp with Cephes' two-step ln 2 reduction before.
// Every float and bf16 GELU (tanh) goes through these rows, contiguous or
// strided, vector body or tail (a masked vector), so a value's bits do not
// depend on where it sits, and bf16 GELU stays float GELU rounded.
//
// Edge values as the formula x / (1 + exp(-2u)) gives them: exp overflows to
// inf (x very negative: -0), underflows to 0 (x large: x), x = -inf gives NaN
// as torch's 0.5 x (1 + tanh u) does, and NaN stays NaN.
#pragma once

#include <algorithm>
#include <cstdint>

#include "elementwise_math.h"
#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"

#if defined(__AVX512F__)
#define KILN_GELU_ROWS 1

namespace kiln::kernels::vm {

/// 2^v on 16 lanes, about 1 ulp: v = n + f with n an integer and |f| <= 1/2
/// (exact), 2^f by a degree-6 polynomial (fitted for relative error on
/// [-1/2, 1/2]: 1.9e-9, 1.15 ulp as float32 Horner), scaled by 2^n with
/// VSCALEFPS, so overflow gives inf and underflow passes through the
/// subnormals to 0. NaN stays NaN.
///
/// With AVX512DQ, VREDUCEPS gives f = v - n in one instruction and takes
/// v = +-inf to f = 0 (VSCALEFPS by n = +-inf then gives inf or 0), where the
/// form without it clamps v to [-200, 300] first so that v - n is never
/// inf - inf. The two give the same bits for every one of the 2^32 float
/// inputs (checked exhaustively, 2026-12-06), and the GELU rows ran 8-10 %
/// faster for the two instructions saved (gpt's [16, 128, 1024], 1 thread).
inline __m512 exp2_16(__m512 v) {
#if defined(__AVX512DQ__)
  const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_reduce_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  // max(lo, v) and min(hi, .) return their second operand for NaN: v passes.
  const __m512 vc = _mm512_min_ps(_mm512_set1_ps(300.0f), _mm512_max_ps(_mm512_set1_ps(-200.0f), v));
  const __m512 n = _mm512_roundscale_ps(vc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(vc, n);
#endif
  __m512 y = _mm512_set1_ps(1.5345810971e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3399930904e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6184890717e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5503286421e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022646248e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718246e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);  // y 2^n, rounded once
}

constexpr float kGeluC = 0.79788456080286535588f;  // sqrt(2/pi)
constexpr float kGeluK = 0.044715f;
constexpr float kLog2E = 1.44269504088896341f;

// Note [GELU's exponent floor]
// For x above about 10, 2^v = exp(-2u) falls below the smallest normal float:
// VSCALEFPS then writes a subnormal or underflows to 0, and on Intel each
// such vector takes a microcode assist (no FTZ/DAZ: kiln keeps IEEE
// subnormals). GELU of randn x 12 (an unnormalised pre-activation) ran 15x
// slower than of randn (BM_ActivationGeluTanhLarge, 724 against 47 us
// forward, 1386 against 108 with backward); floored, it takes 33 and 117 us.
// Every use adds the value to 1:
// sigmoid(2u) = 1 / (1 + 2^v), and 1 + 2^v is 1 for any v below -24, so
// flooring v at -100 leaves every bit of GELU and its gradient as it was
// (checked over all 2^32 floats, 2026-12-07; tests/ops/test_gelu_rows.cpp
// checks a seventh of them and the whole band) and keeps 2^v normal. NaN
// passes: VMAXPS returns its second operand when either is NaN.
constexpr float kGeluExponentFloor = -100.0f;

/// exp(-2u), u = sqrt(2/pi) (x + 0.044715 x^3), as 2^(x (a + b x^2)) with
/// a = -2 sqrt(2/pi) log2(e) and b = a 0.044715: sigmoid(2u) = 1 / (1 + this).
/// The exponent is rounded a few times, and 2^v multiplies that by |v| ln 2
/// = |2u| (exp's condition number): the (4 + 4 |2u|) eps bound of the tests.
/// Below 2^floor it returns 2^floor (Note [GELU's exponent floor]); a floor
/// of -inf leaves v as it is (the test's reference).
inline __m512 gelu_exp(__m512 x, __m512 x_sq, float floor = kGeluExponentFloor) {
  const __m512 a = _mm512_set1_ps(-2.0f * kGeluC * kLog2E), b = _mm512_set1_ps(-2.0f * kGeluC * kGeluK * kLog2E);
  return exp2_16(_mm512_max_ps(_mm512_set1_ps(floor), _mm512_mul_ps(x, _mm512_fmadd_ps(b, x_sq, a))));
}

/// GELU(x), tanh form: x sigmoid(2u).
inline __m512 gelu_tanh16(__m512 x, float floor = kGeluExponentFloor) {
  const __m512 e = gelu_exp(x, _mm512_mul_ps(x, x), floor);
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/// dy · GELU'(x), tanh form, with s = sigmoid(2u): dy (s + x s (1 - s) 2u'),
/// 2u' = 2 sqrt(2/pi) (1 + 3 0.044715 x^2). x s is taken first: where s is 0
/// (x very negative) the term is 0 even once x^2 is huge.
inline __m512 gelu_tanh_backward16(__m512 dy, __m512 x, float floor = kGeluExponentFloor) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 x_sq = _mm512_mul_ps(x, x);
  const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, gelu_exp(x, x_sq, floor)));
  const __m512 du2 = _mm512_fmadd_ps(_mm512_set1_ps(6.0f * kGeluC * kGeluK), x_sq, _mm512_set1_ps(2.0f * kGeluC));
  const __m512 t = _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_sub_ps(one, s));
  return _mm512_mul_ps(dy, _mm512_fmadd_ps(t, du2, s));
}

/// out[i] = GELU(in[i]), i < n (out may equal in).
inline void gelu_tanh_row(float* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, gelu_tanh16(_mm512_loadu_ps(in + i)));
  if (i < n) {
    const __mmask16 m = first_lanes16(n - i);
    _mm512_mask_storeu_ps(out + i, m, gelu_tanh16(_mm512_maskz_loadu_ps(m, in + i)));
  }
}

/// out[i] = dy[i] GELU'(x[i]); an operand whose step is false is one value for the whole row.
/// A row of at least kStreamBytes into a separate output goes out by
/// streaming stores (Note [Streaming stores for fresh outputs]): gpt's
/// [16, 128, 1024] GELU gradient, 8 MB, took 1.2-2.2 ms less per step at 2
/// threads and 1.4-2.0 ms less at 1 (KILN_COMPILE_PROFILE=1, three interleaved
/// pairs each, 2026-12-05). The forward's output is not streamed: its block,
/// freed a moment before, is usually still in cache, and streaming it cost
/// 0.6-1.9 ms more per step.
inline void gelu_tanh_backward_row(float* out, const float* dy, const float* x, int64_t n, bool dy_step, bool x_step) {
  int64_t i = 0;
  if (dy_step && x_step) {
    if (n * static_cast<int64_t>(sizeof(float)) >= kStreamBytes && out != dy && out != x) {
      for (; i < n && reinterpret_cast<uintptr_t>(out + i) % 64 != 0; ++i) {
        const __mmask16 one = 1;
        _mm512_mask_storeu_ps(
            out + i, one, gelu_tanh_backward16(_mm512_maskz_loadu_ps(one, dy + i), _mm512_maskz_loadu_ps(one, x + i)));
      }
      for (; i + 16 <= n; i += 16)
        _mm512_stream_ps(out + i, gelu_tanh_backward16(_mm512_loadu_ps(dy + i), _mm512_loadu_ps(x + i)));
      stream_fence();
    }
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, gelu_tanh_backward16(_mm512_loadu_ps(dy + i), _mm512_loadu_ps(x + i)));
  }
  const __m512 dy0 = _mm512_set1_ps(*dy), x0 = _mm512_set1_ps(*x);
  for (; i < n; i += 16) {
    const __mmask16 m = first_lanes16(n - i);
    const __m512 g = dy_step ? _mm512_maskz_loadu_ps(m, dy + i) : dy0;
    const __m512 v = x_step ? _mm512_maskz_loadu_ps(m, x + i) : x0;
    _mm512_mask_storeu_ps(out + i, m, gelu_tanh_backward16(g, v));
  }
}

/// c[i, 0 .. n) = GELU(c[i, 0 .. n)) in place for rows i < rows (row stride
/// ld floats), split across threads: a product's output, GELU'd after the
/// product rather than as its post-op (Note [GELU after the product] in dnnl_matmul.cpp).
inline void gelu_tanh_rows_in_place(float* c, int64_t rows, int64_t n, int64_t ld) {
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, n)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) gelu_tanh_row(c + r * ld, c + r * ld, n);
  });
}

}  // namespace kiln::kernels::vm

#endif
