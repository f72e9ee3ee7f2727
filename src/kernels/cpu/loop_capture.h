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
  capture::copy_loop_shape(l, s);
  for (int op = 0; op < s.nops; ++op) l.elem_size[op] = es[static_cast<size_t>(op)];
  return l;
}

/// Records `run` (called with `s`) as the kernel and notes its loop; true when
/// the recorder deferred it (the kernel returns without running).
template <typename F>
bool record_loop(const capture::KernelScope& cap, const LoopSpec& s, const ElemSizes& es, F run) {
  const bool deferred = cap.record([run, s] { run(s); });
  capture::note_loop(to_loop(s, es), [run](const capture::Loop& l) {
    LoopSpec part;  // called for every tile of a fused loop: only what is in use is copied
    capture::copy_loop_shape(part, l);
    run(part);
  });
  return deferred;
}

}  // namespace kiln::kernels::ew

#define KILN_CAPTURE_LOOP(name, spec, elem_sizes, ...)                                            \
  const ::kiln::capture::KernelScope kiln_capture_(name, ::kiln::capture::kDeferrable);           \
  if (kiln_capture_.recording() &&                                                                \
      ::kiln::kernels::ew::record_loop(kiln_capture_, spec, elem_sizes,                           \
                                       [=](const ::kiln::kernels::LoopSpec& t) { __VA_ARGS__; })) \
  return
