// The fused attention's row kernels (kiln/kernels/attention.h).
//
// Each row is swept while it stays in L1 (a row of 128 float scores is 512
// bytes): float/double rows keep exp in the row itself between passes;
// 16-bit rows compute in float and round once at the end, recomputing exp
// rather than storing an unrounded intermediate. Sums and maxima use kW
// independent partials combined pairwise, so a row's result depends only on
// its length, never on the thread count.
//
// Rows are independent; the threads split them in contiguous ranges once a
// call holds enough elements (kRowGrain) that a second thread pays for its
// start (~1 µs). At the gpt_infer shape (4 heads × 64 rows × 128 keys per
// block) a call is 32K elements: two threads.
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "elementwise_loop.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/attention.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

constexpr int64_t kRowGrain = 8192;  // elements per thread at least

// Rows are short (the keys of one block: 64..128 at the gpt shapes), so a
// float row runs on 16-lane vectors (GCC/Clang vector extensions, AVX-512
// under -march=native) end to end: its max, exp with the running sum in the
// same sweep, the scaling. A row's last partial vector is computed whole
// with its lanes past n masked to 0 (they are hidden keys, which get 0
// anyway). Other types, and rows shorter than a vector, take plain loops.
constexpr int kW = 16;
using VecF = Vec16f;
using VecI = int32_t __attribute__((vector_size(kW * sizeof(int32_t))));

// Inlined by force: out of line, GCC passes each 64-byte vector through memory.
#define KILN_VEC_INLINE inline __attribute__((always_inline))

KILN_VEC_INLINE VecF splat(float x) { return VecF{} + x; }

KILN_VEC_INLINE VecF load(const float* y) {
  VecF v;
  std::memcpy(&v, y, sizeof(v));
  return v;
}

KILN_VEC_INLINE void store(float* y, VecF v) { std::memcpy(y, &v, sizeof(v)); }

// Lanes k < n of a vector (n < kW).
KILN_VEC_INLINE VecI lanes_below(int64_t n) {
  VecI lane;
  for (int k = 0; k < kW; ++k) lane[k] = k;
  return lane < static_cast<int32_t>(n);
}

template <typename A, typename Comb>
A fold(A* acc, const Comb& comb) {
  for (int w = kW / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) acc[k] = comb(acc[k], acc[k + w]);
  return acc[0];
}

// fold()'s tree on a vector's lanes, in registers (fold16, reduce_engine.h).
KILN_VEC_INLINE float hsum(VecF v) {
  return fold16(v, [](auto x, auto z) { return x + z; });
}

// NaN need not win a max here: it reaches the row through the sum of exp,
// which the max only shifts.
KILN_VEC_INLINE float hmax(VecF v) {
  return fold16(v, [](auto x, auto z) { return z > x ? z : x; });
}

// exp_vec (reduce_engine.h) on a vector, the same steps lane by lane.
KILN_VEC_INLINE VecF exp_v(VecF x) {
  const VecF hi = splat(88.7228317f), lo = splat(-103.972084f);
  VecF fn;
#if defined(__AVX512F__)
  // With every lane in [-86, 88] (no NaN), 2^fn, its halves below and y 2^fn
  // are normal floats: scaling by the halves is exact twice, so one exact
  // scaling by 2^fn (VSCALEFPS) gives the same bits, and neither the clamp
  // (which leaves such lanes as they are) nor a special case applies, so
  // neither runs. A softmax row's x = s - max lies there unless its weights
  // underflow. Skipping the clamp too took the row kernels from 0.38 to 0.30
  // of the products' time in gpt_infer's float32 attention (perf,
  // BM_SdpaGptHeadsF32/1/0/64/1, 2026-12-07).
  const __m512 xv = reinterpret_cast<__m512>(x);
  const __mmask16 in = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-86.0f), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(xv, _mm512_set1_ps(88.0f), _CMP_LE_OQ);
  if (__builtin_expect(in == 0xffff, 1)) {
    const VecF y = exp_reduced_in_range(x, fn);
    return reinterpret_cast<VecF>(_mm512_scalef_ps(reinterpret_cast<__m512>(y), reinterpret_cast<__m512>(fn)));
  }
