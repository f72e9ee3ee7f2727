// Fused attention one head at a time: Note [Attention by head] in
// kiln/kernels/attention.h. The products are the small-product kernel's
// (small_gemm.h) on one head each, the row kernels those of
// attention_softmax.cpp on one head's block.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "elementwise_math.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/half.h"
#include "kiln/core/parallel.h"
#include "kiln/kernels/attention.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kernels/loop.h"
#include "reduce_engine.h"
#include "small_gemm.h"

namespace kiln::kernels {

namespace {

using Band = MatmulBand;

// The head (b, h) of an operand, from row `row`.
struct Head {
  char* p;
  int64_t row;  // row stride, elements
};

Head head_of(const HeadOperand& o, int64_t b, int64_t h, int64_t row, int64_t es) {
  return {static_cast<char*>(o.data) + (b * o.outer + h * o.head + row * o.row) * es, o.row};
}

// A matrix at p with row and column strides (elements).
MatrixOperand matrix(const void* p, int64_t rs, int64_t cs) { return {p, {0, rs, cs}, 0}; }

// c [m, n] (row stride ldc) = a · b under `band`, on this thread, its tiles
// asking for `prefetch`'s lines as they go.
void product(DType dt, int64_t m, int64_t n, int64_t k, MatrixOperand a, MatrixOperand b, void* c, int64_t ldc,
             Band band, detail::PrefetchLines* prefetch) {
  MatmulArgs g;
  g.dtype = dt;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.b = b;
  g.c = c;
  g.c_stride[1] = ldc;
  g.band = band;
  detail::small_matmul_here(g, prefetch);
}

int64_t keys_visible(const AttentionHeads& a, int64_t r0, int64_t n) { return a.causal ? std::min(a.S, r0 + n) : a.S; }

Band band_of(const AttentionHeads& a, Band::Kind kind, int64_t r0) { return a.causal ? Band{kind, r0} : Band{}; }

AttentionBlock block_of(const AttentionHeads& a, int64_t r0, int64_t n, int64_t kend) {
  return {.dtype = a.dtype,
          .batch = 1,
          .rows = n,
          .cols = kend,
          .scale = a.scale,
          .causal = a.causal,
          .row0 = r0,
          .row_batch_stride = a.L};
}

// This thread's scratch: a block's weights, its score gradient, and one
// block's dk or dv before it is added in; and the next head's cache lines,
// which this head's products ask for (Note [Prefetching inside the tiles] in
// small_gemm.h).
struct Scratch {
  std::vector<char> p, ds, part, dropped;
  std::vector<float> u;
  std::vector<const char*> lines;
  detail::PrefetchLines next;
  static char* get(std::vector<char>& v, int64_t bytes) {
    if (static_cast<int64_t>(v.size()) < bytes) v.resize(static_cast<size_t>(bytes));
    return v.data();
  }
};

// rows x cols of dst (row stride ld) += src (contiguous), each sum rounded to
// T once: what add_ of the two tensors computes.
template <typename T>
void add_rows(char* dst, int64_t ld, const char* src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    T* d = reinterpret_cast<T*>(dst) + r * ld;
    const T* s = reinterpret_cast<const T*>(src) + r * cols;
    for (int64_t j = 0; j < cols; ++j) d[j] = static_cast<T>(static_cast<float>(d[j]) + static_cast<float>(s[j]));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The bf16 form 16 columns at a time: widening is exact and float_to_bf16x16
// rounds as BFloat16(float) does, so the bits are the loop's above.
void add_rows_bf16(char* dst, int64_t ld, const char* src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    auto* d = reinterpret_cast<BFloat16*>(dst) + r * ld;
    const auto* s = reinterpret_cast<const BFloat16*>(src) + r * cols;
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m = vm::first_lanes16(cols - j);
      const __m512 x = vm::bf16x16_to_float(_mm256_maskz_loadu_epi16(m, d + j));
      const __m512 y = vm::bf16x16_to_float(_mm256_maskz_loadu_epi16(m, s + j));
      _mm256_mask_storeu_epi16(d + j, m, vm::float_to_bf16x16(_mm512_add_ps(x, y)));
    }
  }
}
#endif

void add_rows(DType dt, char* dst, int64_t ld, const char* src, int64_t rows, int64_t cols) {
  if (dt == kFloat32) return add_rows<float>(dst, ld, src, rows, cols);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  add_rows_bf16(dst, ld, src, rows, cols);
#else
  add_rows<BFloat16>(dst, ld, src, rows, cols);
#endif
}

// Head hi's weights for the block of rows from r0 inside AttentionHeads::weights:
// blocks one after another, each [B, H, n, kend].
char* kept_weights(const AttentionHeads& a, int64_t hi, int64_t r0, int64_t n, int64_t kend) {
  const int64_t before = attention_weights_per_head(std::min(r0, a.L), a.S, a.causal, a.block_rows);
  return static_cast<char*>(a.weights) + (a.B * a.H * before + hi * n * kend) * element_size(a.dtype);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Lanes m of 16 values at p as floats, and back (bf16 rounded as BFloat16(float) rounds).
__m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
__m512 load16(const BFloat16* p, __mmask16 m) { return vm::bf16x16_to_float(_mm256_maskz_loadu_epi16(m, p)); }
void store16(float* p, __mmask16 m, __m512 x) { _mm512_mask_storeu_ps(p, m, x); }
void store16(BFloat16* p, __mmask16 m, __m512 x) { _mm256_mask_storeu_epi16(p, m, vm::float_to_bf16x16(x)); }
#endif

// A block's weights p [n, kend] times the dropout factor (keep ? scale : 0)
// into scratch (Note [Dropout inside the heads]); forward first draws the
// rows' keep bytes from the uniforms as a T tensor holds them (bf16 rounds
// them, as rand's bf16 values are). With `dp` not null (backward) dO vᵀ there
// is multiplied by the same factor in place. Each product is x * (+0 or
// scale) rounded to T once, as dropout's multiply computes it.
template <typename T>
const T* drop_block(const AttentionHeads& a, int64_t hi, int64_t r0, int64_t n, int64_t kend, const T* p, T* dp,
                    bool draw, Scratch& scratch) {
  auto* out = reinterpret_cast<T*>(Scratch::get(scratch.dropped, n * kend * static_cast<int64_t>(sizeof(T))));
  if (draw && static_cast<int64_t>(scratch.u.size()) < kend + 3) scratch.u.resize(static_cast<size_t>(kend + 3));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e0 = (hi * a.L + r0 + i) * a.S;
    uint8_t* keep = a.keep + e0;
    const T* pr = p + i * kend;
    T* o = out + i * kend;
    T* g = dp ? dp + i * kend : nullptr;
    const float* u = nullptr;
    if (draw) {
      const int64_t skip = e0 % 4;
      kiln::detail::philox_uniform_floats(scratch.u.data(), kend + skip, a.seed,
                                          a.first_block + static_cast<uint64_t>(e0 / 4), 0.0f, 1.0f);
      u = scratch.u.data() + skip;
    }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 below = _mm512_set1_ps(a.keep_below), vscale = _mm512_set1_ps(a.dropout_scale);
    for (int64_t j = 0; j < kend; j += 16) {
      const __mmask16 m = vm::first_lanes16(kend - j);
      __mmask16 k;
      if (draw) {
        __m512 uj = _mm512_maskz_loadu_ps(m, u + j);
        if constexpr (!std::is_same_v<T, float>) uj = vm::bf16x16_to_float(vm::float_to_bf16x16(uj));
        k = _mm512_mask_cmp_ps_mask(m, uj, below, _CMP_LT_OQ);
        _mm_mask_storeu_epi8(keep + j, m, _mm_maskz_set1_epi8(k, 1));
      } else {
        k = _mm_mask_test_epi8_mask(m, _mm_maskz_loadu_epi8(m, keep + j), _mm_set1_epi8(static_cast<char>(0xff)));
      }
      const __m512 f = _mm512_maskz_mov_ps(k, vscale);
      store16(o + j, m, _mm512_mul_ps(load16(pr + j, m), f));
      if (g) store16(g + j, m, _mm512_mul_ps(load16(g + j, m), f));
    }
#else
    for (int64_t j = 0; j < kend; ++j) {
      if (draw) keep[j] = static_cast<float>(static_cast<T>(u[j])) < a.keep_below;
      const float f = keep[j] ? a.dropout_scale : 0.0f;
      o[j] = static_cast<T>(static_cast<float>(pr[j]) * f);
      if (g) g[j] = static_cast<T>(static_cast<float>(g[j]) * f);
    }
#endif
    if (draw) std::fill(keep + kend, keep + a.S, uint8_t{0});
  }
  return out;
}

// drop_block for the heads' dtype.
const char* drop_block(const AttentionHeads& a, int64_t hi, int64_t r0, int64_t n, int64_t kend, const char* p,
                       char* dp, bool draw, Scratch& scratch) {
  if (a.dtype == kFloat32)
    return reinterpret_cast<const char*>(
        drop_block(a, hi, r0, n, kend, reinterpret_cast<const float*>(p), reinterpret_cast<float*>(dp), draw, scratch));
  return reinterpret_cast<const char*>(drop_block(a, hi, r0, n, kend, reinterpret_cast<const BFloat16*>(p),
                                                  reinterpret_cast<BFloat16*>(dp), draw, scratch));
}

void forward_head(const AttentionHeads& a, int64_t b, int64_t h, Scratch& scratch) {
  const int64_t es = element_size(a.dtype);
  const int64_t hi = b * a.H + h;  // the head's index in lse
  for (int64_t r0 = 0; r0 < a.L; r0 += a.block_rows) {
    const int64_t n = std::min(a.block_rows, a.L - r0), kend = keys_visible(a, r0, n);
    const Head q = head_of(a.q, b, h, r0, es), k = head_of(a.k, b, h, 0, es), v = head_of(a.v, b, h, 0, es);
    const Head o = head_of(a.out, b, h, r0, es);
    char* s = a.weights ? kept_weights(a, hi, r0, n, kend) : Scratch::get(scratch.p, n * kend * es);
    product(a.dtype, n, kend, a.E, matrix(q.p, q.row, 1), matrix(k.p, 1, k.row), s, kend,
            band_of(a, Band::Kind::Columns, r0), &scratch.next);
    attention_weights(block_of(a, r0, n, kend), s, a.lse ? static_cast<char*>(a.lse) + (hi * a.L + r0) * es : nullptr);
    const void* w = s;
    if (a.keep) w = drop_block(a, hi, r0, n, kend, s, nullptr, true, scratch);
    product(a.dtype, n, a.Ev, kend, matrix(w, kend, 1), matrix(v.p, v.row, 1), o.p, o.row,
            band_of(a, Band::Kind::DepthUpTo, r0), &scratch.next);
  }
}

void backward_head(const AttentionHeads& a, int64_t b, int64_t h, Scratch& scratch) {
  const int64_t es = element_size(a.dtype);
  const int64_t hi = b * a.H + h;
  const Head k = head_of(a.k, b, h, 0, es), v = head_of(a.v, b, h, 0, es);
  const Head dk = head_of(a.dk, b, h, 0, es), dv = head_of(a.dv, b, h, 0, es);
  // The last block first: it sees every key, so its products are dk and dv
  // and the earlier blocks add into their leading rows.
  const int64_t last = (a.L - 1) / a.block_rows * a.block_rows;
  for (int64_t r0 = last; r0 >= 0; r0 -= a.block_rows) {
    const int64_t n = std::min(a.block_rows, a.L - r0), kend = keys_visible(a, r0, n);
    const bool first = r0 == last;
    const Head q = head_of(a.q, b, h, r0, es), dob = head_of(a.dout, b, h, r0, es), dq = head_of(a.dq, b, h, r0, es);
    const AttentionBlock blk = block_of(a, r0, n, kend);
    char* ds = Scratch::get(scratch.ds, n * kend * es);
    char* p = a.weights ? kept_weights(a, hi, r0, n, kend) : Scratch::get(scratch.p, n * kend * es);
    if (!a.weights) {
      product(a.dtype, n, kend, a.E, matrix(q.p, q.row, 1), matrix(k.p, 1, k.row), p, kend,
              band_of(a, Band::Kind::Columns, r0), &scratch.next);
      attention_recompute_weights(blk, p, static_cast<const char*>(a.lse) + (hi * a.L + r0) * es);
    }
    product(a.dtype, n, kend, a.Ev, matrix(dob.p, dob.row, 1), matrix(v.p, 1, v.row), ds, kend,
            band_of(a, Band::Kind::Columns, r0), &scratch.next);
    // dst[0, kend) = (the first block) or += xᵀ y: dv from p and dO, dk from dS and q.
    const Band from = band_of(a, Band::Kind::DepthFrom, r0);
    auto key_rows = [&](const Head& dst, const char* x, const Head& y, int64_t cols) {
      const MatrixOperand xt = matrix(x, 1, kend), ym = matrix(y.p, y.row, 1);
      if (first) return product(a.dtype, kend, cols, n, xt, ym, dst.p, dst.row, from, &scratch.next);
      char* part = Scratch::get(scratch.part, kend * cols * es);
      product(a.dtype, kend, cols, n, xt, ym, part, cols, from, &scratch.next);
      add_rows(a.dtype, dst.p, dst.row, part, kend, cols);
    };
    const char* w = p;  // the weights dV is formed from: with dropout, p times the mask's factor
    if (a.keep) w = drop_block(a, hi, r0, n, kend, p, ds, false, scratch);
    key_rows(dv, w, dob, a.Ev);
    attention_scores_grad(blk, ds, p, static_cast<const char*>(a.D) + (hi * a.L + r0) * es);
    product(a.dtype, n, a.E, kend, matrix(ds, kend, 1), matrix(k.p, k.row, 1), dq.p, dq.row,
            band_of(a, Band::Kind::DepthUpTo, r0), &scratch.next);
    key_rows(dk, ds, q, a.E);
  }
}

// The most cache lines rows of `cols` elements can touch.
int64_t lines_bound(int64_t rows, int64_t cols, int64_t es) { return rows * (cols * es / 64 + 2); }

// Writes the cache lines of `rows` rows of `cols` elements of head (b, h) of
// `o` to out (at most lines_bound of them) and returns how many. It runs once
// a head, so it must cost little beside the head's products: when every row
// starts at the same place in its line (a row stride of whole lines), each
// row has the same lines, written line by line down the rows, a loop of
// stores with no branch per row (row by row, its short inner loops cost 5 %
// of the float32 forward).
int64_t head_lines(const char** out, const HeadOperand& o, int64_t b, int64_t h, int64_t rows, int64_t cols,
                   int64_t es) {
  if (o.data == nullptr) return 0;
  const char* p = static_cast<const char*>(o.data) + (b * o.outer + h * o.head) * es;
  const int64_t stride = o.row * es, bytes = cols * es;
  const auto p0 = reinterpret_cast<uintptr_t>(p);
  int64_t n = 0;
  if (stride % 64 == 0) {
    const int64_t per_row = (static_cast<int64_t>(p0 & 63) + bytes + 63) / 64;
    for (int64_t l = 0; l < per_row; ++l, n += rows) {
      const char* line = reinterpret_cast<const char*>((p0 & ~uintptr_t{63}) + static_cast<uintptr_t>(64 * l));
      for (int64_t r = 0; r < rows; ++r) out[n + r] = line + r * stride;
    }
    return n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const auto start = reinterpret_cast<uintptr_t>(p + r * stride);
    const uintptr_t end = start + static_cast<uintptr_t>(bytes);
    for (uintptr_t line = start & ~uintptr_t{63}; line < end; line += 64)
      out[n++] = reinterpret_cast<const char*>(line);
  }
  return n;
}

// Runs body over this thread's heads, each head's products bringing the next
// head's operands into L2 as they go (Note [Prefetching inside the tiles]).
template <typename Body>
void for_heads(const AttentionHeads& a, bool backward, const Body& body) {
  const int64_t es = element_size(a.dtype);
  parallel_for(a.B * a.H, 1, [&](int64_t lo, int64_t hi) {
    thread_local Scratch scratch;
    for (int64_t i = lo; i < hi; ++i) {
      int64_t count = 0;
      if (i + 1 < hi) {
        const int64_t b = (i + 1) / a.H, h = (i + 1) % a.H;
        const int64_t bound = lines_bound(a.S, a.E, es) + lines_bound(a.S, a.Ev, es) + lines_bound(a.L, a.E, es) +
                              (backward ? lines_bound(a.L, a.Ev, es) : 0);
        if (static_cast<int64_t>(scratch.lines.size()) < bound) scratch.lines.resize(static_cast<size_t>(bound));
        const char** out = scratch.lines.data();
        count += head_lines(out + count, a.k, b, h, a.S, a.E, es);
        count += head_lines(out + count, a.v, b, h, a.S, a.Ev, es);
        count += head_lines(out + count, a.q, b, h, a.L, a.E, es);
        if (backward) count += head_lines(out + count, a.dout, b, h, a.L, a.Ev, es);
      }
      scratch.next = {scratch.lines.data(), count, 0};
      body(i / a.H, i % a.H, scratch);
      for (int64_t l = scratch.next.next; l < scratch.next.count; ++l) __builtin_prefetch(scratch.lines[l], 0, 2);
    }
  });
}

// 16 values of a row from p as floats (zeros past `count`).
template <typename T>
detail::Vec16f row16(const T* p, int64_t count) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (count >= 16) return reinterpret_cast<detail::Vec16f>(_mm512_loadu_ps(p));
  } else {
    if (count >= 16)
      return reinterpret_cast<detail::Vec16f>(
          vm::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
#endif
  detail::Vec16f v = {};
  for (int64_t e = 0; e < std::min<int64_t>(count, 16); ++e) v[e] = static_cast<float>(p[e]);
  return v;
}

// Row (b, h, i)'s D: lane_sum<16>'s partials (lane k takes elements k,
// k + 16, ..., each product added by one FMA) as whole vectors, whole ones
// loaded plainly (Note [Whole vectors unmasked]), then the same fold. Rows
// go in (b, i, h) order: [B, L, H, Ev] operands (a linear's output split
// into heads) are then read straight through.
template <typename T>
void output_dots(int64_t B, int64_t H, int64_t L, int64_t Ev, const HeadOperand& dout, const HeadOperand& out, T* D) {
  parallel_for(B * L * H, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, 2 * Ev)), [&](int64_t lo, int64_t hi) {
    int64_t b = lo / (L * H), i = lo / H % L, h = lo % H;  // advanced row by row
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = static_cast<const T*>(dout.data) + b * dout.outer + h * dout.head + i * dout.row;
      const T* o = static_cast<const T*>(out.data) + b * out.outer + h * out.head + i * out.row;
      detail::Vec16f acc = {};
      for (int64_t e = 0; e < Ev; e += 16) {
#if defined(__AVX512F__)
        acc = reinterpret_cast<detail::Vec16f>(_mm512_fmadd_ps(reinterpret_cast<__m512>(row16(g + e, Ev - e)),
                                                               reinterpret_cast<__m512>(row16(o + e, Ev - e)),
                                                               reinterpret_cast<__m512>(acc)));
#else
        acc += row16(g + e, Ev - e) * row16(o + e, Ev - e);
#endif
      }
      D[(b * H + h) * L + i] = static_cast<T>(detail::sum_partials<16>(reinterpret_cast<float*>(&acc)));
      if (++h == H) {
        h = 0;
        if (++i == L) i = 0, ++b;
      }
    }
  });
}

}  // namespace

