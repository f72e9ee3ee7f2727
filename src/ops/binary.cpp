// Binary arithmetic ops: add sub mul div (with rsub and scalar / tensor) and
// their in-place forms, with broadcasting and PyTorch's type promotion (Note
// [Result type]); each op's backward node sits beside its forward. pow,
// maximum and minimum are in pow_minmax.cpp.
//
// Backward formulas are PyTorch's (derivatives.yaml), written with kiln ops
// so that create_graph gives second derivatives. A node's next edges are
// (a, b) in operand order, with an invalid edge for a Scalar operand; the
// engine sums broadcast dims and casts to each input's dtype. In-place ops
// check the target (check_inplace) before writing and rewrite its history
// (rebase_history) after; a formula that needs self's old value saves a copy
// taken before the write.
#include <optional>

#include "elementwise_common.h"
#include "grad_ops.h"
#include "kiln/ops/elementwise.h"
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

// add / sub / rsub: d/da = grad * coef[0], d/db = grad * coef[1] (unset: 1).
struct AddBackward final : autograd::Node {
  const char* node_name = "AddBackward0";
  std::optional<Scalar> coef[2];
  const char* name() const override { return node_name; }
  TensorList apply(TensorList&& g) override {
    TensorList out(next_edges().size());
    if (!g[0].defined()) return out;
    for (size_t i = 0; i < out.size(); ++i) {
      if (needs_grad(*this, i)) out[i] = coef[i] ? g[0] * *coef[i] : g[0];
    }
    return out;
  }
};

// a * b: d/da = grad * b, d/db = grad * a. Each saved operand is kept only
// when the other operand needs its gradient; mul_ saves self's old value.
struct MulBackward final : autograd::Node {
  SavedVariable a, b;
  std::optional<Scalar> b_scalar;
  DType a_dtype = kFloat32, b_dtype = kFloat32;
  const char* name() const override { return "MulBackward0"; }
  TensorList apply(TensorList&& g) override {
    TensorList out(next_edges().size());
    if (!g[0].defined()) return out;
    if (needs_grad(*this, 0)) out[0] = grad_as(b_scalar ? g[0] * *b_scalar : g[0] * b.unpack(this), a_dtype);
    if (needs_grad(*this, 1)) out[1] = grad_as(g[0] * a.unpack(this), b_dtype);
    return out;
  }
  void release_variables() override {
    a.reset();
    b.reset();
  }
};

// a / b: d/da = grad / b, d/db = -grad * ((a / b) / b). Either operand may
// be a Scalar; div_ saves self's old value, as torch (not the result, which a
// later in-place op may change).
struct DivBackward final : autograd::Node {
  SavedVariable a, b;
  std::optional<Scalar> a_scalar, b_scalar;
  DType a_dtype = kFloat32, b_dtype = kFloat32;
  const char* name() const override { return "DivBackward0"; }
  TensorList apply(TensorList&& g) override {
    TensorList out(next_edges().size());
    if (!g[0].defined()) return out;
    if (needs_grad(*this, 0)) out[0] = grad_as(b_scalar ? g[0] / *b_scalar : g[0] / b.unpack(this), a_dtype);
    if (needs_grad(*this, 1)) {
      const Tensor other = b.unpack(this);
      const Tensor q = a_scalar ? ops::ew::div(*a_scalar, other, {}) : a.unpack(this) / other;
      out[1] = grad_as(-g[0] * (q / other), b_dtype);
    }
    return out;
  }
  void release_variables() override {
    a.reset();
    b.reset();
  }
};

DType arg_dtype(Arg x) { return x.tensor ? x.tensor->dtype() : kFloat32; }

// ---- forwards ----

// torch's alpha_check: alpha's category must fit the result's.
void check_alpha(const char* name, DType result, const Scalar& alpha) {
  KILN_CHECK(!alpha.is_bool() || result == kBool, DTypeError, name,
             ": a bool alpha is only supported for bool results, got a ", dtype_name(result), " result");
  KILN_CHECK(is_floating_point(result) || !alpha.is_floating_point(), DTypeError, name,
             ": for integral input tensors, argument alpha must not be a floating point number (got alpha=",
             alpha.to_double(), ", result dtype ", dtype_name(result), ")");
}

