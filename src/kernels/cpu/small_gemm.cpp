// kiln's bfloat16 and float32 products for batches of small matrices: Note
// [Small products] in small_gemm.h.
//
// Layout of the packed operands, in 32-bit words each holding two bf16 of
// consecutive k (k even in the low half, as VDPBF16PS pairs them):
//   b: word (kk, j) at bp[kk * ldb + j], ldb a multiple of 32, so one k pair
//      of 16 columns is one vector load;
//   a: read where it lies when its rows are contiguous in k (k even), packed
//      [kk][i] when its columns are (a transposed view: Pᵀ, dSᵀ), [i][kk]
//      otherwise. Odd k is padded with a zero pair half in both operands.
#include "small_gemm.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "elementwise_math.h"
#include "kiln/core/error.h"
#include "kiln/core/parallel.h"
#include "transpose16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KILN_SMALL_GEMM 1
#include "intrinsics.h"
#endif

namespace kiln::kernels::detail {

namespace {
constexpr int64_t kMaxDim = 512;
constexpr int64_t kTinyMacs = int64_t{1} << 17;  // Note [Tiny products]
}  // namespace

bool small_matmul_fits(const MatmulArgs& g) {
#ifdef KILN_SMALL_GEMM
  return (g.dtype == kBFloat16 || g.dtype == kFloat32) && g.epilogue == MatmulEpilogue::None && !g.bias && !g.addend &&
         g.m > 0 && g.n > 0 && g.k > 0 && g.m <= kMaxDim && g.n <= kMaxDim && g.k <= kMaxDim;
#else
  (void)g;
  return false;
#endif
}

bool small_matmul_applies(const MatmulArgs& g) { return g.outer * g.batch >= 2 && small_matmul_fits(g); }

bool tiny_matmul_applies(const MatmulArgs& g) {
#ifdef KILN_SMALL_GEMM
  return g.dtype == kFloat32 && g.outer == 1 && g.batch == 1 && g.band.kind == MatmulBand::Kind::None &&
         g.epilogue == MatmulEpilogue::None && !g.addend && g.m > 0 && g.n > 0 && g.k > 0 && g.m <= kMaxDim &&
         g.n <= kMaxDim && g.k <= kMaxDim && g.m * g.n * g.k <= kTinyMacs;
#else
  (void)g;
  return false;
#endif
}

#ifdef KILN_SMALL_GEMM

namespace {

constexpr int kRows = 6;     // rows of c per register tile
constexpr int kVectors = 4;  // 16-column vectors of c per register tile: 24 accumulators
// A tile issues one of its PrefetchLines every this many depth steps (Note
// [Prefetching inside the tiles] in small_gemm.h).
constexpr int64_t kPrefetchEvery = 2;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

uint32_t load_word(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

uint32_t pair(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16); }

// c[0..MR) x [0..16 NV) = a · b for one register tile, rounded to bf16 at the
// store; `last` masks the columns of the last vector. a's word (r, kk) is at
// a + r * a_rs + kk * a_ks (in bf16 elements).
template <int MR, int NV>
struct TileBf16 {
  static void run(int64_t kp, const uint16_t* a, int64_t a_rs, int64_t a_ks, const uint32_t* bp, int64_t ldb,
                  uint16_t* c, int64_t ldc, __mmask16 last, const char* const* pf, int64_t pf_n);
};

template <int MR, int NV>
void TileBf16<MR, NV>::run(int64_t kp, const uint16_t* a, int64_t a_rs, int64_t a_ks, const uint32_t* bp, int64_t ldb,
                           uint16_t* c, int64_t ldc, __mmask16 last, const char* const* pf, int64_t pf_n) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pf_steps = pf_n * kPrefetchEvery;
  for (int64_t kk = 0; kk < kp; ++kk) {
    if (kk < pf_steps && kk % kPrefetchEvery == 0) _mm_prefetch(pf[kk / kPrefetchEvery], _MM_HINT_T1);
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bp + kk * ldb + v * 16));
    for (int r = 0; r < MR; ++r) {
      const __m512bh ar =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(load_word(a + r * a_rs + kk * a_ks))));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) {
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][v]));
      uint16_t* dst = c + r * ldc + v * 16;
      if (v == NV - 1)
        _mm256_mask_storeu_epi16(dst, last, h);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    }
  }
}

