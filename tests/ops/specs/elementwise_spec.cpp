// Registry entries (tests/ops/specs/op_spec.h) for the elementwise family:
// arithmetic (add sub mul div pow maximum minimum and their in-place forms),
// unary math (neg ... clamp, in-place forms), comparisons, logical and
// bitwise ops, equal and allclose.
//
// Every binary entry samples, per dtype: same shape, broadcast ([3,1,4] with
// [5,4]), a Scalar operand, a 0-dim tensor operand, non-contiguous operands,
// empty tensors, and an operand of another dtype (promotion). Unary entries
// sample contiguous, non-contiguous, 0-dim, empty and a multi-block shape.
// torch 1.13 has no CPU float16 kernels for most unary math; for those the
// torch expression computes in float32 and rounds to float16, which is what
// kiln (and newer torch) does.
#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>

#include "kiln/ops/elementwise.h"
#include "kiln/ops/factory.h"
#include "ops/specs/op_spec.h"

namespace kiln::ops {

namespace {

using Fn1 = std::function<Tensor(const Tensor&)>;
using Fn2 = std::function<Tensor(const Tensor&, const Tensor&)>;
using FnS = std::function<Tensor(const Tensor&, const Scalar&)>;
using Expr1 = std::function<std::string(const std::string&)>;
using Expr2 = std::function<std::string(const std::string&, const std::string&)>;

const std::vector<DType> kAll = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};
const std::vector<DType> kNoBool = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8};
const std::vector<DType> kFloats = {kFloat32, kFloat64, kBFloat16, kFloat16};
const std::vector<DType> kIntegral = {kInt64, kInt32, kUInt8, kBool};