// torch's sub_check: subtraction is undefined on bool.
void check_sub(const char* name, Arg a, Arg b) {
  KILN_CHECK(a.dtype() != kBool || b.dtype() != kBool, DTypeError, name,
             ": subtraction, the `-` operator, with two bool tensors is not supported; use the `^` or "
             "logical_xor() operator instead");
  KILN_CHECK(a.dtype() != kBool && b.dtype() != kBool, DTypeError, name,
             ": subtraction, the `-` operator, with a bool tensor is not supported; to invert a mask, use "
             "the `~` or logical_not() operator instead");
}

// alpha in dtype `dt` in `buf`, or null when it is 1 (the kernel's plain a + b).
const void* alpha_arg(const Scalar& alpha, DType dt, unsigned char* buf) {
  if (!alpha.is_bool() && alpha.to_double() == 1.0) return nullptr;
  if (alpha.is_bool() && alpha.to_bool()) return nullptr;
  kernels::scalar_to_bytes(buf, dt, alpha);
  return buf;
}

Scalar negate(const Scalar& s) {
  if (s.is_floating_point()) return Scalar(-s.to_double());
  return Scalar(static_cast<int64_t>(0ull - static_cast<uint64_t>(s.to_int64())));
}

// b's coefficient in a + coef * b: alpha, or -alpha for subtraction; unset when it is 1.
std::optional<Scalar> add_coef(const Scalar& alpha, bool subtract) {
  if (subtract) return negate(alpha);
  if (alpha.to_double() == 1.0) return std::nullopt;
  return alpha;
}

// The node of a + coef * b (add, sub, rsub and their in-place forms).
autograd::NodePtr add_node(const char* node_name, const Scalar& alpha, bool subtract) {
  auto node = make_intrusive<AddBackward>();
  node->node_name = node_name;
  node->coef[1] = add_coef(alpha, subtract);
  return node;
}

// a + alpha * b, or a - alpha * b when `subtract` (alpha is checked before negation, as torch).
Tensor add_impl(const char* name, const char* node_name, Arg a, Arg b, const Scalar& alpha, bool subtract,
                CallSite site) {
  if (a.tensor) ops::check_defined(*a.tensor, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DType rt = ops::ew::result_type(a, b);
  check_alpha(name, rt, alpha);
  alignas(8) unsigned char buf[8];
  Tensor out = ops::ew::binary_out(name, BinaryOp::Add, a, b, rt, alpha_arg(subtract ? negate(alpha) : alpha, rt, buf));
  if (autograd::compute_requires_grad({a.tensor, b.tensor})) {
    autograd::set_history(out, add_node(node_name, alpha, subtract), {a.tensor, b.tensor}, site);
  }
  return out;
}

Tensor& add_inplace_impl(const char* name, const char* node_name, Tensor& self, Arg b, const Scalar& alpha,
                         bool subtract, CallSite site) {
  ops::check_defined(self, name, "self");
  if (b.tensor) ops::check_defined(*b.tensor, name, "other");
  const DType rt = ops::ew::result_type(Arg(self), b);
  check_alpha(name, rt, alpha);
  Tensor holder;
  const Arg other = ops::ew::check_binary_inplace(name, self, b, rt, holder);
  autograd::check_inplace(self, name, site, {b.tensor});
  const bool record = autograd::compute_requires_grad({&self, b.tensor});
  alignas(8) unsigned char buf[8];
  ops::ew::run_binary_inplace(name, BinaryOp::Add, self, other, rt,
                              alpha_arg(subtract ? negate(alpha) : alpha, rt, buf));
  if (record) autograd::rebase_history(self, add_node(node_name, alpha, subtract), {b.tensor}, site);
  return self;
}

// torch.div (true division): integer and bool results become the default float dtype.
DType div_type(Arg a, Arg b) {
  const DType rt = ops::ew::result_type(a, b);
  return is_floating_point(rt) ? rt : default_dtype();
}

}  // namespace

// ---- entry points with a call site (elementwise_common.h) ----