// The tile kernels of every shape up to kRows x kVectors, as a table indexed
// [rows - 1][vectors - 1]; Tile<MR, NV>::run has the signature Fn.
template <typename Fn, template <int, int> typename Tile>
struct TileTable {
  template <int MR, int... V>
  static constexpr std::array<Fn, kVectors> row(std::integer_sequence<int, V...>) {
    return {&Tile<MR, V + 1>::run...};
  }
  template <int... R>
  static constexpr std::array<std::array<Fn, kVectors>, kRows> all(std::integer_sequence<int, R...>) {
    return {row<R + 1>(std::make_integer_sequence<int, kVectors>{})...};
  }
  static constexpr auto table = all(std::make_integer_sequence<int, kRows>{});
};

using TileFn = void (*)(int64_t, const uint16_t*, int64_t, int64_t, const uint32_t*, int64_t, uint16_t*, int64_t,
                        __mmask16, const char* const*, int64_t);
constexpr auto kTiles = TileTable<TileFn, TileBf16>::table;

// The float32 tile: c[0..MR) x [0..16 NV) = a · b, one FMA per lane and k;
// a's element (r, p) at a + r * a_rs + p * a_ks, b's row p at bp + p * ldb
// (the last vector read under `last`: b may be read in place, rows unpadded).
// Accumulators as plain vector types: GCC keeps an array of __m512 (a
// may_alias type) in registers but still stores it to the stack every step.
using Acc = float __attribute__((vector_size(64)));

template <int MR, int NV>
struct TileF32 {
  static void run(int64_t k, const float* a, int64_t a_rs, int64_t a_ks, const float* bp, int64_t ldb, float* c,
                  int64_t ldc, __mmask16 last, const char* const* pf, int64_t pf_n);
};

template <int MR, int NV>
void TileF32<MR, NV>::run(int64_t k, const float* a, int64_t a_rs, int64_t a_ks, const float* bp, int64_t ldb, float* c,
                          int64_t ldc, __mmask16 last, const char* const* pf, int64_t pf_n) {
  Acc acc[MR][NV] = {};
  const int64_t pf_steps = pf_n * kPrefetchEvery;
  // The last vector of b unmasked where it is whole (Note [Whole vectors unmasked]).
  const auto steps = [&]<bool kFull>() {
    for (int64_t p = 0; p < k; ++p) {
      if (p < pf_steps && p % kPrefetchEvery == 0) _mm_prefetch(pf[p / kPrefetchEvery], _MM_HINT_T1);
      __m512 b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV - 1; ++v) b[v] = _mm512_loadu_ps(bp + p * ldb + v * 16);
      if constexpr (kFull) {
        b[NV - 1] = _mm512_loadu_ps(bp + p * ldb + (NV - 1) * 16);
      } else {
        b[NV - 1] = _mm512_maskz_loadu_ps(last, bp + p * ldb + (NV - 1) * 16);
      }
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m512 ar = _mm512_set1_ps(a[r * a_rs + p * a_ks]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[r][v] = reinterpret_cast<Acc>(_mm512_fmadd_ps(ar, b[v], reinterpret_cast<__m512>(acc[r][v])));
      }
    }
  };
  if (last == 0xffff)
    steps.template operator()<true>();
  else
    steps.template operator()<false>();
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* dst = c + r * ldc + v * 16;
      const __m512 x = reinterpret_cast<__m512>(acc[r][v]);
      if (v == NV - 1)
        _mm512_mask_storeu_ps(dst, last, x);
      else
        _mm512_storeu_ps(dst, x);
    }
  }
}

using TileF32Fn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, __mmask16,
                           const char* const*, int64_t);
constexpr auto kF32Tiles = TileTable<TileF32Fn, TileF32>::table;