std::string py_scalar(const Scalar& v) {
  if (v.is_bool()) return v.to_bool() ? "True" : "False";
  if (v.is_integral()) return std::to_string(v.to_int64());
  std::ostringstream os;
  os.precision(17);
  os << v.to_double();
  std::string s = os.str();
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// Same values, non-contiguous layout (the last two dims column-major): the
// target of in-place samples, so they write through strided memory. A fresh
// tensor written by copy_, not a view: an in-place op on a view of a tensor
// that requires grad is refused (docs/autograd.md), and backward checks run
// these samples with x0 requiring grad.
Tensor strided_copy(const Tensor& t) {
  if (t.dim() < 2) return t.clone();
  const int64_t nd = t.dim();
  DimVector strides(static_cast<size_t>(nd));
  strides[nd - 2] = 1;
  strides[nd - 1] = std::max<int64_t>(t.size(-2), 1);
  int64_t step = strides[nd - 1] * std::max<int64_t>(t.size(-1), 1);
  for (int64_t d = nd - 3; d >= 0; --d) {
    strides[d] = step;
    step *= std::max<int64_t>(t.size(d), 1);
  }
  Tensor out = empty_strided(t.sizes(), strides.ref(), t.dtype());
  out.copy_(t);
  return out;
}

// An operand of `dt` for a sample; `positive` draws from [0.5, 2) for floats (log, pow bases).
Tensor operand(IntArrayRef shape, DType dt, uint64_t seed, bool positive = false) {
  return positive && is_floating_point(dt) ? sample_positive(shape, dt, seed) : sample_tensor(shape, dt, seed);
}

Tensor operand_noncontig(IntArrayRef shape, DType dt, uint64_t seed, bool positive = false) {
  if (!positive || !is_floating_point(dt)) return sample_noncontig(shape, dt, seed);
  DimVector big(shape);
  big.back() *= 2;
  return sample_positive(big, dt, seed).slice(-1, 0, std::nullopt, 2);
}

// A Scalar natural for an operand of dtype dt (same category, so the result keeps dt).
Scalar same_kind_scalar(DType dt) {
  if (dt == kBool) return true;
  if (is_integral(dt)) return 3;
  return -1.5;
}

// Integer and bool inputs may give floating results (true division, exp, x + 2.5): those
// compare at the default float dtype's tolerance (integer results stay exact whatever it says).
Tolerance result_tolerance(DType dt) {
  return default_tolerance(is_floating_point(dt) ? dt : default_dtype());
}

OpSample sample(std::string label, std::vector<Tensor> inputs, std::function<std::vector<Tensor>(const std::vector<Tensor>&)> run,
                std::string torch, std::vector<int> grad) {
  return OpSample{std::move(label), std::move(inputs), std::move(run), std::move(torch), std::move(grad)};
}

// ---- binary ops ----

struct BinaryDef {
  BinaryDef(std::string n, std::vector<DType> d, Fn2 f, Expr2 t, FnS sf = nullptr, bool pos = false)
      : name(std::move(n)), dtypes(std::move(d)), fn(std::move(f)), torch(std::move(t)), scalar_fn(std::move(sf)),
        positive_lhs(pos) {}

  std::string name;
  std::vector<DType> dtypes;
  Fn2 fn;        // kiln on two tensors
  Expr2 torch;   // the same in torch, over two Python expressions
  FnS scalar_fn; // kiln with a Scalar right operand (empty: no such overload)
  bool positive_lhs = false;    // pow bases
  bool differentiable = true;   // floating samples list grad inputs
  bool inplace = false;         // writes a strided copy of x0; broadcasts only the right operand
  bool mixed = true;            // add a sample with an operand of another dtype
  // torch 1.13 has no CPU float16 log, which pow's backward needs: float16 samples
  // compare with the op computed in float32 and rounded to float16 (what kiln does).
  bool half_via_float = false;
  std::vector<Scalar> extra_scalars;  // more scalar samples (pow's exponents)
};

OpSpec binary_spec(const BinaryDef& d) {
  OpSpec s;
  s.name = d.name;
  s.dtypes = d.dtypes;
  s.tolerance = result_tolerance;
  s.differentiable = d.differentiable;
  s.samples = [d](DType dt) {
    std::vector<OpSample> out;
    const bool grad = d.differentiable && is_floating_point(dt);
    auto expr = [&](const std::string& a, const std::string& b) {
      if (!d.half_via_float || dt != kFloat16) return d.torch(a, b);
      auto up = [](const std::string& e) { return e.rfind("x", 0) == 0 ? e + ".float()" : e; };
      return "(" + d.torch(up(a), up(b)) + ").half()";
    };
    auto run2 = [d](const std::vector<Tensor>& x) {
      return std::vector<Tensor>{d.fn(d.inplace ? strided_copy(x[0]) : x[0], x[1])};
    };
    auto add2 = [&](const std::string& label, Tensor a, Tensor b) {
      const bool g = grad && is_floating_point(b.dtype());
      out.push_back(sample(label, {std::move(a), std::move(b)}, run2, expr("x0", "x1"),
                           g ? std::vector<int>{0, 1} : std::vector<int>{0}));
      if (!grad) out.back().grad_inputs.clear();
    };
    const bool pos = d.positive_lhs;
    add2("same shape", operand({3, 4}, dt, 1, pos), operand({3, 4}, dt, 2));
    if (d.inplace) {
      add2("broadcast", operand({5, 4}, dt, 3, pos), operand({1, 4}, dt, 4));
      add2("broadcast rank", operand({2, 3, 4}, dt, 3, pos), operand({4}, dt, 4));
    } else {
      add2("broadcast", operand({3, 1, 4}, dt, 3, pos), operand({5, 4}, dt, 4));
      add2("broadcast lhs", operand({4}, dt, 3, pos), operand({2, 3, 4}, dt, 4));
    }
    add2("0-dim other", operand({3, 4}, dt, 5, pos), operand({}, dt, 6));
    if (!d.inplace) add2("0-dim both", operand({}, dt, 5, pos), operand({}, dt, 6));
    add2("noncontig", operand_noncontig({4, 3}, dt, 7, pos), sample_noncontig({4, 3}, dt, 8));
    add2("empty", operand({0, 4}, dt, 9, pos), operand({4}, dt, 10));
    if (d.mixed) {
      // Another dtype: int64 with floating operands (the float wins), float32 with integers (promotes),
      // float64 0-dim with bfloat16 (a 0-dim float does not promote a dimensioned float).
      const DType other = is_floating_point(dt) ? kInt64 : kFloat32;
      if (!d.inplace || is_floating_point(dt)) add2("other dtype", operand({3, 4}, dt, 11, pos), operand({3, 4}, other, 12));
      if (dt == kBFloat16) add2("float64 0-dim", operand({3, 4}, dt, 13, pos), operand({}, kFloat64, 14));
    }
    if (d.scalar_fn) {
      std::vector<Scalar> scalars = {same_kind_scalar(dt)};
      if (!is_floating_point(dt) && !d.inplace) scalars.push_back(2.5);  // promotes to the default float dtype
      scalars.insert(scalars.end(), d.extra_scalars.begin(), d.extra_scalars.end());
      for (const Scalar& v : scalars) {
        if (v.is_floating_point() && !is_floating_point(dt) && d.inplace) continue;
        out.push_back(sample("scalar " + py_scalar(v), {operand({3, 4}, dt, 15, pos)},
                             [d, v](const std::vector<Tensor>& x) {
                               return std::vector<Tensor>{d.scalar_fn(d.inplace ? strided_copy(x[0]) : x[0], v)};
                             },
                             expr("x0", py_scalar(v)), grad ? std::vector<int>{0} : std::vector<int>{}));
      }
    }
    return out;
  };
  const std::string name = d.name;
  const Fn2 fn = d.fn;
  const bool inplace = d.inplace;
  const DType dt0 = d.dtypes.front();
  s.errors = [name, fn, inplace, dt0] {
    std::vector<OpErrorCase> e;
    e.push_back({"incompatible shapes", [fn, dt0] { (void)fn(ones({2, 3}, dt0), ones({4}, dt0)); }, "ShapeError",
                 "[2, 3] and [4]"});
    if (inplace) {
      e.push_back({"self would grow", [fn, dt0] { (void)fn(ones({3, 1}, dt0), ones({3, 4}, dt0)); }, "ShapeError",
                   "doesn't match the broadcast shape [3, 4]"});
    }
    return e;
  };
  return s;
}

// The in-place cast error torch raises (int64 self, float result), for an in-place entry.
void add_cast_error(OpSpec& s, std::function<void(Tensor&)> op) {
  auto base = s.errors;
  s.errors = [base, op] {
    auto e = base();
    e.push_back({"int64 self, float result", [op] {
                   Tensor t = ones({3}, kInt64);
                   op(t);
                 },
                 "DTypeError", "result type float32 can't be cast to the desired output type int64"});
    return e;
  };
}

void add_error(OpSpec& s, std::string label, std::function<void()> run, std::string type, std::string text) {
  auto base = s.errors;
  s.errors = [base, label, run, type, text] {
    auto e = base ? base() : std::vector<OpErrorCase>{};
    e.push_back({label, run, type, text});
    return e;
  };
}

Expr2 call2(const std::string& f) {
  return [f](const std::string& a, const std::string& b) { return f + "(" + a + ", " + b + ")"; };
}
Expr2 method2(const std::string& m) {
  return [m](const std::string& a, const std::string& b) { return a + ".clone()." + m + "(" + b + ")"; };
}

// pow's gradients chain a power, two products and (broadcast) a sum, each rounded to
// float16 by kiln's float16 ops; the oracle computes them in float32 (torch 1.13 has no
// CPU float16 log) and rounds once, so float16 needs a few float16 ulps. float32 keeps the
// driver's default (rtol 1e-4, atol 1e-5).
Tolerance pow_grad_tolerance(DType dt) {
  if (dt == kFloat16) return {5e-3, 5e-3};
  if (dt == kFloat32) return {1e-4, 1e-5};
  return result_tolerance(dt);
}

void register_arithmetic(std::vector<OpSpec>& r) {
  BinaryDef add{"add", kAll, [](const Tensor& a, const Tensor& b) { return a.add(b); }, call2("torch.add"),
                [](const Tensor& a, const Scalar& b) { return a.add(b); }};
  r.push_back(binary_spec(add));
  BinaryDef add_alpha = add;
  add_alpha.name = "add(alpha)";
  add_alpha.dtypes = kNoBool;
  add_alpha.fn = [](const Tensor& a, const Tensor& b) { return a.add(b, a.is_floating_point() ? Scalar(0.5) : Scalar(2)); };
  add_alpha.scalar_fn = nullptr;
  add_alpha.mixed = false;
  add_alpha.torch = [](const std::string& a, const std::string& b) {
    return "torch.add(" + a + ", " + b + ", alpha=(0.5 if " + a + ".is_floating_point() else 2))";
  };
  r.push_back(binary_spec(add_alpha));
  add_error(r.back(), "float alpha, int operands", [] { (void)ones({2}, kInt64).add(ones({2}, kInt64), 0.5); },
            "DTypeError", "alpha must not be a floating point number");

  BinaryDef sub{"sub", kNoBool, [](const Tensor& a, const Tensor& b) { return a.sub(b, 2); },
                [](const std::string& a, const std::string& b) { return "torch.sub(" + a + ", " + b + ", alpha=2)"; },
                [](const Tensor& a, const Scalar& b) { return a.sub(b); }};
  sub.torch = [](const std::string& a, const std::string& b) {
    return b.rfind("x", 0) == 0 ? "torch.sub(" + a + ", " + b + ", alpha=2)" : "torch.sub(" + a + ", " + b + ")";
  };
  r.push_back(binary_spec(sub));
  add_error(r.back(), "bool operands", [] { (void)ones({2}, kBool).sub(ones({2}, kBool)); }, "DTypeError",
            "two bool tensors");
  add_error(r.back(), "bool scalar", [] { (void)ones({2}).sub(true); }, "DTypeError", "with a bool tensor");

  r.push_back(binary_spec(BinaryDef{"mul", kAll, [](const Tensor& a, const Tensor& b) { return a.mul(b); }, call2("torch.mul"),
                           [](const Tensor& a, const Scalar& b) { return a.mul(b); }}));
  r.push_back(binary_spec(BinaryDef{"div", kAll, [](const Tensor& a, const Tensor& b) { return a.div(b); }, call2("torch.div"),
                           [](const Tensor& a, const Scalar& b) { return a.div(b); }}));

  BinaryDef pw{"pow", kNoBool, [](const Tensor& a, const Tensor& b) { return a.pow(b); }, call2("torch.pow"),
               [](const Tensor& a, const Scalar& b) { return a.pow(b); }, /*positive_lhs=*/true};
  pw.extra_scalars = {Scalar(2), Scalar(0), Scalar(1)};
  pw.half_via_float = true;
  r.push_back(binary_spec(pw));
  r.back().grad_tolerance = pow_grad_tolerance;
  add_error(r.back(), "int ** negative int", [] { (void)ones({2}, kInt64).pow(-1); }, "ValueError",
            "Integers to negative integer powers are not allowed");
  add_error(r.back(), "bool ** bool", [] { (void)ones({2}, kBool).pow(ones({2}, kBool)); }, "DTypeError", "bool");
  // Floating bases only: the exponents where torch takes a fast path, and a general one.
  BinaryDef pwf = pw;
  pwf.name = "pow(float exponents)";
  pwf.dtypes = kFloats;
  pwf.extra_scalars = {Scalar(3), Scalar(0.5), Scalar(-0.5), Scalar(-1), Scalar(-2), Scalar(1.7), Scalar(0.0)};
  r.push_back(binary_spec(pwf));
  r.back().grad_tolerance = pow_grad_tolerance;

  r.push_back(binary_spec(BinaryDef{"maximum", kAll, [](const Tensor& a, const Tensor& b) { return a.maximum(b); },
                           call2("torch.maximum")}));
  r.push_back(binary_spec(BinaryDef{"minimum", kAll, [](const Tensor& a, const Tensor& b) { return a.minimum(b); },
                           call2("torch.minimum")}));

  // In-place forms.
  BinaryDef add_{"add_", kAll, [](Tensor a, const Tensor& b) { return a.add_(b); }, method2("add_"),
                 [](Tensor a, const Scalar& b) { return a.add_(b); }};
  add_.inplace = true;
  r.push_back(binary_spec(add_));
  add_cast_error(r.back(), [](Tensor& t) { t.add_(ones({3})); });
  add_error(r.back(), "expanded self", [] { Tensor t = zeros({1}).expand({3}); t.add_(1); }, "ValueError",
            "more than one element of the written-to tensor");
  add_error(r.back(), "self overlaps other", [] {
    Tensor t = arange(4, kFloat32).view({2, 2});
    t.add_(t.t());
  }, "ValueError", "refer to a single memory location");
  BinaryDef sub_{"sub_", kNoBool, [](Tensor a, const Tensor& b) { return a.sub_(b); }, method2("sub_"),
                 [](Tensor a, const Scalar& b) { return a.sub_(b); }};
  sub_.inplace = true;
  r.push_back(binary_spec(sub_));
  add_cast_error(r.back(), [](Tensor& t) { t.sub_(ones({3})); });
  BinaryDef mul_{"mul_", kAll, [](Tensor a, const Tensor& b) { return a.mul_(b); }, method2("mul_"),
                 [](Tensor a, const Scalar& b) { return a.mul_(b); }};
  mul_.inplace = true;
  r.push_back(binary_spec(mul_));
  add_cast_error(r.back(), [](Tensor& t) { t.mul_(1.5); });
  BinaryDef div_{"div_", kFloats, [](Tensor a, const Tensor& b) { return a.div_(b); }, method2("div_"),
                 [](Tensor a, const Scalar& b) { return a.div_(b); }};
  div_.inplace = true;
  r.push_back(binary_spec(div_));
  add_cast_error(r.back(), [](Tensor& t) { t.div_(ones({3}, kInt64)); });
}

void register_compare(std::vector<OpSpec>& r) {
  const std::pair<const char*, Fn2> cmps[] = {
      {"eq", [](const Tensor& a, const Tensor& b) { return a.eq(b); }},
      {"ne", [](const Tensor& a, const Tensor& b) { return a.ne(b); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return a.lt(b); }},
      {"le", [](const Tensor& a, const Tensor& b) { return a.le(b); }},
      {"gt", [](const Tensor& a, const Tensor& b) { return a.gt(b); }},
      {"ge", [](const Tensor& a, const Tensor& b) { return a.ge(b); }},
  };
  for (const auto& [name, fn] : cmps) {
    const std::string n = name;
    BinaryDef d{n, kAll, fn, call2("torch." + n), [n](const Tensor& a, const Scalar& b) {
                  if (n == "eq") return a.eq(b);
                  if (n == "ne") return a.ne(b);
                  if (n == "lt") return a.lt(b);
                  if (n == "le") return a.le(b);
                  if (n == "gt") return a.gt(b);
                  return a.ge(b);
                }};
    d.differentiable = false;
    r.push_back(binary_spec(d));
  }
  const std::pair<const char*, Fn2> logic[] = {
      {"logical_and", [](const Tensor& a, const Tensor& b) { return a.logical_and(b); }},
      {"logical_or", [](const Tensor& a, const Tensor& b) { return a.logical_or(b); }},
      {"logical_xor", [](const Tensor& a, const Tensor& b) { return a.logical_xor(b); }},
  };
  for (const auto& [name, fn] : logic) {
    BinaryDef d{name, kAll, fn, call2(std::string("torch.") + name)};
    d.differentiable = false;
    r.push_back(binary_spec(d));
  }
  const std::pair<const char*, Fn2> bitwise[] = {
      {"bitwise_and", [](const Tensor& a, const Tensor& b) { return a & b; }},
      {"bitwise_or", [](const Tensor& a, const Tensor& b) { return a | b; }},
      {"bitwise_xor", [](const Tensor& a, const Tensor& b) { return a ^ b; }},
  };
  for (const auto& [name, fn] : bitwise) {
    BinaryDef d{name, kIntegral, fn, call2(std::string("torch.") + name)};
    d.differentiable = false;
    d.mixed = false;
    r.push_back(binary_spec(d));
    add_error(r.back(), "floating operands", [fn = fn] { (void)fn(ones({2}), ones({2})); }, "DTypeError",
              "expected integral or bool tensors");
  }
}

// ---- unary ops ----

struct UnaryDef {
  UnaryDef(std::string n, std::vector<DType> d, Fn1 f, Expr1 t, bool pos = false, bool half_float = true,
           bool diff = true)
      : name(std::move(n)), dtypes(std::move(d)), fn(std::move(f)), torch(std::move(t)), positive(pos),
        half_via_float(half_float), differentiable(diff) {}

  std::string name;
  std::vector<DType> dtypes;
  Fn1 fn;
  Expr1 torch;             // over a Python expression for the input
  bool positive = false;   // log, sqrt, rsqrt: positive floating inputs
  bool half_via_float = true;  // torch 1.13 has no CPU float16 kernel: compare with float32 rounded to float16
  bool differentiable = true;
  bool inplace = false;
};

OpSpec unary_spec(const UnaryDef& d) {
  OpSpec s;
  s.name = d.name;
  s.dtypes = d.dtypes;
  s.tolerance = result_tolerance;
  s.differentiable = d.differentiable;
  s.samples = [d](DType dt) {
    std::vector<OpSample> out;
    const std::string expr = d.half_via_float && dt == kFloat16 ? "(" + d.torch("x0.float()") + ").half()" : d.torch("x0");
    auto run = [d](const std::vector<Tensor>& x) {
      return std::vector<Tensor>{d.fn(d.inplace ? strided_copy(x[0]) : x[0])};
    };
    const std::vector<int> grad = d.differentiable && is_floating_point(dt) ? std::vector<int>{0} : std::vector<int>{};
    out.push_back(sample("contiguous", {operand({3, 4}, dt, 21, d.positive)}, run, expr, grad));
    out.push_back(sample("noncontig", {operand_noncontig({4, 5}, dt, 22, d.positive)}, run, expr, grad));
    out.push_back(sample("0-dim", {operand({}, dt, 23, d.positive)}, run, expr, grad));
    out.push_back(sample("empty", {operand({0, 3}, dt, 24, d.positive)}, run, expr, grad));
    // Large: forward only (a numerical gradient costs two forwards per input element).
    out.push_back(sample("several blocks", {operand({7, 77}, dt, 25, d.positive)}, run, expr, {}));
    return out;
  };
  s.errors = [] { return std::vector<OpErrorCase>{}; };
  return s;
}

Expr1 call1(const std::string& f, const std::string& args = "") {
  return [f, args](const std::string& x) { return f + "(" + x + args + ")"; };
}
Expr1 method1(const std::string& m, const std::string& args = "") {
  return [m, args](const std::string& x) { return x + ".clone()." + m + "(" + args + ")"; };
}

void register_unary(std::vector<OpSpec>& r) {
  // Floating functions: integer and bool inputs promote to the default float dtype.
  const std::tuple<const char*, Fn1, bool> promote[] = {
      {"exp", [](const Tensor& x) { return x.exp(); }, false},
      {"log", [](const Tensor& x) { return x.log(); }, true},
      {"log1p", [](const Tensor& x) { return x.log1p(); }, true},
      {"sqrt", [](const Tensor& x) { return x.sqrt(); }, true},
      {"rsqrt", [](const Tensor& x) { return x.rsqrt(); }, true},
      {"sin", [](const Tensor& x) { return x.sin(); }, false},
      {"cos", [](const Tensor& x) { return x.cos(); }, false},
      {"tanh", [](const Tensor& x) { return x.tanh(); }, false},
      {"sigmoid", [](const Tensor& x) { return x.sigmoid(); }, false},
  };
  for (const auto& [name, fn, positive] : promote) {
    r.push_back(unary_spec(UnaryDef{name, kAll, fn, call1(std::string("torch.") + name), positive}));
  }
  r.push_back(unary_spec(UnaryDef{"neg", kNoBool, [](const Tensor& x) { return -x; }, call1("torch.neg"), false, false}));
  add_error(r.back(), "bool", [] { (void)ones({2}, kBool).neg(); }, "DTypeError", "negation");
  r.push_back(unary_spec(UnaryDef{"abs", kNoBool, [](const Tensor& x) { return x.abs(); }, call1("torch.abs"), false, false}));
  add_error(r.back(), "bool", [] { (void)ones({2}, kBool).abs(); }, "DTypeError", "bool");
  r.push_back(unary_spec(UnaryDef{"relu", kNoBool, [](const Tensor& x) { return x.relu(); }, call1("torch.relu")}));
  add_error(r.back(), "bool", [] { (void)ones({2}, kBool).relu(); }, "DTypeError", "Boolean inputs not supported");
  r.push_back(unary_spec(UnaryDef{"gelu", kFloats, [](const Tensor& x) { return x.gelu(); },
                          call1("torch.nn.functional.gelu")}));
  add_error(r.back(), "bad approximate", [] { (void)ones({2}).gelu("fast"); }, "ValueError",
            "approximate argument must be either");
  add_error(r.back(), "int64", [] { (void)ones({2}, kInt64).gelu(); }, "DTypeError", "floating-point");
  r.push_back(unary_spec(UnaryDef{"gelu(tanh)", kFloats, [](const Tensor& x) { return x.gelu("tanh"); },
                          call1("torch.nn.functional.gelu", ", approximate='tanh'")}));
  r.push_back(unary_spec(UnaryDef{"silu", kFloats, [](const Tensor& x) { return x.silu(); }, call1("torch.nn.functional.silu")}));
  add_error(r.back(), "int64", [] { (void)ones({2}, kInt64).silu(); }, "DTypeError", "floating-point");

  // clamp: both bounds, one bound, and bounds of another category (int tensor, float bound -> float).
  r.push_back(unary_spec(UnaryDef{"clamp", kAll, [](const Tensor& x) { return x.clamp(-1, 1); }, call1("torch.clamp", ", -1, 1")}));
  add_error(r.back(), "no bounds", [] { (void)ones({2}).clamp(std::nullopt); }, "ValueError", "at least one of");
  r.push_back(unary_spec(UnaryDef{"clamp(min)", kNoBool, [](const Tensor& x) { return x.clamp(0.5); },
                          call1("torch.clamp", ", min=0.5")}));
  r.push_back(unary_spec(UnaryDef{"clamp(max)", kNoBool, [](const Tensor& x) { return x.clamp(std::nullopt, 2); },
                          call1("torch.clamp", ", max=2")}));
  // The output is NaN whatever x is: no gradient sample (kiln and torch both give 0).
  r.push_back(unary_spec(UnaryDef{"clamp(nan bound)", kFloats, [](const Tensor& x) { return x.clamp(NAN, 1); },
                          call1("torch.clamp", ", float('nan'), 1"), false, true, /*diff=*/false}));

  r.push_back(unary_spec(UnaryDef{"logical_not", kAll, [](const Tensor& x) { return x.logical_not(); },
                          call1("torch.logical_not"), false, false, false}));
  r.push_back(unary_spec(UnaryDef{"bitwise_not", kIntegral, [](const Tensor& x) { return ~x; }, call1("torch.bitwise_not"),
                          false, false, false}));
  add_error(r.back(), "float", [] { (void)~ones({2}); }, "DTypeError", "bitwise_not");

  // In-place forms (on a strided copy of x0). Floating-only ones refuse integer self.
  const std::tuple<const char*, Fn1, bool, std::vector<DType>> inplace[] = {
      {"exp_", [](const Tensor& x) { Tensor t = x; return t.exp_(); }, false, kFloats},
      {"log_", [](const Tensor& x) { Tensor t = x; return t.log_(); }, true, kFloats},
      {"sqrt_", [](const Tensor& x) { Tensor t = x; return t.sqrt_(); }, true, kFloats},
      {"tanh_", [](const Tensor& x) { Tensor t = x; return t.tanh_(); }, false, kFloats},
      {"sigmoid_", [](const Tensor& x) { Tensor t = x; return t.sigmoid_(); }, false, kFloats},
      {"relu_", [](const Tensor& x) { Tensor t = x; return t.relu_(); }, false, kNoBool},
      {"neg_", [](const Tensor& x) { Tensor t = x; return t.neg_(); }, false, kNoBool},
      {"abs_", [](const Tensor& x) { Tensor t = x; return t.abs_(); }, false, kNoBool},
  };
  for (const auto& [name, fn, positive, dtypes] : inplace) {
    const std::string n = name;
    UnaryDef d{n, dtypes, fn, method1(n), positive, n != "neg_" && n != "abs_"};
    d.inplace = true;
    r.push_back(unary_spec(d));
    if (dtypes.size() == kFloats.size()) {
      add_error(r.back(), "int64 self", [fn = fn] { (void)fn(ones({3}, kInt64)); }, "DTypeError",
                "result type float32 can't be cast to the desired output type int64");
    }
  }
  UnaryDef clamp_{"clamp_", kNoBool, [](const Tensor& x) { Tensor t = x; return t.clamp_(-1, 1); },
                  method1("clamp_", "-1, 1")};
  clamp_.inplace = true;
  r.push_back(unary_spec(clamp_));
  add_error(r.back(), "int64 self, float bound", [] { Tensor t = ones({3}, kInt64); t.clamp_(0.5); }, "DTypeError",
            "result type float32 can't be cast");
  UnaryDef pow_{"pow_", kFloats, [](const Tensor& x) { Tensor t = x; return t.pow_(2.5); }, method1("pow_", "2.5"),
                true};
  pow_.inplace = true;
  r.push_back(unary_spec(pow_));
  add_error(r.back(), "int64 self, float exponent", [] { Tensor t = ones({3}, kInt64); t.pow_(0.5); }, "DTypeError",
            "can't be cast");
}

// ---- equal / allclose (Python bools) ----

void register_predicates(std::vector<OpSpec>& r) {
  OpSpec eq;
  eq.name = "equal";
  eq.dtypes = kAll;
  eq.samples = [](DType dt) {
    const Tensor a = sample_tensor({3, 4}, dt, 31);
    auto run = [](const std::vector<Tensor>& x) { return std::vector<Tensor>{scalar_tensor(x[0].equal(x[1]))}; };
    return std::vector<OpSample>{
        sample("equal", {a, a.clone()}, run, "torch.equal(x0, x1)", {}),
        sample("differ", {a, sample_tensor({3, 4}, dt, 32)}, run, "torch.equal(x0, x1)", {}),
        sample("noncontig", {a.t().contiguous().t(), a}, run, "torch.equal(x0, x1)", {}),
        sample("shapes differ", {a, a.view({4, 3})}, run, "torch.equal(x0, x1)", {}),
    };
  };
  eq.errors = [] { return std::vector<OpErrorCase>{}; };
  r.push_back(eq);

  OpSpec ac;
  ac.name = "allclose";
  ac.dtypes = kAll;
  ac.samples = [](DType dt) {
    const Tensor a = sample_tensor({3, 4}, dt, 33);
    const Tensor near = is_floating_point(dt) ? a.add(a.mul(2e-6)) : a.clone();
    auto run = [](const std::vector<Tensor>& x) { return std::vector<Tensor>{scalar_tensor(x[0].allclose(x[1]))}; };
    auto run_tol = [](const std::vector<Tensor>& x) {
      return std::vector<Tensor>{scalar_tensor(x[0].allclose(x[1], 0.1, 0.5))};
    };
    return std::vector<OpSample>{
        sample("near", {a, near}, run, "torch.allclose(x0, x1)", {}),
        sample("far", {a, sample_tensor({3, 4}, dt, 34)}, run, "torch.allclose(x0, x1)", {}),
        sample("loose", {a, sample_tensor({3, 4}, dt, 34)}, run_tol, "torch.allclose(x0, x1, rtol=0.1, atol=0.5)", {}),
        sample("broadcast", {a, a.select(0, 1)}, run, "torch.allclose(x0, x1)", {}),
    };
  };
  ac.errors = [] {
    return std::vector<OpErrorCase>{{"dtypes differ", [] { (void)ones({2}).allclose(ones({2}, kInt64)); },
                                     "DTypeError", "same dtype"}};
  };
  r.push_back(ac);
}

}  // namespace

void register_elementwise_ops(std::vector<OpSpec>& r) {
  register_arithmetic(r);
  register_compare(r);
  register_unary(r);
  register_predicates(r);
}

}  // namespace kiln::ops
