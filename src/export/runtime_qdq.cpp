// The runtime side of QDQ graphs (qdq.h): QuantizeLinear / DequantizeLinear
// kernels, and the fusion of a quantized Conv / Gemm back into one int8 op.
#include <algorithm>
#include <array>
#include <cmath>
#include <set>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/int8.h"
#include "qdq.h"
#include "runtime_kernels.h"

namespace kiln::exporter::detail {
namespace {

using Tensors = std::vector<Tensor>;

bool is_int8(const Graph& g, const Node& n, size_t i) {
  return i < n.inputs.size() && !n.inputs[i].empty() && g.int8_values.count(n.inputs[i]) > 0;
}

// The per-element parameter index of a [outer, channels, inner] walk: one
// scale / zero point for the whole tensor, or one per slice along `axis`.
struct Broadcast {
  int64_t channels = 1, inner = 1;
};

Broadcast broadcast_of(const Node& node, const Tensor& x, const Tensor& scale) {
  if (scale.numel() == 1 && scale.dim() <= 1) return {};
  KILN_CHECK(scale.dim() == 1, ShapeError, node_label(node), ": expected a scalar or 1-D scale, got ",
             scale.shape_string());
  int64_t axis = attr_int(node, "axis", 1);
  if (axis < 0) axis += x.dim();
  KILN_CHECK(axis >= 0 && axis < x.dim() && x.size(axis) == scale.numel(), ShapeError, node_label(node),
             ": a per-axis scale of ", scale.numel(), " values along axis ", attr_int(node, "axis", 1), " of an input ",
             x.shape_string());
  Broadcast b{scale.numel(), 1};
  for (int64_t d = axis + 1; d < x.dim(); ++d) b.inner *= x.size(d);
  return b;
}

// Zero points as int32 (int8 bytes sign-extended), one per channel, or zeros when omitted.
std::vector<int32_t> zero_points(const Tensor& zp, bool int8, int64_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n), 0);
  if (!zp.defined()) return out;
  const Tensor c = zp.contiguous();
  KILN_CHECK(c.numel() == n, ShapeError, "expected ", n, " zero points (as the scale), got ", c.numel());
  if (c.dtype() == kInt32) {
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = c.data_ptr<int32_t>()[i];
    return out;
  }
  KILN_CHECK(c.dtype() == kUInt8, DTypeError, "expected a uint8 or int8 zero point, got ", dtype_name(c.dtype()));
  const uint8_t* p = c.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = int8 ? static_cast<int8_t>(p[i]) : p[i];
  return out;
}

// y = saturate(round_half_even(x / scale) + zero_point), to uint8 or int8 bytes.
Kernel quantize_linear(const Node& node, const Graph& graph) {
  const bool int8 = is_int8(graph, node, 2);
  attr_int(node, "axis", 1);  // refuses an axis that is not an int
  return [node, int8](const Tensors& in) -> Tensors {
    KILN_CHECK(in.size() >= 2 && in[0].defined() && in[1].defined(), ValueError, node_label(node),
               ": expected inputs x and y_scale");
    const Tensor x = in[0].to(kFloat32).contiguous();
    const Tensor scale = in[1].to(kFloat32).contiguous();
    const Broadcast b = broadcast_of(node, x, scale);
    const auto zp = zero_points(in.size() > 2 ? in[2] : Tensor(), int8, b.channels);
    Tensor y = empty(x.sizes(), TensorOptions(kUInt8));
    const float* px = x.data_ptr<float>();
    const float* ps = scale.data_ptr<float>();
    uint8_t* py = y.data_ptr<uint8_t>();
    const double lo = int8 ? -128 : 0, hi = int8 ? 127 : 255;
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
      const auto c = static_cast<size_t>((i / b.inner) % b.channels);
      const double q = std::clamp(static_cast<double>(std::nearbyint(px[i] / ps[c])) + zp[c], lo, hi);
      py[i] = static_cast<uint8_t>(static_cast<int32_t>(q));  // int8 as its two's complement byte
    }
    return {y};
  };
}

