// Internal to the elementwise kernels: math functions that vectorise.
//
// Note [Vectorised transcendentals through libmvec]
// glibc ships SIMD versions of expf, logf, tanhf, erff... (libmvec, ≤ 4 ulp,
// NaN/Inf handled as the scalar functions do), but <math.h> only declares
// them to the compiler under -ffast-math, which we must not use (results stay
// IEEE). Measured with GCC 12 -O3 -march=native: std::exp in a loop does not
// vectorise, not even with -fno-math-errno set per file by pragma. So we
// declare our own aliases of the scalar functions (same symbol, through an
// asm label) carrying `simd` and `const`: the vectoriser then calls
// _ZGVeN16v_expf (AVX-512), _ZGVdN8v_expf (AVX2)... from libmvec, which the
// libm linker script pulls in as needed. `const` is safe because no kernel
// reads errno. Elsewhere (no glibc, clang) the plain std:: functions are used.
//
// sqrt has no libmvec version and GCC will not vectorise std::sqrt while
// errno is live (it keeps a branch to the library call), so sqrt rows use
// intrinsics; IEEE sqrt is correctly rounded, so every path agrees bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "intrinsics.h"
#include "kiln/core/half.h"

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && !defined(KILN_NO_LIBMVEC)
#define KILN_HAVE_LIBMVEC 1
#define KILN_MVEC __attribute__((simd("notinbranch"), const, nothrow, leaf))
extern "C" {
KILN_MVEC float kiln_mvec_expf(float) __asm__("expf");
KILN_MVEC double kiln_mvec_exp(double) __asm__("exp");
KILN_MVEC float kiln_mvec_logf(float) __asm__("logf");
KILN_MVEC double kiln_mvec_log(double) __asm__("log");
KILN_MVEC float kiln_mvec_log1pf(float) __asm__("log1pf");
KILN_MVEC double kiln_mvec_log1p(double) __asm__("log1p");
KILN_MVEC float kiln_mvec_sinf(float) __asm__("sinf");
KILN_MVEC double kiln_mvec_sin(double) __asm__("sin");
KILN_MVEC float kiln_mvec_cosf(float) __asm__("cosf");
KILN_MVEC double kiln_mvec_cos(double) __asm__("cos");
KILN_MVEC float kiln_mvec_tanhf(float) __asm__("tanhf");
KILN_MVEC double kiln_mvec_tanh(double) __asm__("tanh");
KILN_MVEC float kiln_mvec_erff(float) __asm__("erff");
KILN_MVEC double kiln_mvec_erf(double) __asm__("erf");
KILN_MVEC float kiln_mvec_powf(float, float) __asm__("powf");
KILN_MVEC double kiln_mvec_pow(double, double) __asm__("pow");
}
#undef KILN_MVEC
#endif

namespace kiln::kernels::vm {

#ifdef KILN_HAVE_LIBMVEC
inline float exp(float x) { return kiln_mvec_expf(x); }
inline double exp(double x) { return kiln_mvec_exp(x); }
inline float log(float x) { return kiln_mvec_logf(x); }
inline double log(double x) { return kiln_mvec_log(x); }
inline float log1p(float x) { return kiln_mvec_log1pf(x); }
inline double log1p(double x) { return kiln_mvec_log1p(x); }
inline float sin(float x) { return kiln_mvec_sinf(x); }
inline double sin(double x) { return kiln_mvec_sin(x); }
inline float cos(float x) { return kiln_mvec_cosf(x); }
inline double cos(double x) { return kiln_mvec_cos(x); }
inline float tanh(float x) { return kiln_mvec_tanhf(x); }
inline double tanh(double x) { return kiln_mvec_tanh(x); }
inline float erf(float x) { return kiln_mvec_erff(x); }
inline double erf(double x) { return kiln_mvec_erf(x); }
inline float pow(float x, float y) { return kiln_mvec_powf(x, y); }
inline double pow(double x, double y) { return kiln_mvec_pow(x, y); }
#else
template <typename C>
inline C exp(C x) {
  return std::exp(x);
}
template <typename C>
inline C log(C x) {
  return std::log(x);
}
template <typename C>
inline C log1p(C x) {
  return std::log1p(x);
}
template <typename C>
inline C sin(C x) {
  return std::sin(x);
}
template <typename C>
inline C cos(C x) {
  return std::cos(x);
}
template <typename C>
inline C tanh(C x) {
  return std::tanh(x);
}
template <typename C>
inline C erf(C x) {
  return std::erf(x);
}
template <typename C>
inline C pow(C x, C y) {
  return std::pow(x, y);
}
#endif

/// out[i] = sqrt(in[i]) (out may equal in).
inline void sqrt_row(float* out, const float* in, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_sqrt_ps(_mm512_loadu_ps(in + i)));
#elif defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_sqrt_ps(_mm256_loadu_ps(in + i)));
#endif
  for (; i < n; ++i) out[i] = std::sqrt(in[i]);
}

