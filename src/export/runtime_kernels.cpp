// The built-in kernels of exporter::Session: each ONNX operator (opsets 13 to
// 18, the semantics of docs/Operators.md of onnx 1.12 and 1.13) written with kiln's
// ops. Attributes are read and checked when the node is compiled; shapes and
// values of non-constant inputs only when it runs.
#include "runtime_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kiln/core/error.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/einsum.h"
#include "kiln/ops/elementwise.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/layer_norm.h"
#include "kiln/ops/linalg.h"
#include "kiln/ops/reduce.h"
#include "qdq.h"

namespace kiln::exporter {

std::string detail::node_label(const Node& node) { return "node '" + node.name + "' (" + node.op_type + ")"; }

namespace {

using detail::node_label;
using Tensors = std::vector<Tensor>;

// Wraps a kernel so that any error it throws names its node and op.
Kernel labelled(const Node& node, Kernel k) {
  return [label = node_label(node), k = std::move(k)](const Tensors& in) -> Tensors {
    try {
      return k(in);
    } catch (const Error& e) {
      throw ValueError("runtime: " + label + ": " + e.what());
    }
  };
}

const Tensor& input(const Node& node, const Tensors& in, size_t i) {
  KILN_CHECK(i < in.size() && in[i].defined(), ValueError, "expected input ", i, " of ", node.op_type, ", got ",
             i < in.size() ? "an omitted one" : std::to_string(in.size()) + " inputs");
  return in[i];
}
bool has(const Tensors& in, size_t i) { return i < in.size() && in[i].defined(); }

// The int64 values of a 1-D (or scalar) integer tensor: shapes, axes, starts.
std::vector<int64_t> int_values(const Tensor& t, const char* what) {
  KILN_CHECK(t.dtype() == kInt64 || t.dtype() == kInt32, DTypeError, "expected an int64 ", what, " tensor, got ",
             dtype_name(t.dtype()));
  KILN_CHECK(t.dim() <= 1, ShapeError, "expected a 1-D ", what, " tensor, got shape ", t.shape_string());
  const Tensor c = t.to(kInt64).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

int64_t norm_axis(int64_t axis, int64_t rank, const char* what) {
  KILN_CHECK(axis >= -rank && axis < std::max<int64_t>(rank, 1), ValueError, what, " ", axis,
             " is out of range for rank ", rank);
  return axis < 0 ? axis + rank : axis;
}

std::vector<int64_t> sizes_of(const Tensor& t) { return std::vector<int64_t>(t.sizes().begin(), t.sizes().end()); }

std::vector<int64_t> broadcast_sizes(std::vector<int64_t> a, std::vector<int64_t> b) {
  if (a.size() < b.size()) std::swap(a, b);
  const size_t off = a.size() - b.size();
  for (size_t i = 0; i < b.size(); ++i) {
    int64_t& x = a[off + i];
    const int64_t y = b[i];
    KILN_CHECK(x == y || x == 1 || y == 1, ShapeError, "cannot broadcast dims ", x, " and ", y);
    if (x == 1) x = y;
  }
  return a;
}

// ---------------------------------------------------------------- elementwise

KernelFactory unary(Tensor (*f)(const Tensor&)) {
  return [f](const Node& node, const Graph&) -> Kernel {
    return [f, node](const Tensors& in) -> Tensors { return {f(input(node, in, 0))}; };
  };
}

template <typename F>
KernelFactory unary_fn(F f) {
  return [f](const Node& node, const Graph&) -> Kernel {
    return [f, node](const Tensors& in) -> Tensors { return {f(input(node, in, 0))}; };
  };
}

// erf has no kiln op: an elementwise loop (std::erf) over a contiguous copy.
Tensor erf(const Tensor& x) {
  KILN_CHECK(x.dtype() == kFloat32 || x.dtype() == kFloat64, DTypeError, "Erf expects float32 or float64 input, got ",
             dtype_name(x.dtype()));
  Tensor y = x.contiguous().clone();
  const int64_t n = y.numel();
  if (y.dtype() == kFloat32) {
    float* p = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = std::erf(p[i]);
  } else {
    double* p = y.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) p[i] = std::erf(p[i]);
  }
  return y;
}

enum class Bin { Add, Sub, Mul, Div, Pow, Equal, Less, Greater, LessEq, GreaterEq, Max, Min };

Tensor binary_op(Bin op, const Tensor& a, const Tensor& b) {
  switch (op) {
    case Bin::Add: return a.add(b);
    case Bin::Sub: return a.sub(b);
    case Bin::Mul: return a.mul(b);
    case Bin::Div:
      if (!a.is_floating_point() && !b.is_floating_point())  // integer division truncates, as C
        return a.to(kFloat64).div(b.to(kFloat64)).to(a.dtype());
      return a.div(b);
    case Bin::Pow: return a.pow(b).to(a.dtype());  // ONNX: the base's type
    case Bin::Equal: return a.eq(b);
    case Bin::Less: return a.lt(b);
    case Bin::Greater: return a.gt(b);
    case Bin::LessEq: return a.le(b);
    case Bin::GreaterEq: return a.ge(b);
    case Bin::Max: return a.maximum(b);
    case Bin::Min: return a.minimum(b);
  }
  return {};
}

KernelFactory binary(Bin op) {
  return [op](const Node& node, const Graph&) -> Kernel {
    return [op, node](const Tensors& in) -> Tensors {
      const Tensor& a = input(node, in, 0);
      const Tensor& b = input(node, in, 1);
      if (op != Bin::Pow)
        KILN_CHECK(a.dtype() == b.dtype(), DTypeError, "expected inputs of one dtype, got ", dtype_name(a.dtype()),
                   " and ", dtype_name(b.dtype()));
      broadcast_sizes(sizes_of(a), sizes_of(b));  // names the dims when they do not broadcast
      return {binary_op(op, a, b)};
    };
  };
}

// Max, Min, Sum, Mean: any number of inputs, broadcast together.
KernelFactory variadic(const std::string& op) {
  return [op](const Node& node, const Graph&) -> Kernel {
    return [op, node](const Tensors& in) -> Tensors {
      Tensor acc = input(node, in, 0);
      for (size_t i = 1; i < in.size(); ++i) {
        const Tensor& x = input(node, in, i);
        if (op == "Max") acc = acc.maximum(x);
        if (op == "Min") acc = acc.minimum(x);
        if (op == "Sum" || op == "Mean") acc = acc.add(x);
      }
      if (op == "Mean") acc = acc.div(static_cast<double>(in.size()));
      if (in.size() == 1) acc = acc.clone();
      return {acc};
    };
  };
}

Kernel where(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& c = input(node, in, 0);
    KILN_CHECK(c.dtype() == kBool, DTypeError, "expected a bool condition, got ", dtype_name(c.dtype()));
    return {kiln::where(c, input(node, in, 1), input(node, in, 2))};
  };
}

Kernel clip(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    std::optional<Scalar> lo, hi;
    if (has(in, 1)) lo = in[1].item_scalar();
    if (has(in, 2)) hi = in[2].item_scalar();
    if (!lo && !hi) return {x.clone()};
    return {x.clamp(lo, hi)};
  };
}

Kernel leaky_relu(const Node& node, const Graph&) {
  const double alpha = attr_float(node, "alpha", 0.01f);
  return [node, alpha](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    return {kiln::where(x.ge(0), x, x.mul(alpha))};
  };
}

std::optional<DType> kiln_dtype_of_onnx(int64_t t) {
  // onnx::TensorProto::DataType values.
  switch (t) {
    case 1: return kFloat32;
    case 2: return DType::UInt8;
    case 6: return kInt32;
    case 7: return kInt64;
    case 9: return kBool;
    case 10: return kFloat16;
    case 11: return kFloat64;
    case 16: return DType::BFloat16;
    default: return std::nullopt;
  }
}

