// Internal to the CPU kernels: the reduction engine behind
// src/kernels/include/kiln/kernels/reduce.h (see Note [Deterministic reductions] there).
//
// An Op describes one reduction elementwise:
//   using in_t, acc_t;  acc_t identity() const;
//   acc_t map(in_t x, acc_t param) const;     // what is accumulated per element
//   acc_t combine(acc_t a, acc_t b) const;    // associative
// `param` is a per-output value from an earlier pass (the mean for var, the
// max for logsumexp), 0 when the op has none. The engine owns the order of
// evaluation, so every op gets the same deterministic tree and the same
// row/column fast paths.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include "elementwise_math.h"
#include "kiln/core/dtype.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/loop.h"
#include "kiln/kernels/reduce.h"

namespace kiln::kernels::detail {

inline constexpr int kLanes = 64;          // independent partials in a leaf (vector registers' worth)
inline constexpr int64_t kLeaf = 4096;     // elements reduced by one multi-lane pass
inline constexpr int64_t kColWidth = 256;  // outputs per column block (1 KiB row segments of float)
inline constexpr int64_t kColLeaf = 16;    // rows accumulated sequentially in a column leaf

/// The accumulator of a sum-like reduction over T: float for the 16-bit floats,
/// the type itself for float/double, int64 for integers and bool.
template <typename T>
using sum_acc_t = std::conditional_t<is_float_v<T>, compute_t<T>, int64_t>;

/// Integer accumulation wraps (as PyTorch) instead of being undefined on overflow.
template <typename A>
inline A add_wrap(A a, A b) {
  if constexpr (std::is_integral_v<A> && std::is_signed_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <typename A>
inline A mul_wrap(A a, A b) {
  if constexpr (std::is_integral_v<A> && std::is_signed_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

/// NaN-propagating max/min (PyTorch's max, amax, norm(inf)); plain on integers.
template <typename A>
inline A max_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>)
    return (a > b || a != a) ? a : b;
  else
    return a > b ? a : b;
}
template <typename A>
inline A min_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>)
    return (a < b || a != a) ? a : b;
  else
    return a < b ? a : b;
}

template <typename A>
constexpr A lowest_value() {
  if constexpr (std::is_floating_point_v<A>)
    return -std::numeric_limits<A>::infinity();
  else
    return std::numeric_limits<A>::lowest();
}
template <typename A>
constexpr A highest_value() {
  if constexpr (std::is_floating_point_v<A>)
    return std::numeric_limits<A>::infinity();
  else
    return std::numeric_limits<A>::max();
}

/// exp_reduced's steps after its clamp, for an x already inside the clamp's
/// bounds (the attention kernel's vector form tests its lanes first).
template <typename V>
[[gnu::always_inline]] inline V exp_reduced_in_range(V xc, V& fn) {
  // Round to nearest by adding 1.5 * 2^23 (std::floor does not vectorise here).
  constexpr float kRound = 12582912.0f;
  fn = (xc * 1.44269504088896341f + kRound) - kRound;
  V r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  const V r2 = r * r;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * r2 + r + 1.0f;
}

/// The shared steps of exp for a float or a vector of floats (GCC vector
/// extensions; exp_vec below and the attention kernel's vector form): clamp
/// x, fn = round(x / ln2) as a float, r = x - fn ln2 in two steps, and exp(r)
/// by Cephes' degree-6 polynomial. The caller scales by 2^fn in its own type.
template <typename V>
[[gnu::always_inline]] inline V exp_reduced(V x, V& fn) {
  const V hi = V{} + 88.7228317f;   // just below log(FLT_MAX)
  const V lo = V{} + -103.972084f;  // exp rounds to 0 below this
  return exp_reduced_in_range(x < lo ? lo : (x > hi ? hi : x), fn);
}

/// exp(x) for float in a branch-free form the compiler vectorises: x = n ln2 + r,
/// |r| <= ln2/2 + rounding, exp(r) by Cephes' degree-6 polynomial (about 1 ulp), 2^n built
/// in two halves so that results down to the subnormals stay exact in range.
inline float exp_vec(float x) {
  constexpr float kHi = 88.7228317f, kLo = -103.972084f;
  float fn;
  const float y = exp_reduced(x, fn);
  const int32_t n = static_cast<int32_t>(fn);
  const int32_t n1 = n >> 1;
  const int32_t n2 = n - n1;
  const float s1 = std::bit_cast<float>((n1 + 127) << 23);
  const float s2 = std::bit_cast<float>((n2 + 127) << 23);
  float res = y * s1 * s2;
  res = x > kHi ? std::numeric_limits<float>::infinity() : res;
  res = x < kLo ? 0.0f : res;
  return x != x ? x : res;
}
inline double exp_vec(double x) { return std::exp(x); }

/// Pairwise combination of leaf(a) .. leaf(b-1) (b > a): the one tree shape
/// every reduction uses above its leaves.
template <typename A, typename Leaf, typename Comb>
A tree(int64_t a, int64_t b, const Leaf& leaf, const Comb& comb) {
  if (b - a == 1) return leaf(a);
  const int64_t mid = a + (b - a) / 2;
  A l = tree<A>(a, mid, leaf, comb);
  A r = tree<A>(mid, b, leaf, comb);
  return comb(l, r);
}

/// Byte offset of linear index `idx` over dims given innermost first.
inline int64_t offset_of(int64_t idx, int nd, const int64_t* sizes, const int64_t* strides) {
  int64_t off = 0;
  for (int d = 0; d < nd; ++d) {
    off += (idx % sizes[d]) * strides[d];
    idx /= sizes[d];
  }
  return off;
}

/// Odometer over the kept dims of a layout: the input offset of output o, o+1, ...
struct OutIter {
  const ReduceLayout& l;
  int64_t idx[kMaxLoopDims] = {};
  int64_t offset = 0;
  OutIter(const ReduceLayout& layout, int64_t o) : l(layout) {
    for (int d = 0; d < l.out_ndim; ++d) {
      idx[d] = o % l.out_sizes[d];
      o /= l.out_sizes[d];
      offset += idx[d] * l.out_strides[d];
    }
  }
  void next() {
    for (int d = 0; d < l.out_ndim; ++d) {
      offset += l.out_strides[d];
      if (++idx[d] < l.out_sizes[d]) return;
      offset -= l.out_strides[d] * l.out_sizes[d];
      idx[d] = 0;
    }
  }
};

/// 16 float lanes (GCC vector extensions; AVX-512 under -march=native).
using Vec16f = float __attribute__((vector_size(16 * sizeof(float))));

/// The pairwise tree over 16 partials — lane k combined with lane k + 8, then
/// k + 4, k + 2, k + 1 — in registers. The same pairs in the same order as
/// that loop over an array of partials, so the same bits; the loop compiled to
/// a chain of scalar steps through the stack, about a hundred cycles, which
/// rows of a few vectors (attention's, layer norm's) paid once per row.
template <typename Comb>
[[gnu::always_inline]] inline float fold16(Vec16f v, const Comb& comb) {
  using V8 = float __attribute__((vector_size(8 * sizeof(float))));
  using V4 = float __attribute__((vector_size(4 * sizeof(float))));
  using V2 = float __attribute__((vector_size(2 * sizeof(float))));
  const V8 a = comb(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  const V4 b = comb(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
  const V2 c = comb(__builtin_shufflevector(b, b, 0, 1), __builtin_shufflevector(b, b, 2, 3));
  return comb(c[0], c[1]);
}

/// The sum of L partials combined pairwise, lane k with lane k + L/2, then
/// k + L/4, ... (float with 16 or 64 lanes: in registers, fold16, the same bits).
template <int L, typename A>
[[gnu::always_inline]] inline A sum_partials(A* lanes) {
  if constexpr (std::is_same_v<A, float> && (L == 16 || L == 64)) {
    Vec16f v[L / 16];
    std::memcpy(v, lanes, sizeof(v));
    const auto add = [](auto a, auto b) { return a + b; };
    if constexpr (L == 64) return fold16((v[0] + v[2]) + (v[1] + v[3]), add);
    return fold16(v[0], add);
  } else {
    for (int w = L / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) lanes[k] += lanes[k + w];
    return lanes[0];
  }
}

/// Sum of f(0) .. f(n-1) in L independent partials (the compiler vectorises
/// them; one serial chain of adds would be latency-bound), combined pairwise,
/// so a row's sum depends on its length alone (layer norm's and softmax's rows).
template <int L, typename A, typename F>
A lane_sum(int64_t n, const F& f) {
  A lanes[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int k = 0; k < L; ++k) lanes[k] += f(i + k);
  for (int k = 0; i + k < n; ++k) lanes[k] += f(i + k);
  return sum_partials<L>(lanes);
}

/// One leaf: up to kLeaf elements at byte stride `stride`, kLanes partials combined pairwise.
template <typename Op>
typename Op::acc_t leaf_value(const Op& op, const char* p, int64_t n, int64_t stride, typename Op::acc_t param) {
  using T = typename Op::in_t;
  using A = typename Op::acc_t;
  if (n < kLanes) {
    A acc = op.identity();
    for (int64_t i = 0; i < n; ++i) acc = op.combine(acc, op.map(*reinterpret_cast<const T*>(p + i * stride), param));
    return acc;
  }
  A lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = op.identity();
  int64_t i = 0;
  if (stride == static_cast<int64_t>(sizeof(T))) {
    const T* x = reinterpret_cast<const T*>(p);
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] = op.combine(lanes[l], op.map(x[i + l], param));
    for (int l = 0; i + l < n; ++l) lanes[l] = op.combine(lanes[l], op.map(x[i + l], param));
  } else {
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l)
        lanes[l] = op.combine(lanes[l], op.map(*reinterpret_cast<const T*>(p + (i + l) * stride), param));
    for (int l = 0; i + l < n; ++l)
      lanes[l] = op.combine(lanes[l], op.map(*reinterpret_cast<const T*>(p + (i + l) * stride), param));
  }
  if constexpr (std::is_same_v<A, float> && requires { Op::kAddsPartials; }) return sum_partials<kLanes>(lanes);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] = op.combine(lanes[l], lanes[l + w]);
  return lanes[0];
}

