// A 16 x 16 transpose of 32-bit words in AVX-512 registers, for the kernels
// that move a block between row-major and column-major order: the small
// products' packing of a transposed operand (small_gemm.cpp) and the copy of
// a channels-last tensor into NCHW order or back (copy.cpp), and the
// transposing copy of a product's operand (transpose_copy.cpp).
//
// Without AVX-512 (an AVX2-only x86 such as many Zen 2/3 and client chips,
// or another architecture) only transpose16_block exists, as plain loops:
// kiln is built with -march=native, so each kernel must compile for whatever
// CPU builds it (Note [Kernels without AVX-512] in docs/decisions.md).
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kiln::kernels::detail {

#if defined(__AVX512F__)

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

/// One block of up to 16 x 16 words: dst word (j, i) at dst[j * dj + i] from
/// src word (i, j) at src[i * si + j], for i < rows, j < cols. A whole block
/// loads and stores without masks (Note [Whole vectors unmasked] in
/// elementwise_math.h); a partial one masks its short rows and columns.
inline void transpose16_block(uint32_t* dst, int64_t dj, const uint32_t* src, int64_t si, int64_t rows, int64_t cols) {
  const __mmask16 row_mask = rows >= 16 ? __mmask16(0xffff) : __mmask16((1u << rows) - 1);
  const __mmask16 col_mask = cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  __m512i r[16];
  for (int64_t i = 0; i < 16; ++i)
    r[i] = i >= rows    ? _mm512_setzero_si512()
           : cols >= 16 ? _mm512_loadu_si512(src + i * si)
                        : _mm512_maskz_loadu_epi32(col_mask, src + i * si);
  transpose16(r);
  for (int64_t j = 0; j < cols && j < 16; ++j) {
    if (rows >= 16) {
      _mm512_storeu_si512(dst + j * dj, r[j]);
    } else {
      _mm512_mask_storeu_epi32(dst + j * dj, row_mask, r[j]);
    }
  }
}

#else

/// One block of up to 16 x 16 words, as above: a block's 16 source rows are
/// 16 lines that stay in L1 while its columns are written out.
inline void transpose16_block(uint32_t* dst, int64_t dj, const uint32_t* src, int64_t si, int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols && j < 16; ++j)
    for (int64_t i = 0; i < rows && i < 16; ++i) dst[j * dj + i] = src[i * si + j];
}

#endif

}  // namespace kiln::kernels::detail
