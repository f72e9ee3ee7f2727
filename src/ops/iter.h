// Internal to the ops layer: turns tensors into a kernels::LoopSpec.
//
// Operands are aligned to a common broadcast shape (missing or size-1 dims
// get stride 0), dims are ordered innermost first, size-1 dims dropped and
// adjacent dims merged where every operand is dense across them, so a
// contiguous op becomes one flat row that the kernel vectorises. When the
// first operand (the output, by convention) is a channels-last 4-D tensor,
// the dims are taken in its memory order (C innermost), so channels-last
// operands also merge into one flat row.
#pragma once

#include <initializer_list>

#include "kiln/core/tensor.h"
#include "kiln/kernels/loop.h"
#include "kiln/ops/memory_format.h"

namespace kiln::ops {

kernels::LoopSpec make_loop(IntArrayRef shape, std::initializer_list<const Tensor*> operands);

/// Allocates a contiguous tensor for an op's result (charged to the thread's category).
Tensor new_output(IntArrayRef shape, DType dtype);
/// The same in memory format `f` (ChannelsLast needs a 4-D shape).
Tensor new_output(IntArrayRef shape, DType dtype, MemoryFormat f);
/// An elementwise result: channels-last when some operand of exactly `shape`
/// is channels-last (torch's rule that a result follows its inputs' layout,
/// kept to the one non-contiguous format kiln produces itself), else contiguous.
Tensor new_output_like(IntArrayRef shape, DType dtype, std::initializer_list<const Tensor*> operands);

/// Whether a backward may write its result over `grad`, the incoming
/// gradient the engine handed it: nothing else refers to the tensor or its
/// storage (no hook kept it, retain_grad did not store it, the caller did not
/// pass it, two nodes do not share it), the storage owns its memory, and no
/// gradient is being recorded (create_graph). The caller still checks the
/// layout, dtype and shape its kernel writes, and that grad is not an alias
/// of what it reads. Note [GELU's gradient over its incoming buffer] in unary.cpp.
bool writable_incoming_grad(const Tensor& grad);

/// Raises ValueError when `value` cannot be stored in `dt` without overflow, as
/// PyTorch's checked scalar conversion does for fill values (full, fill_):
/// integers outside the type's range (negative integers may wrap into uint8
/// down to -255), finite floats beyond the type's finite range, NaN or
/// infinity into an integer type. Anything converts to bool.
void check_scalar_fits(const Scalar& value, DType dt, const char* op);

/// Raises ShapeError unless `t` is defined; names the op and the argument.
void check_defined(const Tensor& t, const char* op, const char* arg);

}  // namespace kiln::ops