// y = (x - zero_point) * scale, from uint8, int8 or int32.
Kernel dequantize_linear(const Node& node, const Graph& graph) {
  const bool int8 = is_int8(graph, node, 0) || is_int8(graph, node, 2);
  attr_int(node, "axis", 1);
  return [node, int8](const Tensors& in) -> Tensors {
    KILN_CHECK(in.size() >= 2 && in[0].defined() && in[1].defined(), ValueError, node_label(node),
               ": expected inputs x and x_scale");
    const Tensor x = in[0].contiguous();
    KILN_CHECK(x.dtype() == kUInt8 || x.dtype() == kInt32, DTypeError, node_label(node),
               ": expected a uint8, int8 or int32 input, got ", dtype_name(x.dtype()));
    const Tensor scale = in[1].to(kFloat32).contiguous();
    const Broadcast b = broadcast_of(node, x, scale);
    const auto zp = zero_points(in.size() > 2 ? in[2] : Tensor(), int8, b.channels);
    Tensor y = empty(x.sizes(), TensorOptions(kFloat32));
    const float* ps = scale.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
      const auto c = static_cast<size_t>((i / b.inner) % b.channels);
      int32_t v = 0;
      if (x.dtype() == kInt32)
        v = x.data_ptr<int32_t>()[i];
      else
        v = int8 ? static_cast<int8_t>(x.data_ptr<uint8_t>()[i]) : x.data_ptr<uint8_t>()[i];
      py[i] = static_cast<float>(v - zp[c]) * ps[c];
    }
    return {y};
  };
}

const Tensor& constant_input(const Node& node, const Graph& graph, size_t i) {
  const Tensor* t = i < node.inputs.size() ? find_initializer(graph, node.inputs[i]) : nullptr;
  KILN_CHECK(t != nullptr, ValueError, node_label(node), ": expected input ", i, " to be an initializer");
  return *t;
}

Tensor optional_bias(const Node& node, const Graph& graph) {
  return node.inputs.size() > 3 && !node.inputs[3].empty() ? constant_input(node, graph, 3) : Tensor();
}

ops::Int8Quantization quantization(const Node& node) {
  const float scale = attr_float(node, "input_scale", 1.0f);
  const int64_t zp = attr_int(node, "input_zero_point", 0);
  KILN_CHECK(std::isfinite(scale) && scale > 0 && zp >= 0 && zp <= 255, ValueError, node_label(node),
             ": expected input_scale > 0 and input_zero_point in [0, 255], got ", scale, " and ", zp);
  const float out_scale = attr_float(node, "output_scale", 0.0f);
  const int64_t out_zp = attr_int(node, "output_zero_point", 0);
  KILN_CHECK(std::isfinite(out_scale) && out_scale >= 0 && out_zp >= 0 && out_zp <= 255, ValueError, node_label(node),
             ": expected output_scale >= 0 and output_zero_point in [0, 255], got ", out_scale, " and ", out_zp);
  return {.input_scale = scale,
          .input_zero_point = zp,
          .relu = attr_int(node, "relu", 0) != 0,
          .output_scale = out_scale,
          .output_zero_point = out_zp};
}

// The fused node's weight (int8 bytes of rank `rank`), scales and bias, checked before a kernel packs them.
void check_weights(const Node& node, const Graph& graph, int64_t rank) {
  const Tensor& w = constant_input(node, graph, 1);
  const Tensor& s = constant_input(node, graph, 2);
  KILN_CHECK(w.dtype() == kUInt8 && w.dim() == rank && s.dtype() == kFloat32 && s.dim() == 1 && s.numel() == w.size(0),
             ValueError, node_label(node), ": expected an int8 weight of rank ", rank,
             " and float32 scales [out], got ", dtype_name(w.dtype()), " ", w.shape_string(), " and ",
             dtype_name(s.dtype()), " ", s.shape_string());
  const Tensor b = optional_bias(node, graph);
  KILN_CHECK(!b.defined() || (b.dtype() == kFloat32 && b.dim() == 1 && b.numel() == w.size(0)), ValueError,
             node_label(node), ": expected a float32 bias [", w.size(0), "], got ", b.shape_string());
}

