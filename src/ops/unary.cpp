// Unary elementwise ops: neg abs exp log log1p sqrt rsqrt sin cos tanh sigmoid
// relu gelu silu clamp, and their in-place forms, with their backward node
// (UnaryBackward: PyTorch 1.13's formulas, written with kiln ops so that
// double backward works) and gelu's backward op with its own node.
//
// dtype rules, as torch 1.13: the floating functions promote integer and bool
// tensors to the default float dtype (torch.exp(int tensor) is float32);
// neg/abs/relu/clamp keep integer dtypes; gelu and silu accept only floating
// tensors; neg and abs refuse bool.
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include "elementwise_common.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/threshold.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/elementwise.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/memory_format.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;
using ops::ew::needs_grad;

namespace {

using kernels::UnaryOp;

// ---- backward ----

// sign(x) (0 at 0 and NaN), a constant of the graph: abs's d/dx.
Tensor sign_of(const Tensor& x) {
  Tensor out = ops::new_output_like(x.sizes(), x.dtype(), {&x});
  if (out.numel() > 0) kernels::unary(ops::ew::make_unary_loop(x.sizes(), out, x), UnaryOp::Sign, x.dtype());
  return out;
}

// torch's threshold_backward: grad where self > threshold, else 0 (0 at the
// threshold itself). One kernel pass; records ThresholdBackwardBackward0 when
// the gradient requires grad (create_graph), so double backward works.
Tensor threshold_backward(const Tensor& grad, const Tensor& self, const Scalar& threshold);
// The same, written into `grad` itself when nothing else refers to it (the
// engine hands each node its own incoming buffer), sparing a fresh output.
Tensor threshold_backward(Tensor&& grad, const Tensor& self, const Scalar& threshold);

enum class Formula : uint8_t {
  Neg,
  Abs,
  Exp,
  Log,
  Log1p,
  Sqrt,
  Rsqrt,
  Sin,
  Cos,
  Tanh,
  Sigmoid,
  Relu,
  Gelu,
  Silu,
  Clamp
};

// What a formula reads: the input (self), the output (result), or nothing.
enum class Reads : uint8_t { Nothing, Self, Result };

Reads reads(Formula f) {
  switch (f) {
    case Formula::Neg: return Reads::Nothing;
    case Formula::Exp:
    case Formula::Sqrt:
    case Formula::Rsqrt:
    case Formula::Tanh:
    case Formula::Sigmoid:
    case Formula::Relu: return Reads::Result;
    default: return Reads::Self;
  }
}

const char* node_name(Formula f) {
  switch (f) {
    case Formula::Neg: return "NegBackward0";
    case Formula::Abs: return "AbsBackward0";
    case Formula::Exp: return "ExpBackward0";
    case Formula::Log: return "LogBackward0";
    case Formula::Log1p: return "Log1PBackward0";
    case Formula::Sqrt: return "SqrtBackward0";
    case Formula::Rsqrt: return "RsqrtBackward0";
    case Formula::Sin: return "SinBackward0";
    case Formula::Cos: return "CosBackward0";
    case Formula::Tanh: return "TanhBackward0";
    case Formula::Sigmoid: return "SigmoidBackward0";
    case Formula::Relu: return "ReluBackward0";
    case Formula::Gelu: return "GeluBackward0";
    case Formula::Silu: return "SiluBackward0";
    case Formula::Clamp: return "ClampBackward1";
  }
  return "?";
}

// One node for every unary op: `saved` is self or the result (reads()); an
// in-place op whose formula reads self saves what it needs before the write
// (a copy of self, or just sign(self) / the clamp mask in `precomputed`).
struct UnaryBackward final : autograd::Node {
  Formula formula = Formula::Neg;
  SavedVariable saved;
  Tensor precomputed;            // abs_: sign(old self); clamp_: the pass-through mask
  std::optional<Scalar> lo, hi;  // clamp's bounds
  bool gelu_tanh = false;

