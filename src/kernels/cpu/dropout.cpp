// Dropout's float32 kernels (kiln/kernels/dropout.h).
#include "kiln/kernels/dropout.h"

#include <algorithm>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KILN_DROPOUT_AVX512 1
#endif

#include "kiln/core/capture.h"
#include "kiln/core/generator.h"
#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"

namespace kiln::kernels {

namespace {
// Elements a thread draws into its stack buffer and applies at once: whole
// Philox blocks, and the buffer stays in L1.
constexpr int64_t kChunk = 1024;
}  // namespace

void dropout_forward(const float* x, float* out, uint8_t* keep, int64_t n, uint64_t key, uint64_t first_block,
                     float keep_below, float scale) {
  parallel_for((n + kChunk - 1) / kChunk, 16, [&](int64_t c0, int64_t c1) {
    alignas(64) float u[kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * kChunk, len = std::min(kChunk, n - lo);
      detail::philox_uniform_floats(u, len, key, first_block + static_cast<uint64_t>(lo / 4), 0.0f, 1.0f);
      int64_t i = 0;
#ifdef KILN_DROPOUT_AVX512
      // x * (+0 or scale), as the scalar loop: NaN for an infinite or NaN x, -0 for a negative one.
      const __m512 below = _mm512_set1_ps(keep_below), vscale = _mm512_set1_ps(scale);
      for (; i + 16 <= len; i += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_load_ps(u + i), below, _CMP_LT_OQ);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + lo + i), _mm_maskz_set1_epi8(k, 1));
        _mm512_storeu_ps(out + lo + i, _mm512_mul_ps(_mm512_loadu_ps(x + lo + i), _mm512_maskz_mov_ps(k, vscale)));
      }
#endif
      for (; i < len; ++i) {
        const bool k = u[i] < keep_below;
        keep[lo + i] = k;
        out[lo + i] = x[lo + i] * (k ? scale : 0.0f);
      }
    }
  });
}

void dropout_backward(const float* g, const uint8_t* keep, float scale, float* gx, int64_t n) {
  KILN_CAPTURE_KERNEL("dropout_backward", dropout_backward(g, keep, scale, gx, n));
  parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) {
    int64_t i = b;
#ifdef KILN_DROPOUT_AVX512
    const __m512 vscale = _mm512_set1_ps(scale);
    for (; i + 16 <= e; i += 16) {
      const __mmask16 k = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + i)),
                                             _mm_set1_epi8(static_cast<char>(0xff)));
      _mm512_storeu_ps(gx + i, _mm512_mul_ps(_mm512_loadu_ps(g + i), _mm512_maskz_mov_ps(k, vscale)));
    }
#endif
    for (; i < e; ++i) gx[i] = g[i] * (keep[i] ? scale : 0.0f);
  });
}

}  // namespace kiln::kernels