Kernel int8_conv(const Node& node, const Graph& graph) {
  const auto st = attr_ints(node, "strides", {1, 1}), dl = attr_ints(node, "dilations", {1, 1});
  const auto pads = attr_ints(node, "pads", {0, 0, 0, 0});
  KILN_CHECK(st.size() == 2 && dl.size() == 2 && pads.size() == 4, ValueError, node_label(node),
             ": expected 2-D strides, dilations and pads");
  ops::Int8Conv2dOptions o;
  o.stride = {st[0], st[1]};
  o.dilation = {dl[0], dl[1]};
  o.padding = {pads[0], pads[1]};
  o.groups = attr_int(node, "group", 1);
  o.q = quantization(node);
  check_weights(node, graph, 4);
  const ops::Int8Conv2d k(constant_input(node, graph, 1), constant_input(node, graph, 2), optional_bias(node, graph),
                          o);
  if (attr_int(node, "residual", 0) != 0) {
    KILN_CHECK(node.inputs.size() == 5 && !node.inputs[4].empty(), ValueError, node_label(node),
               ": expected the residual as input 4, got ", node.inputs.size(), " inputs");
    return [k](const Tensors& in) -> Tensors { return {k(in[0], in[4])}; };
  }
  return [k](const Tensors& in) -> Tensors { return {k(in[0])}; };
}

Kernel int8_gemm(const Node& node, const Graph& graph) {
  check_weights(node, graph, 2);
  const ops::Int8Linear k(constant_input(node, graph, 1), constant_input(node, graph, 2), optional_bias(node, graph),
                          quantization(node));
  return [k](const Tensors& in) -> Tensors { return {k(in[0])}; };
}

// ---- fusion

const Tensor* scalar_initializer(const Graph& g, const std::string& name, DType dtype) {
  const Tensor* t = find_initializer(g, name);
  return t != nullptr && t->dtype() == dtype && t->numel() == 1 && t->dim() <= 1 ? t : nullptr;
}

struct Producers {
  std::map<std::string, size_t> node_of;    // value -> the node that makes it
  std::map<std::string, int64_t> readers;   // value -> how many node inputs read it
  std::map<std::string, size_t> reader_of;  // value -> a node that reads it (the only one when readers is 1)
  std::set<std::string> outputs;
};

Producers index(const Graph& g) {
  Producers p;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    for (const std::string& o : g.nodes[i].outputs) p.node_of[o] = i;
    for (const std::string& in : g.nodes[i].inputs) {
      ++p.readers[in];
      p.reader_of[in] = i;
    }
  }
  for (const Value& v : g.outputs) p.outputs.insert(v.name);
  return p;
}

// The node making `value` when it is of `op`, read once and not a graph output.
const Node* sole_producer(const Graph& g, const Producers& p, const std::string& value, const std::string& op,
                          size_t* at) {
  auto it = p.node_of.find(value);
  if (it == p.node_of.end() || g.nodes[it->second].op_type != op) return nullptr;
  if (p.outputs.count(value) || p.readers.at(value) != 1) return nullptr;
  *at = it->second;
  return &g.nodes[it->second];
}

bool all_zero(const Tensor& t) {
  const Tensor c = t.contiguous();
  const uint8_t* p = c.data_ptr<uint8_t>();
  return std::all_of(p, p + c.numel(), [](uint8_t v) { return v == 0; });
}

// Takes the Relu that alone reads n's output into n (attribute "relu": the int8 kernel's eltwise post-op
// on the same float result, so the numbers do not change, and the Relu's pass is saved); n then writes
// the Relu's output.
void absorb_relu(Graph& g, const Producers& p, Node& n, std::set<size_t>& dead) {
  if (n.outputs.empty()) return;
  const std::string out = n.outputs[0];
  auto r = p.reader_of.find(out);
  if (p.outputs.count(out) || !p.readers.count(out) || p.readers.at(out) != 1 || r == p.reader_of.end()) return;
  const Node& relu = g.nodes[r->second];
  if (relu.op_type != "Relu" || relu.outputs.size() != 1) return;
  g.values.erase(out);
  n.outputs[0] = relu.outputs[0];
  n.attributes["relu"] = int64_t{1};
  dead.insert(r->second);
}

void drop(Graph& g, const std::set<size_t>& dead) {
  std::vector<Node> kept;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (!dead.count(i)) kept.push_back(std::move(g.nodes[i]));
  g.nodes = std::move(kept);
}