  const char* name() const override { return node_name(formula); }

  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    if (!g.defined() || !needs_grad(*this, 0)) return {Tensor()};
    const Tensor v = saved.defined() ? saved.unpack(this) : Tensor();
    switch (formula) {
      case Formula::Neg: return {-g};
      case Formula::Abs: return {g * (precomputed.defined() ? precomputed : sign_of(v))};
      case Formula::Exp: return {g * v};
      case Formula::Log: return {g / v};
      case Formula::Log1p: return {g / (v + 1)};
      case Formula::Sqrt: return {g / (2 * v)};
      case Formula::Rsqrt: return {-0.5 * g * v.pow(3)};
      case Formula::Sin: return {g * v.cos()};
      case Formula::Cos: return {g * -v.sin()};
      case Formula::Tanh: return {g * (1 - v * v)};
      case Formula::Sigmoid: return {g * (1 - v) * v};
      case Formula::Relu: return {threshold_backward(std::move(grads[0]), v, Scalar(0))};
      case Formula::Gelu: return {ops::ew::gelu_backward(std::move(grads[0]), v, gelu_tanh)};
      case Formula::Silu: {
        const Tensor s = v.sigmoid();
        return {g * s * (1 + v * (1 - s))};
      }
      case Formula::Clamp: {
        // The gradient passes where lo <= x <= hi (both inclusive, as torch); a NaN bound passes nothing.
        Tensor mask = precomputed;
        if (!mask.defined()) {
          if (lo && hi)
            mask = v.ge(*lo).logical_and(v.le(*hi));
          else
            mask = lo ? v.ge(*lo) : v.le(*hi);
        }
        return {where(mask, g, Scalar(0))};
      }
    }
    return {Tensor()};
  }

  void release_variables() override {
    saved.reset();
    precomputed = Tensor();
  }
};

// Records the node of an out-of-place unary op.
void record_unary(Tensor& out, const Tensor& x, Formula f, CallSite site, bool gelu_tanh = false,
                  std::optional<Scalar> lo = std::nullopt, std::optional<Scalar> hi = std::nullopt) {
  auto node = make_intrusive<UnaryBackward>();
  node->formula = f;
  node->gelu_tanh = gelu_tanh;
  node->lo = lo;
  node->hi = hi;
  if (reads(f) == Reads::Self)
    node->saved = SavedVariable(x, false);
  else if (reads(f) == Reads::Result)
    node->saved = SavedVariable(out, /*is_output=*/true);
  autograd::set_history(out, node, {&x}, site);
}

// For an in-place unary op on `self` about to be overwritten: the node, with
// what its formula needs from the old self; null when nothing is recorded.
IntrusivePtr<UnaryBackward> inplace_node(const Tensor& self, Formula f) {
  if (!autograd::compute_requires_grad({&self})) return {};
  auto node = make_intrusive<UnaryBackward>();
  node->formula = f;
  if (f == Formula::Abs)
    node->precomputed = sign_of(self);
  else if (reads(f) == Reads::Self)
    node->saved = SavedVariable(ops::ew::old_value(self), false);
  return node;
}

// After the write: saves the result where the formula reads it, and rewrites self's history.
void finish_inplace(Tensor& self, const IntrusivePtr<UnaryBackward>& node, CallSite site) {
  if (!node) return;
  if (reads(node->formula) == Reads::Result) node->saved = SavedVariable(self, /*is_output=*/true);
  autograd::rebase_history(self, node, {}, site);
}

// GELU's backward as an op: records its own node so that double backward works.
//   d/dgrad = gelu_backward(ggI, self); d/dself = ggI * grad * gelu''(self)  (torch's gelu_double_backward)
struct GeluBackwardBackward final : autograd::Node {
  SavedVariable grad, self;
  bool tanh_form = false;
  const char* name() const override { return "GeluBackwardBackward0"; }
  TensorList apply(TensorList&& gg) override {
    TensorList out(2);
    if (!gg[0].defined()) return out;
    const Tensor x = self.unpack(this);
    if (needs_grad(*this, 0)) out[0] = ops::ew::gelu_backward(gg[0], x, tanh_form);
    if (needs_grad(*this, 1)) {
      Tensor second;
      if (tanh_form) {
        constexpr double kBeta = 0.79788456080286535588;  // sqrt(2/pi)
        constexpr double kKappa = 0.044715;
        const Tensor x_sq = x * x;
        const Tensor t = (kBeta * (x + kKappa * x_sq * x)).tanh();
        const Tensor f = 0.5 * x;
        const Tensor sech_sq = 1 - t * t;
        const Tensor h = kBeta * (1 + 3 * kKappa * x_sq);
        const Tensor f_prime_gh = 0.5 * sech_sq * h;
        const Tensor g_prime_fh = f * h * (-2 * sech_sq * t * h);
        const Tensor h_prime_fg = f * sech_sq * (6 * kKappa * kBeta * x);
        second = f_prime_gh + f_prime_gh + g_prime_fh + h_prime_fg;
      } else {
        constexpr double kAlpha = 0.39894228040143267794;  // 1/sqrt(2 pi)
        const Tensor x_sq = x * x;
        const Tensor pdf = kAlpha * (-0.5 * x_sq).exp();
        second = 2 * pdf - x_sq * pdf;
      }
      out[1] = gg[0] * grad.unpack(this) * second;
    }
    return out;
  }
  void release_variables() override {
    grad.reset();
    self.reset();
  }
};

