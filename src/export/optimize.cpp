// Graph-level inference optimisation (include/kiln/export/optimize.h).
#include "kiln/export/optimize.h"

#include <set>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::exporter {
namespace {

const Tensor* initializer(const Graph& g, const std::string& name) {
  for (const auto& entry : g.initializers)
    if (entry.first == name) return &entry.second;
  return nullptr;
}

Shape fixed_shape(const Tensor& t) {
  Shape s;
  for (int64_t d : t.sizes()) s.push_back(Dim::fixed(d));
  return s;
}

}  // namespace

FoldReport fold_batch_norm(Graph& g) {
  FoldReport r;
  r.nodes_before = static_cast<int64_t>(g.nodes.size());
  std::map<std::string, int64_t> readers;
  for (const Node& n : g.nodes)
    for (const std::string& in : n.inputs) ++readers[in];
  for (const Value& v : g.outputs) ++readers[v.name];
  std::map<std::string, size_t> producer;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    for (const std::string& o : g.nodes[i].outputs) producer[o] = i;

  const NoGradGuard no_grad;
  std::set<size_t> removed;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    Node& bn = g.nodes[i];
    if (bn.op_type != "BatchNormalization" || bn.inputs.size() != 5 || bn.outputs.size() != 1) continue;
    auto p = producer.find(bn.inputs[0]);
    if (p == producer.end() || readers[bn.inputs[0]] != 1) continue;
    Node& conv = g.nodes[p->second];
    if (conv.op_type != "Conv" || conv.outputs.size() != 1) continue;
    const Tensor* w = initializer(g, conv.inputs[1]);
    const Tensor* b = conv.inputs.size() > 2 ? initializer(g, conv.inputs[2]) : nullptr;
    const Tensor *gamma = initializer(g, bn.inputs[1]), *beta = initializer(g, bn.inputs[2]),
                 *mean = initializer(g, bn.inputs[3]), *var = initializer(g, bn.inputs[4]);
    if (!w || (conv.inputs.size() > 2 && !b) || !gamma || !beta || !mean || !var) continue;
    const double eps = std::get<float>(bn.attributes.at("epsilon"));
    const Tensor s = gamma->to(kFloat64) * (var->to(kFloat64) + eps).rsqrt();  // [C]
    const int64_t c = s.size(0);
    const Tensor w2 = (w->to(kFloat64) * s.reshape({c, 1, 1, 1})).to(kFloat32).contiguous();
    const Tensor b0 = b ? b->to(kFloat64) : zeros({c}, TensorOptions(kFloat64));
    const Tensor b2 = ((b0 - mean->to(kFloat64)) * s + beta->to(kFloat64)).to(kFloat32).contiguous();
    const std::string base = bn.module.empty() ? bn.name : bn.module;
    const std::string wn = base + ".folded_weight", bname = base + ".folded_bias";
    KILN_CHECK(!g.values.count(wn) && !g.values.count(bname), InternalError, "export: fold names ", wn, " taken");
    g.initializers.emplace_back(wn, w2);
    g.initializers.emplace_back(bname, b2);
    g.values[wn] = Value{wn, kFloat32, fixed_shape(w2)};
    g.values[bname] = Value{bname, kFloat32, fixed_shape(b2)};
    // The Conv now computes what the BatchNormalization did, under its name.
    const std::string old = conv.outputs[0];
    conv.inputs.resize(3);
    conv.inputs[1] = wn;
    conv.inputs[2] = bname;
    conv.outputs[0] = bn.outputs[0];
    conv.name += "+" + bn.op_type;
    producer[bn.outputs[0]] = p->second;
    g.values.erase(old);
    std::erase_if(g.module_outputs, [&old](const ModuleOutput& m) { return m.value == old; });
    removed.insert(i);
    ++r.folded;
  }
  std::vector<Node> kept;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (!removed.count(i)) kept.push_back(std::move(g.nodes[i]));
  g.nodes = std::move(kept);
  // Drop the initializers nothing reads now (BN statistics, the unfolded weights).
  std::set<std::string> used;
  for (const Node& n : g.nodes) used.insert(n.inputs.begin(), n.inputs.end());
  std::vector<std::pair<std::string, Tensor>> inits;
  for (auto& entry : g.initializers) {
    if (used.count(entry.first)) {
      inits.push_back(std::move(entry));
    } else {
      g.values.erase(entry.first);
    }
  }
  g.initializers = std::move(inits);
  r.nodes_after = static_cast<int64_t>(g.nodes.size());
  g.validate();
  return r;
}

}  // namespace kiln::exporter
