// GELU's vector rows (src/kernels/cpu/gelu_rows.h) against the same rows
// without Note [GELU's exponent floor]: the floor keeps 2^v normal where it
// used to pass through the subnormals, and must leave every bit of GELU and
// of its gradient as it was. Every 7th float bit pattern, and every float
// where 2^v reaches the floor or the subnormals (x from 4 to 12, either sign).
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <limits>

#include "kernels/cpu/gelu_rows.h"

#ifdef KILN_GELU_ROWS

namespace {

using namespace kiln::kernels::vm;

// Lanes of 16 consecutive bit patterns from `first` whose results differ.
int differing(uint32_t first) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)), lane));
  const __m512 dy = _mm512_set1_ps(0.37f);
  const auto bits = [](__m512 v) { return _mm512_castps_si512(v); };
  // A floor of -inf: the rows as they were before the floor (VMAXPS with -inf returns v).
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const __mmask16 m =
      _mm512_cmpneq_epi32_mask(bits(gelu_tanh16(x)), bits(gelu_tanh16(x, kNone))) |
      _mm512_cmpneq_epi32_mask(bits(gelu_tanh_backward16(dy, x)), bits(gelu_tanh_backward16(dy, x, kNone)));
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