/// One piece (n <= kReducePiece elements): a tree over leaves.
template <typename Op>
typename Op::acc_t piece_value(const Op& op, const char* p, int64_t n, int64_t stride, typename Op::acc_t param) {
  using A = typename Op::acc_t;
  if (n <= kLeaf) return leaf_value(op, p, n, stride, param);
  const int64_t leaves = (n + kLeaf - 1) / kLeaf;
  return tree<A>(
      0, leaves,
      [&](int64_t i) { return leaf_value(op, p + i * kLeaf * stride, std::min(kLeaf, n - i * kLeaf), stride, param); },
      [&](A a, A b) { return op.combine(a, b); });
}

/// The canonical value of a 1-D run of n >= 1 elements: a tree over pieces.
template <typename Op>
typename Op::acc_t run_value(const Op& op, const char* p, int64_t n, int64_t stride, typename Op::acc_t param) {
  using A = typename Op::acc_t;
  if (n <= kReducePiece) return piece_value(op, p, n, stride, param);
  const int64_t pieces = (n + kReducePiece - 1) / kReducePiece;
  return tree<A>(
      0, pieces,
      [&](int64_t c) {
        return piece_value(op, p + c * kReducePiece * stride, std::min(kReducePiece, n - c * kReducePiece), stride,
                           param);
      },
      [&](A a, A b) { return op.combine(a, b); });
}

