#pragma once
// Values to and from a 16-bit wire type (internal to src/dist): the
// shared-memory all-reduce and the MPI path of the compressed all-reduce
// (DDP's compression hooks) convert every value they move, so the loops are
// vectorised where the build allows.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kiln/core/half.h"

namespace kiln::dist::detail {

// How an element type goes to and from a wire where values travel as `W` (float, or a 16-bit wire type held as bits)
// and are summed in float.
template <typename W>
struct Wire;
template <>
struct Wire<float> {
  using Bits = float;
  static float widen(float x) { return x; }
  static float narrow(float x) { return x; }
};
template <>
struct Wire<BFloat16> {
  using Bits = uint16_t;
  static float widen(uint16_t b) { return static_cast<float>(BFloat16::from_bits(b)); }
  static uint16_t narrow(float x) { return BFloat16::from_float(x); }
};
template <>
struct Wire<Half> {
  using Bits = uint16_t;
  static float widen(uint16_t b) { return Half::to_float(b); }
  static uint16_t narrow(float x) { return Half::from_float(x); }
};

// n values of type From into To: a copy when they are the same, else each
// rounded to (or widened from) the wire type W, 16 lanes at a time where the
// build has AVX-512 (bfloat16: the integer rounding of BFloat16::from_float,
// NaN made 0x7fc0 alike) or F16C (float16: round to nearest even as
// Half::from_float; only a NaN's payload may differ). These loops run over
// every value the all-reduce moves: scalar, they cost more than the bytes
// they save.
template <typename W, typename To, typename From>
inline void convert(To* dst, const From* src, size_t n) {
  if constexpr (std::is_same_v<To, From>) {
    std::memcpy(dst, src, n * sizeof(To));
  } else if constexpr (std::is_same_v<To, float>) {
    size_t i = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<W, BFloat16>) {
      for (; i + 16 <= n; i += 16) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
      }
    } else {
      for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    }
#elif defined(__F16C__) && defined(__AVX__)
    if constexpr (std::is_same_v<W, Half>) {
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = Wire<W>::widen(src[i]);
  } else {
    size_t i = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<W, BFloat16>) {
      const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x7fc0);
      const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
      for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, odd)), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
        r = _mm512_mask_mov_epi32(r, nan, quiet);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
      }
    } else {
      for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
#elif defined(__F16C__) && defined(__AVX__)
    if constexpr (std::is_same_v<W, Half>) {
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; ++i) dst[i] = Wire<W>::narrow(src[i]);
  }
}

}  // namespace kiln::dist::detail