// threshold_backward's own backward (torch's derivatives.yaml):
//   d/dgrad = threshold_backward(ggI, self, threshold); d/dself = 0.
struct ThresholdBackwardBackward final : autograd::Node {
  SavedVariable self;
  Scalar threshold{0};
  const char* name() const override { return "ThresholdBackwardBackward0"; }
  TensorList apply(TensorList&& gg) override {
    TensorList out(2);
    if (!gg[0].defined()) return out;
    if (needs_grad(*this, 0)) out[0] = threshold_backward(gg[0], self.unpack(this), threshold);
    if (needs_grad(*this, 1)) out[1] = zeros_like(gg[0]);
    return out;
  }
  void release_variables() override { self.reset(); }
};

Tensor threshold_backward(const Tensor& grad, const Tensor& self, const Scalar& threshold) {
  ops::OpScope rs("threshold_backward", {&grad, &self});
  Tensor out;
  if (grad.dtype() == self.dtype() && grad.dtype() != kBool && grad.sizes() == self.sizes()) {
    out = ops::new_output_like(grad.sizes(), grad.dtype(), {&self, &grad});
    if (out.numel() > 0) {
      alignas(8) unsigned char thr[8];
      kernels::scalar_to_bytes(thr, grad.dtype(), threshold);
      kernels::threshold_backward(ops::make_loop(grad.sizes(), {&out, &grad, &self}), grad.dtype(), thr);
    }
  } else {  // mixed dtypes or a broadcast: the general composition (rare; a custom caller)
    const NoGradGuard no_grad;
    out = where(self <= threshold, Scalar(0), grad);
  }
  if (autograd::compute_requires_grad({&grad, &self})) {
    auto node = make_intrusive<ThresholdBackwardBackward>();
    node->self = SavedVariable(self, false);
    node->threshold = threshold;
    autograd::set_history(out, node, {&grad, &self});
  }
  return out;
}

Tensor threshold_backward(Tensor&& grad, const Tensor& self, const Scalar& threshold) {
  // Dense in either format: a channels-last gradient (a convolution's) is written over as well.
  const bool reuse =
      ops::writable_incoming_grad(grad) && (grad.is_contiguous() || is_contiguous(grad, MemoryFormat::ChannelsLast)) &&
      grad.dtype() == self.dtype() && grad.dtype() != kBool && grad.sizes() == self.sizes() && !grad.is_alias_of(self);
  if (!reuse) return threshold_backward(static_cast<const Tensor&>(grad), self, threshold);
  Tensor out = std::move(grad);
  {
    // A listener reads the inputs when the scope closes: `grad` is empty by then, and so is
    // `out` once it is moved into the result, so the scope ends before the return.
    ops::OpScope rs("threshold_backward", {&out, &self});
    if (out.numel() > 0) {
      alignas(8) unsigned char thr[8];
      kernels::scalar_to_bytes(thr, out.dtype(), threshold);
      kernels::threshold_backward(ops::make_loop(out.sizes(), {&out, &out, &self}), out.dtype(), thr);
    }
  }
  out.bump_version();
  return out;
}

// ---- forwards ----

enum class Kind {
  Promote,    // integer/bool -> default float dtype (exp, log, sigmoid...)
  KeepType,   // any dtype but bool (neg, abs, relu)
  FloatOnly,  // floating tensors only (gelu, silu)
};