namespace ops::ew {

Tensor add(Arg a, Arg b, const Scalar& alpha, CallSite site) {
  OpScope rs("add", {a.tensor, b.tensor});
  return add_impl("add", "AddBackward0", a, b, alpha, false, site);
}

Tensor sub(const Tensor& a, Arg b, const Scalar& alpha, CallSite site) {
  OpScope rs("sub", {&a, b.tensor});
  ops::check_defined(a, "sub", "self");
  if (b.tensor) ops::check_defined(*b.tensor, "sub", "other");
  check_sub("sub", a, b);
  return add_impl("sub", "SubBackward0", a, b, alpha, true, site);
}

Tensor rsub(const Tensor& self, const Scalar& other, const Scalar& alpha, CallSite site) {
  OpScope rs("rsub", {&self});
  ops::check_defined(self, "rsub", "self");
  check_sub("rsub", other, self);
  return add_impl("rsub", "RsubBackward1", other, self, alpha, true, site);
}

Tensor& add_(Tensor& self, Arg b, const Scalar& alpha, CallSite site) {
  OpScope rs("add_", {&self, b.tensor});
  return add_inplace_impl("add_", "AddBackward0", self, b, alpha, false, site);
}

Tensor& sub_(Tensor& self, Arg b, const Scalar& alpha, CallSite site) {
  OpScope rs("sub_", {&self, b.tensor});
  ops::check_defined(self, "sub_", "self");
  if (b.tensor) ops::check_defined(*b.tensor, "sub_", "other");
  check_sub("sub_", self, b);
  return add_inplace_impl("sub_", "SubBackward0", self, b, alpha, true, site);
}

Tensor mul(const Tensor& a, Arg b, CallSite site) {
  OpScope rs("mul", {&a, b.tensor});
  ops::check_defined(a, "mul", "self");
  if (b.tensor) ops::check_defined(*b.tensor, "mul", "other");
  Tensor out = binary_out("mul", BinaryOp::Mul, a, b, result_type(a, b));
  if (autograd::compute_requires_grad({&a, b.tensor})) {
    auto node = make_intrusive<MulBackward>();
    node->a_dtype = a.dtype();
    node->b_dtype = arg_dtype(b);
    if (b.tensor) {
      if (a.requires_grad()) node->b = SavedVariable(*b.tensor, false);
      if (b.tensor->requires_grad()) node->a = SavedVariable(a, false);
    } else {
      node->b_scalar = *b.scalar;
    }
    autograd::set_history(out, node, {&a, b.tensor}, site);
  }
  return out;
}

Tensor& mul_(Tensor& self, Arg b, CallSite site) {
  OpScope rs("mul_", {&self, b.tensor});
  ops::check_defined(self, "mul_", "self");
  if (b.tensor) ops::check_defined(*b.tensor, "mul_", "other");
  const DType rt = result_type(Arg(self), b);
  Tensor holder;
  const Arg other = check_binary_inplace("mul_", self, b, rt, holder);
  autograd::check_inplace(self, "mul_", site, {b.tensor});
  IntrusivePtr<MulBackward> node;
  if (autograd::compute_requires_grad({&self, b.tensor})) {
    node = make_intrusive<MulBackward>();
    node->a_dtype = self.dtype();
    node->b_dtype = arg_dtype(b);
    if (b.tensor) {
      if (self.requires_grad()) node->b = SavedVariable(*b.tensor, false);
      // d/dother needs self's value before the write.
      if (b.tensor->requires_grad()) node->a = SavedVariable(old_value(self), false);
    } else {
      node->b_scalar = *b.scalar;
    }
  }
  run_binary_inplace("mul_", BinaryOp::Mul, self, other, rt);
  if (node) autograd::rebase_history(self, node, {b.tensor}, site);
  return self;
}

Tensor div(Arg a, Arg b, CallSite site) {
  OpScope rs("div", {a.tensor, b.tensor});
  if (a.tensor) ops::check_defined(*a.tensor, "div", "self");
  if (b.tensor) ops::check_defined(*b.tensor, "div", "other");
  Tensor out = binary_out("div", BinaryOp::Div, a, b, div_type(a, b));
  if (autograd::compute_requires_grad({a.tensor, b.tensor})) {
    auto node = make_intrusive<DivBackward>();
    node->a_dtype = arg_dtype(a);
    node->b_dtype = arg_dtype(b);
    if (a.scalar) node->a_scalar = *a.scalar;
    if (b.scalar) node->b_scalar = *b.scalar;
    if (b.tensor) {
      node->b = SavedVariable(*b.tensor, false);
      if (a.tensor && b.tensor->requires_grad()) node->a = SavedVariable(*a.tensor, false);
    }
    autograd::set_history(out, node, {a.tensor, b.tensor}, site);
  }
  return out;
}

Tensor& div_(Tensor& self, Arg b, CallSite site) {
  OpScope rs("div_", {&self, b.tensor});
  ops::check_defined(self, "div_", "self");
  if (b.tensor) ops::check_defined(*b.tensor, "div_", "other");
  const DType rt = div_type(self, b);
  Tensor holder;
  const Arg other = check_binary_inplace("div_", self, b, rt, holder);
  autograd::check_inplace(self, "div_", site, {b.tensor});
  IntrusivePtr<DivBackward> node;
  if (autograd::compute_requires_grad({&self, b.tensor})) {
    node = make_intrusive<DivBackward>();
    node->a_dtype = self.dtype();
    node->b_dtype = arg_dtype(b);
    if (b.scalar) node->b_scalar = *b.scalar;
    if (b.tensor) {
      node->b = SavedVariable(*b.tensor, false);
      // d/dother needs self's value before the write.
      if (b.tensor->requires_grad()) node->a = SavedVariable(old_value(self), false);
    }
  }
  run_binary_inplace("div_", BinaryOp::Div, self, other, rt);
  if (node) autograd::rebase_history(self, node, {b.tensor}, site);
  return self;
}

}  // namespace ops::ew

