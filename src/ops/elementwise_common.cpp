// The elementwise family's shared plumbing (elementwise_common.h): operand
// preparation, the binary loop, the in-place checks, and the kernels' drivers
// without autograd that the ops (and their backward formulas) build on.
#include <algorithm>

#include "elementwise_common.h"
#include "grad_ops.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/copy.h"

namespace kiln::ops::ew {

void prepare_operand_in_loop(Operand& op, Arg arg, DType compute, const Tensor& out, bool in_loop) {
  op.stored = compute;
  if (arg.scalar) {
    kernels::scalar_to_bytes(op.buf, compute, *arg.scalar);
    return;
  }
  const Tensor& t = *arg.tensor;
  // Converted once, then kept in a register; not while a capture records, which must
  // read the tensor again on every replay (the copy below is a recorded kernel).
  if (t.dtype() != compute && t.numel() == 1 && !capture::recording()) {
    kernels::convert_element(op.buf, compute, t.data_ptr(), t.dtype());
    return;
  }
  // A broadcast operand (fewer elements than the loop) is read more than once:
  // converting it once, into a copy smaller than the output, costs less than
  // converting it on every read (measured: [4096, 1024] f32 + [1024] bf16
  // takes ~20% longer converted in the loop).
  if (t.dtype() != compute && (!in_loop || t.numel() != out.numel())) {
    op.converted = copy_no_grad(t, compute);  // a conversion inside the op: the op records its own node
    op.tensor = &op.converted;
    return;
  }
  op.tensor = &t;
  op.stored = t.dtype();
}

kernels::LoopSpec make_binary_loop(IntArrayRef shape, const Tensor& out, Operand& a, Operand& b) {
  kernels::LoopSpec s;
  if (a.tensor && b.tensor) return make_loop(shape, {&out, a.tensor, b.tensor});
  if (a.tensor) {
    s = make_loop(shape, {&out, a.tensor});
  } else if (b.tensor) {
    s = make_loop(shape, {&out, b.tensor});
    s.data[2] = s.data[1];
    for (int d = 0; d < s.ndim; ++d) {
      s.strides[2][d] = s.strides[1][d];
      s.strides[1][d] = 0;
    }
  } else {
    s = make_loop(shape, {&out});
  }
  s.nops = 3;
  // A scalar's bytes live on the caller's stack; a recorded kernel gets a copy that outlives it.
  if (!a.tensor) s.data[1] = static_cast<char*>(const_cast<void*>(capture::stable_bytes(a.buf, sizeof(a.buf))));
  if (!b.tensor) s.data[2] = static_cast<char*>(const_cast<void*>(capture::stable_bytes(b.buf, sizeof(b.buf))));
  return s;
}

void check_inplace_cast(const char* op, DType result, const Tensor& self) {
  KILN_CHECK(ops::can_cast(result, self.dtype()), DTypeError, op, ": result type ", dtype_name(result),
             " can't be cast to the desired output type ", dtype_name(self.dtype()),
             " (an in-place op keeps self's dtype; use the out-of-place op to get a ", dtype_name(result), " result)");
}

void check_inplace_shape(const char* op, const Tensor& self, IntArrayRef other_sizes) {
  const DimVector shape = broadcast_shapes(self.sizes(), other_sizes, op);
  KILN_CHECK(shape.ref() == self.sizes(), ShapeError, op, ": output with shape ", self.sizes(),
             " doesn't match the broadcast shape ", shape, " (other operand has shape ", other_sizes,
             "); an in-place op cannot change self's shape");
}

namespace {

// No two elements share memory and together they fill a dense block (in some dim order).
bool is_non_overlapping_and_dense(const Tensor& t) {
  if (t.is_contiguous()) return true;
  const int64_t nd = t.dim();
  DimVector order(static_cast<size_t>(nd));
  for (int64_t d = 0; d < nd; ++d) order[d] = d;
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return t.strides()[x] < t.strides()[y]; });
  int64_t expected = 1;
  for (int64_t d : order) {
    const int64_t size = t.sizes()[d];
    if (size == 1) continue;
    if (t.strides()[d] != expected) return false;
    expected *= size;
  }
  return true;
}

