// Registry entries (tests/ops/specs/op_spec.h) for the factories and the
// copy/conversion ops: zeros ones full scalar_tensor arange linspace eye,
// the *_like forms, to(dtype) over the whole 8x8 conversion matrix, clone,
// contiguous, copy_, fill_, zero_. Random factories cannot match torch's RNG;
// tests/core/test_rng.cpp covers them.
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "kiln/ops/factory.h"
#include "ops/specs/op_spec.h"

namespace kiln::ops {

namespace {

constexpr DType kAll[] = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};

std::string td(DType dt) { return "torch." + std::string(dtype_name(dt)); }

// "(2, 3)" / "()" / "(4,)": a Python tuple for a shape.
std::string py_shape(IntArrayRef s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

std::string py_scalar(const Scalar& v) {
  if (v.is_bool()) return v.to_bool() ? "True" : "False";
  if (v.is_integral()) return std::to_string(v.to_int64());
  const double d = v.to_double();
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::ostringstream os;
  os.precision(17);
  os << d;
  std::string s = os.str();
  if (s.find_first_of(".e") == std::string::npos) s += ".0";  // keep it a Python float
  return s;
}

using RunFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

OpSample make(std::string label, std::vector<Tensor> inputs, RunFn run, std::string torch) {
  return OpSample{std::move(label), std::move(inputs), std::move(run), std::move(torch), {}};
}

// A fill value natural for the dtype.
Scalar fill_value(DType dt) {
  if (dt == kBool) return true;
  if (dt == kUInt8) return 7;
  if (is_integral(dt)) return -3;
  return 2.5;
}

std::vector<OpErrorCase> no_errors() { return {}; }

// ---- zeros / ones / full / scalar_tensor / eye ----

template <typename Make>
OpSpec shape_factory(const std::string& name, Make fn) {
  OpSpec s;
  s.name = name;
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [name, fn](DType dt) {
    std::vector<OpSample> out;
    for (auto shape : {std::vector<int64_t>{2, 3}, {}, {0, 4}, {2, 1, 3}}) {
      out.push_back(make(shape_str(shape), {}, [=](const std::vector<Tensor>&) { return std::vector<Tensor>{fn(shape, dt)}; },
                         "torch." + name + "(" + py_shape(shape) + ", dtype=" + td(dt) + ")"));
    }
    if (dt == default_dtype()) {
      out.push_back(make("default dtype", {}, [=](const std::vector<Tensor>&) {
        return std::vector<Tensor>{name == "zeros" ? zeros({3}) : ones({3})};
      }, "torch." + name + "(3)"));
    }
    return out;
  };
  s.errors = [name, fn] {
    return std::vector<OpErrorCase>{
        {"negative size", [=] { fn({2, -1}, kFloat32); }, "ShapeError", name + ": expected non-negative sizes"}};
  };
  return s;
}

OpSpec full_spec() {
  OpSpec s;
  s.name = "full";
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [](DType dt) {
    std::vector<OpSample> out;
    const Scalar v = fill_value(dt);
    for (auto shape : {std::vector<int64_t>{2, 3}, {}, {0}}) {
      out.push_back(make("value " + py_scalar(v) + " " + shape_str(shape), {},
                         [=](const std::vector<Tensor>&) { return std::vector<Tensor>{full(shape, v, dt)}; },
                         "torch.full(" + py_shape(shape) + ", " + py_scalar(v) + ", dtype=" + td(dt) + ")"));
    }
    // A float value into an integer dtype truncates; -1 wraps into uint8; anything is a bool.
    const Scalar other = dt == kUInt8 ? Scalar(-1) : (is_floating_point(dt) ? Scalar(-4) : Scalar(-2.75));
    out.push_back(make("value " + py_scalar(other), {},
                       [=](const std::vector<Tensor>&) { return std::vector<Tensor>{full({4}, other, dt)}; },
                       "torch.full((4,), " + py_scalar(other) + ", dtype=" + td(dt) + ")"));
    // Without a dtype the value decides: int -> int64, float -> default dtype, bool -> bool.
    if (dt == kInt64 || dt == default_dtype() || dt == kBool) {
      const Scalar inferred = dt == kInt64 ? Scalar(3) : (dt == kBool ? Scalar(true) : Scalar(1.5));
      out.push_back(make("inferred dtype", {},
                         [=](const std::vector<Tensor>&) { return std::vector<Tensor>{full({2}, inferred)}; },
                         "torch.full((2,), " + py_scalar(inferred) + ")"));
    }
    return out;
  };
  s.errors = [] {
    return std::vector<OpErrorCase>{
        {"uint8 overflow", [] { full({2}, 300, kUInt8); }, "ValueError", "cannot be converted to dtype uint8"},
        {"uint8 negative float", [] { full({2}, -1.5, kUInt8); }, "ValueError", "without overflow"},
        {"float16 overflow", [] { full({2}, 1e10, kFloat16); }, "ValueError", "cannot be converted to dtype float16"},
        {"int32 overflow", [] { full({2}, int64_t{1} << 40, kInt32); }, "ValueError", "dtype int32"},
        {"nan into int64", [] { full({2}, std::nan(""), kInt64); }, "ValueError", "dtype int64"},
        {"negative size", [] { full({-2}, 1.0); }, "ShapeError", "full: expected non-negative sizes"},
    };
  };
  return s;
}

OpSpec scalar_tensor_spec() {
  OpSpec s;
  s.name = "scalar_tensor";
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [](DType dt) {
    const Scalar v = fill_value(dt);
    return std::vector<OpSample>{make("value " + py_scalar(v), {},
                                      [=](const std::vector<Tensor>&) { return std::vector<Tensor>{scalar_tensor(v, dt)}; },
                                      "torch.scalar_tensor(" + py_scalar(v) + ", dtype=" + td(dt) + ")")};
  };
  s.errors = no_errors;
  return s;
}

OpSpec eye_spec() {
  OpSpec s;
  s.name = "eye";
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [](DType dt) {
    std::vector<OpSample> out;
    for (const auto& nm : {std::pair<int64_t, int64_t>{3, -1}, {2, 4}, {4, 2}, {0, -1}, {3, 0}, {1, -1}}) {
      const int64_t n = nm.first, m = nm.second;  // not a structured binding: the lambda below captures n
      const std::optional<int64_t> mm = m < 0 ? std::nullopt : std::optional<int64_t>(m);
      // torch 1.13 has no bfloat16 eye; kiln does, and must equal float32's converted.
      const std::string args = std::to_string(n) + (mm ? ", " + std::to_string(m) : "");
      const std::string torch = dt == kBFloat16 ? "torch.eye(" + args + ").to(torch.bfloat16)"
                                                : "torch.eye(" + args + ", dtype=" + td(dt) + ")";
      out.push_back(make("n=" + std::to_string(n) + (mm ? " m=" + std::to_string(m) : ""), {},
                         [=](const std::vector<Tensor>&) { return std::vector<Tensor>{eye(n, mm, dt)}; }, torch));
    }
    return out;
  };
  s.errors = [] {
    return std::vector<OpErrorCase>{
        {"negative n", [] { eye(-1); }, "ValueError", "n must be greater or equal to 0, got -1"},
        {"negative m", [] { eye(2, -3); }, "ValueError", "m must be greater or equal to 0, got -3"},
    };
  };
  return s;
}

// ---- arange / linspace ----

OpSpec arange_spec() {
  OpSpec s;
  s.name = "arange";
  s.dtypes = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8};
  s.samples = [](DType dt) {
    struct R { Scalar start, end, step; };
    std::vector<R> ranges = {{0, 10, 3}, {5, 0, -2}, {0.5, 3.2, 1}, {-1.5, 2, 1}, {0, 0, 1}, {2.5, 9.75, 2.25}};
    if (is_floating_point(dt)) {
      ranges.push_back({0, 1, 0.1});
      ranges.push_back({-1, 1, 0.25});
      ranges.push_back({10, 0, -1.5});
      ranges.push_back({-3, 50, 0.7});
    } else {
      ranges.push_back({-5, 5, 3});
      ranges.push_back({1, 40, 7});
    }
    std::vector<OpSample> out;
    for (const R& r : ranges) {
      const std::string args = py_scalar(r.start) + ", " + py_scalar(r.end) + ", " + py_scalar(r.step);
      out.push_back(make(args, {},
                         [=](const std::vector<Tensor>&) { return std::vector<Tensor>{arange(r.start, r.end, r.step, dt)}; },
                         "torch.arange(" + args + ", dtype=" + td(dt) + ")"));
    }
    out.push_back(make("end only 4.5", {}, [=](const std::vector<Tensor>&) { return std::vector<Tensor>{arange(4.5, dt)}; },
                       "torch.arange(4.5, dtype=" + td(dt) + ")"));
    if (dt == kInt64) {
      out.push_back(make("inferred int64", {}, [](const std::vector<Tensor>&) { return std::vector<Tensor>{arange(5)}; },
                         "torch.arange(5)"));
      out.push_back(make("inferred int64 range", {},
                         [](const std::vector<Tensor>&) { return std::vector<Tensor>{arange(-7, 8, 4)}; },
                         "torch.arange(-7, 8, 4)"));
    }
    if (dt == default_dtype()) {
      out.push_back(make("inferred float", {},
                         [](const std::vector<Tensor>&) { return std::vector<Tensor>{arange(0, 1, 0.25)}; },
                         "torch.arange(0, 1, 0.25)"));
    }
    return out;
  };
  s.errors = [] {
    return std::vector<OpErrorCase>{
        {"zero step", [] { arange(0, 3, 0); }, "ValueError", "step must be nonzero"},
        {"step truncates to zero", [] { arange(0.5, 3.2, 0.7, kInt32); }, "ValueError", "step must be nonzero"},
        {"wrong sign", [] { arange(0, -3, 1); }, "ValueError", "upper bound and larger bound inconsistent"},
        {"bool", [] { arange(0, 3, 1, kBool); }, "DTypeError", "bool"},
        {"infinite", [] { arange(0.0, std::numeric_limits<double>::infinity(), 1.0); }, "ValueError",
         "unsupported range"},
        {"nan into int64", [] { arange(0.0, std::nan(""), 1.0, kInt64); }, "ValueError", "arange: value nan"},
    };
  };
  return s;
}

OpSpec linspace_spec() {
  OpSpec s;
  s.name = "linspace";
  s.dtypes = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8};
  s.samples = [](DType dt) {
    struct L { Scalar start, end; int64_t steps; };
    // Integer results of more than 4 elements only where the step is exact: torch's AVX2 kernel
    // truncates each vector's base before adding j * step, so inexact steps differ by 1 between
    // its vector and scalar paths. kiln follows the scalar path (Note [arange and linspace ...]).
    std::vector<L> cases = {{0, 1, 5}, {0, 10, 4}, {10, 0, 4}, {2, 2, 1}, {0, 1, 0}, {3, 5, 2}, {0, 100, 11}, {0, 90, 7}};
    if (dt == kUInt8) {
      cases.push_back({-1, 1, 3});  // -1 wraps to 255 first, as torch
    } else {
      cases.push_back({-3.7, 4.2, 7});
      cases.push_back({-1, 1, 5});
    }
    if (is_floating_point(dt)) {
      cases.push_back({-1, 1, 100});
      cases.push_back({0.1, 0.7, 13});
    }
    std::vector<OpSample> out;
    for (const L& c : cases) {
      const std::string args = py_scalar(c.start) + ", " + py_scalar(c.end) + ", " + std::to_string(c.steps);
      out.push_back(make(args, {},
                         [=](const std::vector<Tensor>&) { return std::vector<Tensor>{linspace(c.start, c.end, c.steps, dt)}; },
                         "torch.linspace(" + args + ", dtype=" + td(dt) + ")"));
    }
    if (dt == default_dtype()) {
      out.push_back(make("default dtype", {},
                         [](const std::vector<Tensor>&) { return std::vector<Tensor>{linspace(0, 6, 4)}; },
                         "torch.linspace(0, 6, 4)"));
    }
    return out;
  };
  s.errors = [] {
    return std::vector<OpErrorCase>{
        {"negative steps", [] { linspace(0, 1, -1); }, "ValueError", "number of steps must be non-negative"},
        {"bool", [] { linspace(0, 1, 3, kBool); }, "DTypeError", "bool"},
        {"start overflows uint8", [] { linspace(300, 1, 3, kUInt8); }, "ValueError", "cannot be converted"},
    };
  };
  return s;
}