void attention_output_dots(DType dtype, int64_t B, int64_t H, int64_t L, int64_t Ev, const HeadOperand& dout,
                           const HeadOperand& out, void* D) {
  KILN_CAPTURE_KERNEL("attention_output_dots", attention_output_dots(dtype, B, H, L, Ev, dout, out, D));
  KILN_ASSERT(dtype == kFloat32 || dtype == kBFloat16, "attention_output_dots: float32 or bfloat16, got ",
              dtype_name(dtype));
  if (dtype == kFloat32) return output_dots<float>(B, H, L, Ev, dout, out, static_cast<float*>(D));
  output_dots<BFloat16>(B, H, L, Ev, dout, out, static_cast<BFloat16*>(D));
}

int64_t attention_weights_per_head(int64_t L, int64_t S, bool causal, int64_t block_rows) {
  int64_t total = 0;
  for (int64_t r0 = 0; r0 < L; r0 += block_rows) {
    const int64_t n = std::min(block_rows, L - r0);
    total += n * (causal ? std::min(S, r0 + n) : S);
  }
  return total;
}

bool attention_keeps_weights(int64_t L, int64_t S, int64_t E, int64_t Ev, bool causal, int64_t block_rows) {
  return block_rows > 0 && attention_weights_per_head(L, S, causal, block_rows) <= (L + S) * (E + Ev);
}