#endif
  const VecF y = exp_reduced(x, fn);
  const VecI n = __builtin_convertvector(fn, VecI);
  const VecI n1 = n >> 1;
  const VecI n2 = n - n1;
  const VecF s1 = reinterpret_cast<const VecF&>(static_cast<const VecI&>((n1 + 127) << 23));
  const VecF s2 = reinterpret_cast<const VecF&>(static_cast<const VecI&>((n2 + 127) << 23));
  VecF res = y * s1 * s2;
  res = x > hi ? splat(std::numeric_limits<float>::infinity()) : res;
  res = x < lo ? splat(0.0f) : res;
  return x != x ? x : res;
}

// One float row of n >= kW visible keys out of cols, in place: the weights,
// 0 on the hidden keys. Returns the scaled max and the sum of exp.
std::pair<float, float> softmax_row(float* y, int64_t n, int64_t cols, float scale) {
  VecF mx = load(y);
  for (int64_t i = kW; i + kW <= n; i += kW) mx = load(y + i) > mx ? load(y + i) : mx;
  if (n % kW) mx = load(y + n - kW) > mx ? load(y + n - kW) : mx;  // overlaps: a max is idempotent
  const float m = hmax(mx) * scale;                                // scale > 0 keeps the order
  const VecF vs = splat(scale), vm = splat(m);
  VecF acc = splat(0.0f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const VecF e = exp_v(load(y + i) * vs - vm);
    store(y + i, e);
    acc += e;
  }
  if (i < n) {
    const VecI keep = lanes_below(n - i);
    if (i + kW <= cols) {  // the lanes past n are hidden keys of this row
      const VecF e = keep ? exp_v(load(y + i) * vs - vm) : splat(0.0f);
      store(y + i, e);
      acc += e;
      i += kW;
    } else {  // the row ends inside this vector
      float buf[kW] = {};
      for (int64_t k = 0; k < n - i; ++k) buf[k] = y[i + k];
      const VecF e = keep ? exp_v(load(buf) * vs - vm) : splat(0.0f);
      acc += e;
      for (int64_t k = 0; k < n - i; ++k) y[i + k] = e[k];
      i = n;
    }
  }
  for (int64_t j = i; j < cols; ++j) y[j] = 0.0f;
  const float sum = hsum(acc), inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) y[j] *= inv;
  return {m, sum};
}

// The plain forms: f(0) .. f(n-1) in kW partials, combined pairwise.
template <typename A, typename F>
A row_sum(int64_t n, const F& f) {
  A acc[kW] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % kW] += f(i);
  return fold(acc, [](A x, A z) { return x + z; });
}

template <typename A, typename F>
A row_max(int64_t n, const F& f) {
  A acc[kW];
  for (int k = 0; k < kW; ++k) acc[k] = -std::numeric_limits<A>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const A v = f(i);
    acc[i % kW] = v > acc[i % kW] ? v : acc[i % kW];
  }
  return fold(acc, [](A x, A z) { return z > x ? z : x; });
}

// 16-bit rows (bf16, fp16) of at least kW visible keys run the float vector
// code on a float copy of the row and round once at the end. The copy gets
// the same float values, lane by lane and partial by partial, as the plain
// loops below compute (exp_v is exp_vec lane by lane; the vector partials are
// the loops' i % kW partials, folded alike), so the results do not change,
// only the time: the plain loops convert and call exp_vec per element.
template <typename T>
constexpr bool kHalf = !std::is_same_v<T, float> && !std::is_same_v<T, double>;

float* float_row(int64_t cols) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < cols) buf.resize(static_cast<size_t>(cols));
  return buf.data();
}

// The elementwise drivers' block conversions: bf16 and fp16 rows convert 16
// lanes at a time (the vector loads that follow a widen then read whole vector
// stores), with the dtype's own rounding.
template <typename T>
void widen(const T* y, int64_t n, float* f) {
  ew::load_block<float, T>(f, reinterpret_cast<const char*>(y), static_cast<int64_t>(sizeof(T)), n);
}

