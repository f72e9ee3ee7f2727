// pow (tensor ** scalar, tensor ** tensor, scalar ** tensor, pow_) and
// maximum / minimum, with their backward nodes (PyTorch 1.13's formulas,
// written with kiln ops so that double backward works). See binary.cpp for
// the conventions every node of the family follows.
#include <cmath>
#include <optional>

#include "elementwise_common.h"
#include "kiln/kernels/copy.h"
#include "kiln/ops/elementwise.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;
using kernels::BinaryOp;
using ops::ew::Arg;
using ops::ew::grad_as;
using ops::ew::needs_grad;

namespace {

// ---- backward nodes ----

// self ** e (e a Scalar): grad * (e * self ** (e - 1)); zeros when e == 0 (torch's pow_backward).
struct PowBackward0 final : autograd::Node {
  SavedVariable self;
  Scalar exponent;
  const char* name() const override { return "PowBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined() || !needs_grad(*this, 0)) return {Tensor()};
    const Tensor x = self.unpack(this);
    if (ops::ew::scalar_equals(exponent, 0.0)) return {zeros(x.sizes(), x.dtype())};
    const Scalar e_minus_1 =
        exponent.is_floating_point() ? Scalar(exponent.to_double() - 1.0) : Scalar(exponent.to_int64() - 1);
    return {grad_as(g[0] * (exponent * x.pow(e_minus_1)), x.dtype())};
  }
  void release_variables() override { self.reset(); }
};

// self ** exponent, both tensors:
//   d/dself     = where(exponent == 0, 0, grad * (exponent * self ** (exponent - 1)))
//   d/dexponent = grad * where(self == 0 & exponent >= 0, 0, result * log(self))
struct PowBackward1 final : autograd::Node {
  SavedVariable self, exponent, result;
  const char* name() const override { return "PowBackward1"; }
  TensorList apply(TensorList&& g) override {
    TensorList out(2);
    if (!g[0].defined()) return out;
    const Tensor x = self.unpack(this), e = exponent.unpack(this);
    if (needs_grad(*this, 0)) {
      out[0] = grad_as(where(e == 0, Scalar(0), g[0] * (e * x.pow(e - 1))), x.dtype());
    }
    if (needs_grad(*this, 1)) {
      const Tensor y = result.unpack(this);
      const Tensor xs = x.dtype() == y.dtype() ? x : x.to(y.dtype());
      out[1] = grad_as(g[0] * where((x == 0).logical_and(e >= 0), Scalar(0), y * xs.log()), e.dtype());
    }
    return out;
  }
  void release_variables() override {
    self.reset();
    exponent.reset();
    result.reset();
  }
};

// base ** exponent, base a Scalar: grad * result * log(base), and 0 where
// base == 0 and exponent >= 0 (torch's pow_backward_exponent).
struct PowBackward2 final : autograd::Node {
  SavedVariable exponent, result;  // exponent only when base == 0
  double log_base = 0;
  const char* name() const override { return "PowBackward2"; }
  TensorList apply(TensorList&& g) override {
    TensorList out(2);
    if (!g[0].defined() || !needs_grad(*this, 1)) return out;
    const Tensor y = result.unpack(this);
    Tensor d = y * log_base;
    if (exponent.defined()) {
      const Tensor e = exponent.unpack(this);
      d = where(e >= 0, Scalar(0), d);
      out[1] = grad_as(g[0] * d, e.dtype());
    } else {
      out[1] = g[0] * d;
    }
    return out;
  }
  void release_variables() override {
    exponent.reset();
    result.reset();
  }
};

// maximum / minimum: the gradient goes to the larger (smaller) input; equal
// inputs split it half and half, as torch 1.13:
//   max: d/da = where(a == b, grad / 2, grad).masked_fill(a < b, 0), d/db likewise with a > b.
struct MaxMinBackward final : autograd::Node {
  SavedVariable a, b;
  bool is_max = true;
  const char* name() const override { return is_max ? "MaximumBackward0" : "MinimumBackward0"; }
  TensorList apply(TensorList&& g) override {
    TensorList out(2);
    if (!g[0].defined()) return out;
    const Tensor x = a.unpack(this), y = b.unpack(this);
    const Tensor shared = where(x == y, g[0] * 0.5, g[0]);
    if (needs_grad(*this, 0)) out[0] = grad_as(where(is_max ? x < y : x > y, Scalar(0), shared), x.dtype());
    if (needs_grad(*this, 1)) out[1] = grad_as(where(is_max ? x > y : x < y, Scalar(0), shared), y.dtype());
    return out;
  }
  void release_variables() override {
    a.reset();
    b.reset();
  }
};

// ---- forwards ----

DType pow_type(const char* name, Arg a, Arg b) {
  const DType rt = ops::ew::result_type(a, b);
  KILN_CHECK(rt != kBool, DTypeError, name,
             ": pow is not implemented for bool (the operands promote to bool); "
             "convert to an integer or floating dtype first");
  return rt;
}

void check_int_pow_exponent(const char* name, const Tensor& self, const Scalar& exponent) {
  KILN_CHECK(
      !(is_integral(self.dtype(), /*include_bool=*/true) && !exponent.is_floating_point() && exponent.to_int64() < 0),
      ValueError, name, ": Integers to negative integer powers are not allowed (", dtype_name(self.dtype()),
      " tensor ** ", exponent.to_int64(), "); use a floating-point tensor or exponent");
}

// self ** exponent in dtype rt, into a new tensor; records nothing.
Tensor pow_scalar_out(const Tensor& self, const Scalar& exponent, DType rt) {
  Tensor out = ops::new_output_like(self.sizes(), rt, {&self});
  if (out.numel() == 0) return out;
  const auto loop = ops::make_loop(self.sizes(), {&out, &self});
  if (ops::ew::scalar_equals(exponent, 0.0)) {  // x ** 0 is 1, even for NaN (torch fills)
    kernels::fill(loop, rt, 1);
  } else if (ops::ew::scalar_equals(exponent, 1.0)) {
    kernels::copy_cast(loop, rt, self.dtype());
  } else if (rt == self.dtype()) {
    kernels::pow_scalar(loop, rt, exponent);
  } else {  // int tensor ** 2.5: convert into out, then raise in place
    kernels::copy_cast(loop, rt, self.dtype());
    kernels::pow_scalar(ops::make_loop(self.sizes(), {&out, &out}), rt, exponent);
  }
  return out;
}

Tensor pow_tensor(Arg base, const Tensor& exponent, CallSite site) {
  ops::OpScope rs("pow", {base.tensor, &exponent});
  Tensor out = ops::ew::binary_out("pow", BinaryOp::Pow, base, exponent, pow_type("pow", base, exponent));
  if (!autograd::compute_requires_grad({base.tensor, &exponent})) return out;
  if (base.tensor) {
    auto node = make_intrusive<PowBackward1>();
    node->self = SavedVariable(*base.tensor, false);
    node->exponent = SavedVariable(exponent, false);
    if (exponent.requires_grad()) node->result = SavedVariable(out, /*is_output=*/true);
    autograd::set_history(out, node, {base.tensor, &exponent}, site);
  } else {
    auto node = make_intrusive<PowBackward2>();
    node->log_base = std::log(base.scalar->to_double());
    node->result = SavedVariable(out, /*is_output=*/true);
    if (ops::ew::scalar_equals(*base.scalar, 0.0)) node->exponent = SavedVariable(exponent, false);
    autograd::set_history(out, node, {nullptr, &exponent}, site);
  }
  return out;
}

Tensor minmax(const char* name, BinaryOp op, bool is_max, const Tensor& a, const Tensor& b, CallSite site) {
  ops::OpScope rs(ops::NamePtr{name}, {&a, &b});
  ops::check_defined(a, name, "self");
  ops::check_defined(b, name, "other");
  Tensor out = ops::ew::binary_out(name, op, Arg(a), Arg(b), ops::result_type(a, b));
  if (autograd::compute_requires_grad({&a, &b})) {
    auto node = make_intrusive<MaxMinBackward>();
    node->is_max = is_max;
    node->a = SavedVariable(a, false);
    node->b = SavedVariable(b, false);
    autograd::set_history(out, node, {&a, &b}, site);
  }
  return out;
}

}  // namespace

