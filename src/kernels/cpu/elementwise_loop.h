// Internal to the elementwise kernels: the drivers that turn a LoopSpec into
// calls of a contiguous "row" function.
//
// A row function computes n results from contiguous arrays of the compute
// type (float for the 16-bit floats). The drivers hand it the operands'
// memory directly when they already are contiguous arrays of that type, and
// otherwise convert/gather kBlock elements at a time into stack buffers, call
// the row on those, and convert/scatter the results back. So each op is
// written once, as a row the compiler vectorises, and every dtype, stride
// pattern and broadcast is handled here.
//
// Note [Elementwise aliasing]
// The output may be the same memory as an input (in-place ops), element for
// element: rows read element i before writing element i, and blocks are
// loaded before they are stored. Partial overlaps are rejected or cloned by
// the ops layer before a kernel runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "elementwise_math.h"
#include "kiln/core/dtype.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels::ew {

/// Elements per conversion block: 1 KiB of float per buffer, stays in L1.
inline constexpr int64_t kBlock = 256;
/// 1-D loops are split across threads at multiples of this many elements
/// (a cache line of doubles or more), so threads never share a line of output.
inline constexpr int64_t kSplitQuantum = 64;

/// Value conversion with copy_'s semantics (floats to bool test != 0; the
/// 16-bit floats go through float).
template <typename To, typename From>
inline To cast(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, bool>) {
    return static_cast<compute_t<From>>(v) != compute_t<From>(0);
  } else if constexpr (is_reduced_float_v<To>) {
    return To(static_cast<float>(static_cast<compute_t<From>>(v)));
  } else {
    return static_cast<To>(static_cast<compute_t<From>>(v));
  }
}

/// Calls body(ptrs, inner_strides, n) over `s`, on several threads when the
/// loop has at least kGrainSize elements. A loop that coalesced into one row
/// (the contiguous case) is split inside the row; others split by rows.
template <typename Body>
void elementwise_for(const LoopSpec& s, Body&& body) {
  const int64_t n = s.numel();
  if (n == 0) return;
  if (s.ndim > 1) {
    for_each_row(s, body);
    return;
  }
  int64_t st[kMaxOperands] = {};
  for (int op = 0; op < s.nops; ++op) st[op] = s.inner_stride(op);
  if (n < kGrainSize) {
    body(s.data, st, n);
    return;
  }
  const int64_t chunks = (n + kSplitQuantum - 1) / kSplitQuantum;
  parallel_for(chunks, kGrainSize / kSplitQuantum, [&](int64_t b, int64_t e) {
    const int64_t lo = b * kSplitQuantum, hi = std::min(n, e * kSplitQuantum);
    char* p[kMaxOperands] = {};
    for (int op = 0; op < s.nops; ++op) p[op] = s.data[op] + lo * st[op];
    body(p, st, hi - lo);
  });
}

/// dst[0..n) = src elements (type T, byte stride `st`; 0 broadcasts one value) as C.
template <typename C, typename T>
inline void load_block(C* dst, const char* src, int64_t st, int64_t n) {
  if constexpr (std::is_same_v<T, Half> && std::is_same_v<C, float>) {
    if (st == static_cast<int64_t>(sizeof(T))) return vm::half_to_float_row(dst, reinterpret_cast<const Half*>(src), n);
  }
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, float>) {
    if (st == static_cast<int64_t>(sizeof(T)))
      return vm::bf16_to_float_row(dst, reinterpret_cast<const BFloat16*>(src), n);
  }
  if (st == static_cast<int64_t>(sizeof(T))) {
    const T* s = reinterpret_cast<const T*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = cast<C>(s[i]);
  } else if (st == 0) {
    const C v = cast<C>(*reinterpret_cast<const T*>(src));
    for (int64_t i = 0; i < n; ++i) dst[i] = v;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = cast<C>(*reinterpret_cast<const T*>(src + i * st));
  }
}

/// dst elements (type O, byte stride `st`) = src[0..n) converted from C.
template <typename O, typename C>
inline void store_block(char* dst, int64_t st, const C* src, int64_t n) {
  if constexpr (std::is_same_v<O, Half> && std::is_same_v<C, float>) {
    if (st == static_cast<int64_t>(sizeof(O))) return vm::float_to_half_row(reinterpret_cast<Half*>(dst), src, n);
  }
  if constexpr (std::is_same_v<O, BFloat16> && std::is_same_v<C, float>) {
    if (st == static_cast<int64_t>(sizeof(O))) return vm::float_to_bf16_row(reinterpret_cast<BFloat16*>(dst), src, n);
  }
  if (st == static_cast<int64_t>(sizeof(O))) {
    O* d = reinterpret_cast<O*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = cast<O>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) *reinterpret_cast<O*>(dst + i * st) = cast<O>(src[i]);
  }
}