/// As tree(), for vectors of w accumulators (column reductions).
template <typename A, typename Leaf, typename Comb>
void vec_tree(int64_t a, int64_t b, int64_t w, const Leaf& leaf, const Comb& comb, A* out) {
  if (b - a == 1) {
    leaf(a, out);
    return;
  }
  const int64_t mid = a + (b - a) / 2;
  vec_tree(a, mid, w, leaf, comb, out);
  A right[kColWidth];
  vec_tree(mid, b, w, leaf, comb, right);
  for (int64_t j = 0; j < w; ++j) out[j] = comb(out[j], right[j]);
}

#if defined(__AVX512F__)
// Note [Column sums in registers]
// A column leaf sums each of its w <= kColWidth columns over kColLeaf rows in
// row order, starting from 0. The generic leaf below walks 64 columns down
// the rows, then the next 64 down the same rows: each row is visited four
// times, 128 bytes at a time, and the loads wait on memory (gpt's bias
// gradients, bf16 [2048, 1024] read from L3, ran at 33 GB/s on 1 thread).
// For float sums of float, bf16 and float16 this leaf keeps up to 256 column
// sums in 16 vector registers and reads each row once, front to back. Each
// column's additions are the same, in the same order, so the bits are too.
// Standalone, 2048 rows from cache on 1 thread (2026-12-06): 768 columns
// 113 -> 57 us, 1024 columns 119 -> 68 us.