template <typename T>
void narrow(const float* f, int64_t n, T* y) {
  ew::store_block<T, float>(reinterpret_cast<char*>(y), static_cast<int64_t>(sizeof(T)), f, n);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// bf16 and float32 rows of up to kRegVectors * kW keys (gpt's blocks: 64
// and 128) are held in registers from the load to the store: no float copy
// of the row, no second and third sweep through memory. The arithmetic is
// softmax_row's, vector for vector and partial for partial (the max over the
// same visible scores, exp_v, the sum in the same lanes and order, the same
// fold, the same reciprocal), so the bits are those of the float copy path;
// rows of fewer than kW visible keys get the plain loops' bits (one partial
// per lane, hidden lanes adding 0 to the same fold).
//
// Each kernel is instantiated for the NV = ceil(n / kW) vectors that hold a
// row's visible keys, so its loops unroll and the vectors stay in registers.
// One loop over kRegVectors with a test per vector kept them on the stack:
// gpt's bf16 forward spent 43 % of its time in the row kernel and the plain
// loops of the rows shorter than a vector (perf, BM_SdpaGptHeadsBf16/1/0,
// 2026-12-06).
constexpr int kRegVectors = 8;

// The n visible keys of a bf16 row as NV vectors of floats (lanes past n: 0).
template <int NV>
KILN_VEC_INLINE void load_visible(const BFloat16* y, int64_t n, VecF* v) {
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j)  // whole vectors unmasked (Note [Whole vectors unmasked])
    v[j] =
        reinterpret_cast<VecF>(vm::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + j * kW))));
  const __m256i h = _mm256_maskz_loadu_epi16(vm::first_lanes16(n - (NV - 1) * kW), y + (NV - 1) * kW);
  v[NV - 1] = reinterpret_cast<VecF>(vm::bf16x16_to_float(h));
}

// Stores lanes [0, n) of v rounded to bf16, and 0 for the hidden keys [n, cols).
template <int NV>
KILN_VEC_INLINE void store_visible(BFloat16* y, int64_t n, int64_t cols, const VecF* v) {
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j * kW), vm::float_to_bf16x16(reinterpret_cast<__m512>(v[j])));
  const __m512 last = _mm512_maskz_mov_ps(vm::first_lanes16(n - (NV - 1) * kW), reinterpret_cast<__m512>(v[NV - 1]));
  _mm256_mask_storeu_epi16(y + (NV - 1) * kW, vm::first_lanes16(cols - (NV - 1) * kW), vm::float_to_bf16x16(last));
  for (int64_t c = NV * kW; c < cols; c += kW)
    _mm256_mask_storeu_epi16(y + c, vm::first_lanes16(cols - c), _mm256_setzero_si256());
}

// The float32 forms of the two above.
template <int NV>
KILN_VEC_INLINE void load_visible(const float* y, int64_t n, VecF* v) {
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j) v[j] = reinterpret_cast<VecF>(_mm512_loadu_ps(y + j * kW));
  v[NV - 1] = reinterpret_cast<VecF>(_mm512_maskz_loadu_ps(vm::first_lanes16(n - (NV - 1) * kW), y + (NV - 1) * kW));
}

template <int NV>
KILN_VEC_INLINE void store_visible(float* y, int64_t n, int64_t cols, const VecF* v) {
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j) _mm512_storeu_ps(y + j * kW, reinterpret_cast<__m512>(v[j]));
  const __m512 last = _mm512_maskz_mov_ps(vm::first_lanes16(n - (NV - 1) * kW), reinterpret_cast<__m512>(v[NV - 1]));
  _mm512_mask_storeu_ps(y + (NV - 1) * kW, vm::first_lanes16(cols - (NV - 1) * kW), last);
  for (int64_t c = NV * kW; c < cols; c += kW)
    _mm512_mask_storeu_ps(y + c, vm::first_lanes16(cols - c), _mm512_setzero_ps());
}