// [begin, end) byte extent of the memory a view can touch.
void byte_extent(const Tensor& t, const char*& begin, const char*& end) {
  const int64_t es = t.element_size();
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.sizes()[d] - 1) * t.strides()[d] * es;
    (span < 0 ? lo : hi) += span;
  }
  begin = static_cast<const char*>(t.data_ptr()) + lo;
  end = static_cast<const char*>(t.data_ptr()) + hi + es;
}

}  // namespace

void check_no_internal_overlap(const char* op, const Tensor& self) {
  if (self.numel() <= 1 || is_non_overlapping_and_dense(self)) return;
  bool overlap = false;
  for (int64_t d = 0; d < self.dim(); ++d) overlap = overlap || (self.sizes()[d] > 1 && self.strides()[d] == 0);
  KILN_CHECK(!overlap, ValueError, op,
             ": unsupported operation: more than one element of the written-to tensor "
             "(shape ",
             self.sizes(), ", strides ", self.strides(),
             ") refers to a single memory location. "
             "Please clone() the tensor before performing the operation.");
}

Tensor resolve_input_overlap(const char* op, const Tensor& self, const Tensor& input) {
  if (self.is_same(input) || self.numel() == 0 || input.numel() == 0) return input;
  if (self.storage().get() != input.storage().get()) return input;
  const char *a0, *a1, *b0, *b1;
  byte_extent(self, a0, a1);
  byte_extent(input, b0, b1);
  if (a1 <= b0 || b1 <= a0) return input;  // disjoint memory
  const bool same_view = self.data_ptr() == input.data_ptr() && self.strides() == input.strides() &&
                         self.sizes() == input.sizes() && self.dtype() == input.dtype();
  if (same_view) return input;  // element i reads what element i writes: safe
  // Dense tensors over overlapping memory: torch reports a partial overlap; we do the same.
  KILN_CHECK(!(is_non_overlapping_and_dense(self) && is_non_overlapping_and_dense(input)), ValueError, op,
             ": unsupported operation: some elements of the input tensor (shape ", input.sizes(), ", strides ",
             input.strides(), ") and the written-to tensor (shape ", self.sizes(), ", strides ", self.strides(),
             ") refer to a single memory location. Please clone() the tensor before performing the operation.");
  // Strided views whose extents interleave (x[::2] and x[1::2]): reading a copy is always right.
  return input.clone();
}

Tensor binary_out(const char* name, kernels::BinaryOp op, Arg a, Arg b, DType compute, const void* alpha) {
  if (a.tensor) ops::check_defined(*a.tensor, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DimVector shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  Tensor out = ops::new_output_like(shape, compute, {a.tensor, b.tensor});
  if (out.numel() == 0) return out;
  Operand oa, ob;
  prepare_operand_in_loop(oa, a, compute, out, kernels::converts_in_loop(op));
  prepare_operand_in_loop(ob, b, compute, out, kernels::converts_in_loop(op));
  kernels::binary(make_binary_loop(shape, out, oa, ob), op, compute, {compute, oa.stored, ob.stored}, alpha);
  return out;
}

Arg check_binary_inplace(const char* name, Tensor& self, Arg b, DType compute, Tensor& holder) {
  ops::check_defined(self, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  check_inplace_cast(name, compute, self);
  check_inplace_shape(name, self, b.sizes());
  check_no_internal_overlap(name, self);
  if (!b.tensor) return b;
  holder = resolve_input_overlap(name, self, *b.tensor);
  return Arg(holder);
}

void run_binary_inplace(const char* name, kernels::BinaryOp op, Tensor& self, Arg b, DType compute, const void* alpha) {
  if (self.numel() > 0 && self.dtype() != compute && !kernels::converts_in_loop(op)) {
    Tensor tmp = binary_out(name, op, Arg(self), b, compute, alpha);
    kernels::copy_cast(ops::make_loop(self.sizes(), {&self, &tmp}), self.dtype(), compute);
  } else if (self.numel() > 0) {
    // self is operand 0 and 1. A float16 self += float32 other computes in
    // float32 and rounds once into self, converting in the loop both ways.
    Operand oa, ob;
    oa.tensor = &self;
    oa.stored = self.dtype();
    prepare_operand_in_loop(ob, b, compute, self, kernels::converts_in_loop(op));
    kernels::binary(make_binary_loop(self.sizes(), self, oa, ob), op, compute, {self.dtype(), self.dtype(), ob.stored},
                    alpha);
  }
  self.bump_version();
}

}  // namespace kiln::ops::ew