// ---- Tensor methods and free functions ----

Tensor Tensor::add(const Tensor& other, const Scalar& alpha, std::source_location loc) const {
  return ops::ew::add(*this, other, alpha, CallSite::from(loc));
}
Tensor Tensor::add(const Scalar& other, const Scalar& alpha, std::source_location loc) const {
  return ops::ew::add(*this, other, alpha, CallSite::from(loc));
}
Tensor& Tensor::add_(const Tensor& other, const Scalar& alpha, std::source_location loc) {
  return ops::ew::add_(*this, other, alpha, CallSite::from(loc));
}
Tensor& Tensor::add_(const Scalar& other, const Scalar& alpha, std::source_location loc) {
  return ops::ew::add_(*this, other, alpha, CallSite::from(loc));
}

Tensor Tensor::sub(const Tensor& other, const Scalar& alpha, std::source_location loc) const {
  return ops::ew::sub(*this, other, alpha, CallSite::from(loc));
}
Tensor Tensor::sub(const Scalar& other, const Scalar& alpha, std::source_location loc) const {
  return ops::ew::sub(*this, other, alpha, CallSite::from(loc));
}
Tensor& Tensor::sub_(const Tensor& other, const Scalar& alpha, std::source_location loc) {
  return ops::ew::sub_(*this, other, alpha, CallSite::from(loc));
}
Tensor& Tensor::sub_(const Scalar& other, const Scalar& alpha, std::source_location loc) {
  return ops::ew::sub_(*this, other, alpha, CallSite::from(loc));
}

Tensor Tensor::mul(const Tensor& other, std::source_location loc) const {
  return ops::ew::mul(*this, other, CallSite::from(loc));
}
Tensor Tensor::mul(const Scalar& other, std::source_location loc) const {
  return ops::ew::mul(*this, other, CallSite::from(loc));
}
Tensor& Tensor::mul_(const Tensor& other, std::source_location loc) {
  return ops::ew::mul_(*this, other, CallSite::from(loc));
}
Tensor& Tensor::mul_(const Scalar& other, std::source_location loc) {
  return ops::ew::mul_(*this, other, CallSite::from(loc));
}

Tensor Tensor::div(const Tensor& other, std::source_location loc) const {
  return ops::ew::div(*this, other, CallSite::from(loc));
}
Tensor Tensor::div(const Scalar& other, std::source_location loc) const {
  return ops::ew::div(*this, other, CallSite::from(loc));
}
Tensor& Tensor::div_(const Tensor& other, std::source_location loc) {
  return ops::ew::div_(*this, other, CallSite::from(loc));
}
Tensor& Tensor::div_(const Scalar& other, std::source_location loc) {
  return ops::ew::div_(*this, other, CallSite::from(loc));
}

Tensor rsub(const Tensor& self, const Scalar& other, const Scalar& alpha, std::source_location loc) {
  return ops::ew::rsub(self, other, alpha, CallSite::from(loc));
}

Tensor div(const Scalar& self, const Tensor& other, std::source_location loc) {
  ops::check_defined(other, "div", "other");
  return ops::ew::div(self, other, CallSite::from(loc));
}

}  // namespace kiln