// softmax_row on R consecutive rows (row k at y + k cols) of n[k] visible
// keys, each filling NV = ceil(n[k] / kW) vectors (the caller pairs only such
// rows, so only a row's last vector is partial): the max, m[k], and the sum,
// sum[k]. A row's work is one chain (max, exp, sum, reciprocal) whose latency
// exceeds its arithmetic; two rows side by side overlap their chains.
template <typename T, int R, int NV>
void softmax_rows(T* y, const int64_t* n, int64_t cols, float scale, float* m, float* sum) {
  VecF v[R][NV];
  __mmask16 keep[R];
  VecF mx[R];
#pragma GCC unroll 2
  for (int k = 0; k < R; ++k) {
    load_visible<NV>(y + k * cols, n[k], v[k]);
    keep[k] = vm::first_lanes16(n[k] - (NV - 1) * kW);
    // The last vector's hidden lanes out of the max; the max is exact in any order.
    mx[k] = reinterpret_cast<VecF>(_mm512_mask_blend_ps(
        keep[k], _mm512_set1_ps(-std::numeric_limits<float>::infinity()), reinterpret_cast<__m512>(v[k][NV - 1])));
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j)
#pragma GCC unroll 2
    for (int k = 0; k < R; ++k) mx[k] = v[k][j] > mx[k] ? v[k][j] : mx[k];
  const VecF vs = splat(scale);
  VecF vm_[R], acc[R];
#pragma GCC unroll 2
  for (int k = 0; k < R; ++k) {
    m[k] = hmax(mx[k]) * scale;  // scale > 0 keeps the order
    vm_[k] = splat(m[k]);
    acc[k] = splat(0.0f);
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j)
#pragma GCC unroll 2
    for (int k = 0; k < R; ++k) {
      v[k][j] = exp_v(v[k][j] * vs - vm_[k]);
      acc[k] += v[k][j];
    }
#pragma GCC unroll 2
  for (int k = 0; k < R; ++k) {
    v[k][NV - 1] = reinterpret_cast<VecF>(
        _mm512_maskz_mov_ps(keep[k], reinterpret_cast<__m512>(exp_v(v[k][NV - 1] * vs - vm_[k]))));
    acc[k] += v[k][NV - 1];
    sum[k] = hsum(acc[k]);
    const VecF vi = splat(1.0f / sum[k]);
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) v[k][j] *= vi;
    store_visible<NV>(y + k * cols, n[k], cols, v[k]);
  }
}

// recompute's row: exp(y · scale - l) on the n visible keys, 0 after.
template <int NV>
void recompute_row_bf16(BFloat16* y, int64_t n, int64_t cols, float scale, float l) {
  VecF v[NV];
  load_visible<NV>(y, n, v);
  const VecF vs = splat(scale), vl = splat(l);
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) v[j] = exp_v(v[j] * vs - vl);
  store_visible<NV>(y, n, cols, v);
}

// scores_grad's row: p (dp - d) scale on the n visible keys, 0 after.
template <int NV>
void scores_grad_row_bf16(BFloat16* g, const BFloat16* p, int64_t n, int64_t cols, float d, float scale) {
  VecF dp[NV], pr[NV];
  load_visible<NV>(g, n, dp);
  load_visible<NV>(p, n, pr);
  const VecF vd = splat(d), vs = splat(scale);
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) dp[j] = pr[j] * (dp[j] - vd) * vs;
  store_visible<NV>(g, n, cols, dp);
}

// Each kernel's instances by NV - 1.
template <template <int> typename K>
struct ByVectors {
  template <int... I>
  static constexpr auto table(std::integer_sequence<int, I...>) {
    return std::array{&K<I + 1>::run...};
  }
  static constexpr auto kTable = table(std::make_integer_sequence<int, kRegVectors>{});
};
template <typename T>
struct Softmax {
  template <int NV>
  struct K {
    static void run(T* y, const int64_t* n, int64_t cols, float scale, float* m, float* sum) {
      softmax_rows<T, 1, NV>(y, n, cols, scale, m, sum);
    }
  };
  template <int NV>
  struct K2 {
    static void run(T* y, const int64_t* n, int64_t cols, float scale, float* m, float* sum) {
      softmax_rows<T, 2, NV>(y, n, cols, scale, m, sum);
    }
  };
};
template <int NV>
struct RecomputeK {
  static void run(BFloat16* y, int64_t n, int64_t cols, float scale, float l) {
    recompute_row_bf16<NV>(y, n, cols, scale, l);
  }
};
template <int NV>
struct ScoresGradK {
  static void run(BFloat16* g, const BFloat16* p, int64_t n, int64_t cols, float d, float scale) {
    scores_grad_row_bf16<NV>(g, p, n, cols, d, scale);
  }
};
int vectors_of(int64_t n) { return static_cast<int>((n + kW - 1) / kW); }

template <typename T>
constexpr bool kRegRows = std::is_same_v<T, BFloat16>;
#else
template <typename T>
constexpr bool kRegRows = false;
#endif

// Keys row i of a block sees.
int64_t visible(const AttentionBlock& a, int64_t i) { return a.causal ? std::min(a.cols, a.row0 + i + 1) : a.cols; }