/// 16 values of T at p (kMasked: the lanes of m; the others 0) widened to float: exact.
template <bool kMasked, typename T>
inline __m512 load_as_float16(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return kMasked ? _mm512_maskz_loadu_ps(m, p) : _mm512_loadu_ps(p);
  } else {
    const __m256i h =
        kMasked ? _mm256_maskz_loadu_epi16(m, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, BFloat16>)
      return vm::bf16x16_to_float(h);
    else
      return _mm512_cvtph_ps(h);
  }
}

/// Columns [0, 16 NV) of rows [r0, r1) (masked: the first w of them, w <= 16 NV), each summed from 0 in row order into
/// acc.
template <int NV, bool kMasked, typename T, typename RowOff>
void sum_col_leaf_vectors(const char* base, int64_t r0, int64_t r1, int64_t w, const RowOff& row_off, float* acc) {
  __mmask16 m[NV];
  __m512 a[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t left = kMasked ? w - 16 * v : 16;
    m[v] = left <= 0 ? __mmask16(0) : vm::first_lanes16(left);
    a[v] = _mm512_setzero_ps();
  }
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = reinterpret_cast<const T*>(base + row_off(r));
    // One row pointer with constant offsets: otherwise GCC 12 strength-reduces
    // each of the NV addresses on its own and spills them to vector registers.
    asm("" : "+r"(x));
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) a[v] = _mm512_add_ps(a[v], load_as_float16<kMasked>(x + 16 * v, m[v]));
  }
  for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(acc + 16 * v, m[v], a[v]);
}

template <typename Op>
inline constexpr bool kFloatSumLeaf = requires {
  Op::kAddsPartials;
}
&&std::is_same_v<typename Op::acc_t, float> &&
    (std::is_same_v<typename Op::in_t, float> || std::is_same_v<typename Op::in_t, BFloat16> ||
     std::is_same_v<typename Op::in_t, Half>);
#endif

/// Reduces rows [r0, r1) of w contiguous columns into acc; row r starts at base + row_off(r).
template <typename Op, typename RowOff>
void col_leaf(const Op& op, const char* base, int64_t r0, int64_t r1, int64_t w, const RowOff& row_off,
              const typename Op::acc_t* param, typename Op::acc_t* acc) {
  using T = typename Op::in_t;
  using A = typename Op::acc_t;
#if defined(__AVX512F__)
  if constexpr (kFloatSumLeaf<Op>) {  // Note [Column sums in registers]
    int64_t j = 0;
    for (; w - j >= 256; j += 256)
      sum_col_leaf_vectors<16, false, T>(base + j * static_cast<int64_t>(sizeof(T)), r0, r1, 256, row_off, acc + j);
    for (; j < w; j += 64)
      sum_col_leaf_vectors<4, true, T>(base + j * static_cast<int64_t>(sizeof(T)), r0, r1, w - j, row_off, acc + j);
    return;
  }
#endif
  // Blocks of 256 bytes of outputs (four AVX-512 registers: four independent
  // add chains) in a fixed-size local array the compiler keeps in registers
  // across the rows.
  constexpr int64_t V = std::max<int64_t>(1, 256 / static_cast<int64_t>(sizeof(A)));
  int64_t j = 0;
  for (; j + V <= w; j += V) {
    A a[V], p[V];
    for (int64_t v = 0; v < V; ++v) {
      a[v] = op.identity();
      p[v] = param[j + v];
    }
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = reinterpret_cast<const T*>(base + row_off(r)) + j;
      for (int64_t v = 0; v < V; ++v) a[v] = op.combine(a[v], op.map(x[v], p[v]));
    }
    for (int64_t v = 0; v < V; ++v) acc[j + v] = a[v];
  }
  if (j == w) return;
  for (int64_t k = j; k < w; ++k) acc[k] = op.identity();
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = reinterpret_cast<const T*>(base + row_off(r));
    for (int64_t k = j; k < w; ++k) acc[k] = op.combine(acc[k], op.map(x[k], param[k]));
  }
}

