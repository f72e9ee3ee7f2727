// Strided N-ary loops over raw pointers (the kernels layer: no Tensor here).
//
// The ops layer describes each operand as a base pointer plus per-dim byte
// strides over a common (broadcast) shape, with dims ordered innermost first
// and already coalesced. Kernels walk it with for_each_row, which hands the
// body one innermost row at a time (pointers, inner byte strides, length), so
// the body can take a tight contiguous path the compiler vectorises and a
// general strided path for the rest. Rows are split across OpenMP threads
// above a grain size; the split depends only on sizes and thread count, so
// results are deterministic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kiln/core/error.h"
#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"

namespace kiln::kernels {

inline constexpr int kMaxLoopDims = 16;
inline constexpr int kMaxOperands = 4;

struct LoopSpec {
  int ndim = 0;  // dims, innermost first; ndim == 0 means one element
  int nops = 0;  // operand 0 is the output by convention
  int64_t sizes[kMaxLoopDims] = {};
  int64_t strides[kMaxOperands][kMaxLoopDims] = {};  // bytes
  char* data[kMaxOperands] = {};

  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= sizes[d];
    return n;
  }
  int64_t inner_size() const { return ndim ? sizes[0] : 1; }
  int64_t inner_stride(int op) const { return ndim ? strides[op][0] : 0; }
};

using ::kiln::parallel_for;  // kiln/core/parallel.h

/// Calls body(char* const* ptrs, const int64_t* inner_strides, int64_t n) for
/// each innermost row of `s`, rows [row_begin, row_end).
template <typename Body>
void for_each_row_range(const LoopSpec& s, int64_t row_begin, int64_t row_end, Body& body) {
  const int nops = s.nops;
  const int64_t inner = s.inner_size();
  int64_t inner_strides[kMaxOperands] = {};
  for (int op = 0; op < nops; ++op) inner_strides[op] = s.inner_stride(op);
  if (s.ndim <= 1) {
    char* ptrs[kMaxOperands] = {};
    for (int op = 0; op < nops; ++op) ptrs[op] = s.data[op];
    if (row_begin < row_end) body(ptrs, inner_strides, inner);
    return;
  }
  // Multi-index over the outer dims (1..ndim-1) of row_begin.
  int64_t idx[kMaxLoopDims] = {};
  int64_t r = row_begin;
  for (int d = 1; d < s.ndim; ++d) {
    idx[d] = r % s.sizes[d];
    r /= s.sizes[d];
  }
  char* ptrs[kMaxOperands] = {};
  for (int op = 0; op < nops; ++op) {
    char* p = s.data[op];
    for (int d = 1; d < s.ndim; ++d) p += idx[d] * s.strides[op][d];
    ptrs[op] = p;
  }
  for (int64_t row = row_begin; row < row_end; ++row) {
    body(ptrs, inner_strides, inner);
    // Advance the odometer.
    for (int d = 1; d < s.ndim; ++d) {
      ++idx[d];
      for (int op = 0; op < nops; ++op) ptrs[op] += s.strides[op][d];
      if (idx[d] < s.sizes[d]) break;
      for (int op = 0; op < nops; ++op) ptrs[op] -= s.strides[op][d] * s.sizes[d];
      idx[d] = 0;
    }
  }
}

template <typename Body>
void for_each_row(const LoopSpec& s, Body&& body, int64_t grain = kGrainSize) {
  const int64_t inner = std::max<int64_t>(s.inner_size(), 1);
  const int64_t rows = s.ndim <= 1 ? 1 : s.numel() / inner;
  if (s.numel() == 0) return;
  if (rows == 1 || s.numel() < grain) {
    for_each_row_range(s, 0, rows, body);
    return;
  }
  const int64_t row_grain = std::max<int64_t>(1, grain / inner);
  parallel_for(rows, row_grain, [&](int64_t b, int64_t e) { for_each_row_range(s, b, e, body); });
}

/// As for_each_row, for bodies that treat each element on its own (a copy, a
/// cast, a map): a loop that coalesced into one long row is also split across
/// threads, at multiples of 64 elements (so threads never share an output
/// cache line), where for_each_row would run it whole on one thread.
template <typename Body>
void for_each_element_run(const LoopSpec& s, Body&& body, int64_t grain = kGrainSize) {
  const int64_t n = s.numel();
  if (s.ndim > 1 || n < 2 * grain) return for_each_row(s, body, grain);
  constexpr int64_t kQuantum = 64;
  int64_t st[kMaxOperands] = {};
  for (int op = 0; op < s.nops; ++op) st[op] = s.inner_stride(op);
  parallel_for((n + kQuantum - 1) / kQuantum, grain / kQuantum, [&](int64_t b, int64_t e) {
    const int64_t lo = b * kQuantum, hi = std::min(n, e * kQuantum);
    char* p[kMaxOperands] = {};
    for (int op = 0; op < s.nops; ++op) p[op] = s.data[op] + lo * st[op];
    body(p, st, hi - lo);
  });
}

/// out[i] = f(in0[i], in1[i], ...) with operand types Out, In...; the output is operand 0.
/// Contiguous rows take a loop the compiler vectorises.
template <typename Out, typename... In, typename F>
void map_elements(const LoopSpec& s, F f, int64_t grain = kGrainSize) {
  constexpr int N = sizeof...(In);
  for_each_element_run(
      s,
      [&](char* const* ptrs, const int64_t* st, int64_t n) {
        bool contig = st[0] == static_cast<int64_t>(sizeof(Out));
        int k = 1;
        ((contig = contig && st[k++] == static_cast<int64_t>(sizeof(In))), ...);
        Out* out = reinterpret_cast<Out*>(ptrs[0]);
        if (contig) {
          [&]<size_t... I>(std::index_sequence<I...>) {
            for (int64_t i = 0; i < n; ++i) out[i] = f(reinterpret_cast<const In*>(ptrs[I + 1])[i]...);
          }
          (std::make_index_sequence<N>{});
        } else {
          [&]<size_t... I>(std::index_sequence<I...>) {
            for (int64_t i = 0; i < n; ++i) {
              *reinterpret_cast<Out*>(ptrs[0] + i * st[0]) =
                  f(*reinterpret_cast<const In*>(ptrs[I + 1] + i * st[I + 1])...);
            }
          }
          (std::make_index_sequence<N>{});
        }
      },
      grain);
}

}  // namespace kiln::kernels