// range(r0, r1) over the call's rows (row r is (b, i) = (r / rows, r % rows)), split across threads.
template <typename Range>
void for_row_ranges(const AttentionBlock& a, const Range& range) {
  const int64_t total = a.batch * a.rows;
  if (get_num_threads() == 1 || total * a.cols < 2 * kRowGrain) {
    range(int64_t{0}, total);
    return;
  }
  parallel_for(total, std::max<int64_t>(1, kRowGrain / std::max<int64_t>(a.cols, 1)), range);
}

// body(b, i, row) over every row (b, i) of the call, split across threads.
template <typename Body>
void for_rows(const AttentionBlock& a, const Body& body) {
  for_row_ranges(a, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) body(r / a.rows, r % a.rows, r);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// weights() on float32 or bf16 rows of at most kRegVectors vectors: two
// rows at a time where both take the same number of vectors (neighbours in a
// causal block but at every kW-th row), else one.
template <typename T>
void weights_reg_rows(const AttentionBlock& a, T* s, T* lse) {
  for_row_ranges(a, [&](int64_t r0, int64_t r1) {
    const float scale = static_cast<float>(a.scale);
    const int64_t cols = a.cols;
    for (int64_t r = r0; r < r1;) {
      int64_t n[2] = {visible(a, r % a.rows), 0};
      const int nv = vectors_of(n[0]);
      int rows = 1;
      if (r + 1 < r1) {
        n[1] = visible(a, (r + 1) % a.rows);
        if (vectors_of(n[1]) == nv) rows = 2;
      }
      float m[2], sum[2];
      (rows == 2 ? ByVectors<Softmax<T>::template K2>::kTable : ByVectors<Softmax<T>::template K>::kTable)[nv - 1](
          s + r * cols, n, cols, scale, m, sum);
      if (lse)
        for (int k = 0; k < rows; ++k)
          lse[(r + k) / a.rows * a.row_batch_stride + (r + k) % a.rows] = static_cast<T>(m[k] + std::log(sum[k]));
      r += rows;
    }
  });
}
#endif

template <typename T>
void weights(const AttentionBlock& a, T* s, T* lse) {
  using A = compute_t<T>;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (kRegRows<T> || std::is_same_v<T, float>) {
    if (a.cols <= kRegVectors * kW) return weights_reg_rows(a, s, lse);
  }
#endif
  // Everything the row loops read is a local of the row body: a store through
  // y could otherwise alias a captured value, which the loop would then reload
  // every element (and not vectorise).
  for_rows(a, [&](int64_t b, int64_t i, int64_t r) {
    const A scale = static_cast<A>(a.scale);
    T* y = s + r * a.cols;
    const int64_t n = visible(a, i), cols = a.cols;
    A m, sum;
    if constexpr (std::is_same_v<T, float>) {
      if (n >= kW) {
        std::tie(m, sum) = softmax_row(y, n, cols, scale);
        if (lse) lse[b * a.row_batch_stride + i] = m + std::log(sum);
        return;
      }
    }
    if constexpr (kHalf<T>) {
      if (n >= kW) {
        float* f = float_row(cols);
        widen(y, cols, f);
        std::tie(m, sum) = softmax_row(f, n, cols, scale);
        narrow(f, cols, y);
        if (lse) lse[b * a.row_batch_stride + i] = static_cast<T>(m + std::log(sum));
        return;
      }
    }
    // The max of the raw scores, scaled: scale > 0 keeps the order.
    if constexpr (std::is_same_v<T, A>) {
      m = row_max<A>(n, [&](int64_t j) { return y[j]; }) * scale;
      for (int64_t j = 0; j < n; ++j) y[j] = exp_vec(y[j] * scale - m);
      sum = row_sum<A>(n, [&](int64_t j) { return y[j]; });
      const A inv = A(1) / sum;
      for (int64_t j = 0; j < n; ++j) y[j] *= inv;
    } else {
      m = row_max<A>(n, [&](int64_t j) { return static_cast<A>(y[j]); }) * scale;
      sum = row_sum<A>(n, [&](int64_t j) { return exp_vec(static_cast<A>(y[j]) * scale - m); });
      const A inv = A(1) / sum;
      for (int64_t j = 0; j < n; ++j) y[j] = static_cast<T>(exp_vec(static_cast<A>(y[j]) * scale - m) * inv);
    }
    for (int64_t j = n; j < cols; ++j) y[j] = T(0);
    if (lse) lse[b * a.row_batch_stride + i] = static_cast<T>(m + std::log(sum));
  });
}

template <typename T>
void recompute(const AttentionBlock& a, T* s, const T* lse) {
  using A = compute_t<T>;
  for_rows(a, [&](int64_t b, int64_t i, int64_t r) {
    const A scale = static_cast<A>(a.scale);
    T* y = s + r * a.cols;
    const int64_t n = visible(a, i), cols = a.cols;
    const A l = static_cast<A>(lse[b * a.row_batch_stride + i]);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (kRegRows<T>) {
      if (cols <= kRegVectors * kW) return ByVectors<RecomputeK>::kTable[vectors_of(n) - 1](y, n, cols, scale, l);
    }
#endif
    if constexpr (kHalf<T>) {
      if (n >= kW) {
        float* f = float_row(n);
        widen(y, n, f);
        const VecF vs = splat(scale), vl = splat(l);
        int64_t j = 0;
        for (; j + kW <= n; j += kW) store(f + j, exp_v(load(f + j) * vs - vl));
        for (; j < n; ++j) f[j] = exp_vec(f[j] * scale - l);
        narrow(f, n, y);
        for (int64_t c = n; c < cols; ++c) y[c] = T(0);
        return;
      }
    }
    for (int64_t j = 0; j < n; ++j) y[j] = static_cast<T>(exp_vec(static_cast<A>(y[j]) * scale - l));
    for (int64_t j = n; j < cols; ++j) y[j] = T(0);
  });
}

template <typename T>
void scores_grad(const AttentionBlock& a, T* dp, const T* p, const T* D) {
  using A = compute_t<T>;
  for_rows(a, [&](int64_t b, int64_t i, int64_t r) {
    const A scale = static_cast<A>(a.scale);
    T* g = dp + r * a.cols;
    const T* pr = p + r * a.cols;
    const int64_t n = visible(a, i), cols = a.cols;
    const A d = static_cast<A>(D[b * a.row_batch_stride + i]);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (kRegRows<T>) {
      if (cols <= kRegVectors * kW) return ByVectors<ScoresGradK>::kTable[vectors_of(n) - 1](g, pr, n, cols, d, scale);
    }
#endif
    if constexpr (kHalf<T>) {
      if (n >= kW) {  // two float copies, one vectorised loop: the same expression per element
        float* f = float_row(2 * n);
        float* fp = f + n;
        widen(g, n, f);
        widen(pr, n, fp);
        for (int64_t j = 0; j < n; ++j) f[j] = fp[j] * (f[j] - d) * scale;
        narrow(f, n, g);
        for (int64_t j = n; j < cols; ++j) g[j] = T(0);
        return;
      }
    }
    for (int64_t j = 0; j < n; ++j) g[j] = static_cast<T>(static_cast<A>(pr[j]) * (static_cast<A>(g[j]) - d) * scale);
    for (int64_t j = n; j < cols; ++j) g[j] = T(0);
  });
}

}  // namespace