Kernel cast(const Node& node, const Graph&) {
  const int64_t to = attr_int(node, "to", -1);
  const auto dt = kiln_dtype_of_onnx(to);
  KILN_CHECK(dt.has_value(), DTypeError, node_label(node), ": casts to ONNX element type ", to,
             ", which kiln has no dtype for");
  return [node, dt](const Tensors& in) -> Tensors { return {input(node, in, 0).to(*dt, /*copy=*/true)}; };
}

// A Constant with a scalar or list attribute (load_onnx turns Constants with a
// tensor value into initializers).
Kernel constant(const Node& node, const Graph&) {
  Tensor value;
  if (node.attributes.count("value_float"))
    value = full({}, attr_float(node, "value_float", 0), TensorOptions(kFloat32));
  if (node.attributes.count("value_int")) value = full({}, attr_int(node, "value_int", 0), TensorOptions(kInt64));
  if (node.attributes.count("value_ints")) {
    const auto v = attr_ints(node, "value_ints", {});
    value = tensor(v, {static_cast<int64_t>(v.size())});
  }
  if (node.attributes.count("value_floats")) {
    const auto* vp = std::get_if<std::vector<float>>(&node.attributes.at("value_floats"));
    KILN_CHECK(vp != nullptr, ValueError, node_label(node), ": expected value_floats to be a list of floats");
    const auto& v = *vp;
    value = tensor(v, {static_cast<int64_t>(v.size())});
  }
  KILN_CHECK(value.defined(), ValueError, node_label(node),
             ": expected a value_float, value_int, value_floats or value_ints attribute");
  return [value](const Tensors&) -> Tensors { return {value}; };
}

// ---------------------------------------------------------------- padding helpers

// x padded with `value`: begin[i] / end[i] cells before / after spatial dim i (dims 2...).
Tensor pad_spatial(const Tensor& x, const std::vector<int64_t>& begin, const std::vector<int64_t>& end, double value) {
  std::vector<int64_t> sizes = sizes_of(x);
  for (size_t i = 0; i < begin.size(); ++i) sizes[2 + i] += begin[i] + end[i];
  Tensor out = full(sizes, value, TensorOptions(x.dtype()));
  Tensor region = out;
  for (size_t i = 0; i < begin.size(); ++i)
    region = region.narrow(static_cast<int64_t>(2 + i), begin[i], x.size(static_cast<int64_t>(2 + i)));
  region.copy_(x);
  return out;
}

struct Window {
  std::vector<int64_t> kernel, strides, dilations, begin, end;
};

// Kernel/stride/dilation/pads of a Conv or pool node for an input of spatial
// sizes `in` (auto_pad resolved here, where the input's size is known).
Window window(const Node& node, const std::vector<int64_t>& kernel, const std::vector<int64_t>& in) {
  const size_t n = in.size();
  Window w;
  w.kernel = kernel;
  w.strides = attr_ints(node, "strides", std::vector<int64_t>(n, 1));
  w.dilations = attr_ints(node, "dilations", std::vector<int64_t>(n, 1));
  const auto pads = attr_ints(node, "pads", std::vector<int64_t>(2 * n, 0));
  KILN_CHECK(w.kernel.size() == n && w.strides.size() == n && w.dilations.size() == n && pads.size() == 2 * n,
             ValueError, "expected kernel_shape, strides and dilations of ", n, " values and pads of ", 2 * n,
             " for an input with ", n, " spatial dims");
  const std::string auto_pad = attr_string(node, "auto_pad", "NOTSET");
  w.begin.assign(pads.begin(), pads.begin() + static_cast<std::ptrdiff_t>(n));
  w.end.assign(pads.begin() + static_cast<std::ptrdiff_t>(n), pads.end());
  for (size_t i = 0; i < n; ++i) {
    KILN_CHECK(w.strides[i] > 0 && w.dilations[i] > 0 && w.kernel[i] > 0, ValueError,
               "expected positive kernel_shape, strides and dilations");
    if (auto_pad == "VALID") {
      w.begin[i] = w.end[i] = 0;
    } else if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") {
      const int64_t out = (in[i] + w.strides[i] - 1) / w.strides[i];
      const int64_t total =
          std::max<int64_t>(0, (out - 1) * w.strides[i] + (w.kernel[i] - 1) * w.dilations[i] + 1 - in[i]);
      w.begin[i] = auto_pad == "SAME_UPPER" ? total / 2 : total - total / 2;
      w.end[i] = total - w.begin[i];
    } else {
      KILN_CHECK(auto_pad == "NOTSET", ValueError, "expected auto_pad NOTSET, SAME_UPPER, SAME_LOWER or VALID, got ",
                 auto_pad);
    }
  }
  return w;
}

bool symmetric(const Window& w) { return w.begin == w.end; }

// 1-D inputs run as 2-D with a height of 1.
void lift_1d(Tensor& x, std::vector<int64_t>& k, Window& w) {
  x = x.unsqueeze(2);
  k.insert(k.begin(), 1);
  w.kernel.insert(w.kernel.begin(), 1);
  w.strides.insert(w.strides.begin(), 1);
  w.dilations.insert(w.dilations.begin(), 1);
  w.begin.insert(w.begin.begin(), 0);
  w.end.insert(w.end.begin(), 0);
}

std::vector<int64_t> spatial(const Tensor& x) { return std::vector<int64_t>(x.sizes().begin() + 2, x.sizes().end()); }

// ---------------------------------------------------------------- conv, gemm, matmul

Kernel conv(const Node& node, const Graph&) {
  const auto group = attr_int(node, "group", 1);
  const auto kshape = attr_ints(node, "kernel_shape", {});
  return [node, group, kshape](const Tensors& in) -> Tensors {
    Tensor x = input(node, in, 0);
    const Tensor& wt = input(node, in, 1);
    const Tensor b = has(in, 2) ? in[2] : Tensor();
    KILN_CHECK(x.dim() == 3 || x.dim() == 4, ShapeError,
               "kiln runs 1-D and 2-D convolutions (inputs [N, C, L] or [N, C, H, W]), got ", x.shape_string());
    KILN_CHECK(wt.dim() == x.dim(), ShapeError, "expected a weight of rank ", x.dim(), ", got ", wt.shape_string());
    std::vector<int64_t> k = kshape.empty() ? std::vector<int64_t>(wt.sizes().begin() + 2, wt.sizes().end()) : kshape;
    Window w = window(node, k, spatial(x));
    Tensor weight = wt;
    const bool one_d = x.dim() == 3;
    if (one_d) {
      lift_1d(x, k, w);
      weight = weight.unsqueeze(2);
    }
    std::vector<int64_t> pad(2, 0);
    if (symmetric(w)) {
      pad = w.begin;
    } else {
      x = pad_spatial(x, w.begin, w.end, 0.0);
    }
    Tensor y = conv2d(x, weight, b, w.strides, pad, w.dilations, group);
    if (one_d) y = y.squeeze(2);
    return {y};
  };
}

