// infer::optimize (include/kiln/export/infer.h): capture, the passes, and the
// kernels of kiln's fused nodes on ops::PackedConv2d / ops::PackedLinear.
#include "kiln/export/infer.h"

#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/optimize.h"
#include "kiln/ops/attention.h"
#include "kiln/ops/fused_inference.h"

namespace kiln::infer {
namespace {

using exporter::Graph;
using exporter::Node;

ops::InferenceActivation activation_of(const Node& n) {
  const std::string a = exporter::attr_string(n, "activation", "none");
  if (a == "none") return ops::InferenceActivation::None;
  if (a == "relu") return ops::InferenceActivation::Relu;
  if (a == "gelu") return ops::InferenceActivation::GeluErf;
  if (a == "gelu_tanh") return ops::InferenceActivation::GeluTanh;
  throw ValueError("infer: node " + n.name + " (" + n.op_type +
                   ") expects activation none, relu, gelu or gelu_tanh, got \"" + a + "\"");
}

// The weight and optional bias of a fused node: initializers at inputs 1 and 2.
std::pair<Tensor, Tensor> weights_of(const Node& n, const Graph& g) {
  KILN_CHECK(n.inputs.size() >= 3, ValueError, "infer: node ", n.name, " (", n.op_type,
             ") expects inputs [x, weight, bias or \"\", residual?], got ", n.inputs.size());
  const Tensor* w = exporter::find_initializer(g, n.inputs[1]);
  KILN_CHECK(w != nullptr, ValueError, "infer: node ", n.name, " (", n.op_type,
             ") expects its weight to be an initializer, got the value '", n.inputs[1], "'");
  const Tensor* b = n.inputs[2].empty() ? nullptr : exporter::find_initializer(g, n.inputs[2]);
  KILN_CHECK(n.inputs[2].empty() || b != nullptr, ValueError, "infer: node ", n.name, " (", n.op_type,
             ") expects its bias to be an initializer, got the value '", n.inputs[2], "'");
  return {*w, b ? *b : Tensor()};
}

bool has_residual(const Node& n) {
  const bool r = exporter::attr_int(n, "residual", 0) != 0;
  KILN_CHECK(n.inputs.size() == (r ? 4u : 3u), ValueError, "infer: node ", n.name, " (", n.op_type,
             ") with residual=", r ? 1 : 0, " expects ", r ? 4 : 3, " inputs, got ", n.inputs.size());
  return r;
}

exporter::Kernel fused_conv(const Node& n, const Graph& g) {
  const auto [w, b] = weights_of(n, g);
  const auto strides = exporter::attr_ints(n, "strides", {1, 1});
  const auto pads = exporter::attr_ints(n, "pads", {0, 0, 0, 0});
  const auto dil = exporter::attr_ints(n, "dilations", {1, 1});
  KILN_CHECK(strides.size() == 2 && pads.size() == 4 && dil.size() == 2, ValueError, "infer: node ", n.name,
             " (kiln.FusedConv) expects 2-D strides, dilations and 4 pads");
  ops::PackedConv2dOptions o;
  o.stride = {strides[0], strides[1]};
  o.padding = {pads[0], pads[1]};
  o.padding_end = {pads[2], pads[3]};
  o.dilation = {dil[0], dil[1]};
  o.groups = exporter::attr_int(n, "group", 1);
  o.activation = activation_of(n);
  const bool residual = has_residual(n);
  const ops::PackedConv2d conv(w, b, o);
  return [conv, residual](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{conv(in[0], residual ? in[3] : Tensor())};
  };
}

exporter::Kernel fused_gemm(const Node& n, const Graph& g) {
  const auto [w, b] = weights_of(n, g);
  const bool residual = has_residual(n);
  const ops::PackedLinear lin(w, b, activation_of(n));
  return [lin, residual](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{lin(in[0], residual ? in[3] : Tensor())};
  };
}

// kiln.Attention(qkv): the heads split as views of the qkv product (as
// CausalSelfAttention::attend does), kiln's blocked attention kernel, heads merged.
exporter::Kernel attention(const Node& n, const Graph&) {
  const int64_t nh = exporter::attr_int(n, "n_head", 0);
  const bool causal = exporter::attr_int(n, "causal", 0) != 0;
  KILN_CHECK(nh > 0, ValueError, "infer: node ", n.name, " (kiln.Attention) expects n_head > 0, got ", nh);
  return [nh, causal, name = n.name](const std::vector<Tensor>& in) {
    const Tensor& qkv = in[0];
    KILN_CHECK(qkv.dim() == 3 && qkv.size(2) % (3 * nh) == 0, ShapeError, "infer: node ", name,
               " (kiln.Attention) expects qkv [B, T, 3 * d] with d a multiple of ", nh, " heads, got ",
               qkv.shape_string());
    const int64_t b = qkv.size(0), t = qkv.size(1), d = qkv.size(2) / 3, hs = d / nh;
    const auto parts = qkv.split(d, 2);
    auto heads = [&](const Tensor& p) { return p.view({b, t, nh, hs}).transpose(1, 2); };  // [B, nh, T, hs]
    const Tensor y = ops::attention_fused(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, causal);
    return std::vector<Tensor>{y.transpose(1, 2).reshape({b, t, d})};
  };
}

std::string counts(const std::map<std::string, int64_t>& m) {
  std::string s;
  for (const auto& [op, k] : m) s += (s.empty() ? "" : ", ") + op + " " + std::to_string(k);
  return s;
}

}  // namespace

exporter::SessionOptions fused_kernels() {
  exporter::SessionOptions o;
  o.kernels["kiln.FusedConv"] = fused_conv;
  o.kernels["kiln.FusedGemm"] = fused_gemm;
  o.kernels["kiln.Attention"] = attention;
  return o;
}

std::string OptimizeReport::str() const {
  std::ostringstream os;
  os << "nodes " << nodes_before << " -> " << nodes_after << ": " << batch_norms_folded << " BatchNorms folded, "
     << identities_removed << " Identity/Dropout removed, " << fused_conv << " kiln.FusedConv, " << fused_gemm
     << " kiln.FusedGemm, " << attention << " kiln.Attention (" << absorbed << " nodes absorbed)\n";
  os << "  before: " << counts(ops_before) << "\n";
  os << "  after:  " << counts(ops_after) << "\n";
  return os.str();
}

InferenceModel::InferenceModel(exporter::Graph graph, OptimizeReport report)
    : session_(std::make_shared<const exporter::Session>(std::move(graph), fused_kernels())),
      report_(std::move(report)) {}

std::vector<Tensor> InferenceModel::run(const std::vector<Tensor>& inputs) const { return session_->run(inputs); }

Tensor InferenceModel::forward(const Tensor& x) const { return session_->run({x})[0]; }

const exporter::Graph& InferenceModel::graph() const { return session_->graph(); }

InferenceModel optimize(nn::Module& module, const std::vector<Tensor>& example_inputs, const OptimizeOptions& options) {
  exporter::CaptureOptions co;
  co.dynamic_axes = options.dynamic_axes;
  if (co.dynamic_axes.empty() && example_inputs.size() == 1 && example_inputs[0].defined()) {
    co.dynamic_axes["input"][0] = "batch";
    if (example_inputs[0].dtype() == kInt64 && example_inputs[0].dim() == 2) co.dynamic_axes["input"][1] = "seq";
  }
  Graph g = exporter::capture(module, example_inputs, co);
  OptimizeReport r;
  r.nodes_before = static_cast<int64_t>(g.nodes.size());
  r.ops_before = g.op_counts();
  const exporter::StandardReport s = exporter::optimize_standard(g);
  r.batch_norms_folded = s.fold.folded;
  r.identities_removed = s.identities_removed;
  if (options.fuse) {
    const exporter::FuseReport f = exporter::fuse_for_kiln(g);
    r.fused_conv = f.fused_conv;
    r.fused_gemm = f.fused_gemm;
    r.attention = f.attention;
    r.absorbed = f.absorbed;
  }
  r.nodes_after = static_cast<int64_t>(g.nodes.size());
  r.ops_after = g.op_counts();
  return InferenceModel(std::move(g), std::move(r));
}

}  // namespace kiln::infer