void attention_weights(const AttentionBlock& a, void* scores, void* lse) {
  KILN_CAPTURE_KERNEL("attention_weights", attention_weights(a, scores, lse));
  if (a.batch * a.rows * a.cols == 0) return;
  visit_dtype<kFloatingTypes>(a.dtype, "attention_weights",
                              [&]<typename T>() { weights(a, static_cast<T*>(scores), static_cast<T*>(lse)); });
}

void attention_recompute_weights(const AttentionBlock& a, void* scores, const void* lse) {
  KILN_CAPTURE_KERNEL("attention_recompute_weights", attention_recompute_weights(a, scores, lse));
  if (a.batch * a.rows * a.cols == 0) return;
  visit_dtype<kFloatingTypes>(a.dtype, "attention_recompute_weights",
                              [&]<typename T>() { recompute(a, static_cast<T*>(scores), static_cast<const T*>(lse)); });
}

void attention_scores_grad(const AttentionBlock& a, void* dp, const void* p, const void* D) {
  KILN_CAPTURE_KERNEL("attention_scores_grad", attention_scores_grad(a, dp, p, D));
  if (a.batch * a.rows * a.cols == 0) return;
  visit_dtype<kFloatingTypes>(a.dtype, "attention_scores_grad", [&]<typename T>() {
    scores_grad(a, static_cast<T*>(dp), static_cast<const T*>(p), static_cast<const T*>(D));
  });
}

}  // namespace kiln::kernels