// A residual block's add (and the ReLU after it) into the int8 convolution that feeds it: Add(conv, r),
// where the conv's output is read by nothing else and r has the same shape and is computed before the
// conv (a block's shortcut; when both sides are int8 convolutions, the later one takes the add). The
// kernel adds r after its scales and bias (a oneDNN binary post-op on the same float result), so the
// numbers do not change.
void fuse_int8_residuals(Graph& g) {
  const Producers p = index(g);
  std::set<size_t> dead;
  auto made_before = [&](const std::string& v, size_t at) {
    auto it = p.node_of.find(v);
    return it == p.node_of.end() ? find_initializer(g, v) == nullptr  // a graph input
                                 : it->second < at;
  };
  for (size_t ia = 0; ia < g.nodes.size(); ++ia) {
    const Node& add = g.nodes[ia];
    if (add.op_type != "Add" || add.inputs.size() != 2 || add.outputs.size() != 1 || add.inputs[0] == add.inputs[1])
      continue;
    for (int side = 1; side >= 0; --side) {
      const std::string& v = add.inputs[static_cast<size_t>(side)];
      const std::string& r = add.inputs[static_cast<size_t>(1 - side)];
      size_t ic = 0;
      const Node* conv = sole_producer(g, p, v, kOpInt8Conv, &ic);
      if (conv == nullptr || dead.count(ic) || attr_int(*conv, "relu", 0) != 0 || conv->inputs.size() > 4) continue;
      auto vv = g.values.find(v), rv = g.values.find(r);
      if (vv == g.values.end() || rv == g.values.end() || vv->second.shape != rv->second.shape ||
          rv->second.dtype != kFloat32 || !made_before(r, ic))
        continue;
      Node& c = g.nodes[ic];
      c.inputs.resize(4);
      c.inputs.push_back(r);
      c.attributes["residual"] = int64_t{1};
      g.values.erase(v);
      c.outputs[0] = add.outputs[0];
      dead.insert(ia);
      absorb_relu(g, p, c, dead);  // the block's ReLU after the add
      break;
    }
  }
  drop(g, dead);
}

bool is_fused_int8(const Node& n) { return n.op_type == kOpInt8Conv || n.op_type == kOpInt8Gemm; }

// uint8 between fused int8 layers (fuse_qdq's uint8_chain). A reader of a uint8 value takes it as its
// input codes (ops::Int8Conv2d / Int8Linear accept kUInt8 input as already quantized).
void chain_uint8(Graph& g) {
  std::map<std::string, std::vector<std::pair<size_t, size_t>>> readers;  // value -> (node, input index)
  for (size_t i = 0; i < g.nodes.size(); ++i)
    for (size_t k = 0; k < g.nodes[i].inputs.size(); ++k) readers[g.nodes[i].inputs[k]].push_back({i, k});
  std::set<std::string> outputs;
  for (const Value& v : g.outputs) outputs.insert(v.name);
  for (Node& n : g.nodes) {
    if (!is_fused_int8(n) || n.outputs.size() != 1 || attr_int(n, "residual", 0) != 0) continue;
    const std::string& v = n.outputs[0];
    auto it = readers.find(v);
    if (outputs.count(v) || it == readers.end() || it->second.empty()) continue;
    bool ok = true;
    float scale = 0.0f;
    int64_t zp = -1;
    for (const auto& [i, k] : it->second) {
      const Node& r = g.nodes[i];
      const float s = attr_float(r, "input_scale", 0.0f);
      const int64_t z = attr_int(r, "input_zero_point", -1);
      ok = ok && is_fused_int8(r) && k == 0 && s > 0 && (zp < 0 || (s == scale && z == zp));
      scale = s;
      zp = z;
    }
    if (!ok) continue;
    n.attributes["output_scale"] = scale;
    n.attributes["output_zero_point"] = zp;
    auto val = g.values.find(v);
    if (val != g.values.end()) val->second.dtype = kUInt8;
  }
}

}  // namespace

std::map<std::string, KernelFactory> qdq_kernels() {
  return {{"QuantizeLinear", quantize_linear},
          {"DequantizeLinear", dequantize_linear},
          {kOpInt8Conv, int8_conv},
          {kOpInt8Gemm, int8_gemm}};
}