Kernel gemm(const Node& node, const Graph&) {
  const double alpha = attr_float(node, "alpha", 1.0f), beta = attr_float(node, "beta", 1.0f);
  const bool ta = attr_int(node, "transA", 0) != 0, tb = attr_int(node, "transB", 0) != 0;
  return [node, alpha, beta, ta, tb](const Tensors& in) -> Tensors {
    const Tensor& a = input(node, in, 0);
    const Tensor& b = input(node, in, 1);
    KILN_CHECK(a.dim() == 2 && b.dim() == 2, ShapeError, "expected 2-D A and B, got ", a.shape_string(), " and ",
               b.shape_string());
    const bool c = has(in, 2);
    // The common case (a Linear layer) is kiln's linear: one fused matmul + bias.
    if (!ta && tb && alpha == 1.0 && beta == 1.0 && (!c || in[2].dim() == 1) && a.is_floating_point())
      return {linear(a, b, c ? in[2] : Tensor())};
    Tensor y = (ta ? a.t() : a).mm(tb ? b.t() : b);
    if (alpha != 1.0) y = y.mul(alpha);
    if (c) y = y.add(beta == 1.0 ? in[2] : in[2].mul(beta));
    return {y};
  };
}

Kernel matmul(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors { return {input(node, in, 0).matmul(input(node, in, 1))}; };
}

// ---------------------------------------------------------------- normalisation

Kernel softmax(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", -1);
  const bool log = node.op_type == "LogSoftmax";
  return [node, axis, log](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    return {log ? x.log_softmax(a) : x.softmax(a)};
  };
}

Kernel layer_normalization(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", -1);
  const double eps = attr_float(node, "epsilon", 1e-5f);
  size_t wanted = 0;
  for (size_t i = 0; i < node.outputs.size(); ++i)
    if (!node.outputs[i].empty()) wanted = i + 1;
  return [node, axis, eps, wanted](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const Tensor& scale = input(node, in, 1);
    const Tensor b = has(in, 2) ? in[2] : Tensor();
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    const std::vector<int64_t> norm_shape(x.sizes().begin() + a, x.sizes().end());
    const bool fits = sizes_of(scale) == norm_shape && (!b.defined() || sizes_of(b) == norm_shape);
    if (wanted <= 1 && fits) return {ops::layer_norm(x, norm_shape, scale, b, eps)};
    std::vector<int64_t> dims;
    for (int64_t d = a; d < x.dim(); ++d) dims.push_back(d);
    const Tensor mean = x.mean(dims, true);
    const Tensor centred = x.sub(mean);
    const Tensor inv_std = centred.mul(centred).mean(dims, true).add(eps).rsqrt();
    Tensor y = centred.mul(inv_std).mul(scale);
    if (b.defined()) y = y.add(b);
    Tensors out{y};
    if (wanted > 1) out.push_back(mean);
    if (wanted > 2) out.push_back(inv_std);
    return out;
  };
}

// Inference form y = (x - mean) / sqrt(var + eps) * scale + B; with
// training_mode = 1 the batch's statistics, and the updated running ones.
Kernel batch_normalization(const Node& node, const Graph&) {
  const double eps = attr_float(node, "epsilon", 1e-5f);
  const double momentum = attr_float(node, "momentum", 0.9f);
  const bool training = attr_int(node, "training_mode", 0) != 0;
  return [node, eps, momentum, training](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    KILN_CHECK(x.dim() >= 2, ShapeError, "expected an input [N, C, ...], got ", x.shape_string());
    std::vector<int64_t> bshape(static_cast<size_t>(x.dim()), 1);
    bshape[1] = x.size(1);
    auto per_channel = [&](size_t i) {
      const Tensor& t = input(node, in, i);
      KILN_CHECK(t.dim() == 1 && t.size(0) == x.size(1), ShapeError, "expected input ", i, " of shape [", x.size(1),
                 "], got ", t.shape_string());
      return t.reshape(bshape);
    };
    const Tensor scale = per_channel(1), shift = per_channel(2);
    Tensor mean = per_channel(3), var = per_channel(4);
    Tensors out;
    if (training) {
      std::vector<int64_t> dims{0};
      for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
      const Tensor bm = x.mean(dims, true);
      const Tensor bv = x.var(dims, 0, true);
      out.push_back(x.sub(bm).div(bv.add(eps).sqrt()).mul(scale).add(shift));
      out.push_back(mean.mul(momentum).add(bm.mul(1.0 - momentum)).reshape({x.size(1)}));
      out.push_back(var.mul(momentum).add(bv.mul(1.0 - momentum)).reshape({x.size(1)}));
      return out;
    }
    // One multiply-add per element: scale / sqrt(var + eps) and the shift folded per channel.
    const Tensor a = scale.div(var.add(eps).sqrt());
    const Tensor c = shift.sub(mean.mul(a));
    return {x.mul(a).add(c)};
  };
}

// ---------------------------------------------------------------- pooling

// One 2-D pooling over [N, C, H, W] with ONNX's window: kiln's own padding
// where it can (symmetric, at most half the window), else padded explicitly.
// `indices`, when given, receives MaxPool's argmax positions within each plane.
Tensor pool2d(const Tensor& x, const std::vector<int64_t>& k, const Window& w, bool max, bool ceil_mode, bool count_pad,
              Tensor* indices) {
  bool native = symmetric(w);
  for (size_t i = 0; i < 2; ++i) native = native && w.begin[i] * 2 <= (k[i] - 1) * w.dilations[i] + 1;
  if (max) {
    if (indices) {
      KILN_CHECK(native, ValueError, "MaxPool's Indices output with asymmetric or wide pads is not supported");
      auto [y, idx] = max_pool2d_with_indices(x, k, w.strides, w.begin, w.dilations, ceil_mode);
      *indices = idx;
      return y;
    }
    if (native) return max_pool2d(x, k, w.strides, w.begin, w.dilations, ceil_mode);
    const Tensor xp = pad_spatial(x, w.begin, w.end, -std::numeric_limits<double>::infinity());
    return max_pool2d(xp, k, w.strides, std::vector<int64_t>{0, 0}, w.dilations, ceil_mode);
  }
  KILN_CHECK(w.dilations == std::vector<int64_t>(2, 1), ValueError, "AveragePool with dilations is not supported");
  if (native) return avg_pool2d(x, k, w.strides, w.begin, ceil_mode, count_pad);
  // Padded explicitly: the window's sum over the cells it counts (the padding
  // too with count_include_pad) divided by how many it counts.
  const Tensor counted =
      pad_spatial(ones(sizes_of(x), TensorOptions(x.dtype())), w.begin, w.end, count_pad ? 1.0 : 0.0);
  const Tensor xp = pad_spatial(x, w.begin, w.end, 0.0);
  const std::vector<int64_t> none{0, 0};
  return avg_pool2d(xp, k, w.strides, none, ceil_mode, false)
      .div(avg_pool2d(counted, k, w.strides, none, ceil_mode, false));
}

// Window `w` restricted to spatial dims [from, from + 2).
Window sub_window(const Window& w, size_t from) {
  auto part = [from](const std::vector<int64_t>& v) { return std::vector<int64_t>{v[from], v[from + 1]}; };
  return Window{part(w.kernel), part(w.strides), part(w.dilations), part(w.begin), part(w.end)};
}