inline void sqrt_row(double* out, const double* in, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 8 <= n; i += 8) _mm512_storeu_pd(out + i, _mm512_sqrt_pd(_mm512_loadu_pd(in + i)));
#elif defined(__AVX__)
  for (; i + 4 <= n; i += 4) _mm256_storeu_pd(out + i, _mm256_sqrt_pd(_mm256_loadu_pd(in + i)));
#endif
  for (; i < n; ++i) out[i] = std::sqrt(in[i]);
}

/// out[i] = 1 / sqrt(in[i]): a true division, not the approximate rsqrt instruction (torch does the same).
/// Works in L1-sized pieces so the division re-reads sqrt's results from cache.
template <typename C>
inline void rsqrt_row(C* out, const C* in, int64_t n) {
  constexpr int64_t kPiece = 512;
  for (int64_t i0 = 0; i0 < n; i0 += kPiece) {
    const int64_t m = n - i0 < kPiece ? n - i0 : kPiece;
    sqrt_row(out + i0, in + i0, m);
    C* o = out + i0;
    for (int64_t i = 0; i < m; ++i) o[i] = C(1) / o[i];
  }
}

/// float16 <-> float rows. Half's scalar conversions branch (subnormals, NaN)
/// and do not vectorise; F16C converts 8 or 16 at a time with the same
/// round-to-nearest-even, so results are identical (NaN stays NaN).
inline void half_to_float_row(float* dst, const Half* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void float_to_half_row(Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; ++i) dst[i] = Half(src[i]);
}

/// bfloat16 <-> float rows. Widening is a shift; narrowing rounds as
/// BFloat16(float), torch's c10::BFloat16, does: to nearest even, NaN to
/// 0x7fc0, subnormals kept (Note [bf16 rounding by VCVTNE2PS2BF16]).
///
/// Note [bf16 rounding by VCVTNE2PS2BF16]
/// BFloat16's integer rounding takes nine vector instructions per 16 values.
/// VCVTNE2PS2BF16 (AVX512-BF16) rounds 32 values to nearest even in one, and
/// differs from BFloat16 only on NaN (it keeps sign and payload) and on
/// subnormal inputs (flushed to zero). A VFPCLASSPS test per vector sends a
/// vector holding either to the integer form, so every bit stays BFloat16's.
/// Standalone, on an L1-resident row (1 thread, 2026-12-05): 0.039 ns per value
/// against 0.095 for the integer form. Stop 57 tried the one-vector
/// VCVTNEPS2BF16 inside GELU's rows and measured no gain; the two-vector form
/// on whole rows took bf16 GELU's forward on an L2-resident block from
/// 29.8-40.4 to 25.4-35.8 us (best of 40, two interleaved pairs).
#if defined(__AVX512F__)
// Note [Whole vectors unmasked]
// A loop that loaded every vector under a mask, full or not, ran slower in
// gpt's step on this machine (AMD EPYC, family 26) than the same loop with
// plain loads, though no slower in isolation, where its operands stay in
// cache: layer norm's backward at 6.6 against 3.8 ms per float32 step
// (Note [Layer norm backward in two passes]); the bf16 small products'
// pair packing (pack_pairs_of_rows) at 1.4-1.6 % of the bf16 step's samples
// against 0.8-1.2 %, and the float32 tile at 4.0-4.2 % against 3.5 % (perf at
// 2 kHz, 1 thread, two interleaved pairs each, 2026-12-05). The cause was
// not pinned down. Hot loops load whole vectors plainly and keep the mask
// for a row's short last vector.
/// The mask of the first n of 16 lanes (all 16 from n = 16 on): a row's last, partial vector.
inline __mmask16 first_lanes16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

/// 16 bf16 (the low halves of 16 words) widened to float: exact.
inline __m512 bf16x16_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// 16 floats rounded to bf16 as BFloat16(float) rounds them: to nearest even
/// on the integer bits, any NaN to 0x7fc0.
inline __m256i float_to_bf16x16_int(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

#if defined(__AVX512BF16__)
/// Lanes the instruction would round otherwise than BFloat16: NaN (quiet or signalling) and subnormal.
inline __mmask16 bf16_special_lanes(__m512 f) { return _mm512_fpclass_ps_mask(f, 0x01 | 0x80 | 0x20); }
#endif

/// float_to_bf16x16_int's bits, by VCVTNEPS2BF16 where it gives them.
inline __m256i float_to_bf16x16(__m512 f) {
#if defined(__AVX512BF16__)
  if (__builtin_expect(bf16_special_lanes(f) == 0, 1)) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
#endif
  return float_to_bf16x16_int(f);
}

#if defined(__AVX512BF16__)
/// 32 floats rounded as float_to_bf16x16 rounds them, into dst[0..32).
inline __m512i float_to_bf16x32_vec(__m512 lo, __m512 hi) {
  if (__builtin_expect(_kortestz_mask16_u8(bf16_special_lanes(lo), bf16_special_lanes(hi)), 1))
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  return _mm512_inserti64x4(_mm512_castsi256_si512(float_to_bf16x16_int(lo)), float_to_bf16x16_int(hi), 1);
}
inline void float_to_bf16x32(BFloat16* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, float_to_bf16x32_vec(lo, hi));
}
#endif
#endif