// ---- *_like ----

OpSpec like_spec(const std::string& name) {
  OpSpec s;
  s.name = name;
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [name](DType dt) {
    auto call = [name](const Tensor& x, std::optional<TensorOptions> o, DType dt) {
      if (name == "zeros_like") return zeros_like(x, o);
      if (name == "ones_like") return ones_like(x, o);
      return full_like(x, fill_value(o ? o->dtype_or_default() : dt), o);
    };
    auto torch_call = [name](DType value_dt, const std::string& extra) {
      const std::string v = name == "full_like" ? ", " + py_scalar(fill_value(value_dt)) : "";
      return "torch." + name + "(x0" + v + extra + ")";
    };
    std::vector<OpSample> out;
    const std::vector<std::pair<std::string, Tensor>> inputs = {
        {"contiguous", sample_tensor({2, 3}, dt, 1)},
        {"noncontig", sample_noncontig({3, 4}, dt, 2)},
        {"0-dim", sample_tensor({}, dt, 3)},
        {"empty", sample_tensor({0, 2}, dt, 4)}};
    for (const auto& [label, x] : inputs) {
      out.push_back(make(label, {x}, [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{call(in[0], std::nullopt, dt)}; },
                         torch_call(dt, "")));
    }
    const DType other = dt == kFloat64 ? kInt32 : kFloat64;
    out.push_back(make("dtype=" + std::string(dtype_name(other)), {sample_tensor({2, 2}, dt, 5)},
                       [=](const std::vector<Tensor>& in) {
                         return std::vector<Tensor>{call(in[0], TensorOptions(other), dt)};
                       },
                       torch_call(other, ", dtype=" + td(other))));
    return out;
  };
  s.errors = no_errors;
  return s;
}