int64_t attention_heads_weights_size(const AttentionHeads& a) {
  return a.B * a.H * attention_weights_per_head(a.L, a.S, a.causal, a.block_rows);
}

bool attention_heads_apply(const AttentionHeads& a) {
  if ((a.dtype != kFloat32 && a.dtype != kBFloat16) || a.B <= 0 || a.H <= 0 || a.L <= 0 || a.S <= 0 || a.E <= 0 ||
      a.Ev <= 0 || a.block_rows <= 0 || (a.causal && a.L < a.S))
    return false;
  // The largest products a head runs: [rows, S] x [S, E] and [S, rows] x [rows, E].
  MatmulArgs g;
  g.dtype = a.dtype;
  g.m = std::max(std::min(a.block_rows, a.L), a.S);
  g.n = std::max({a.S, a.E, a.Ev});
  g.k = g.n;
  return detail::small_matmul_fits(g);
}

void attention_heads_forward(const AttentionHeads& a) {
  KILN_CAPTURE_KERNEL("attention_heads_forward", attention_heads_forward(a));
  KILN_ASSERT(attention_heads_apply(a), "attention_heads_forward: arguments the kernel does not take");
  for_heads(a, false, [&](int64_t b, int64_t h, Scratch& s) { forward_head(a, b, h, s); });
}

void attention_heads_backward(const AttentionHeads& a) {
  KILN_CAPTURE_KERNEL("attention_heads_backward", attention_heads_backward(a));
  KILN_ASSERT(attention_heads_apply(a), "attention_heads_backward: arguments the kernel does not take");
  for_heads(a, true, [&](int64_t b, int64_t h, Scratch& s) { backward_head(a, b, h, s); });
}

}  // namespace kiln::kernels