inline void bf16_to_float_row(float* dst, const BFloat16* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void float_to_bf16_row(BFloat16* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (; i + 32 <= n; i += 32) float_to_bf16x32(dst + i, _mm512_loadu_ps(src + i), _mm512_loadu_ps(src + i + 16));
#endif
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), float_to_bf16x16(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = BFloat16(src[i]);
}

// Note [Streaming stores for fresh outputs]
// A store to a line that is not in this core's cache first reads the line
// (read for ownership), and a freshly allocated output's lines are usually
// cold or, at 2 threads, dirty in the other core's cache: the store then
// waits on a cross-core transfer (106-496 ns a round trip on this machine,
// bench "Parallel regions"). Layer norm's backward writes its [2048, 256]
// input gradient that way and ran slower at 2 threads than at 1 (in gpt's
// step, 3.8-4.7 ms against 3.0-4.3 ms per step). Non-temporal stores write
// whole lines without reading them: 2.1-2.6 ms at 2 threads, and GELU's
// backward (gelu_rows.h) with the adds 5.5-6.4 -> 4.2-4.9 ms (gpt's float32
// step, KILN_COMPILE_PROFILE=1, five interleaved pairs, 2026-12-05); the add
// that reads the gradient next did not slow down. The machine has quieter
// spells in which the plain stores' backward ran at 2.1 ms, and streaming
// was then 0.2-0.5 ms slower in two pairs of three; at 1 thread the
// difference was within +-0.3 ms. bf16 GELU's gradient (4 MB in gpt) is not
// streamed: streaming it made `binary` itself faster at 2 threads (4.4-7.6 ->
// 3.9-5.3 ms per step), but the three ops that read it next (c_fc's input and
// weight gradient products and its bias gradient's sum) slower, and all four
// together took 0.6-1.3 ms more per bf16 step at 2 threads and 1.2 ms more at
// 1 (`--profile table`, medians of two sets of six interleaved pairs and of
// four pairs, 2026-12-06). The float32 gradient (8 MB) still streams: at 1
// thread GELU's backward alone was 0.4-1.0 ms faster streaming, and the
// products after it gave back at most about as much (four pairs); at 2
// threads the pairs were too noisy to say.
//
// Streaming stores bypass the cache, so they pay only for outputs too large
// to stay there until read (a thread writing kStreamBytes or more) and whose
// lines are not already in cache: a forward output often lands in a block
// freed a moment before, and streaming GELU's forward output was slower. A
// thread that streamed must fence (stream_fence) before another thread may
// read what it wrote.
inline constexpr int64_t kStreamBytes = int64_t{1} << 20;

/// dst[0..n) = src[0..n), the 64-byte lines of dst that lie wholly inside it
/// written by non-temporal stores (the rest by plain ones). The values are
/// src's bits: only how they reach memory changes.
inline void stream_row(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const int64_t lead = std::min<int64_t>(n, ((64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64) / 4);
  if (reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
    for (; i < lead; ++i) dst[i] = src[i];
    for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

/// Orders this thread's streaming stores before whatever it does next (a
/// parallel region's end, where other threads start reading them).
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Integer arithmetic that wraps modulo 2^bits, as torch's does, without the
// undefined behaviour of signed overflow in C++ (UBSan builds check this).
template <typename T>
inline T wrapping_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <typename T>
inline T wrapping_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  // uint8 * uint8 promotes to int: widen to unsigned first so it cannot overflow either.
  using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
  return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
}
template <typename T>
inline T wrapping_neg(T x) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(U(0) - static_cast<U>(x)));
}

/// torch's powi: exact integer power by squaring (wrapping); a negative
/// exponent gives 1 for base 1, +-1 for base -1, and 0 otherwise.
template <typename T>
inline T int_pow(T base, T exp) {
  if constexpr (std::is_signed_v<T>) {
    if (exp < 0) {
      if (base == 1) return 1;
      if (base == -1) return (exp % 2) != 0 ? T(-1) : T(1);
      return 0;
    }
  }
  T result = 1;
  while (exp) {
    if (exp & 1) result = wrapping_mul(result, base);
    exp = static_cast<T>(exp / 2);
    base = wrapping_mul(base, base);
  }
  return result;
}

}  // namespace kiln::kernels::vm