Kernel pool(const Node& node, const Graph&) {
  const bool max = node.op_type == "MaxPool";
  const auto kshape = attr_ints(node, "kernel_shape", {});
  KILN_CHECK(!kshape.empty(), ValueError, node_label(node), ": expected a kernel_shape attribute");
  const bool ceil_mode = attr_int(node, "ceil_mode", 0) != 0;
  const bool count_pad = attr_int(node, "count_include_pad", 0) != 0;
  const bool column_major = attr_int(node, "storage_order", 0) != 0;
  const bool want_indices = node.outputs.size() > 1 && !node.outputs[1].empty();
  return [node, max, kshape, ceil_mode, count_pad, column_major, want_indices](const Tensors& in) -> Tensors {
    const Tensor& x0 = input(node, in, 0);
    const int64_t r = static_cast<int64_t>(kshape.size());
    KILN_CHECK(x0.dim() == 2 + r && r >= 1 && r <= 3, ShapeError,
               "kiln runs 1-D, 2-D and 3-D pooling over inputs [N, C, ...] with a kernel_shape of the input's "
               "spatial rank, got input ",
               x0.shape_string(), " and ", r, " kernel dims");
    // Integer inputs (MaxPool takes uint8 and int8) pool in float64, which holds them exactly.
    Tensor x = x0.is_floating_point() ? x0 : x0.to(kFloat64);
    std::vector<int64_t> k = kshape;
    Window w = window(node, k, spatial(x));
    if (r == 1) lift_1d(x, k, w);
    Tensor y, idx;
    if (r <= 2) {
      y = pool2d(x, k, w, max, ceil_mode, count_pad, want_indices ? &idx : nullptr);
    } else {
      KILN_CHECK(!want_indices, ValueError, "MaxPool's Indices output is supported for 1-D and 2-D pooling");
      // A box window is separable: pool (H, W) on [N, C*D, H, W], then D on [N, C, D, H'*W'].
      const int64_t n = x.size(0), c = x.size(1), d = x.size(2);
      Tensor hw = pool2d(x.reshape({n, c * d, x.size(3), x.size(4)}), {k[1], k[2]}, sub_window(w, 1), max, ceil_mode,
                         count_pad, nullptr);
      const int64_t h2 = hw.size(2), w2 = hw.size(3);
      const Window wd{{k[0], 1}, {w.strides[0], 1}, {w.dilations[0], 1}, {w.begin[0], 0}, {w.end[0], 0}};
      y = pool2d(hw.reshape({n, c, d, h2 * w2}), {k[0], 1}, wd, max, ceil_mode, count_pad, nullptr);
      y = y.reshape({n, c, y.size(2), h2, w2});
    }
    if (r == 1) y = y.squeeze(2);
    if (!x0.is_floating_point()) y = y.to(x0.dtype());
    if (!want_indices) return {y};
    // ONNX's indices count over the whole input tensor, row-major (or, with
    // storage_order 1, column-major within each plane).
    const int64_t h = r == 1 ? 1 : x0.size(2), wd = x0.size(-1);
    Tensor plane = idx;
    if (column_major) {
      const Tensor row = idx.to(kFloat64).div(static_cast<double>(wd)).to(kInt64);  // exact: non-negative
      plane = idx.sub(row.mul(wd)).mul(h).add(row);
    }
    if (r == 1) plane = plane.squeeze(2);
    std::vector<int64_t> base_shape(static_cast<size_t>(plane.dim()), 1);
    base_shape[0] = x0.size(0);
    base_shape[1] = x0.size(1);
    const Tensor base = arange(x0.size(0) * x0.size(1), TensorOptions(kInt64)).mul(h * wd).reshape(base_shape);
    return {y, plane.add(base)};
  };
}

Kernel global_pool(const Node& node, const Graph&) {
  const bool max = node.op_type == "GlobalMaxPool";
  return [node, max](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    KILN_CHECK(x.dim() >= 3, ShapeError, "expected an input [N, C, ...], got ", x.shape_string());
    std::vector<int64_t> dims;
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    return {max ? x.amax(dims, true) : x.mean(dims, true)};
  };
}

// ---------------------------------------------------------------- reductions

Kernel reduce(const Node& node, const Graph&) {
  const auto attr_axes = attr_ints(node, "axes", {});
  const bool has_attr_axes = node.attributes.count("axes") > 0;
  const bool keep = attr_int(node, "keepdims", 1) != 0;
  const bool noop_empty = attr_int(node, "noop_with_empty_axes", 0) != 0;
  const std::string op = node.op_type;
  return [node, attr_axes, has_attr_axes, keep, noop_empty, op](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    // Axes: the attribute (ReduceMean/Max/Min to opset 17) or the second input (ReduceSum from 13).
    std::vector<int64_t> axes = has_attr_axes ? attr_axes : std::vector<int64_t>{};
    if (has(in, 1)) axes = int_values(in[1], "axes");
    if (axes.empty()) {
      if (noop_empty) return {x.clone()};
      for (int64_t d = 0; d < x.dim(); ++d) axes.push_back(d);
    }
    for (int64_t& a : axes) a = norm_axis(a, x.dim(), "axis");
    std::sort(axes.begin(), axes.end());
    KILN_CHECK(std::adjacent_find(axes.begin(), axes.end()) == axes.end(), ValueError, "axes repeat a dim");
    if (x.dim() == 0) return {x.clone()};
    if (op == "ReduceMean") return {x.mean(axes, keep)};
    if (op == "ReduceSum") return {x.sum(axes, keep)};
    if (op == "ReduceMax") return {x.amax(axes, keep)};
    if (op == "ReduceMin") return {x.amin(axes, keep)};
    if (op == "ReduceL1") return {x.abs().sum(axes, keep)};
    if (op == "ReduceL2") return {x.mul(x).sum(axes, keep).sqrt()};
    if (op == "ReduceSumSquare") return {x.mul(x).sum(axes, keep)};
    if (op == "ReduceLogSum") return {x.sum(axes, keep).log()};
    if (op == "ReduceLogSumExp") return {x.logsumexp(axes, keep)};
    // ReduceProd: one dim at a time, the highest first so the others keep their index.
    Tensor y = x;
    for (auto it = axes.rbegin(); it != axes.rend(); ++it) y = y.prod(*it, keep);
    return {y};
  };
}

// ---------------------------------------------------------------- shape ops

Kernel flatten(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", 1);
  return [node, axis](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t r = x.dim();
    KILN_CHECK(axis >= -r && axis <= r, ValueError, "axis ", axis, " is out of range for rank ", r);
    const int64_t a = axis < 0 ? axis + r : axis;
    int64_t outer = 1, inner = 1;
    for (int64_t d = 0; d < r; ++d) (d < a ? outer : inner) *= x.size(d);
    return {x.reshape({outer, inner})};
  };
}

Kernel reshape(const Node& node, const Graph&) {
  const bool allow_zero = attr_int(node, "allowzero", 0) != 0;
  return [node, allow_zero](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    std::vector<int64_t> shape = int_values(input(node, in, 1), "shape");
    int64_t infer = -1, known = 1;
    for (size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] == 0 && !allow_zero) {
        KILN_CHECK(static_cast<int64_t>(i) < x.dim(), ShapeError, "shape entry ", i, " copies a dim of ",
                   x.shape_string(), ", which has none there");
        shape[i] = x.size(static_cast<int64_t>(i));
      }
      if (shape[i] == -1) {
        KILN_CHECK(infer < 0, ShapeError, "expected at most one -1 in the shape, got two");
        infer = static_cast<int64_t>(i);
      } else {
        KILN_CHECK(shape[i] >= 0, ShapeError, "expected shape entries >= -1, got ", shape[i]);
        known *= shape[i];
      }
    }
    if (infer >= 0) {
      KILN_CHECK(known > 0 && x.numel() % known == 0, ShapeError, "cannot reshape ", x.shape_string(),
                 " with a -1 beside dims of product ", known);
      shape[static_cast<size_t>(infer)] = x.numel() / known;
    }
    return {x.reshape(shape)};
  };
}

Kernel transpose(const Node& node, const Graph&) {
  const auto perm_attr = attr_ints(node, "perm", {});
  return [node, perm_attr](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    std::vector<int64_t> perm = perm_attr;
    if (perm.empty())
      for (int64_t d = x.dim() - 1; d >= 0; --d) perm.push_back(d);
    KILN_CHECK(static_cast<int64_t>(perm.size()) == x.dim(), ShapeError, "perm has ", perm.size(),
               " entries for an input of rank ", x.dim());
    return {x.permute(perm)};
  };
}