// Packs rows 2kk and 2kk+1 of x (x[k * rs + j], j contiguous, k < K, j < J)
// into words dst[kk * ld + j]: b when its rows are contiguous, or a transposed a.
void pack_pairs_of_rows(uint32_t* dst, int64_t ld, const uint16_t* x, int64_t rs, int64_t K, int64_t J) {
  // Word j of the output interleaves element j of the two rows: lanes 0..31
  // of a permutation over (row 2kk, row 2kk+1) as one 64-lane table.
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo_idx = _mm512_load_si512(kLo);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t kk = 0; kk < (K + 1) / 2; ++kk) {
    const uint16_t* r0 = x + 2 * kk * rs;
    const bool has_r1 = 2 * kk + 1 < K;
    uint32_t* d = dst + kk * ld;
    for (int64_t j = 0; j < J; j += 32) {
      const int64_t left = std::min<int64_t>(32, J - j);
      const __mmask32 m = left == 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      // Note [Whole vectors unmasked]
      const auto load = [&](const uint16_t* p) {
        return left == 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
      };
      const __m512i x0 = load(r0 + j);
      const __m512i x1 = has_r1 ? load(r0 + rs + j) : _mm512_setzero_si512();
      _mm512_storeu_si512(d + j, _mm512_permutex2var_epi16(x0, lo_idx, x1));
      _mm512_storeu_si512(d + j + 16, _mm512_permutex2var_epi16(x0, hi_idx, x1));
    }
  }
}

// Any strides: word (kk, j) = x's elements (2kk, j) and (2kk + 1, j), the
// latter 0 past K, at x + k * x_k + j * x_j; stored at dst + kk * d_kk + j * d_j.
void pack_pairs_strided(uint32_t* dst, int64_t d_kk, int64_t d_j, const uint16_t* x, int64_t x_k, int64_t x_j,
                        int64_t K, int64_t J) {
  for (int64_t kk = 0; kk < (K + 1) / 2; ++kk)
    for (int64_t j = 0; j < J; ++j)
      dst[kk * d_kk + j * d_j] =
          pair(x[2 * kk * x_k + j * x_j], 2 * kk + 1 < K ? x[(2 * kk + 1) * x_k + j * x_j] : uint16_t{0});
}

// Word (w, j) of the output = word w of y's row j (rows `row_bytes` apart,
// `words` words each): b's pairs when b is a transposed view (kᵀ, vᵀ), its
// bf16 pairs or its floats.
void pack_transposed_words(uint32_t* dst, int64_t ld, const char* y, int64_t row_bytes, int64_t words, int64_t J) {
  for (int64_t j0 = 0; j0 < J; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, J - j0);
    for (int64_t k0 = 0; k0 < words; k0 += 16) {
      const int64_t w = std::min<int64_t>(16, words - k0);
      const __mmask16 m = vm::first_lanes16(w);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const char* p = y + (j0 + i) * row_bytes + 4 * k0;
        // Note [Whole vectors unmasked]
        r[i] = i >= rows ? _mm512_setzero_si512() : w == 16 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(m, p);
      }
      transpose16(r);
      for (int i = 0; i < w; ++i) _mm512_storeu_si512(dst + (k0 + i) * ld + j0, r[i]);
    }
  }
}

// The part of a band's product (Note [Causal products]) that the tile of rows
// [i0, i0 + rows) computes: depth steps [lo, hi), a step being `per_step`
// terms of the sum (2 for bf16's pairs), and columns [0, cols). A step that
// straddles the band's edge is taken whole: its other term is a zero of a.
struct TileSpan {
  int64_t lo, hi, cols;
};

TileSpan tile_span(const MatmulBand& band, int64_t i0, int64_t rows, int64_t n, int64_t k, int64_t per_step) {
  using Kind = MatmulBand::Kind;
  const int64_t steps = (k + per_step - 1) / per_step;
  switch (band.kind) {
    case Kind::Columns: return {0, steps, band.through(i0 + rows - 1, n)};
    case Kind::DepthUpTo: return {0, (band.through(i0 + rows - 1, k) + per_step - 1) / per_step, n};
    case Kind::DepthFrom: return {band.from(i0, k) / per_step, steps, n};
    case Kind::None: break;
  }
  return {0, steps, n};
}