int64_t fuse_qdq(Graph& g, bool uint8_chain) {
  const Producers p = index(g);
  std::set<size_t> dead;
  int64_t fused = 0;
  for (Node& n : g.nodes) {
    const bool conv = n.op_type == "Conv";
    if (!(conv || n.op_type == "Gemm") || n.inputs.size() < 2) continue;
    size_t i_dq = 0, i_q = 0, i_wdq = 0;
    const Node* dq = sole_producer(g, p, n.inputs[0], "DequantizeLinear", &i_dq);
    const Node* wdq = sole_producer(g, p, n.inputs[1], "DequantizeLinear", &i_wdq);
    if (dq == nullptr || wdq == nullptr || dq->inputs.size() != 3 || wdq->inputs.size() != 3) continue;
    const Node* q = sole_producer(g, p, dq->inputs[0], "QuantizeLinear", &i_q);
    if (q == nullptr || q->inputs.size() != 3) continue;
    // Activation: uint8 per tensor, the same parameters on Q and DQ.
    const Tensor* sx = scalar_initializer(g, dq->inputs[1], kFloat32);
    const Tensor* zx = scalar_initializer(g, dq->inputs[2], kUInt8);
    const Tensor* sq = scalar_initializer(g, q->inputs[1], kFloat32);
    const Tensor* zq = scalar_initializer(g, q->inputs[2], kUInt8);
    if (!sx || !zx || !sq || !zq || g.int8_values.count(dq->inputs[2])) continue;
    if (sx->item<float>() != sq->item<float>() || zx->item<uint8_t>() != zq->item<uint8_t>()) continue;
    // Weight: int8 initializer, per output channel (axis 0), zero points 0.
    const Tensor* w = find_initializer(g, wdq->inputs[0]);
    const Tensor* sw = find_initializer(g, wdq->inputs[1]);
    const Tensor* zw = find_initializer(g, wdq->inputs[2]);
    if (!w || !sw || !zw || !g.int8_values.count(wdq->inputs[0]) || !g.int8_values.count(wdq->inputs[2])) continue;
    if (w->dim() < 2 || sw->dtype() != kFloat32 || sw->dim() != 1 || sw->numel() != w->size(0)) continue;
    if (zw->numel() != sw->numel() || !all_zero(*zw) || attr_int(*wdq, "axis", 1) != 0) continue;
    const bool bias_ok = n.inputs.size() < 3 || n.inputs[2].empty() || find_initializer(g, n.inputs[2]) != nullptr;
    if (!bias_ok) continue;
    if (conv) {
      const auto pads = attr_ints(n, "pads", {0, 0, 0, 0});
      const bool ok = w->dim() == 4 && attr_string(n, "auto_pad", "NOTSET") == "NOTSET" && pads.size() == 4 &&
                      pads[0] == pads[2] && pads[1] == pads[3];
      if (!ok) continue;
    } else {
      const bool ok = attr_int(n, "transA", 0) == 0 && attr_int(n, "transB", 0) == 1 &&
                      attr_float(n, "alpha", 1.0f) == 1.0f && attr_float(n, "beta", 1.0f) == 1.0f;
      if (!ok) continue;
    }
    std::vector<std::string> inputs{q->inputs[0], wdq->inputs[0], wdq->inputs[1]};
    if (n.inputs.size() > 2 && !n.inputs[2].empty()) inputs.push_back(n.inputs[2]);
    const float scale = sx->item<float>();
    const int64_t zero_point = zx->item<uint8_t>();
    for (const std::string& v : {q->outputs[0], dq->outputs[0], wdq->outputs[0]}) g.values.erase(v);
    dead.insert({i_q, i_dq, i_wdq});
    n.op_type = conv ? kOpInt8Conv : kOpInt8Gemm;
    n.inputs = std::move(inputs);
    n.attributes["input_scale"] = scale;
    n.attributes["input_zero_point"] = zero_point;
    absorb_relu(g, p, n, dead);
    ++fused;
  }
  if (dead.empty()) return 0;
  drop(g, dead);
  fuse_int8_residuals(g);
  if (uint8_chain) chain_uint8(g);
  return fused;
}

}  // namespace kiln::exporter::detail