Kernel gather(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", 0);
  return [node, axis](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const Tensor& idx = input(node, in, 1);
    KILN_CHECK(idx.dtype() == kInt64 || idx.dtype() == kInt32, DTypeError, "expected int64 or int32 indices, got ",
               dtype_name(idx.dtype()));
    KILN_CHECK(x.dim() >= 1, ShapeError, "expected data of rank >= 1, got a scalar");
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    const int64_t n = x.size(a);
    Tensor flat = idx.to(kInt64).reshape({-1});
    // Negative indices count from the end, as ONNX allows.
    flat = kiln::where(flat.lt(0), flat.add(n), flat);
    if (flat.numel() > 0) {
      const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
      KILN_CHECK(lo >= 0 && hi < n, IndexError, "index ", lo < 0 ? lo - n : hi, " is out of range for axis ", a,
                 " of size ", n);
    }
    std::vector<int64_t> out(x.sizes().begin(), x.sizes().begin() + a);
    for (int64_t s : idx.sizes()) out.push_back(s);
    out.insert(out.end(), x.sizes().begin() + a + 1, x.sizes().end());
    return {x.index_select(a, flat).reshape(out)};
  };
}

Kernel concat(const Node& node, const Graph&) {
  KILN_CHECK(node.attributes.count("axis"), ValueError, node_label(node), ": expected an axis attribute");
  const int64_t axis = attr_int(node, "axis", 0);
  return [node, axis](const Tensors& in) -> Tensors {
    KILN_CHECK(!in.empty(), ValueError, "expected at least one input");
    const int64_t a = norm_axis(axis, input(node, in, 0).dim(), "axis");
    return {cat(in, a)};
  };
}

Kernel expand(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const auto out = broadcast_sizes(sizes_of(x), int_values(input(node, in, 1), "shape"));
    std::vector<int64_t> lifted(out.size() - static_cast<size_t>(x.dim()), 1);
    for (int64_t s : x.sizes()) lifted.push_back(s);
    return {x.reshape(lifted).expand(out)};
  };
}

Kernel slice(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    Tensor x = input(node, in, 0);
    const auto starts = int_values(input(node, in, 1), "starts");
    const auto ends = int_values(input(node, in, 2), "ends");
    KILN_CHECK(starts.size() == ends.size(), ShapeError, "expected as many starts as ends, got ", starts.size(),
               " and ", ends.size());
    std::vector<int64_t> axes(starts.size()), steps(starts.size(), 1);
    std::iota(axes.begin(), axes.end(), 0);
    if (has(in, 3)) axes = int_values(in[3], "axes");
    if (has(in, 4)) steps = int_values(in[4], "steps");
    KILN_CHECK(axes.size() == starts.size() && steps.size() == starts.size(), ShapeError,
               "expected axes and steps with one entry per start");
    for (size_t i = 0; i < starts.size(); ++i) {
      const int64_t a = norm_axis(axes[i], x.dim(), "axis");
      const int64_t n = x.size(a), step = steps[i];
      KILN_CHECK(step != 0, ValueError, "a step of 0");
      int64_t s = starts[i], e = ends[i];
      if (s < 0) s = s < -n ? -1 : s + n;  // (guards overflow on INT64_MIN)
      if (e < 0) e = e < -n ? -1 : e + n;
      if (step > 0) {
        s = std::clamp<int64_t>(s, 0, n);
        e = std::clamp<int64_t>(e, 0, n);
        x = x.slice(a, s, std::max(s, e), step);
      } else {
        s = std::clamp<int64_t>(s, -1, n - 1);
        e = std::clamp<int64_t>(e, -1, n - 1);
        std::vector<int64_t> idx;
        for (int64_t j = s; j > e; j += step) idx.push_back(j);
        x = x.index_select(a, tensor(idx, {static_cast<int64_t>(idx.size())}));
      }
    }
    return {x};
  };
}

Kernel split(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", 0);
  const auto split_attr = attr_ints(node, "split", {});
  const auto outputs = static_cast<int64_t>(node.outputs.size());
  const int64_t num_outputs = attr_int(node, "num_outputs", outputs);
  return [node, axis, split_attr, num_outputs](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    std::vector<int64_t> sizes = has(in, 1) ? int_values(in[1], "split") : split_attr;
    if (sizes.empty()) {
      KILN_CHECK(num_outputs > 0, ValueError, "expected at least one output");
      const int64_t n = x.size(a), chunk = (n + num_outputs - 1) / num_outputs;
      for (int64_t left = n; left > 0; left -= chunk) sizes.push_back(std::min(chunk, left));
      while (static_cast<int64_t>(sizes.size()) < num_outputs) sizes.push_back(0);
    }
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    KILN_CHECK(total == x.size(a), ShapeError, "split sizes add to ", total, ", the axis has ", x.size(a));
    return x.split_with_sizes(sizes, a);
  };
}

Kernel shape(const Node& node, const Graph&) {
  const int64_t start = attr_int(node, "start", 0);
  const bool has_end = node.attributes.count("end") > 0;
  const int64_t end = attr_int(node, "end", 0);
  return [node, start, has_end, end](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t r = x.dim();
    auto clampd = [r](int64_t v) { return std::clamp<int64_t>(v < 0 ? v + r : v, 0, r); };
    const int64_t s = clampd(start), e = has_end ? clampd(end) : r;
    std::vector<int64_t> dims;
    for (int64_t d = s; d < e; ++d) dims.push_back(x.size(d));
    return {tensor(dims, {static_cast<int64_t>(dims.size())})};
  };
}

// Axes: the second input from opset 13, the attribute before.
Kernel unsqueeze(const Node& node, const Graph&) {
  const auto attr_axes = attr_ints(node, "axes", {});
  return [node, attr_axes](const Tensors& in) -> Tensors {
    Tensor x = input(node, in, 0);
    auto axes = has(in, 1) ? int_values(in[1], "axes") : attr_axes;
    const int64_t r = x.dim() + static_cast<int64_t>(axes.size());
    for (int64_t& a : axes) a = norm_axis(a, r, "axis");
    std::sort(axes.begin(), axes.end());
    for (int64_t a : axes) x = x.unsqueeze(a);
    return {x};
  };
}

Kernel squeeze(const Node& node, const Graph&) {
  const auto attr_axes = attr_ints(node, "axes", {});
  return [node, attr_axes](const Tensors& in) -> Tensors {
    Tensor x = input(node, in, 0);
    auto axes = has(in, 1) ? int_values(in[1], "axes") : attr_axes;
    if (axes.empty()) return {x.squeeze()};
    for (int64_t& a : axes) {
      a = norm_axis(a, x.dim(), "axis");
      KILN_CHECK(x.size(a) == 1, ShapeError, "cannot squeeze axis ", a, " of size ", x.size(a));
    }
    std::sort(axes.rbegin(), axes.rend());
    for (int64_t a : axes) x = x.squeeze(a);
    return {x};
  };
}

Kernel identity(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors { return {input(node, in, 0)}; };
}

// Inference Dropout: the identity (and an all-true mask). Training-mode
// dropout is random, which a deterministic runtime does not reproduce.
Kernel dropout(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    if (has(in, 2)) {
      const bool training = in[2].item<bool>();
      const double ratio = has(in, 1) ? in[1].item<double>() : 0.5;
      KILN_CHECK(!training || ratio == 0.0, ValueError, "training-mode Dropout (ratio ", ratio,
                 ") is random; the runtime runs inference graphs");
    }
    return {x, ones(sizes_of(x), TensorOptions(kBool))};
  };
}

// ---------------------------------------------------------------- more elementwise

