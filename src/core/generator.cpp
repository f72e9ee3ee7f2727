#include "kiln/core/generator.h"

#include <cmath>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kiln/core/capture.h"

namespace kiln {

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {c0, c1, c2, c3};
}

namespace detail {

namespace {
float uniform_of(uint32_t w, float a, float span) {
  const float u = static_cast<float>(w >> 8) * (1.0f / 16777216.0f);  // exact
  return std::fma(span, u, a);
}
}  // namespace

// Note [Philox sixteen at a time]
// One Philox block a step costs about 25 integer operations per float32
// value, and rand's fill ran at about 1 ns a value at 2 threads: with dropout
// 0.1, configs/gpt_mobydick.toml spent 15 % of its step drawing the masks.
// AVX-512 runs sixteen counters' rounds side by side, two such groups at once
// (a round waits on the one before, so one group left the multiplier idle):
// each 32 x 32 -> 64-bit product of a round is VPMULUDQ on the even lanes and
// on the odd lanes shifted down, whose high and low halves one permute each
// picks back into sixteen lanes (on another port than the multiplies), and
// the key goes in with one three-way xor. The
// four words of sixteen blocks are then turned into 64 consecutive values
// (a 4 x 4 transpose within 128-bit lanes, then one across them). The words
// are Philox's own and a + span * u is one fused multiply-add, as the scalar
// code computes it (GCC contracts it there), so every value has the scalar
// loop's bits (Philox.UniformFloatsHaveTheScalarBits in tests/core/test_rng.cpp).
void philox_uniform_floats(float* out, int64_t n, uint64_t key, uint64_t first_block, float a, float span) {
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kM0)), m1 = _mm512_set1_epi32(static_cast<int>(kM1));
  const __m512i step16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(1.0f / 16777216.0f), va = _mm512_set1_ps(a), vspan = _mm512_set1_ps(span);
  // The high and low 32-bit halves of x * m in each of sixteen lanes: lane i
  // takes them from its own product, in `even` for even i and in `odd`
  // (indices 16 + ...) for odd i.
  const __m512i pick_hi = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  const __m512i pick_lo = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const auto mul_hi_lo = [&](__m512i x, __m512i m, __m512i& hi, __m512i& lo) {
    const __m512i even = _mm512_mul_epu32(x, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), m);
    hi = _mm512_permutex2var_epi32(even, pick_hi, odd);
    lo = _mm512_permutex2var_epi32(even, pick_lo, odd);
  };
  // Counter words of the sixteen blocks from `base`: c0, c1 the counter's low and high 32 bits, c2 = c3 = 0.
  const auto counters = [&](uint64_t base, __m512i& c0, __m512i& c1) {
    const __m512i lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base)));
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32)));
    c0 = _mm512_add_epi32(lo, step16);
    // A low word that wrapped past 2^32 carries into the high word.
    c1 = _mm512_mask_add_epi32(hi, _mm512_cmplt_epu32_mask(c0, lo), hi, _mm512_set1_epi32(1));
  };
  const auto round = [&](__m512i* c, __m512i k0, __m512i k1) {
    __m512i hi0, lo0, hi1, lo1;
    mul_hi_lo(c[0], m0, hi0, lo0);
    mul_hi_lo(c[2], m1, hi1, lo1);
    c[0] = _mm512_ternarylogic_epi32(hi1, c[1], k0, 0x96);  // three-way xor
    c[1] = lo1;
    c[2] = _mm512_ternarylogic_epi32(hi0, c[3], k1, 0x96);
    c[3] = lo0;
  };
  // The 64 values of sixteen blocks' words c into out.
  const auto emit = [&](const __m512i* c, float* o) {
    __m512 f[4];
    for (int w = 0; w < 4; ++w)
      f[w] = _mm512_fmadd_ps(vspan, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c[w], 8)), scale), va);
    // f[w] lane b is block b's word w; out wants block 0's four words, then block 1's...
    const __m512 t0 = _mm512_unpacklo_ps(f[0], f[1]), t1 = _mm512_unpackhi_ps(f[0], f[1]);
    const __m512 t2 = _mm512_unpacklo_ps(f[2], f[3]), t3 = _mm512_unpackhi_ps(f[2], f[3]);
    const auto lo_pd = [](__m512 x, __m512 y) {
      return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
    };
    const auto hi_pd = [](__m512 x, __m512 y) {
      return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
    };
    // u[j]'s 128-bit lane l holds block 4 l + j.
    const __m512 u0 = lo_pd(t0, t2), u1 = hi_pd(t0, t2), u2 = lo_pd(t1, t3), u3 = hi_pd(t1, t3);
    const __m512 v01lo = _mm512_shuffle_f32x4(u0, u1, 0x44), v23lo = _mm512_shuffle_f32x4(u2, u3, 0x44);
    const __m512 v01hi = _mm512_shuffle_f32x4(u0, u1, 0xEE), v23hi = _mm512_shuffle_f32x4(u2, u3, 0xEE);
    _mm512_storeu_ps(o, _mm512_shuffle_f32x4(v01lo, v23lo, 0x88));
    _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(v01lo, v23lo, 0xDD));
    _mm512_storeu_ps(o + 32, _mm512_shuffle_f32x4(v01hi, v23hi, 0x88));
    _mm512_storeu_ps(o + 48, _mm512_shuffle_f32x4(v01hi, v23hi, 0xDD));
  };
  // G groups of sixteen blocks from `base`, their 64 G values into o.
  const auto draw = [&](auto groups, uint64_t base, float* o) {
    constexpr int G = decltype(groups)::value;
    __m512i c[G][4];
    for (int g = 0; g < G; ++g) {
      counters(base + static_cast<uint64_t>(16 * g), c[g][0], c[g][1]);
      c[g][2] = c[g][3] = _mm512_setzero_si512();
    }
    uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0)), vk1 = _mm512_set1_epi32(static_cast<int>(k1));
      for (int g = 0; g < G; ++g) round(c[g], vk0, vk1);
      k0 += kW0;
      k1 += kW1;
    }
    for (int g = 0; g < G; ++g) emit(c[g], o + 64 * g);
  };
  for (; i + 128 <= n; i += 128)
    draw(std::integral_constant<int, 2>{}, first_block + static_cast<uint64_t>(i / 4), out + i);
  for (; i + 64 <= n; i += 64)
    draw(std::integral_constant<int, 1>{}, first_block + static_cast<uint64_t>(i / 4), out + i);
#endif
  // One block for each four values (i is a multiple of 4 here).
  for (; i < n; i += 4) {
    const auto w = philox4x32(key, 0, first_block + static_cast<uint64_t>(i / 4));
    for (int64_t l = 0; l < 4 && i + l < n; ++l) out[i + l] = uniform_of(w[static_cast<size_t>(l)], a, span);
  }
}

}  // namespace detail

void Generator::manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = {seed, 0};
}

uint64_t Generator::initial_seed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_.seed;
}

GeneratorState Generator::get_state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

void Generator::set_state(const GeneratorState& s) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = s;
}

uint64_t Generator::reserve(uint64_t blocks) {
  // Every draw comes through here. The tensor fills (rand, randn, randint,
  // randperm, dropout's mask) reserve inside a recorded host write, which a
  // replay runs again: it reserves anew, as the eager step would. A draw made
  // anywhere else would repeat the capture's numbers on replay and leave the
  // offset where it was, so it is a graph break.
  if (blocks > 0) capture::graph_break_if_recording("random numbers (dropout, rand, randn, randperm...)");
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t first = state_.offset;
  state_.offset += blocks;
  return first;
}

Generator& default_generator() {
  static Generator g;
  return g;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace kiln