// ---- to(dtype): the conversion matrix ----

// Values that probe a conversion from `src` to `dst`: rounding ties, subnormals,
// overflow to inf, NaN and inf, truncation toward zero, wrapping. Only values
// whose conversion C++ defines (and PyTorch therefore agrees on) are used:
// no NaN/inf/out-of-range floats into integers, no negative floats into uint8.
Tensor conversion_input(DType src, DType dst) {
  if (src == kBool) return tensor<bool>({true, false, true, false});
  std::vector<double> v;
  if (is_floating_point(src)) {
    if (dst == kUInt8) {
      v = {0, 0.5, 0.99, 1.5, 2.5, 3.999, 100.25, 200.75, 254.9, -0.0};
    } else if (is_integral(dst)) {
      v = {0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.7, -0.7, 3.999, -3.999, 100.25, -100.75, 30000.5, -30000.5};
    } else {
      const double inf = std::numeric_limits<double>::infinity();
      v = {0, -0.0, 0.1, -2.5, 1.0 / 3, 100.25, std::nan(""), inf, -inf, 1e-3, 3e-5, -6e-8,
           // bfloat16 ties (1 + 2^-8 lies halfway between 1 and 1 + 2^-7) and near-ties
           1 + std::ldexp(1, -8), 1 + 3 * std::ldexp(1, -8), 1 + std::ldexp(1, -8) + std::ldexp(1, -20),
           -(1 + std::ldexp(1, -8)),
           // float16 ties, subnormals and the overflow threshold (65520 rounds to inf)
           1 + std::ldexp(1, -11), 1 + 3 * std::ldexp(1, -11), std::ldexp(1, -24), std::ldexp(1, -25),
           3 * std::ldexp(1, -25), std::ldexp(1, -26), std::ldexp(1.5, -20), 65504, 65519.99, 65520, -65520, 1e5};
      if (src == kFloat32 || src == kFloat64) {
        v.push_back(3.4e38);                  // rounds to inf in bfloat16 only when above its max
        v.push_back(1e-40);                   // a float32 subnormal
        v.push_back(std::ldexp(1.0, -133));   // bfloat16 subnormal range
      }
      if (src == kFloat64) {
        v.push_back(1e300);                   // inf in every narrower type
        v.push_back(1 + std::ldexp(1, -24));  // a float32 tie from float64
        v.push_back(1e-320);
      }
    }
    return tensor<double>(v).to(src);
  }
  // Integer sources: values the source can hold; wrapping into narrower integers is defined (C++20).
  std::vector<int64_t> iv = {0, 1, 7, 127, 128, 200, 255};
  if (src != kUInt8) {
    const std::vector<int64_t> more = {-1, -7, -128, 256, 300, 2049, 65504, 65519, 65520, 70000, 16777217,
                                       std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
    iv.insert(iv.end(), more.begin(), more.end());
  }
  if (src == kInt64) {
    const std::vector<int64_t> more = {(int64_t{1} << 40) + 5, (int64_t{1} << 53) + 1, -(int64_t{1} << 62),
                                       std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
    iv.insert(iv.end(), more.begin(), more.end());
  }
  return tensor<int64_t>(iv).to(src);
}

OpSpec to_spec() {
  OpSpec s;
  s.name = "to";
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.tolerance = [](DType) { return Tolerance{0.0, 0.0}; };  // conversions are exact
  s.samples = [](DType src) {
    std::vector<OpSample> out;
    for (DType dst : kAll) {
      out.push_back(make("to " + std::string(dtype_name(dst)), {conversion_input(src, dst)},
                         [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].to(dst)}; },
                         "x0.to(" + td(dst) + ")"));
    }
    const DType dst = src == kFloat32 ? kFloat64 : kFloat32;
    out.push_back(make("noncontig to " + std::string(dtype_name(dst)), {sample_noncontig({3, 4}, src, 7)},
                       [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].to(dst)}; },
                       "x0.to(" + td(dst) + ")"));
    out.push_back(make("expanded to " + std::string(dtype_name(dst)), {sample_tensor({3, 1}, src, 8).expand({3, 4})},
                       [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].to(dst)}; },
                       "x0.to(" + td(dst) + ")"));
    out.push_back(make("same dtype copy=true", {sample_tensor({2, 3}, src, 9)},
                       [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].to(src, true)}; },
                       "x0.to(" + td(src) + ", copy=True)"));
    out.push_back(make("0-dim", {sample_tensor({}, src, 10)},
                       [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].to(dst)}; },
                       "x0.to(" + td(dst) + ")"));
    return out;
  };
  s.errors = [] {
    return std::vector<OpErrorCase>{
        {"undefined", [] { Tensor().to(kFloat32); }, "ValueError", "undefined tensor"}};
  };
  return s;
}