// An elementwise function without a kiln op, looped over a contiguous copy.
template <typename F>
Tensor map_float(const Tensor& x, const char* what, F f) {
  KILN_CHECK(x.dtype() == kFloat32 || x.dtype() == kFloat64, DTypeError, what,
             " expects float32 or float64 input, got ", dtype_name(x.dtype()));
  Tensor y = x.contiguous().clone();
  const int64_t n = y.numel();
  if (y.dtype() == kFloat32) {
    float* p = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(f(static_cast<double>(p[i])));
  } else {
    double* p = y.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) p[i] = f(p[i]);
  }
  return y;
}

// Activations with attributes (alpha, beta, gamma at their ONNX defaults).
Kernel activation(const Node& node, const Graph&) {
  const std::string op = node.op_type;
  const double alpha = attr_float(node, "alpha",
                                  op == "Selu"          ? 1.67326319217681884765625f
                                  : op == "HardSigmoid" ? 0.2f
                                  : op == "HardSwish"   ? 1.0f / 6.0f
                                                        : 1.0f);
  const double beta = attr_float(node, "beta", 0.5f);
  const double gamma = attr_float(node, "gamma", 1.05070102214813232421875f);
  return [node, op, alpha, beta, gamma](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const Tensor pos = x.gt(0);
    if (op == "Elu") return {kiln::where(pos, x, x.exp().sub(1).mul(alpha))};
    if (op == "Selu") return {kiln::where(pos, x, x.exp().sub(1).mul(alpha)).mul(gamma)};
    if (op == "Celu") return {x.clamp(0.0).add(x.div(alpha).exp().sub(1).mul(alpha).clamp(std::nullopt, 0.0))};
    if (op == "HardSigmoid") return {x.mul(alpha).add(beta).clamp(0.0, 1.0)};
    if (op == "HardSwish") return {x.mul(x.mul(1.0 / 6.0).add(0.5).clamp(0.0, 1.0))};
    if (op == "ThresholdedRelu") return {kiln::where(x.gt(alpha), x, zeros_like(x))};
    if (op == "Softsign") return {x.div(x.abs().add(1))};
    // softplus(x) = log(1 + e^x), as x itself where e^x would overflow.
    const Tensor softplus = kiln::where(x.gt(20), x, x.exp().log1p());
    if (op == "Softplus") return {softplus};
    return {x.mul(softplus.tanh())};  // Mish
  };
}

Kernel prelu(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const Tensor& slope = input(node, in, 1);
    broadcast_sizes(sizes_of(x), sizes_of(slope));
    return {kiln::where(x.lt(0), x.mul(slope), x)};
  };
}

Kernel logical(const Node& node, const Graph&) {
  const std::string op = node.op_type;
  return [node, op](const Tensors& in) -> Tensors {
    const Tensor& a = input(node, in, 0);
    const Tensor& b = input(node, in, 1);
    KILN_CHECK(a.dtype() == kBool && b.dtype() == kBool, DTypeError, "expected bool inputs, got ",
               dtype_name(a.dtype()), " and ", dtype_name(b.dtype()));
    if (op == "And") return {a.logical_and(b)};
    if (op == "Or") return {a.logical_or(b)};
    return {a.logical_xor(b)};
  };
}

Kernel is_inf(const Node& node, const Graph&) {
  const bool pos = attr_int(node, "detect_positive", 1) != 0, neg = attr_int(node, "detect_negative", 1) != 0;
  return [node, pos, neg](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const double inf = std::numeric_limits<double>::infinity();
    Tensor out = zeros(sizes_of(x), TensorOptions(kBool));
    if (pos) out = out.logical_or(x.eq(inf));
    if (neg) out = out.logical_or(x.eq(-inf));
    return {out};
  };
}

Kernel arg_reduce(const Node& node, const Graph&) {
  const bool max = node.op_type == "ArgMax";
  const int64_t axis = attr_int(node, "axis", 0);
  const bool keep = attr_int(node, "keepdims", 1) != 0;
  const bool last = attr_int(node, "select_last_index", 0) != 0;
  return [node, max, axis, keep, last](const Tensors& in) -> Tensors {
    Tensor x = input(node, in, 0);
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    const int64_t n = x.size(a);
    // The last of equal extremes: the first one along the reversed axis.
    if (last) x = x.index_select(a, arange(n - 1, -1, -1, TensorOptions(kInt64)));
    Tensor idx = max ? x.argmax(a, keep) : x.argmin(a, keep);
    if (last) idx = full_like(idx, n - 1).sub(idx);
    return {idx};
  };
}

Kernel tile(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const auto reps = int_values(input(node, in, 1), "repeats");
    KILN_CHECK(static_cast<int64_t>(reps.size()) == x.dim(), ShapeError, "expected one repeat per dim of ",
               x.shape_string(), ", got ", reps.size());
    return {x.repeat(reps)};
  };
}

Kernel range(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const Tensor& start = input(node, in, 0);
    const double s = start.item<double>(), limit = input(node, in, 1).item<double>(),
                 d = input(node, in, 2).item<double>();
    KILN_CHECK(d != 0, ValueError, "a delta of 0");
    const auto n = static_cast<int64_t>(std::max(std::ceil((limit - s) / d), 0.0));
    KILN_CHECK(n <= (int64_t{1} << 32), ValueError, "Range of ", n, " elements");
    // start + i * delta in float64, then the inputs' dtype (exact for integers).
    return {arange(n, TensorOptions(kFloat64)).mul(d).add(s).to(start.dtype())};
  };
}

Kernel size(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors { return {full({}, input(node, in, 0).numel(), TensorOptions(kInt64))}; };
}

// ConstantOfShape: the value comes as input 1 (load_onnx turns the tensor
// attribute into an initializer there), float32 zero without it.
Kernel constant_of_shape(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    const auto shape = int_values(input(node, in, 0), "shape");
    if (!has(in, 1)) return {zeros(shape, TensorOptions(kFloat32))};
    KILN_CHECK(in[1].numel() == 1, ShapeError, "expected a one-element value, got ", in[1].shape_string());
    return {full(shape, in[1].item_scalar(), TensorOptions(in[1].dtype()))};
  };
}