/// Unary driver: operand 0 (type O) = row over operand 1 (type T).
/// Row: void(compute_t<O>* out, const compute_t<T>* in, int64_t n); out may equal in.
template <typename O, typename T, typename Row>
void run_unary(const LoopSpec& s, Row row) {
  using C = compute_t<T>;
  using OC = compute_t<O>;
  elementwise_for(s, [&](char* const* p, const int64_t* st, int64_t n) {
    if constexpr (std::is_same_v<O, OC> && std::is_same_v<T, C>) {
      if (st[0] == static_cast<int64_t>(sizeof(O)) && st[1] == static_cast<int64_t>(sizeof(T))) {
        row(reinterpret_cast<O*>(p[0]), reinterpret_cast<const T*>(p[1]), n);
        return;
      }
    }
    alignas(64) C in[kBlock];
    alignas(64) OC out[kBlock];
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t m = std::min(kBlock, n - i0);
      load_block<C, T>(in, p[1] + i0 * st[1], st[1], m);
      row(out, in, m);
      store_block<O, OC>(p[0] + i0 * st[0], st[0], out, m);
    }
  });
}

/// out[i] = f(in[i]) in the compute type, operand 0 and 1 of type T: a plain
/// loop the compiler vectorises.
template <typename T, typename F>
void map(const LoopSpec& s, F f) {
  using C = compute_t<T>;
  run_unary<T, T>(s, [f](C* out, const C* in, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = f(in[i]);
  });
}

/// Elements per 64-byte vector of C.
template <typename C>
inline constexpr int64_t kVecWidth = 64 / static_cast<int64_t>(sizeof(C));

/// As the plain row loop, but the last n % kVecWidth elements are padded to a
/// whole vector instead of running the compiler's scalar epilogue. For ops
/// that call libmvec (Note [Vectorised transcendentals through libmvec]) the
/// SIMD and scalar libm functions may differ in the last ulp; this way every
/// element takes the SIMD function whatever its position in the row, so a
/// strided or differently split tensor gives the same bits as a contiguous one.
template <typename OC, typename C, typename F>
inline void map_row_padded(OC* out, const C* in, int64_t n, F f) {
  constexpr int64_t kW = kVecWidth<C>;
  const int64_t nv = n - n % kW;
  for (int64_t i = 0; i < nv; ++i) out[i] = f(in[i]);
  if (nv < n) {
    alignas(64) C x[kW] = {};
    alignas(64) OC y[kW];
    for (int64_t i = nv; i < n; ++i) x[i - nv] = in[i];
    for (int64_t i = 0; i < kW; ++i) y[i] = f(x[i]);
    for (int64_t i = nv; i < n; ++i) out[i] = y[i - nv];
  }
}

/// map() for element functions that call libmvec (see map_row_padded).
template <typename T, typename F>
void map_vm(const LoopSpec& s, F f) {
  using C = compute_t<T>;
  run_unary<T, T>(s, [f](C* out, const C* in, int64_t n) { map_row_padded(out, in, n, f); });
}

/// out[i] = f(a[i], b[i]) over contiguous arrays, where an operand flagged as
/// scalar (a_step/b_step false) is one value broadcast along the row and is
/// kept in a register, so `x + 2` vectorises like `x + y`.
template <typename OC, typename C, typename F>
inline void binary_row(OC* out, const C* a, const C* b, int64_t n, bool a_step, bool b_step, F f) {
  if (a_step && b_step) {
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
  } else if (a_step) {
    const C bv = *b;
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i], bv);
  } else if (b_step) {
    const C av = *a;
    for (int64_t i = 0; i < n; ++i) out[i] = f(av, b[i]);
  } else {
    const OC v = f(*a, *b);
    for (int64_t i = 0; i < n; ++i) out[i] = v;
  }
}

