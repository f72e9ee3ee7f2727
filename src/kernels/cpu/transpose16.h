// A 16 x 16 transpose of 32-bit words in AVX-512 registers, for the kernels
// that move a block between row-major and column-major order: the small
// products' packing of a transposed operand (small_gemm.cpp) and the copy of
// a channels-last tensor into NCHW order or back (copy.cpp).
#pragma once

#include <immintrin.h>

namespace kiln::kernels::detail {

/// Transposes a 16 x 16 block of 32-bit words in registers: r[i] holds row i
/// before, column i after.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // Rows 4g..4g+3: u[4g + c] holds, in each 128-bit lane L, column 4L + c of those four rows.
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x01, y01, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x01, y01, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x23, y23, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x23, y23, 0xDD);
  }
}

}  // namespace kiln::kernels::detail