// Pad: constant (negative pads crop), reflect and edge, over all dims or `axes`.
Kernel pad(const Node& node, const Graph&) {
  const std::string mode = attr_string(node, "mode", "constant");
  KILN_CHECK(mode == "constant" || mode == "reflect" || mode == "edge", ValueError, node_label(node),
             ": expected mode constant, reflect or edge, got ", mode);
  return [node, mode](const Tensors& in) -> Tensors {
    Tensor x = input(node, in, 0);
    const int64_t r = x.dim();
    const auto pads = int_values(input(node, in, 1), "pads");
    std::vector<int64_t> axes(static_cast<size_t>(r));
    std::iota(axes.begin(), axes.end(), 0);
    if (has(in, 3)) axes = int_values(in[3], "axes");
    const auto k = static_cast<int64_t>(axes.size());
    KILN_CHECK(static_cast<int64_t>(pads.size()) == 2 * k, ShapeError, "expected ", 2 * k, " pads, got ", pads.size());
    std::vector<int64_t> begin(static_cast<size_t>(r), 0), end(static_cast<size_t>(r), 0);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t a = norm_axis(axes[static_cast<size_t>(i)], r, "axis");
      begin[static_cast<size_t>(a)] = pads[static_cast<size_t>(i)];
      end[static_cast<size_t>(a)] = pads[static_cast<size_t>(i + k)];
    }
    if (mode == "constant") {
      // Crop first (negative pads), then pad.
      for (int64_t d = 0; d < r; ++d) {
        const int64_t b = std::min<int64_t>(begin[static_cast<size_t>(d)], 0);
        const int64_t e = std::min<int64_t>(end[static_cast<size_t>(d)], 0);
        KILN_CHECK(x.size(d) + b + e >= 0, ShapeError, "pads crop more than dim ", d, " holds");
        if (b || e) x = x.narrow(d, -b, x.size(d) + b + e);
      }
      std::vector<int64_t> sizes = sizes_of(x);
      for (int64_t d = 0; d < r; ++d)
        sizes[static_cast<size_t>(d)] +=
            std::max<int64_t>(begin[static_cast<size_t>(d)], 0) + std::max<int64_t>(end[static_cast<size_t>(d)], 0);
      const Scalar value = has(in, 2) ? in[2].item_scalar() : Scalar(0);
      Tensor out = full(sizes, value, TensorOptions(x.dtype()));
      Tensor region = out;
      for (int64_t d = 0; d < r; ++d)
        region = region.narrow(d, std::max<int64_t>(begin[static_cast<size_t>(d)], 0), x.size(d));
      region.copy_(x);
      return {out};
    }
    // reflect / edge: gather each dim's source indices.
    for (int64_t d = 0; d < r; ++d) {
      const int64_t b = begin[static_cast<size_t>(d)], e = end[static_cast<size_t>(d)], n = x.size(d);
      if (b == 0 && e == 0) continue;
      KILN_CHECK(b >= 0 && e >= 0 && n > 0, ShapeError, mode, " padding needs non-negative pads and a non-empty dim");
      KILN_CHECK(mode == "edge" || (n > 1 && b < n && e < n), ShapeError,
                 "reflect padding needs pads smaller than the dim (", n, ")");
      std::vector<int64_t> idx;
      for (int64_t i = -b; i < n + e; ++i) {
        int64_t j = i;
        if (mode == "edge") {
          j = std::clamp<int64_t>(i, 0, n - 1);
        } else {
          if (j < 0) j = -j;
          if (j >= n) j = 2 * (n - 1) - j;
        }
        idx.push_back(j);
      }
      x = x.index_select(d, tensor(idx, {static_cast<int64_t>(idx.size())}));
    }
    return {x};
  };
}

Kernel instance_normalization(const Node& node, const Graph&) {
  const double eps = attr_float(node, "epsilon", 1e-5f);
  return [node, eps](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    KILN_CHECK(x.dim() >= 3, ShapeError, "expected an input [N, C, ...], got ", x.shape_string());
    std::vector<int64_t> dims, bshape(static_cast<size_t>(x.dim()), 1);
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    bshape[1] = x.size(1);
    const Tensor mean = x.mean(dims, true);
    const Tensor centred = x.sub(mean);
    const Tensor y = centred.mul(centred.mul(centred).mean(dims, true).add(eps).rsqrt());
    return {y.mul(input(node, in, 1).reshape(bshape)).add(input(node, in, 2).reshape(bshape))};
  };
}

// DepthToSpace (DCR or CRD) and SpaceToDepth: reshapes and one permutation.
Kernel depth_space(const Node& node, const Graph&) {
  const int64_t b = attr_int(node, "blocksize", 0);
  KILN_CHECK(b > 0, ValueError, node_label(node), ": expected a positive blocksize");
  const bool to_space = node.op_type == "DepthToSpace";
  const bool crd = attr_string(node, "mode", "DCR") == "CRD";
  return [node, b, to_space, crd](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    KILN_CHECK(x.dim() == 4, ShapeError, "expected an input [N, C, H, W], got ", x.shape_string());
    const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    if (to_space) {
      KILN_CHECK(c % (b * b) == 0, ShapeError, "channels ", c, " are not a multiple of blocksize^2");
      const int64_t co = c / (b * b);
      const Tensor t = crd ? x.reshape({n, co, b, b, h, w}).permute({0, 1, 4, 2, 5, 3})
                           : x.reshape({n, b, b, co, h, w}).permute({0, 3, 4, 1, 5, 2});
      return {t.reshape({n, co, h * b, w * b})};
    }
    KILN_CHECK(h % b == 0 && w % b == 0, ShapeError, "H and W must be multiples of blocksize, got ", x.shape_string());
    const Tensor t = x.reshape({n, c, h / b, b, w / b, b}).permute({0, 3, 5, 1, 2, 4});
    return {t.reshape({n, c * b * b, h / b, w / b})};
  };
}

Kernel einsum_kernel(const Node& node, const Graph&) {
  const std::string eq = attr_string(node, "equation", "");
  KILN_CHECK(!eq.empty(), ValueError, node_label(node), ": expected an equation attribute");
  return [eq](const Tensors& in) -> Tensors { return {einsum(eq, in)}; };
}

Kernel cast_like(const Node& node, const Graph&) {
  return [node](const Tensors& in) -> Tensors {
    return {input(node, in, 0).to(input(node, in, 1).dtype(), /*copy=*/true)};
  };
}

// Trilu: keeps the upper (j - i >= k) or lower (j - i <= k) triangle of the last two dims.
Kernel trilu(const Node& node, const Graph&) {
  const bool upper = attr_int(node, "upper", 1) != 0;
  return [node, upper](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    KILN_CHECK(x.dim() >= 2, ShapeError, "expected an input of rank >= 2, got ", x.shape_string());
    const int64_t k = has(in, 1) ? in[1].item<int64_t>() : 0;
    const int64_t m = x.size(-2), n = x.size(-1);
    const Tensor diff = arange(n, TensorOptions(kInt64)).sub(arange(m, TensorOptions(kInt64)).reshape({m, 1}));
    const Tensor keep = upper ? diff.ge(k) : diff.le(k);
    return {kiln::where(keep, x, zeros_like(x))};
  };
}

// Negative indices count from the end of `dim`, and every index must land in it.
Tensor element_indices(const Tensor& x, const Tensor& idx, int64_t dim) {
  KILN_CHECK(idx.dtype() == kInt64 || idx.dtype() == kInt32, DTypeError, "expected int64 or int32 indices, got ",
             dtype_name(idx.dtype()));
  const int64_t n = x.size(dim);
  Tensor i = idx.to(kInt64);
  i = kiln::where(i.lt(0), i.add(n), i);
  if (i.numel() > 0)
    KILN_CHECK(i.min().item<int64_t>() >= 0 && i.max().item<int64_t>() < n, IndexError,
               "an index is out of range for axis ", dim, " of size ", n);
  return i;
}

Kernel gather_elements(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", 0);
  return [node, axis](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    return {x.gather(a, element_indices(x, input(node, in, 1), a))};
  };
}

Kernel scatter_elements(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", 0);
  const std::string reduction = attr_string(node, "reduction", "none");
  KILN_CHECK(reduction == "none" || reduction == "add", ValueError, node_label(node),
             ": expected reduction none or add, got ", reduction);
  return [node, axis, reduction](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    const Tensor idx = element_indices(x, input(node, in, 1), a);
    const Tensor& upd = input(node, in, 2);
    return {reduction == "add" ? x.scatter_add(a, idx, upd) : x.scatter(a, idx, upd)};
  };
}

// Hardmax: 1 at the first maximum along `axis`, 0 elsewhere.
Kernel hardmax(const Node& node, const Graph&) {
  const int64_t axis = attr_int(node, "axis", -1);
  return [node, axis](const Tensors& in) -> Tensors {
    const Tensor& x = input(node, in, 0);
    const int64_t a = norm_axis(axis, x.dim(), "axis");
    return {zeros_like(x).scatter(a, x.argmax(a, true), 1.0)};
  };
}