/// binary_row with map_row_padded's tail handling (for libmvec element functions).
template <typename OC, typename C, typename F>
inline void binary_row_padded(OC* out, const C* a, const C* b, int64_t n, bool a_step, bool b_step, F f) {
  constexpr int64_t kW = kVecWidth<C>;
  const int64_t nv = n - n % kW;
  binary_row(out, a, b, nv, a_step, b_step, f);
  if (nv < n) {
    alignas(64) C x[kW] = {};
    alignas(64) C y[kW] = {};
    alignas(64) OC z[kW];
    for (int64_t i = nv; i < n; ++i) {
      x[i - nv] = a_step ? a[i] : a[0];
      y[i - nv] = b_step ? b[i] : b[0];
    }
    binary_row(z, x, y, kW, true, true, f);
    for (int64_t i = nv; i < n; ++i) out[i] = z[i - nv];
  }
}

/// Calls the row function a binary driver uses: f's own `row` when it has one
/// (an op written as vector rows, gelu_rows.h), else a loop of f per element.
template <bool kPadded, typename OC, typename C, typename F>
inline void call_binary_row(OC* out, const C* a, const C* b, int64_t n, bool a_step, bool b_step, F f) {
  if constexpr (requires { f.row(out, a, b, n, a_step, b_step); }) {
    f.row(out, a, b, n, a_step, b_step);
  } else if constexpr (kPadded) {
    binary_row_padded(out, a, b, n, a_step, b_step, f);
  } else {
    binary_row(out, a, b, n, a_step, b_step, f);
  }
}

/// dst[0..n) = the elements at `src` (stored as U, byte stride `st`; 0 repeats
/// one value) as the compute type C of dtype T, exactly as converting the
/// operand to T first (copy_) and then loading it would: cast<C>(cast<T>(u)).
template <typename C, typename T, typename U>
void load_converted(C* dst, const char* src, int64_t st, int64_t n) {
  if constexpr (std::is_same_v<C, T>) {
    load_block<C, U>(dst, src, st, n);  // one conversion; float16 rows take F16C (same bits as copy_)
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = cast<C>(cast<T>(*reinterpret_cast<const U*>(src + i * st)));
  }
}

/// The elements at `dst` (stored as O2, byte stride `st`) = src[0..n), results
/// of an op whose output type is O, as writing an O result and then copying it
/// into O2 (copy_) would: cast<O2>(cast<O>(c)). Element by element with copy_'s
/// own conversion, so NaN payloads match too.
template <typename O2, typename O, typename OC>
void store_converted(char* dst, int64_t st, const OC* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) *reinterpret_cast<O2*>(dst + i * st) = cast<O2>(cast<O>(src[i]));
}

template <typename C>
using LoadFn = void (*)(C* dst, const char* src, int64_t st, int64_t n);
template <typename OC>
using StoreFn = void (*)(char* dst, int64_t st, const OC* src, int64_t n);

/// How a binary loop's operands differ from the driver's types: a null entry
/// is an operand of the driver's type (T for inputs, O for the output); others
/// convert a block on the way in or out (Note [Mixed dtypes in the loop]).
template <typename C, typename OC>
struct BinaryConverters {
  LoadFn<C> a = nullptr, b = nullptr;
  StoreFn<OC> out = nullptr;
  bool any() const { return a || b || out; }
};

/// The loader of an input stored as `stored` for a driver whose input type is T (null when it is T).
template <typename T>
LoadFn<compute_t<T>> load_converter(DType stored) {
  LoadFn<compute_t<T>> fn = nullptr;
  if (stored != dtype_of_v<T>) visit_dtype(stored, [&]<typename U>() { fn = &load_converted<compute_t<T>, T, U>; });
  return fn;
}

/// The storer of an output stored as `stored` for a driver whose output type is O (null when it is O).
template <typename O>
StoreFn<compute_t<O>> store_converter(DType stored) {
  StoreFn<compute_t<O>> fn = nullptr;
  if (stored != dtype_of_v<O>) visit_dtype(stored, [&]<typename O2>() { fn = &store_converted<O2, O, compute_t<O>>; });
  return fn;
}