// ---- clone / contiguous / copy_ / fill_ / zero_ ----

OpSpec unary_copy_spec(const std::string& name) {
  OpSpec s;
  s.name = name;
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [name](DType dt) {
    auto f = [name](const Tensor& x) { return name == "clone" ? x.clone() : x.contiguous(); };
    std::vector<OpSample> out;
    const std::vector<std::pair<std::string, Tensor>> inputs = {
        {"contiguous", sample_tensor({2, 3}, dt, 11)},
        {"noncontig", sample_noncontig({4, 3}, dt, 12)},
        {"expanded", sample_tensor({1, 3}, dt, 13).expand({4, 3})},
        {"sliced", sample_tensor({6, 5}, dt, 14).slice(0, 1, 5, 2).slice(1, 1, std::nullopt)},
        {"0-dim", sample_tensor({}, dt, 15)},
        {"empty", sample_tensor({2, 0}, dt, 16)}};
    for (const auto& [label, x] : inputs) {
      out.push_back(make(label, {x}, [=](const std::vector<Tensor>& in) { return std::vector<Tensor>{f(in[0])}; },
                         "x0." + name + "()"));
    }
    return out;
  };
  s.errors = no_errors;
  return s;
}

OpSpec copy_spec() {
  OpSpec s;
  s.name = "copy_";
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  auto run = [](const std::vector<Tensor>& in) {
    Tensor dst = in[0];
    dst.copy_(in[1]);
    return std::vector<Tensor>{dst};
  };
  s.samples = [run](DType dt) {
    // Sources whose values convert to dt without undefined behaviour (non-negative for uint8).
    auto src = [dt](IntArrayRef shape, DType sdt, uint64_t seed) {
      return dt == kUInt8 && is_floating_point(sdt) ? sample_positive(shape, sdt, seed, 0.0, 200.0)
                                                    : sample_tensor(shape, sdt, seed);
    };
    const DType other = dt == kFloat32 ? kInt64 : kFloat32;
    return std::vector<OpSample>{
        make("same dtype", {sample_tensor({2, 3}, dt, 21), src({2, 3}, dt, 22)}, run, "x0.copy_(x1)"),
        make("from " + std::string(dtype_name(other)), {sample_tensor({2, 3}, dt, 23), src({2, 3}, other, 24)}, run,
             "x0.copy_(x1)"),
        make("broadcast row", {sample_tensor({3, 4}, dt, 25), src({4}, other, 26)}, run, "x0.copy_(x1)"),
        make("broadcast column", {sample_tensor({3, 4}, dt, 27), src({3, 1}, dt, 28)}, run, "x0.copy_(x1)"),
        make("noncontig dst and src", {sample_noncontig({3, 4}, dt, 29), src({4, 3}, other, 30).t()}, run,
             "x0.copy_(x1)"),
        make("0-dim into 2-D", {sample_tensor({2, 2}, dt, 31), src({}, dt, 32)}, run, "x0.copy_(x1)"),
        make("empty", {sample_tensor({0, 3}, dt, 33), src({0, 3}, other, 34)}, run, "x0.copy_(x1)"),
    };
  };
  s.errors = [] {
    return std::vector<OpErrorCase>{
        {"not broadcastable", [] { zeros({2, 3}).copy_(zeros({4})); }, "ShapeError", "copy_"},
        {"source larger than destination", [] { zeros({3}).copy_(zeros({2, 3})); }, "ShapeError",
         "cannot be broadcast to the destination's shape [3]"},
        {"expanded destination", [] { zeros({3, 1}).expand({3, 4}).copy_(ones({3, 4})); }, "ValueError",
         "share one memory location"},
    };
  };
  return s;
}