/// Column piece c (rows [c*kReduceColPiece, ...) of R): a tree over leaves of kColLeaf rows.
template <typename Op, typename RowOff>
void col_piece(const Op& op, const char* base, int64_t c, int64_t R, int64_t w, const RowOff& row_off,
               const typename Op::acc_t* param, typename Op::acc_t* acc) {
  using A = typename Op::acc_t;
  const int64_t r0 = c * kReduceColPiece, r1 = std::min(R, r0 + kReduceColPiece);
  const int64_t leaves = (r1 - r0 + kColLeaf - 1) / kColLeaf;
  vec_tree<A>(
      0, leaves, w,
      [&](int64_t i, A* out) {
        col_leaf(op, base, r0 + i * kColLeaf, std::min(r1, r0 + (i + 1) * kColLeaf), w, row_off, param, out);
      },
      [&](A a, A b) { return op.combine(a, b); }, acc);
}

/// The canonical value of w columns over R >= 1 rows: a tree over column pieces.
template <typename Op, typename RowOff>
void col_value(const Op& op, const char* base, int64_t R, int64_t w, const RowOff& row_off,
               const typename Op::acc_t* param, typename Op::acc_t* acc) {
  using A = typename Op::acc_t;
  const int64_t pieces = (R + kReduceColPiece - 1) / kReduceColPiece;
  vec_tree<A>(
      0, pieces, w, [&](int64_t c, A* out) { col_piece(op, base, c, R, w, row_off, param, out); },
      [&](A a, A b) { return op.combine(a, b); }, acc);
}

/// Threads decide only who computes what: small work stays on the caller.
inline bool run_serial(int64_t work) { return work < kGrainSize || get_num_threads() == 1; }

// Rows: output o reduces R1 runs (the outer reduced dims) of n0 elements (reduced dim 0).
template <typename Op, typename Store>
void run_rows(const ReduceLayout& l, const Op& op, const typename Op::acc_t* param, Store& store) {
  using A = typename Op::acc_t;
  const int64_t G = l.num_outputs(), R = l.reduce_numel();
  const int64_t n0 = l.red_ndim ? l.red_sizes[0] : 1, s0 = l.red_ndim ? l.red_strides[0] : 0;
  const int64_t R1 = R / n0;
  const int64_t per_run = (n0 + kReducePiece - 1) / kReducePiece;
  const int64_t P = R1 * per_run;  // pieces per output
  const int nd1 = std::max(l.red_ndim - 1, 0);
  auto piece = [&](const char* base, int64_t q, A p) -> A {
    const int64_t k = q / per_run, c = q % per_run;
    const char* run = base + (k ? offset_of(k, nd1, l.red_sizes + 1, l.red_strides + 1) : 0);
    return piece_value(op, run + c * kReducePiece * s0, std::min(kReducePiece, n0 - c * kReducePiece), s0, p);
  };
  auto comb = [&](A a, A b) { return op.combine(a, b); };
  auto value = [&](const char* base, A p) -> A {
    if (P == 1) return piece(base, 0, p);
    return tree<A>(
        0, P, [&](int64_t q) { return piece(base, q, p); }, comb);
  };
  auto outputs = [&](int64_t b, int64_t e) {
    OutIter it(l, b);
    for (int64_t o = b; o < e; ++o, it.next()) store(o, value(l.in + it.offset, param ? param[o] : A(0)));
  };
  const int nthreads = get_num_threads();
  if (run_serial(G * R)) {
    outputs(0, G);
  } else if (P == 1 || G >= 4 * nthreads) {
    parallel_for(G, std::max<int64_t>(1, kGrainSize / R), [&](int64_t b, int64_t e) { outputs(b, e); });
  } else {
    // Few outputs over long reductions: every (output, piece) pair is a work item.
    auto buf = std::make_unique<A[]>(static_cast<size_t>(G * P));
    parallel_for(G * P, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t o = i / P;
        const char* base = l.in + offset_of(o, l.out_ndim, l.out_sizes, l.out_strides);
        buf[i] = piece(base, i % P, param ? param[o] : A(0));
      }
    });
    for (int64_t o = 0; o < G; ++o) {
      const A* pieces = buf.get() + o * P;
      store(o, tree<A>(
                   0, P, [&](int64_t q) { return pieces[q]; }, comb));
    }
  }
}