void check_kind(const char* name, Kind kind, DType dt) {
  if (kind == Kind::KeepType) {
    KILN_CHECK(dt != kBool, DTypeError, name,
               ": not supported for bool tensors; for a mask use the `~` or "
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
  Tensor out = ops::new_output_like(x.sizes(), rt, {&x});
  if (out.numel() == 0) return out;
  if (rt == x.dtype()) {
    kernels::unary(ops::ew::make_unary_loop(x.sizes(), out, x), op, rt);
  } else {  // convert into the output, then work in place there: no temporary
    kernels::copy_cast(ops::make_loop(x.sizes(), {&out, &x}), rt, x.dtype());
    kernels::unary(ops::ew::make_unary_loop(x.sizes(), out, out), op, rt);
  }
  return out;
}

void check_unary_inplace(const char* name, const Tensor& self, Kind kind) {
  ops::check_defined(self, name, "self");
  check_kind(name, kind, self.dtype());
  ops::ew::check_inplace_cast(name, result_dtype(kind, self.dtype()), self);
  ops::ew::check_no_internal_overlap(name, self);
}

void run_unary_inplace(UnaryOp op, Tensor& self) {
  if (self.numel() > 0) kernels::unary(ops::ew::make_unary_loop(self.sizes(), self, self), op, self.dtype());
  self.bump_version();
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
  throw ValueError(
      detail::concat("gelu: approximate argument must be either \"none\" or \"tanh\", got \"", approximate, "\""));
}

// clamp's result type: a floating tensor keeps its dtype; others promote with the bounds (torch's meta).
DType clamp_type(const char* name, const Tensor& x, const std::optional<Scalar>& lo, const std::optional<Scalar>& hi) {
  ops::check_defined(x, name, "self");
  KILN_CHECK(lo || hi, ValueError, name, ": at least one of 'min' or 'max' must not be None");
  if (is_floating_point(x.dtype())) return x.dtype();
  ops::ResultTypeState st;
  st.update(x);
  if (lo) st.update(*lo);
  if (hi) st.update(*hi);
  const DType rt = st.result();
  KILN_CHECK(rt != kBool, DTypeError, name,
             ": not implemented for bool (a bool tensor with bool bounds); "
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

// An out-of-place op with its node.
Tensor unary_op(const char* name, UnaryOp op, const Tensor& x, Kind kind, Formula f, CallSite site) {
  ops::OpScope rs(ops::NamePtr{name}, {&x});
  Tensor out = unary_out(name, op, x, kind);
  // A capture may pool this ReLU's input in its place (docs/compile.md, "Rewrites"): it needs to see who reads it.
  if (op == UnaryOp::Relu && capture::recording()) capture::watch(*out.storage(), "relu output");
  if (autograd::compute_requires_grad({&x})) record_unary(out, x, f, site);
  return out;
}

// An in-place op with its node.
Tensor& unary_op_(const char* name, UnaryOp op, Tensor& self, Kind kind, Formula f, CallSite site) {
  ops::OpScope rs(ops::NamePtr{name}, {&self});
  check_unary_inplace(name, self, kind);
  autograd::check_inplace(self, name, site);
  auto node = inplace_node(self, f);
  run_unary_inplace(op, self);
  finish_inplace(self, node, site);
  return self;
}

}  // namespace

namespace ops::ew {

Tensor neg(const Tensor& x, CallSite site) {
  check_neg("neg", x);
  return unary_op("neg", UnaryOp::Neg, x, Kind::KeepType, Formula::Neg, site);
}

Tensor gelu_backward(const Tensor& grad, const Tensor& self, bool tanh_form) {
  OpScope rs("gelu_backward", {&grad, &self});
  Tensor out =
      binary_out("gelu_backward", tanh_form ? kernels::BinaryOp::GeluTanhBackward : kernels::BinaryOp::GeluErfBackward,
                 grad, self, ops::result_type(grad, self));
  if (autograd::compute_requires_grad({&grad, &self})) {
    auto node = make_intrusive<GeluBackwardBackward>();
    node->tanh_form = tanh_form;
    node->self = SavedVariable(self, false);
    if (self.requires_grad()) node->grad = SavedVariable(grad, false);
    autograd::set_history(out, node, {&grad, &self});
  }
  return out;
}

// Note [GELU's gradient over its incoming buffer]
// As threshold_backward does for ReLU: when the engine's buffer is the only
// reference to the incoming gradient, GELU's backward writes dy * GELU'(x)
// over it. In gpt's step that gradient is the [2048, 1024] product c_proj's
// backward has just written, so the 8 MB result lands in lines the loop has
// just read, where a fresh output is a block last touched a step ago, whose
// lines each cost a read from memory before the write (or, streamed, a trip
// to memory and back for the three ops that read it next); and the step's
// backward holds one 8 MB tensor less per block. A gradient kept elsewhere (a
// hook's, retain_grad's, a buffer two nodes share) has more references and is
// left alone; under create_graph the op records GeluBackwardBackward instead.
Tensor gelu_backward(Tensor&& grad, const Tensor& self, bool tanh_form) {
  const bool reuse = writable_incoming_grad(grad) && grad.is_contiguous() && is_floating_point(grad.dtype()) &&
                     grad.dtype() == self.dtype() && grad.sizes() == self.sizes() && !grad.is_alias_of(self);
  if (!reuse) return gelu_backward(static_cast<const Tensor&>(grad), self, tanh_form);
  Tensor out = std::move(grad);
  {
    // The scope closes before `out` is moved into the result (see threshold_backward).
    OpScope rs("gelu_backward", {&out, &self});
    run_binary_inplace("gelu_backward",
                       tanh_form ? kernels::BinaryOp::GeluTanhBackward : kernels::BinaryOp::GeluErfBackward, out,
                       Arg(self), out.dtype(), nullptr);
  }
  return out;
}

}  // namespace ops::ew

Tensor Tensor::neg(std::source_location loc) const { return ops::ew::neg(*this, CallSite::from(loc)); }
Tensor& Tensor::neg_(std::source_location loc) {
  check_neg("neg_", *this);
  return unary_op_("neg_", UnaryOp::Neg, *this, Kind::KeepType, Formula::Neg, CallSite::from(loc));
}
Tensor Tensor::abs(std::source_location loc) const {
  return unary_op("abs", UnaryOp::Abs, *this, Kind::KeepType, Formula::Abs, CallSite::from(loc));
}
Tensor& Tensor::abs_(std::source_location loc) {
  return unary_op_("abs_", UnaryOp::Abs, *this, Kind::KeepType, Formula::Abs, CallSite::from(loc));
}
Tensor Tensor::relu(std::source_location loc) const {
  check_relu("relu", *this);
  return unary_op("relu", UnaryOp::Relu, *this, Kind::KeepType, Formula::Relu, CallSite::from(loc));
}
Tensor& Tensor::relu_(std::source_location loc) {
  check_relu("relu_", *this);
  return unary_op_("relu_", UnaryOp::Relu, *this, Kind::KeepType, Formula::Relu, CallSite::from(loc));
}

Tensor Tensor::exp(std::source_location loc) const {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::exp, [&](const Tensor& x) { return x.exp(loc); }, *this);
  return unary_op("exp", UnaryOp::Exp, *this, Kind::Promote, Formula::Exp, CallSite::from(loc));
}
Tensor& Tensor::exp_(std::source_location loc) {
  return unary_op_("exp_", UnaryOp::Exp, *this, Kind::Promote, Formula::Exp, CallSite::from(loc));
}
Tensor Tensor::log(std::source_location loc) const {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::log, [&](const Tensor& x) { return x.log(loc); }, *this);
  return unary_op("log", UnaryOp::Log, *this, Kind::Promote, Formula::Log, CallSite::from(loc));
}
Tensor& Tensor::log_(std::source_location loc) {
  return unary_op_("log_", UnaryOp::Log, *this, Kind::Promote, Formula::Log, CallSite::from(loc));
}
Tensor Tensor::log1p(std::source_location loc) const {
  return unary_op("log1p", UnaryOp::Log1p, *this, Kind::Promote, Formula::Log1p, CallSite::from(loc));
}
Tensor Tensor::sqrt(std::source_location loc) const {
  return unary_op("sqrt", UnaryOp::Sqrt, *this, Kind::Promote, Formula::Sqrt, CallSite::from(loc));
}
Tensor& Tensor::sqrt_(std::source_location loc) {
  return unary_op_("sqrt_", UnaryOp::Sqrt, *this, Kind::Promote, Formula::Sqrt, CallSite::from(loc));
}
Tensor Tensor::rsqrt(std::source_location loc) const {
  return unary_op("rsqrt", UnaryOp::Rsqrt, *this, Kind::Promote, Formula::Rsqrt, CallSite::from(loc));
}
Tensor Tensor::sin(std::source_location loc) const {
  return unary_op("sin", UnaryOp::Sin, *this, Kind::Promote, Formula::Sin, CallSite::from(loc));
}
Tensor Tensor::cos(std::source_location loc) const {
  return unary_op("cos", UnaryOp::Cos, *this, Kind::Promote, Formula::Cos, CallSite::from(loc));
}
Tensor Tensor::tanh(std::source_location loc) const {
  return unary_op("tanh", UnaryOp::Tanh, *this, Kind::Promote, Formula::Tanh, CallSite::from(loc));
}
Tensor& Tensor::tanh_(std::source_location loc) {
  return unary_op_("tanh_", UnaryOp::Tanh, *this, Kind::Promote, Formula::Tanh, CallSite::from(loc));
}
Tensor Tensor::sigmoid(std::source_location loc) const {
  return unary_op("sigmoid", UnaryOp::Sigmoid, *this, Kind::Promote, Formula::Sigmoid, CallSite::from(loc));
}
Tensor& Tensor::sigmoid_(std::source_location loc) {
  return unary_op_("sigmoid_", UnaryOp::Sigmoid, *this, Kind::Promote, Formula::Sigmoid, CallSite::from(loc));
}
Tensor Tensor::silu(std::source_location loc) const {
  return unary_op("silu", UnaryOp::Silu, *this, Kind::FloatOnly, Formula::Silu, CallSite::from(loc));
}
Tensor Tensor::gelu(std::string_view approximate, std::source_location loc) const {
  ops::OpScope rs("gelu", {this});
  const UnaryOp op = gelu_op(approximate);
  Tensor out = unary_out("gelu", op, *this, Kind::FloatOnly);
  if (autograd::compute_requires_grad({this})) {
    record_unary(out, *this, Formula::Gelu, CallSite::from(loc), op == UnaryOp::GeluTanh);
  }
  return out;
}

Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max, std::source_location loc) const {
  ops::OpScope rs("clamp", {this});
  const DType rt = clamp_type("clamp", *this, min, max);
  Tensor out = ops::new_output_like(sizes(), rt, {this});
  if (out.numel() > 0) {
    if (rt == dtype()) {
      run_clamp(ops::make_loop(sizes(), {&out, this}), rt, min, max);
    } else {  // int tensor clamped by a float bound: convert into out, clamp in place
      kernels::copy_cast(ops::make_loop(sizes(), {&out, this}), rt, dtype());
      run_clamp(ops::make_loop(sizes(), {&out, &out}), rt, min, max);
    }
  }
  if (autograd::compute_requires_grad({this})) {
    record_unary(out, *this, Formula::Clamp, CallSite::from(loc), false, min, max);
  }
  return out;
}