OpSpec fill_spec(const std::string& name) {
  OpSpec s;
  s.name = name;
  s.dtypes.assign(std::begin(kAll), std::end(kAll));
  s.samples = [name](DType dt) {
    const Scalar v = fill_value(dt);
    const bool zero = name == "zero_";
    auto run = [=](const std::vector<Tensor>& in) {
      Tensor x = in[0];
      if (zero) x.zero_();
      else x.fill_(v);
      return std::vector<Tensor>{x};
    };
    const std::string torch = zero ? "x0.zero_()" : "x0.fill_(" + py_scalar(v) + ")";
    return std::vector<OpSample>{
        make("contiguous", {sample_tensor({2, 3}, dt, 41)}, run, torch),
        make("noncontig", {sample_noncontig({3, 4}, dt, 42)}, run, torch),
        make("0-dim", {sample_tensor({}, dt, 43)}, run, torch),
        make("empty", {sample_tensor({0}, dt, 44)}, run, torch),
    };
  };
  if (name == "fill_") {
    s.errors = [] {
      return std::vector<OpErrorCase>{
          {"uint8 overflow", [] { zeros({2}, kUInt8).fill_(256); }, "ValueError", "fill_: value 256"},
          {"int32 from inf", [] { zeros({2}, kInt32).fill_(std::numeric_limits<double>::infinity()); }, "ValueError",
           "dtype int32"},
      };
    };
  } else {
    s.errors = no_errors;
  }
  return s;
}

}  // namespace

void register_factory_ops(std::vector<OpSpec>& r) {
  r.push_back(shape_factory("zeros", [](IntArrayRef s, DType dt) { return zeros(s, dt); }));
  r.push_back(shape_factory("ones", [](IntArrayRef s, DType dt) { return ones(s, dt); }));
  r.push_back(full_spec());
  r.push_back(scalar_tensor_spec());
  r.push_back(eye_spec());
  r.push_back(arange_spec());
  r.push_back(linspace_spec());
  r.push_back(like_spec("zeros_like"));
  r.push_back(like_spec("ones_like"));
  r.push_back(like_spec("full_like"));
  r.push_back(to_spec());
  r.push_back(unary_copy_spec("clone"));
  r.push_back(unary_copy_spec("contiguous"));
  r.push_back(copy_spec());
  r.push_back(fill_spec("fill_"));
  r.push_back(fill_spec("zero_"));
}

}  // namespace kiln::ops