// Columns: kept dim 0 is contiguous; each unit is a block of up to kColWidth
// outputs that accumulates whole input rows.
//
// Note [Column sums by row stretches]
// When few column blocks are split into row pieces, the (block, piece) work
// items go to the threads piece by piece: a thread takes every block of its
// first rows, not every row of its first blocks. The input of such a sum is
// usually a gradient that the previous op wrote with its rows split the same
// way (the elementwise loops give each thread a contiguous stretch), so each
// thread now reads the rows its own core wrote (the likely reason it is
// faster; not confirmed). The tree is unchanged (each piece lands in the same slot
// and pieces combine by index), so the bits are too. gpt's bias gradients at 2
// threads, per step (`--profile table`, four interleaved runs of each binary):
// bf16 [2048, 1024] 0.75 -> 0.55 ms and [2048, 768] 0.48 -> 0.38; float32
// 0.96 -> 0.88 and 0.65 -> 0.56.
template <typename Op, typename Store>
void run_cols(const ReduceLayout& l, const Op& op, const typename Op::acc_t* param, Store& store) {
  using T = typename Op::in_t;
  using A = typename Op::acc_t;
  const int64_t G = l.num_outputs(), R = l.reduce_numel();
  const int64_t K = l.out_sizes[0];
  const int64_t blocks = (K + kColWidth - 1) / kColWidth;
  const int64_t U = (G / K) * blocks;
  const int64_t P = (R + kReduceColPiece - 1) / kReduceColPiece;
  const int64_t rs0 = l.red_strides[0];
  const bool one_red = l.red_ndim == 1;
  auto row_off = [&](int64_t r) { return one_red ? r * rs0 : offset_of(r, l.red_ndim, l.red_sizes, l.red_strides); };
  const A zeros[kColWidth] = {};
  struct Unit {
    const char* base;
    int64_t o0, w;
  };
  auto unit = [&](int64_t u) {
    const int64_t q = u / blocks, j0 = (u % blocks) * kColWidth;
    const char* base =
        l.in + offset_of(q, l.out_ndim - 1, l.out_sizes + 1, l.out_strides + 1) + j0 * static_cast<int64_t>(sizeof(T));
    return Unit{base, q * K + j0, std::min(kColWidth, K - j0)};
  };
  auto units = [&](int64_t b, int64_t e) {
    A acc[kColWidth];
    for (int64_t u = b; u < e; ++u) {
      const Unit un = unit(u);
      col_value(op, un.base, R, un.w, row_off, param ? param + un.o0 : zeros, acc);
      for (int64_t j = 0; j < un.w; ++j) store(un.o0 + j, acc[j]);
    }
  };
  const int nthreads = get_num_threads();
  if (run_serial(G * R)) {
    units(0, U);
  } else if (P == 1 || U >= 4 * nthreads) {
    parallel_for(U, std::max<int64_t>(1, kGrainSize / (R * kColWidth)), [&](int64_t b, int64_t e) { units(b, e); });
  } else {
    // Few column blocks over many rows: every (block, row piece) pair is a work
    // item, handed out row piece by row piece, so that each thread reads whole
    // rows from its own stretch of the input (Note [Column sums by row stretches]).
    auto buf = std::make_unique<A[]>(static_cast<size_t>(U * P * kColWidth));
    parallel_for(U * P, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t u = i % U, c = i / U;
        const Unit un = unit(u);
        col_piece(op, un.base, c, R, un.w, row_off, param ? param + un.o0 : zeros, buf.get() + (u * P + c) * kColWidth);
      }
    });
    A acc[kColWidth];
    for (int64_t u = 0; u < U; ++u) {
      const Unit un = unit(u);
      const A* pieces = buf.get() + u * P * kColWidth;
      vec_tree<A>(
          0, P, un.w, [&](int64_t c, A* out) { std::copy_n(pieces + c * kColWidth, un.w, out); },
          [&](A a, A b) { return op.combine(a, b); }, acc);
      for (int64_t j = 0; j < un.w; ++j) store(un.o0 + j, acc[j]);
    }
  }
}