Tensor Tensor::pow(const Tensor& exponent, std::source_location loc) const {
  ops::check_defined(*this, "pow", "self");
  ops::check_defined(exponent, "pow", "exponent");
  return pow_tensor(*this, exponent, CallSite::from(loc));
}

Tensor Tensor::pow(const Scalar& exponent, std::source_location loc) const {
  ops::OpScope rs("pow", {this});
  ops::check_defined(*this, "pow", "self");
  const DType rt = pow_type("pow", *this, exponent);
  check_int_pow_exponent("pow", *this, exponent);
  Tensor out = pow_scalar_out(*this, exponent, rt);
  if (autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<PowBackward0>();
    node->self = SavedVariable(*this, false);
    node->exponent = exponent;
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

Tensor& Tensor::pow_(const Scalar& exponent, std::source_location loc) {
  ops::OpScope rs("pow_", {this});
  const CallSite site = CallSite::from(loc);
  ops::check_defined(*this, "pow_", "self");
  const DType rt = pow_type("pow_", *this, exponent);
  check_int_pow_exponent("pow_", *this, exponent);
  ops::ew::check_inplace_cast("pow_", rt, *this);
  ops::ew::check_no_internal_overlap("pow_", *this);
  autograd::check_inplace(*this, "pow_", site);
  IntrusivePtr<PowBackward0> node;
  if (autograd::compute_requires_grad({this})) {
    node = make_intrusive<PowBackward0>();
    node->self = SavedVariable(ops::ew::old_value(*this), false);  // the formula reads self before the write
    node->exponent = exponent;
  }
  if (numel() > 0 && !ops::ew::scalar_equals(exponent, 1.0)) {
    const auto loop = ops::make_loop(sizes(), {this, this});
    if (ops::ew::scalar_equals(exponent, 0.0)) {
      kernels::fill(loop, dtype(), 1);
    } else if (rt == dtype()) {
      kernels::pow_scalar(loop, rt, exponent);
    } else {
      Tensor tmp = pow_scalar_out(*this, exponent, rt);
      kernels::copy_cast(ops::make_loop(sizes(), {this, &tmp}), dtype(), rt);
    }
  }
  bump_version();
  if (node) autograd::rebase_history(*this, node, {}, site);
  return *this;
}

Tensor pow(const Scalar& self, const Tensor& exponent, std::source_location loc) {
  ops::check_defined(exponent, "pow", "exponent");
  return pow_tensor(self, exponent, CallSite::from(loc));
}

Tensor Tensor::maximum(const Tensor& other, std::source_location loc) const {
  return minmax("maximum", BinaryOp::Maximum, true, *this, other, CallSite::from(loc));
}
Tensor Tensor::minimum(const Tensor& other, std::source_location loc) const {
  return minmax("minimum", BinaryOp::Minimum, false, *this, other, CallSite::from(loc));
}

}  // namespace kiln