// Mod: fmod = 1 the C remainder (sign of the dividend), 0 the floored one
// (sign of the divisor; integers only), over the broadcast inputs.
Kernel mod(const Node& node, const Graph&) {
  const bool c_fmod = attr_int(node, "fmod", 0) != 0;
  return [node, c_fmod](const Tensors& in) -> Tensors {
    const Tensor& a = input(node, in, 0);
    const Tensor& b = input(node, in, 1);
    KILN_CHECK(a.dtype() == b.dtype(), DTypeError, "expected inputs of one dtype, got ", dtype_name(a.dtype()), " and ",
               dtype_name(b.dtype()));
    KILN_CHECK(c_fmod || !a.is_floating_point(), ValueError, "fmod = 0 is defined for integer inputs only");
    const auto out = broadcast_sizes(sizes_of(a), sizes_of(b));
    if (a.is_floating_point()) {
      const Tensor x = a.expand(out).to(kFloat64).contiguous(), y = b.expand(out).to(kFloat64).contiguous();
      Tensor r = empty(out, TensorOptions(kFloat64));
      for (int64_t i = 0; i < r.numel(); ++i)
        r.data_ptr<double>()[i] = std::fmod(x.data_ptr<double>()[i], y.data_ptr<double>()[i]);
      return {r.to(a.dtype())};
    }
    const Tensor x = a.expand(out).to(kInt64).contiguous(), y = b.expand(out).to(kInt64).contiguous();
    Tensor r = empty(out, TensorOptions(kInt64));
    const int64_t *px = x.data_ptr<int64_t>(), *py = y.data_ptr<int64_t>();
    int64_t* pr = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < r.numel(); ++i) {
      KILN_CHECK(py[i] != 0, ValueError, "integer Mod by zero");
      int64_t v = px[i] % py[i];
      if (!c_fmod && v != 0 && ((v < 0) != (py[i] < 0))) v += py[i];
      pr[i] = v;
    }
    return {r.to(a.dtype())};
  };
}

template <typename F>
KernelFactory wrap(F f) {
  return [f](const Node& node, const Graph& graph) { return f(node, graph); };
}

}  // namespace

const std::map<std::string, KernelFactory>& detail::builtin_kernels() {
  static const std::map<std::string, KernelFactory> table = [] {
    std::map<std::string, KernelFactory> t;
    t["Relu"] = unary_fn([](const Tensor& x) { return x.relu(); });
    t["Tanh"] = unary_fn([](const Tensor& x) { return x.tanh(); });
    t["Sigmoid"] = unary_fn([](const Tensor& x) { return x.sigmoid(); });
    t["Sqrt"] = unary_fn([](const Tensor& x) { return x.sqrt(); });
    t["Neg"] = unary_fn([](const Tensor& x) { return x.neg(); });
    t["Abs"] = unary_fn([](const Tensor& x) { return x.abs(); });
    t["Exp"] = unary_fn([](const Tensor& x) { return x.exp(); });
    t["Log"] = unary_fn([](const Tensor& x) { return x.log(); });
    t["Reciprocal"] = unary_fn([](const Tensor& x) { return ones_like(x).div(x); });
    t["Not"] = unary_fn([](const Tensor& x) { return x.logical_not(); });
    t["Erf"] = unary(&erf);
    t["Floor"] =
        unary_fn([](const Tensor& x) { return map_float(x, "Floor", [](double v) { return std::floor(v); }); });
    t["Ceil"] = unary_fn([](const Tensor& x) { return map_float(x, "Ceil", [](double v) { return std::ceil(v); }); });
    // Round: halves to even, as ONNX (and the default floating-point rounding mode).
    t["Round"] =
        unary_fn([](const Tensor& x) { return map_float(x, "Round", [](double v) { return std::nearbyint(v); }); });
    t["Sign"] = unary_fn([](const Tensor& x) {
      return map_float(x, "Sign", [](double v) { return static_cast<double>((v > 0) - (v < 0)); });
    });
    t["Sin"] = unary_fn([](const Tensor& x) { return x.sin(); });
    t["Cos"] = unary_fn([](const Tensor& x) { return x.cos(); });
    t["IsNaN"] = unary_fn([](const Tensor& x) { return x.ne(x); });
    t["IsInf"] = wrap(is_inf);
    for (const char* op :
         {"Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "ThresholdedRelu", "Softsign", "Softplus", "Mish"})
      t[op] = wrap(activation);
    t["PRelu"] = wrap(prelu);
    for (const char* op : {"And", "Or", "Xor"}) t[op] = wrap(logical);
    t["ArgMax"] = wrap(arg_reduce);
    t["ArgMin"] = wrap(arg_reduce);
    t["Tile"] = wrap(tile);
    t["Range"] = wrap(range);
    t["Size"] = wrap(size);
    t["ConstantOfShape"] = wrap(constant_of_shape);
    t["Pad"] = wrap(pad);
    t["InstanceNormalization"] = wrap(instance_normalization);
    t["DepthToSpace"] = wrap(depth_space);
    t["SpaceToDepth"] = wrap(depth_space);
    t["Einsum"] = wrap(einsum_kernel);
    t["CastLike"] = wrap(cast_like);
    t["Trilu"] = wrap(trilu);
    t["GatherElements"] = wrap(gather_elements);
    t["ScatterElements"] = wrap(scatter_elements);
    t["Hardmax"] = wrap(hardmax);
    t["Mod"] = wrap(mod);
    t["Add"] = binary(Bin::Add);
    t["Sub"] = binary(Bin::Sub);
    t["Mul"] = binary(Bin::Mul);
    t["Div"] = binary(Bin::Div);
    t["Pow"] = binary(Bin::Pow);
    t["Equal"] = binary(Bin::Equal);
    t["Less"] = binary(Bin::Less);
    t["Greater"] = binary(Bin::Greater);
    t["LessOrEqual"] = binary(Bin::LessEq);
    t["GreaterOrEqual"] = binary(Bin::GreaterEq);
    for (const char* op : {"Max", "Min", "Sum", "Mean"}) t[op] = variadic(op);
    t["Where"] = wrap(where);
    t["Clip"] = wrap(clip);
    t["LeakyRelu"] = wrap(leaky_relu);
    t["Cast"] = wrap(cast);
    t["Constant"] = wrap(constant);
    t["Conv"] = wrap(conv);
    t["Gemm"] = wrap(gemm);
    t["MatMul"] = wrap(matmul);
    t["Softmax"] = wrap(softmax);
    t["LogSoftmax"] = wrap(softmax);
    t["LayerNormalization"] = wrap(layer_normalization);
    t["BatchNormalization"] = wrap(batch_normalization);
    t["MaxPool"] = wrap(pool);
    t["AveragePool"] = wrap(pool);
    t["GlobalAveragePool"] = wrap(global_pool);
    t["GlobalMaxPool"] = wrap(global_pool);
    for (const char* op : {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                           "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"})
      t[op] = wrap(reduce);
    t["Flatten"] = wrap(flatten);
    t["Reshape"] = wrap(reshape);
    t["Transpose"] = wrap(transpose);
    t["Gather"] = wrap(gather);
    t["Concat"] = wrap(concat);
    t["Expand"] = wrap(expand);
    t["Slice"] = wrap(slice);
    t["Split"] = wrap(split);
    t["Shape"] = wrap(shape);
    t["Unsqueeze"] = wrap(unsqueeze);
    t["Squeeze"] = wrap(squeeze);
    t["Identity"] = wrap(identity);
    t["Dropout"] = wrap(dropout);
    for (auto& [op, f] : detail::qdq_kernels()) t[op] = f;
    // Every kernel's run-time errors name its node.
    for (auto& [op, f] : t) f = [inner = f](const Node& n, const Graph& g) { return labelled(n, inner(n, g)); };
    return t;
  }();
  return table;
}

}  // namespace kiln::exporter
