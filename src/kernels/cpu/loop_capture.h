// Internal to the elementwise kernels: recording one for kiln::compile with
// the description of its loop that fusion needs (kiln/core/capture_loop.h).
//
//   KILN_CAPTURE_LOOP("unary", s, ew::sizes_all(s, element_size(dt)), unary(t, op, dt));
//
// records the kernel as KILN_CAPTURE_KERNEL does (the call with `t` bound to
// `s`), then notes the loop with a runner that makes the same call for any
// part of it (`t` bound to the part). The call must touch memory only
// through `t`'s operands, element for element.
#pragma once

#include <algorithm>
#include <array>
#include <utility>

#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels::ew {

static_assert(kMaxLoopDims == capture::kLoopDims && kMaxOperands == capture::kLoopOperands);

using ElemSizes = std::array<int, kMaxOperands>;

/// Every operand of `s` has elements of `bytes`.
inline ElemSizes sizes_all(int bytes) { return {bytes, bytes, bytes, bytes}; }

inline capture::Loop to_loop(const LoopSpec& s, const ElemSizes& es) {
  capture::Loop l;
  l.ndim = s.ndim;
  l.nops = s.nops;
  std::copy(s.sizes, s.sizes + s.ndim, l.sizes);
  for (int op = 0; op < s.nops; ++op) {
    std::copy(s.strides[op], s.strides[op] + s.ndim, l.strides[op]);
    l.data[op] = s.data[op];
    l.elem_size[op] = es[static_cast<size_t>(op)];
  }
  return l;
}

// Called for every tile of a fused loop: copies only the dims and operands in use.
inline void from_loop(const capture::Loop& l, LoopSpec& s) {
  s.ndim = l.ndim;
  s.nops = l.nops;
  std::copy(l.sizes, l.sizes + l.ndim, s.sizes);
  for (int op = 0; op < l.nops; ++op) {
    std::copy(l.strides[op], l.strides[op] + l.ndim, s.strides[op]);
    s.data[op] = l.data[op];
  }
}

/// Records `run` (called with `s`) as the kernel and notes its loop.
template <typename F>
void record_loop(const capture::KernelScope& cap, const LoopSpec& s, const ElemSizes& es, F run) {
  cap.record([run, s] { run(s); });
  capture::note_loop(to_loop(s, es), [run](const capture::Loop& l) {
    LoopSpec part;
    from_loop(l, part);
    run(part);
  });
}

}  // namespace kiln::kernels::ew

#define KILN_CAPTURE_LOOP(name, spec, elem_sizes, ...)              \
  const ::kiln::capture::KernelScope kiln_capture_(name);           \
  if (kiln_capture_.recording())                                    \
  ::kiln::kernels::ew::record_loop(kiln_capture_, spec, elem_sizes, \
                                   [=](const ::kiln::kernels::LoopSpec& t) { __VA_ARGS__; })
