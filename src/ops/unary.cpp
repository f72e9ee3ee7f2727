// Unary elementwise ops: neg abs exp log log1p sqrt rsqrt sin cos tanh sigmoid
// relu gelu silu clamp, and their in-place forms.
// Backward formulas will sit beside each forward (autograd issue).
//
// dtype rules, as torch 1.13: the floating functions promote integer and bool
// tensors to the default float dtype (torch.exp(int tensor) is float32);
// neg/abs/relu/clamp keep integer dtypes; gelu and silu accept only floating
// tensors; neg and abs refuse bool.
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>

#include "elementwise_common.h"
#include "kiln/kernels/copy.h"

namespace kiln {

namespace {

using kernels::UnaryOp;

enum class Kind {
  Promote,    // integer/bool -> default float dtype (exp, log, sigmoid...)
  KeepType,   // any dtype but bool (neg, abs, relu)
  FloatOnly,  // floating tensors only (gelu, silu)
};

void check_kind(const char* name, Kind kind, DType dt) {
  if (kind == Kind::KeepType) {
    KILN_CHECK(dt != kBool, DTypeError, name, ": not supported for bool tensors; for a mask use the `~` or "
               "logical_not() operator, or convert with .to(kInt64) first");
  } else if (kind == Kind::FloatOnly) {
    KILN_CHECK(is_floating_point(dt), DTypeError, name,
               ": expected a floating-point tensor (float32, float64, bfloat16, float16), got ", dtype_name(dt));
  }
}

DType result_dtype(Kind kind, DType dt) {
  return kind == Kind::Promote && !is_floating_point(dt) ? default_dtype() : dt;
}

Tensor unary_out(const char* name, UnaryOp op, const Tensor& x, Kind kind) {
  ops::check_defined(x, name, "self");
  check_kind(name, kind, x.dtype());
  const DType rt = result_dtype(kind, x.dtype());
  Tensor out = ops::new_output(x.sizes(), rt);
  if (out.numel() == 0) return out;
  if (rt == x.dtype()) {
    kernels::unary(ops::ew::make_unary_loop(x.sizes(), out, x), op, rt);
  } else {  // convert into the output, then work in place there: no temporary
    kernels::copy_cast(ops::make_loop(x.sizes(), {&out, &x}), rt, x.dtype());
    kernels::unary(ops::ew::make_unary_loop(x.sizes(), out, out), op, rt);
  }
  return out;
}

Tensor& unary_inplace(const char* name, UnaryOp op, Tensor& self, Kind kind) {
  ops::check_defined(self, name, "self");
  check_kind(name, kind, self.dtype());
  ops::ew::check_inplace_cast(name, result_dtype(kind, self.dtype()), self);
  ops::ew::check_no_internal_overlap(name, self);
  if (self.numel() > 0) kernels::unary(ops::ew::make_unary_loop(self.sizes(), self, self), op, self.dtype());
  self.bump_version();
  return self;
}

void check_relu(const char* name, const Tensor& x) {
  ops::check_defined(x, name, "self");
  KILN_CHECK(x.dtype() != kBool, DTypeError, name, ": Boolean inputs not supported for relu");
}

void check_neg(const char* name, const Tensor& x) {
  ops::check_defined(x, name, "self");
  KILN_CHECK(x.dtype() != kBool, DTypeError, name,
             ": negation, the `-` operator, on a bool tensor is not supported; to invert a mask, use the `~` or "
             "logical_not() operator instead");
}

UnaryOp gelu_op(std::string_view approximate) {
  if (approximate == "none") return UnaryOp::GeluErf;
  if (approximate == "tanh") return UnaryOp::GeluTanh;
  throw ValueError(detail::concat("gelu: approximate argument must be either \"none\" or \"tanh\", got \"",
                                  approximate, "\""));
}

// clamp's result type: a floating tensor keeps its dtype; others promote with the bounds (torch's meta).
DType clamp_type(const char* name, const Tensor& x, const std::optional<Scalar>& lo,
                 const std::optional<Scalar>& hi) {
  ops::check_defined(x, name, "self");
  KILN_CHECK(lo || hi, ValueError, name, ": at least one of 'min' or 'max' must not be None");
  if (is_floating_point(x.dtype())) return x.dtype();
  ops::ResultTypeState st;
  st.update(x);
  if (lo) st.update(*lo);
  if (hi) st.update(*hi);
  const DType rt = st.result();
  KILN_CHECK(rt != kBool, DTypeError, name, ": not implemented for bool (a bool tensor with bool bounds); "
             "use logical ops, or integer bounds to get an int64 result");
  return rt;
}

bool is_nan(const std::optional<Scalar>& s) { return s && s->is_floating_point() && std::isnan(s->to_double()); }

// out = clamp(in, lo, hi) in dtype rt; torch fills NaN when both bounds are given and one is NaN.
void run_clamp(const kernels::LoopSpec& loop, DType rt, const std::optional<Scalar>& lo,
               const std::optional<Scalar>& hi) {
  if (lo && hi && (is_nan(lo) || is_nan(hi))) {
    kernels::fill(loop, rt, std::numeric_limits<double>::quiet_NaN());
    return;
  }
  alignas(8) unsigned char lo_buf[8], hi_buf[8];
  if (lo) kernels::scalar_to_bytes(lo_buf, rt, *lo);
  if (hi) kernels::scalar_to_bytes(hi_buf, rt, *hi);
  kernels::clamp(loop, rt, lo ? lo_buf : nullptr, hi ? hi_buf : nullptr);
}

}  // namespace

Tensor Tensor::neg() const {
  check_neg("neg", *this);
  return unary_out("neg", UnaryOp::Neg, *this, Kind::KeepType);
}
Tensor& Tensor::neg_() {
  check_neg("neg_", *this);
  return unary_inplace("neg_", UnaryOp::Neg, *this, Kind::KeepType);
}
Tensor Tensor::abs() const { return unary_out("abs", UnaryOp::Abs, *this, Kind::KeepType); }
Tensor& Tensor::abs_() { return unary_inplace("abs_", UnaryOp::Abs, *this, Kind::KeepType); }
Tensor Tensor::relu() const {
  check_relu("relu", *this);
  return unary_out("relu", UnaryOp::Relu, *this, Kind::KeepType);
}
Tensor& Tensor::relu_() {
  check_relu("relu_", *this);
  return unary_inplace("relu_", UnaryOp::Relu, *this, Kind::KeepType);
}

Tensor Tensor::exp() const { return unary_out("exp", UnaryOp::Exp, *this, Kind::Promote); }
Tensor& Tensor::exp_() { return unary_inplace("exp_", UnaryOp::Exp, *this, Kind::Promote); }
Tensor Tensor::log() const { return unary_out("log", UnaryOp::Log, *this, Kind::Promote); }
Tensor& Tensor::log_() { return unary_inplace("log_", UnaryOp::Log, *this, Kind::Promote); }
Tensor Tensor::log1p() const { return unary_out("log1p", UnaryOp::Log1p, *this, Kind::Promote); }
Tensor Tensor::sqrt() const { return unary_out("sqrt", UnaryOp::Sqrt, *this, Kind::Promote); }
Tensor& Tensor::sqrt_() { return unary_inplace("sqrt_", UnaryOp::Sqrt, *this, Kind::Promote); }
Tensor Tensor::rsqrt() const { return unary_out("rsqrt", UnaryOp::Rsqrt, *this, Kind::Promote); }
Tensor Tensor::sin() const { return unary_out("sin", UnaryOp::Sin, *this, Kind::Promote); }
Tensor Tensor::cos() const { return unary_out("cos", UnaryOp::Cos, *this, Kind::Promote); }
Tensor Tensor::tanh() const { return unary_out("tanh", UnaryOp::Tanh, *this, Kind::Promote); }
Tensor& Tensor::tanh_() { return unary_inplace("tanh_", UnaryOp::Tanh, *this, Kind::Promote); }
Tensor Tensor::sigmoid() const { return unary_out("sigmoid", UnaryOp::Sigmoid, *this, Kind::Promote); }
Tensor& Tensor::sigmoid_() { return unary_inplace("sigmoid_", UnaryOp::Sigmoid, *this, Kind::Promote); }
Tensor Tensor::silu() const { return unary_out("silu", UnaryOp::Silu, *this, Kind::FloatOnly); }
Tensor Tensor::gelu(std::string_view approximate) const {
  return unary_out("gelu", gelu_op(approximate), *this, Kind::FloatOnly);
}

Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max) const {
  const DType rt = clamp_type("clamp", *this, min, max);
  Tensor out = ops::new_output(sizes(), rt);
  if (out.numel() == 0) return out;
  if (rt == dtype()) {
    run_clamp(ops::make_loop(sizes(), {&out, this}), rt, min, max);
  } else {  // int tensor clamped by a float bound: convert into out, clamp in place
    kernels::copy_cast(ops::make_loop(sizes(), {&out, this}), rt, dtype());
    run_clamp(ops::make_loop(sizes(), {&out, &out}), rt, min, max);
  }
  return out;
}

Tensor& Tensor::clamp_(std::optional<Scalar> min, std::optional<Scalar> max) {
  const DType rt = clamp_type("clamp_", *this, min, max);
  // torch allows no promotion at all for in-place clamp (not even one can_cast permits).
  KILN_CHECK(rt == dtype(), DTypeError, "clamp_: result type ", dtype_name(rt),
             " can't be cast to the desired output type ", dtype_name(dtype()),
             " (the bounds promote the result; use clamp() for a ", dtype_name(rt), " result)");
  ops::ew::check_no_internal_overlap("clamp_", *this);
  if (numel() > 0) run_clamp(ops::make_loop(sizes(), {this, this}), rt, min, max);
  bump_version();
  return *this;
}

}  // namespace kiln
