// transpose_copy (transpose_copy.h): 16 x 16 blocks of 32-bit words turned
// in registers (transpose16.h, as the channels-last copies in copy.cpp do);
// 2-byte elements are widened to words for the turn and narrowed back, which
// moves their bits unchanged.
#include "transpose_copy.h"

#include <algorithm>

#include "kiln/core/error.h"
#include "kiln/core/parallel.h"

#if defined(__AVX512F__)
#include "intrinsics.h"  // before transpose16.h: GCC 12's false warnings silenced
#include "transpose16.h"
#endif

namespace kiln::kernels::detail {

namespace {

// dst rows [c0, c1) (src columns), all src rows, one element at a time.
template <typename T>
void turn_scalar(const T* src, int64_t ld, int64_t rows, T* dst, int64_t c0, int64_t c1, int64_t r0) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t r = r0; r < rows; ++r) dst[c * rows + r] = src[r * ld + c];
}

#if defined(__AVX512F__)
// 32 x 16 of 2-byte elements: src rows r..r+31, columns c..c+15 -> dst rows
// c..c+15, columns r..r+31, so each dst row gets a whole 64-byte line.
inline void turn32x16_halves(const uint16_t* src, int64_t ld, uint16_t* dst, int64_t rows, int64_t r, int64_t c) {
  __m512i lo[16], hi[16];
  for (int i = 0; i < 16; ++i) {
    lo[i] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (r + i) * ld + c)));
    hi[i] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (r + 16 + i) * ld + c)));
  }
  transpose16(lo);
  transpose16(hi);
  for (int i = 0; i < 16; ++i) {
    const __m512i both =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo[i])), _mm512_cvtepi32_epi16(hi[i]), 1);
    _mm512_storeu_si512(dst + (c + i) * rows + r, both);
  }
}
#endif

// dst rows [c0, c1): 4-byte elements in blocks of up to 16 x 16 (transpose16.h,
// each 64 bytes of a dst row at once); 2-byte ones in whole 32 x 16 blocks, the
// edges one by one.
template <typename T>
void turn_rows(const T* src, int64_t ld, int64_t rows, T* dst, int64_t c0, int64_t c1) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    const auto* s = reinterpret_cast<const uint32_t*>(src);
    auto* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t c = c0; c < c1; c += 16)
      for (int64_t r = 0; r < rows; r += 16)
        transpose16_block(d + c * rows + r, rows, s + r * ld + c, ld, std::min<int64_t>(16, rows - r),
                          std::min<int64_t>(16, c1 - c));
    return;
  } else {
    const int64_t whole = rows / 32 * 32;
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      for (int64_t r = 0; r < whole; r += 32)
        turn32x16_halves(reinterpret_cast<const uint16_t*>(src), ld, reinterpret_cast<uint16_t*>(dst), rows, r, c);
      turn_scalar(src, ld, rows, dst, c, c + 16, whole);
    }
    turn_scalar(src, ld, rows, dst, c, c1, 0);
    return;
  }
#endif
  turn_scalar(src, ld, rows, dst, c0, c1, 0);
}

template <typename T>
void transpose_as(const void* src, int64_t ld, int64_t rows, int64_t cols, void* dst) {
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  // 16 dst rows per unit: one block column; a grain of a few units keeps each
  // thread's share of src lines (64 bytes = 16 or 32 columns) its own.
  const int64_t units = (cols + 15) / 16;
  parallel_for(units, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, 16 * rows)),
               [&](int64_t lo, int64_t hi) { turn_rows(s, ld, rows, d, lo * 16, std::min(cols, hi * 16)); });
}

}  // namespace

void transpose_copy(DType dt, const void* src, int64_t ld, int64_t rows, int64_t cols, void* dst) {
  KILN_ASSERT(ld >= cols, "transpose_copy: row stride below the row length");
  switch (element_size(dt)) {
    case 4: return transpose_as<uint32_t>(src, ld, rows, cols, dst);
    case 2: return transpose_as<uint16_t>(src, ld, rows, cols, dst);
    default: KILN_ASSERT(false, "transpose_copy: 4- or 2-byte elements only");
  }
}

}  // namespace kiln::kernels::detail
