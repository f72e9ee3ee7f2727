// The few tensor operations autograd performs itself — summing two gradients
// that reach one tensor, reducing a broadcast gradient, casting it to its
// input's dtype, the implicit ones of loss.backward(), the zeros a custom
// Function's undefined gradient becomes — reached through a table that the ops
// layer fills in.
//
// Why a table: autograd sits below ops (ops record autograd nodes), yet these
// sums must be ops themselves, recorded under create_graph so that double
// backward sees them. Calling ops directly would make kiln_autograd depend on
// kiln_ops at link time, a cycle DESIGN.md §1 forbids. src/ops/grad_math.cpp
// installs the table during static initialisation; kiln_ops's link interface
// forces that object into every program that links ops, so the table is
// always set before any backward can run.
#pragma once

#include <cstdint>

#include "kiln/core/tensor.h"

namespace kiln::autograd {

struct GradMath {
  Tensor (*add)(const Tensor& a, const Tensor& b);        // a + b, recorded when grad mode is on
  void (*add_)(const Tensor& self, const Tensor& other);  // self += other, in place
  Tensor (*clone)(const Tensor& t);
  Tensor (*contiguous)(const Tensor& t);
  Tensor (*to)(const Tensor& t, DType dtype);
  Tensor (*view)(const Tensor& t, IntArrayRef shape);
  Tensor (*sum)(const Tensor& t, IntArrayRef dims, bool keepdim);
  Tensor (*ones_like)(const Tensor& t);
  Tensor (*zeros)(IntArrayRef shape, DType dtype);
  // For views written in place (CopySlices, refresh_view); recorded when grad mode is on.
  Tensor (*as_strided)(const Tensor& t, IntArrayRef sizes, IntArrayRef strides, int64_t storage_offset);
  Tensor (*empty_strided)(IntArrayRef sizes, IntArrayRef strides, DType dtype);
  void (*copy_)(const Tensor& self, const Tensor& src);
};

/// The table ops installed. Raises InternalError if none was (a program that
/// links autograd without ops cannot run backward).
const GradMath& grad_math();

/// Called by the ops layer while the program starts.
void install_grad_math(const GradMath& math);

}  // namespace kiln::autograd