/// Runs `op` over the layout and calls store(o, acc) once per output o.
template <typename Op, typename Store>
void run_reduce(const ReduceLayout& l, const Op& op, const typename Op::acc_t* param, Store&& store) {
  using T = typename Op::in_t;
  const int64_t G = l.num_outputs();
  if (G == 0) return;
  if (l.reduce_numel() == 0) {
    for (int64_t o = 0; o < G; ++o) store(o, op.identity());
    return;
  }
  constexpr int64_t es = sizeof(T);
  if (l.out_ndim >= 1 && l.out_strides[0] == es && l.red_ndim >= 1 && l.red_strides[0] != es) {
    run_cols(l, op, param, store);
  } else {
    run_rows(l, op, param, store);
  }
}

/// Scratch for one value per output: on the stack when small (no allocation for
/// the common small reductions), on the heap otherwise.
template <typename A>
class OutputScratch {
 public:
  explicit OutputScratch(int64_t n) {
    if (n > kSmall) heap_ = std::make_unique<A[]>(static_cast<size_t>(n));
  }
  A* data() { return heap_ ? heap_.get() : small_; }

 private:
  static constexpr int64_t kSmall = 64;
  A small_[kSmall];
  std::unique_ptr<A[]> heap_;
};

// ---- ops shared by several kernels ----

template <typename T, typename A = sum_acc_t<T>>
struct SumOp {
  using in_t = T;
  using acc_t = A;
  A identity() const { return A(0); }
  A map(T x, A) const { return static_cast<A>(x); }
  A combine(A a, A b) const { return add_wrap(a, b); }
  static constexpr bool kAddsPartials = true;  // combine is a + b: leaf_value may fold in registers
};

template <typename T, bool IsMax>
struct MaxOp {
  using in_t = T;
  using acc_t = compute_t<T>;
  using A = acc_t;
  A identity() const { return IsMax ? lowest_value<A>() : highest_value<A>(); }
  A map(T x, A) const { return static_cast<A>(x); }
  A combine(A a, A b) const { return IsMax ? max_nan(a, b) : min_nan(a, b); }
};

/// Max that may drop NaN (twice as fast as MaxOp): for softmax and logsumexp,
/// whose later passes turn any NaN in the slice into a NaN result anyway.
template <typename T>
struct FastMaxOp {
  using in_t = T;
  using acc_t = compute_t<T>;
  using A = acc_t;
  A identity() const { return lowest_value<A>(); }
  A map(T x, A) const { return static_cast<A>(x); }
  A combine(A a, A b) const { return a > b ? a : b; }
};

/// sum(exp(x - param)): the middle pass of softmax and logsumexp.
template <typename T>
struct ExpShiftOp {
  using in_t = T;
  using acc_t = compute_t<T>;
  using A = acc_t;
  A identity() const { return A(0); }
  A map(T x, A shift) const { return exp_vec(static_cast<A>(x) - shift); }
  A combine(A a, A b) const { return a + b; }
};

}  // namespace kiln::kernels::detail