Tensor& Tensor::clamp_(std::optional<Scalar> min, std::optional<Scalar> max, std::source_location loc) {
  ops::OpScope rs("clamp_", {this});
  const CallSite site = CallSite::from(loc);
  const DType rt = clamp_type("clamp_", *this, min, max);
  // torch allows no promotion at all for in-place clamp (not even one can_cast permits).
  KILN_CHECK(rt == dtype(), DTypeError, "clamp_: result type ", dtype_name(rt),
             " can't be cast to the desired output type ", dtype_name(dtype()),
             " (the bounds promote the result; use clamp() for a ", dtype_name(rt), " result)");
  ops::ew::check_no_internal_overlap("clamp_", *this);
  autograd::check_inplace(*this, "clamp_", site);
  IntrusivePtr<UnaryBackward> node;
  if (autograd::compute_requires_grad({this})) {
    // The pass-through mask depends on the old value, which the write loses (x < lo and x == lo both give lo).
    node = make_intrusive<UnaryBackward>();
    node->formula = Formula::Clamp;
    if (min && max)
      node->precomputed = ge(*min).logical_and(le(*max));
    else
      node->precomputed = min ? ge(*min) : le(*max);
  }
  if (numel() > 0) run_clamp(ops::make_loop(sizes(), {this, this}), rt, min, max);
  bump_version();
  if (node) autograd::rebase_history(*this, node, {}, site);
  return *this;
}

}  // namespace kiln