// Note [Mixed dtypes in the loop]
// float32 + bfloat16 computes in float32. Rather than converting the bfloat16
// operand into a float32 copy (a whole extra pass over memory and a
// temporary), the driver converts kBlock elements at a time into a stack
// buffer and runs the same row function on it; operands that already are
// contiguous arrays of the compute type are read in place, and the output is
// written in place or, for an in-place op on a tensor of another dtype
// (bfloat16 self += float32), rounded from the block into it. Each element
// goes through the conversions copy_ would have made, in the same order, so
// the results are bitwise those of converting first.
template <typename O, typename T, bool kPadded, typename F>
void run_binary_converted(const LoopSpec& s, F f, const BinaryConverters<compute_t<T>, compute_t<O>>& conv) {
  using C = compute_t<T>;
  using OC = compute_t<O>;
  constexpr int64_t kT = sizeof(T), kO = sizeof(O);
  elementwise_for(s, [&](char* const* p, const int64_t* st, int64_t n) {
    alignas(64) C a[kBlock];
    alignas(64) C b[kBlock];
    alignas(64) OC out[kBlock];
    const auto load = [](C* dst, LoadFn<C> fn, const char* src, int64_t stride, int64_t m) {
      if (fn) {
        fn(dst, src, stride, m);
      } else {
        load_block<C, T>(dst, src, stride, m);
      }
    };
    const bool a_step = st[1] != 0, b_step = st[2] != 0;
    const bool a_direct = std::is_same_v<T, C> && !conv.a && st[1] == kT;
    const bool b_direct = std::is_same_v<T, C> && !conv.b && st[2] == kT;
    const bool out_direct = std::is_same_v<O, OC> && !conv.out && st[0] == kO;
    if (!a_step) load(a, conv.a, p[1], 0, 1);
    if (!b_step) load(b, conv.b, p[2], 0, 1);
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t m = std::min(kBlock, n - i0);
      const C* pa = a;
      const C* pb = b;
      if (a_direct) {
        pa = reinterpret_cast<const C*>(p[1]) + i0;
      } else if (a_step) {
        load(a, conv.a, p[1] + i0 * st[1], st[1], m);
      }
      if (b_direct) {
        pb = reinterpret_cast<const C*>(p[2]) + i0;
      } else if (b_step) {
        load(b, conv.b, p[2] + i0 * st[2], st[2], m);
      }
      OC* po = out_direct ? reinterpret_cast<OC*>(p[0]) + i0 : out;
      call_binary_row<kPadded>(po, pa, pb, m, a_step, b_step, f);
      if (out_direct) continue;
      if (conv.out) {
        conv.out(p[0] + i0 * st[0], st[0], out, m);
      } else {
        store_block<O, OC>(p[0] + i0 * st[0], st[0], out, m);
      }
    }
  });
}

/// Binary driver: operand 0 (type O) = f(operand 1, operand 2), inputs of type T,
/// f: (compute_t<T>, compute_t<T>) -> compute_t<O>. kPadded: f calls libmvec (map_row_padded).
/// `conv`, when given, names operands stored in other dtypes (run_binary_converted).
template <typename O, typename T, bool kPadded = false, typename F>
void run_binary(const LoopSpec& s, F f, const BinaryConverters<compute_t<T>, compute_t<O>>* conv = nullptr) {
  using C = compute_t<T>;
  using OC = compute_t<O>;
  constexpr int64_t kT = sizeof(T);
  if (conv && conv->any()) return run_binary_converted<O, T, kPadded>(s, f, *conv);
  elementwise_for(s, [&](char* const* p, const int64_t* st, int64_t n) {
    if constexpr (std::is_same_v<O, OC> && std::is_same_v<T, C>) {
      if (st[0] == static_cast<int64_t>(sizeof(O)) && (st[1] == kT || st[1] == 0) && (st[2] == kT || st[2] == 0)) {
        call_binary_row<kPadded>(reinterpret_cast<O*>(p[0]), reinterpret_cast<const T*>(p[1]),
                                 reinterpret_cast<const T*>(p[2]), n, st[1] != 0, st[2] != 0, f);
        return;
      }
    }
    alignas(64) C a[kBlock];
    alignas(64) C b[kBlock];
    alignas(64) OC out[kBlock];
    const bool a_step = st[1] != 0, b_step = st[2] != 0;
    if (!a_step) a[0] = cast<C>(*reinterpret_cast<const T*>(p[1]));
    if (!b_step) b[0] = cast<C>(*reinterpret_cast<const T*>(p[2]));
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t m = std::min(kBlock, n - i0);
      if (a_step) load_block<C, T>(a, p[1] + i0 * st[1], st[1], m);
      if (b_step) load_block<C, T>(b, p[2] + i0 * st[2], st[2], m);
      call_binary_row<kPadded>(out, a, b, m, a_step, b_step, f);
      store_block<O, OC>(p[0] + i0 * st[0], st[0], out, m);
    }
  });
}

}  // namespace kiln::kernels::ew
