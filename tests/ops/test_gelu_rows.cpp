// GELU's vector rows (src/kernels/cpu/gelu_rows.h) against the same rows
// without Note [GELU's exponent floor]: the floor keeps 2^v normal where it
// used to pass through the subnormals, and must leave every bit of GELU and
// of its gradient as it was. Every 7th float bit pattern, and every float
// where 2^v reaches the floor or the subnormals (x from 4 to 12, either sign).
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>

#include "kernels/cpu/gelu_rows.h"

#ifdef KILN_GELU_ROWS

namespace {

using namespace kiln::kernels::vm;

// gelu_exp, gelu_tanh16 and gelu_tanh_backward16 as they were before the floor.
__m512 unfloored_exp(__m512 x, __m512 x_sq) {
  const __m512 a = _mm512_set1_ps(-2.0f * kGeluC * kLog2E), b = _mm512_set1_ps(-2.0f * kGeluC * kGeluK * kLog2E);
  return exp2_16(_mm512_mul_ps(x, _mm512_fmadd_ps(b, x_sq, a)));
}

__m512 unfloored_forward(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), unfloored_exp(x, _mm512_mul_ps(x, x))));
}

__m512 unfloored_backward(__m512 dy, __m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 x_sq = _mm512_mul_ps(x, x);
  const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, unfloored_exp(x, x_sq)));
  const __m512 du2 = _mm512_fmadd_ps(_mm512_set1_ps(6.0f * kGeluC * kGeluK), x_sq, _mm512_set1_ps(2.0f * kGeluC));
  const __m512 t = _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_sub_ps(one, s));
  return _mm512_mul_ps(dy, _mm512_fmadd_ps(t, du2, s));
}

// Lanes of 16 consecutive bit patterns from `first` whose results differ.
int differing(uint32_t first) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)), lane));
  const __m512 dy = _mm512_set1_ps(0.37f);
  const auto bits = [](__m512 v) { return _mm512_castps_si512(v); };
  const __mmask16 m = _mm512_cmpneq_epi32_mask(bits(gelu_tanh16(x)), bits(unfloored_forward(x))) |
                      _mm512_cmpneq_epi32_mask(bits(gelu_tanh_backward16(dy, x)), bits(unfloored_backward(dy, x)));
  return __builtin_popcount(m);
}

TEST(GeluRows, TheExponentFloorLeavesEveryBit) {
  int64_t bad = 0;
  for (uint64_t first = 0; first < (uint64_t{1} << 32); first += 16 * 7) bad += differing(static_cast<uint32_t>(first));
  for (const float sign : {1.0f, -1.0f}) {
    const uint32_t lo = std::bit_cast<uint32_t>(4.0f * sign), hi = std::bit_cast<uint32_t>(12.0f * sign);
    for (uint32_t first = lo; first < hi; first += 16) bad += differing(first);
  }
  EXPECT_EQ(bad, 0);
}

}  // namespace

#endif