// c [m, n] in tiles of up to kRows rows and kVectors 16-column vectors, each
// tile the table's kernel for its shape: a's rows from a + i0 * a_rs, b's
// columns from bp + j0 (in a's and b's own units), `per_step` terms of k per
// depth step. Under a band each tile computes only its span; a Columns band's
// hidden entries are then written 0.
template <typename Table, typename A, typename B, typename C>
void sweep_tiles(const Table& tiles, int64_t m, int64_t n, int64_t k, int64_t per_step, const MatmulBand& band,
                 const A* a, int64_t a_rs, int64_t a_ks, const B* bp, int64_t ldb, C* c, int64_t ldc,
                 PrefetchLines* prefetch) {
  for (int64_t j0 = 0; j0 < n; j0 += 16 * kVectors) {
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m - i0);
      const TileSpan span = tile_span(band, i0, rows, n, k, per_step);
      const int64_t cols = std::min<int64_t>({16 * kVectors, n - j0, span.cols - j0});
      if (cols <= 0) continue;  // every entry hidden: zeroed below
      const int64_t vectors = (cols + 15) / 16;
      const __mmask16 last = vm::first_lanes16(cols - 16 * (vectors - 1));
      const int64_t steps = std::max<int64_t>(span.hi - span.lo, 0);
      const char* const* pf = nullptr;
      int64_t pf_n = 0;
      if (prefetch && prefetch->next < prefetch->count) {
        pf = prefetch->lines + prefetch->next;
        pf_n = std::min((steps + kPrefetchEvery - 1) / kPrefetchEvery, prefetch->count - prefetch->next);
        prefetch->next += pf_n;
      }
      tiles[rows - 1][vectors - 1](steps, a + i0 * a_rs + span.lo * a_ks, a_rs, a_ks, bp + span.lo * ldb + j0, ldb,
                                   c + i0 * ldc + j0, ldc, last, pf, pf_n);
    }
  }
  if (band.kind != MatmulBand::Kind::Columns) return;
  for (int64_t i = 0; i < m; ++i) {
    std::fill(c + i * ldc + band.through(i, n), c + i * ldc + n, C(0));
  }
}

