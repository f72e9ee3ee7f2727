#include "iter.h"

#include <cmath>
#include <limits>

#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::ops {

kernels::LoopSpec make_loop(IntArrayRef shape, std::initializer_list<const Tensor*> operands) {
  kernels::LoopSpec s;
  const int nd = static_cast<int>(shape.size());
  KILN_CHECK(nd <= kernels::kMaxLoopDims, ShapeError, "tensors of more than ", kernels::kMaxLoopDims,
             " dims are not supported by elementwise kernels, got shape ", shape);
  KILN_ASSERT(operands.size() <= static_cast<size_t>(kernels::kMaxOperands), "too many operands");
  s.nops = static_cast<int>(operands.size());
  int op = 0;
  for (const Tensor* t : operands) {
    s.data[op] = static_cast<char*>(t->data_ptr());
    const int64_t es = t->element_size();
    const int64_t td = t->dim();
    KILN_ASSERT(td <= nd, "operand has more dims than the loop shape");
    for (int d = 0; d < nd; ++d) {
      const int64_t src_d = d - (nd - td);  // right-aligned
      int64_t stride = 0;
      if (src_d >= 0 && t->sizes()[src_d] != 1) stride = t->strides()[src_d] * es;
      s.strides[op][nd - 1 - d] = stride;  // innermost first
    }
    ++op;
  }
  // Loop dim i (innermost first) visits shape dim nd - 1 - order[i].
  int order[kernels::kMaxLoopDims];
  for (int d = 0; d < nd; ++d) order[d] = d;
  const Tensor* first = operands.size() > 0 ? *operands.begin() : nullptr;
  if (nd == 4 && first && first->dim() == 4 && suggest_memory_format(*first) == MemoryFormat::ChannelsLast) {
    // Innermost first in NHWC: C (shape dim 1 = loop dim 2), W, H, N.
    const int nhwc[4] = {2, 0, 1, 3};
    int64_t permuted[kernels::kMaxOperands][4];
    for (int o = 0; o < s.nops; ++o) {
      for (int d = 0; d < 4; ++d) permuted[o][d] = s.strides[o][nhwc[d]];
      for (int d = 0; d < 4; ++d) s.strides[o][d] = permuted[o][d];
    }
    for (int d = 0; d < 4; ++d) order[d] = nhwc[d];
  }
  int out = 0;
  for (int d = 0; d < nd; ++d) {
    const int64_t size = shape[nd - 1 - order[d]];
    if (size == 1) continue;
    if (out > 0) {
      bool merge = true;
      for (int o = 0; o < s.nops && merge; ++o) merge = s.strides[o][d] == s.strides[o][out - 1] * s.sizes[out - 1];
      if (merge) {
        s.sizes[out - 1] *= size;
        continue;
      }
    }
    s.sizes[out] = size;
    for (int o = 0; o < s.nops; ++o) s.strides[o][out] = s.strides[o][d];
    ++out;
  }
  s.ndim = out;
  if (shape_numel(shape) == 0) {  // keep an empty loop empty
    s.ndim = 1;
    s.sizes[0] = 0;
  }
  return s;
}

Tensor new_output(IntArrayRef shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  if (inference_mode_enabled()) t.impl()->set_inference(true);
  return t;
}

Tensor new_output(IntArrayRef shape, DType dtype, MemoryFormat f) {
  Tensor t = empty(shape, TensorOptions(dtype), f);
  if (inference_mode_enabled()) t.impl()->set_inference(true);
  return t;
}

bool writable_incoming_grad(const Tensor& grad) {
  return !grad_mode_enabled() && grad.defined() && grad.use_count() == 1 && grad.storage().use_count() == 1 &&
         grad.storage()->owns_memory();
}

Tensor new_output_like(IntArrayRef shape, DType dtype, std::initializer_list<const Tensor*> operands) {
  if (shape.size() == 4) {
    for (const Tensor* t : operands) {
      if (t && t->defined() && t->sizes() == shape && suggest_memory_format(*t) == MemoryFormat::ChannelsLast) {
        return new_output(shape, dtype, MemoryFormat::ChannelsLast);
      }
    }
  }
  return new_output(shape, dtype);
}

void check_scalar_fits(const Scalar& value, DType dt, const char* op) {
  if (dt == kBool || value.is_bool()) return;
  double lo = 0, hi = 0;
  visit_dtype(dt, [&]<typename T>() {
    if constexpr (std::is_same_v<T, BFloat16>) {
      hi = 3.3895313892515355e38;  // (2 - 2^-7) * 2^127
      lo = -hi;
    } else if constexpr (std::is_same_v<T, Half>) {
      hi = 65504.0;
      lo = -hi;
    } else if constexpr (!std::is_same_v<T, bool>) {
      hi = static_cast<double>(std::numeric_limits<T>::max());
      lo = static_cast<double>(std::numeric_limits<T>::lowest());
    }
  });
  bool overflow;
  if (value.is_integral()) {
    const int64_t i = value.to_int64();
    if (is_floating_point(dt))
      overflow = std::fabs(static_cast<double>(i)) > hi;
    else if (dt == kUInt8)
      overflow = i > 255 || i < -255;  // torch lets negatives wrap (-1 -> 255)
    else if (dt == kInt32)
      overflow = i > std::numeric_limits<int32_t>::max() || i < std::numeric_limits<int32_t>::min();
    else
      overflow = false;  // int64
  } else {
    const double d = value.to_double();
    if (is_floating_point(dt))
      overflow = std::isfinite(d) && (d < lo || d > hi);
    else
      overflow = !std::isfinite(d) || d < lo || d > hi;
  }
  if (!overflow) return;
  const std::string shown = value.is_integral() ? std::to_string(value.to_int64()) : detail::concat(value.to_double());
  throw ValueError(detail::concat(op, ": value ", shown, " cannot be converted to dtype ", dtype_name(dt),
                                  " without overflow (finite range [", lo, ", ", hi, "])"));
}

void check_defined(const Tensor& t, const char* op, const char* arg) {
  KILN_CHECK(t.defined(), ValueError, op, ": argument '", arg, "' is an undefined tensor");
}

}  // namespace kiln::ops