// Asks for the cache lines of a strided matrix (rows x cols, strides in
// elements) to be brought into L2 ahead of use: attention's heads are views
// with rows 1.5 KiB apart, which the hardware prefetcher does not follow, and
// backward reads them long after forward wrote them.
template <typename E>
void prefetch_matrix(const E* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  if (cs != 1) {
    if (rs != 1) return;
    std::swap(rows, cols);
    std::swap(rs, cs);
  }
  const int64_t bytes = cols * static_cast<int64_t>(sizeof(E));
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(x + r * rs);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

// This thread's packing space, kept between calls.
struct Buffers {
  std::vector<uint32_t> a, b;
  uint32_t* get(std::vector<uint32_t>& v, int64_t words) {
    if (static_cast<int64_t>(v.size()) < words) v.resize(static_cast<size_t>(words));
    return v.data();
  }
};

// One product c[m, n] = a[m, k] · b[k, n] (strides in elements).
void product(const MatmulArgs& g, const uint16_t* a, const uint16_t* b, uint16_t* c, Buffers& buf,
             PrefetchLines* prefetch) {
  const int64_t m = g.m, n = g.n, k = g.k, kp = (k + 1) / 2;
  const int64_t a_rs = g.a.stride[1], a_cs = g.a.stride[2], b_rs = g.b.stride[1], b_cs = g.b.stride[2];
  const int64_t ldb = round_up(n, 32);
  uint32_t* bp = buf.get(buf.b, kp * ldb);
  if (b_cs == 1) {
    pack_pairs_of_rows(bp, ldb, b, b_rs, k, n);
  } else if (b_rs == 1 && k % 2 == 0) {
    pack_transposed_words(bp, ldb, reinterpret_cast<const char*>(b), 2 * b_cs, k / 2, n);
  } else {
    pack_pairs_strided(bp, ldb, 1, b, b_rs, b_cs, k, n);
  }
  // a's word (i, kk) at ap + i * ap_rs + kk * ap_ks, in elements.
  const uint16_t* ap = a;
  int64_t ap_rs = a_rs, ap_ks = 2;
  if (a_cs == 1 && k % 2 == 0) {
    // read in place
  } else if (a_rs == 1) {
    const int64_t lda = round_up(m, 32);
    uint32_t* packed = buf.get(buf.a, kp * lda);
    pack_pairs_of_rows(packed, lda, a, a_cs, k, m);
    ap = reinterpret_cast<const uint16_t*>(packed);
    ap_rs = 2;
    ap_ks = 2 * lda;
  } else {
    uint32_t* packed = buf.get(buf.a, m * kp);
    pack_pairs_strided(packed, 1, kp, a, a_cs, a_rs, k, m);
    ap = reinterpret_cast<const uint16_t*>(packed);
    ap_rs = 2 * kp;
    ap_ks = 2;
  }
  sweep_tiles(kTiles, m, n, k, 2, g.band, ap, ap_rs, ap_ks, bp, ldb, c, g.c_row_stride(), prefetch);
}

// One float32 product: a is read in place (any strides: each tile broadcasts
// single elements), b in place when its rows are contiguous, else packed.
void product_f32(const MatmulArgs& g, const float* a, const float* b, float* c, Buffers& buf, PrefetchLines* prefetch) {
  const int64_t m = g.m, n = g.n, k = g.k;
  const int64_t b_rs = g.b.stride[1], b_cs = g.b.stride[2];
  const float* bp = b;
  int64_t ldb = b_rs;
  if (b_cs != 1) {
    ldb = round_up(n, 32);
    uint32_t* packed = buf.get(buf.b, k * ldb);
    if (b_rs == 1) {
      pack_transposed_words(packed, ldb, reinterpret_cast<const char*>(b), 4 * b_cs, k, n);
    } else {
      auto* f = reinterpret_cast<float*>(packed);
      for (int64_t p = 0; p < k; ++p)
        for (int64_t j = 0; j < n; ++j) f[p * ldb + j] = b[p * b_rs + j * b_cs];
    }
    bp = reinterpret_cast<const float*>(packed);
  }
  sweep_tiles(kF32Tiles, m, n, k, 1, g.band, a, g.a.stride[1], g.a.stride[2], bp, ldb, c, g.c_row_stride(), prefetch);
}

// Runs every product of g, in ranges of the outer x batch index across threads.
template <typename E, typename Product>
void run_products(const MatmulArgs& g, Product product, bool here, PrefetchLines* prefetch = nullptr) {
  const int64_t total = g.outer * g.batch;
  const auto* a0 = static_cast<const E*>(g.a.data);
  const auto* b0 = static_cast<const E*>(g.b.data);
  auto* c0 = static_cast<E*>(g.c);
  // Each product is whole on one thread: the bits do not depend on the thread count.
  auto range = [&](int64_t lo, int64_t hi) {
    thread_local Buffers buf;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t o = i / g.batch, bi = i % g.batch;
      const E* a = a0 + o * g.a.outer_stride + bi * g.a.stride[0];
      const E* b = b0 + o * g.b.outer_stride + bi * g.b.stride[0];
      E* c = c0 + o * g.c_outer() + bi * g.c_batch_stride();
      if (i + 1 < hi) {  // the next product's operands, while this one computes
        const int64_t o1 = (i + 1) / g.batch, b1 = (i + 1) % g.batch;
        prefetch_matrix(a0 + o1 * g.a.outer_stride + b1 * g.a.stride[0], g.m, g.k, g.a.stride[1], g.a.stride[2]);
        prefetch_matrix(b0 + o1 * g.b.outer_stride + b1 * g.b.stride[0], g.k, g.n, g.b.stride[1], g.b.stride[2]);
      }
      product(g, a, b, c, buf, prefetch);
    }
  };
  if (here) {
    range(0, total);
  } else {
    parallel_for(total, 1, range);
  }
}

}  // namespace

void small_matmul(const MatmulArgs& g) {
  if (g.dtype == kFloat32) return run_products<float>(g, product_f32, false);
  run_products<uint16_t>(g, product, false);
}

void small_matmul_here(const MatmulArgs& g, PrefetchLines* prefetch) {
  if (g.dtype == kFloat32) return run_products<float>(g, product_f32, true, prefetch);
  run_products<uint16_t>(g, product, true, prefetch);
}

void tiny_matmul(const MatmulArgs& g) {
  thread_local Buffers buf;
  auto* c = static_cast<float*>(g.c);
  product_f32(g, static_cast<const float*>(g.a.data), static_cast<const float*>(g.b.data), c, buf, nullptr);
  if (!g.bias) return;
  const auto* bias = static_cast<const float*>(g.bias);
  const int64_t ldc = g.c_row_stride();
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = 0; j < g.n; ++j) c[i * ldc + j] += bias[j];
}

#else

void small_matmul(const MatmulArgs&) { KILN_ASSERT(false, "small_matmul: not built for this CPU"); }
void small_matmul_here(const MatmulArgs&, PrefetchLines*) {
  KILN_ASSERT(false, "small_matmul_here: not built for this CPU");
}
void tiny_matmul(const MatmulArgs&) { KILN_ASSERT(false, "tiny_matmul: not built for this CPU"); }

#endif

}  // namespace kiln::kernels::detail
