// Graph-level inference optimisation, the standard passes
// (include/kiln/export/optimize.h): BatchNorm folding, Identity/Dropout
// removal, dead-node removal.
#include "kiln/export/optimize.h"

#include <set>

#include "graph_edit.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::exporter {
namespace detail {

GraphIndex::GraphIndex(const Graph& g) {
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    for (const std::string& in : g.nodes[i].inputs)
      if (!in.empty()) readers[in].push_back(i);
    for (const std::string& o : g.nodes[i].outputs) producer[o] = i;
  }
  for (const Value& v : g.outputs) graph_outputs.insert(v.name);
  for (const auto& entry : g.initializers) initializers[entry.first] = &entry.second;
}

const Tensor* GraphIndex::init(const std::string& name) const {
  auto it = initializers.find(name);
  return it == initializers.end() ? nullptr : it->second;
}

std::optional<size_t> GraphIndex::sole_reader(const std::string& value) const {
  if (graph_outputs.count(value)) return std::nullopt;
  auto it = readers.find(value);
  if (it == readers.end() || it->second.size() != 1) return std::nullopt;
  return it->second[0];
}

std::optional<size_t> GraphIndex::producer_of(const std::string& value) const {
  auto it = producer.find(value);
  if (it == producer.end()) return std::nullopt;
  return it->second;
}

std::optional<float> scalar_value(const GraphIndex& ix, const std::string& name) {
  const Tensor* t = ix.init(name);
  if (!t || t->dtype() != kFloat32 || t->numel() != 1) return std::nullopt;
  return t->contiguous().data_ptr<float>()[0];
}

void compact(Graph& g, const std::set<size_t>& removed) {
  std::vector<Node> kept;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (!removed.count(i)) kept.push_back(std::move(g.nodes[i]));
  g.nodes = std::move(kept);
  std::set<std::string> defined, used;
  for (const Value& v : g.inputs) defined.insert(v.name);
  for (const Node& n : g.nodes) {
    defined.insert(n.outputs.begin(), n.outputs.end());
    used.insert(n.inputs.begin(), n.inputs.end());
  }
  for (const Value& v : g.outputs) used.insert(v.name);
  std::vector<std::pair<std::string, Tensor>> inits;
  for (auto& entry : g.initializers)
    if (used.count(entry.first)) inits.push_back(std::move(entry));
  g.initializers = std::move(inits);
  for (const auto& entry : g.initializers) defined.insert(entry.first);
  std::erase_if(g.values, [&](const auto& kv) { return !defined.count(kv.first); });
  std::erase_if(g.module_outputs, [&](const ModuleOutput& m) { return !defined.count(m.value); });
  g.validate();
}

std::string add_initializer(Graph& g, const std::string& name, const Tensor& t) {
  std::string n = name;
  for (int k = 1; g.values.count(n); ++k) n = name + "_" + std::to_string(k);
  const Tensor c = t.to(kFloat32).contiguous();
  g.initializers.emplace_back(n, c);
  Shape s;
  for (int64_t d : c.sizes()) s.push_back(Dim::fixed(d));
  g.values[n] = Value{n, kFloat32, s};
  return n;
}

}  // namespace detail

namespace {

using detail::GraphIndex;

bool gemm_is_linear(const Node& n) {
  auto get = [&](const char* a, int64_t dflt) {
    auto it = n.attributes.find(a);
    return it == n.attributes.end() ? dflt : std::get<int64_t>(it->second);
  };
  auto getf = [&](const char* a) {
    auto it = n.attributes.find(a);
    return it == n.attributes.end() ? 1.0f : std::get<float>(it->second);
  };
  return get("transA", 0) == 0 && get("transB", 0) == 1 && getf("alpha") == 1.0f && getf("beta") == 1.0f;
}

// The BatchNormalization's per-channel scale s and shift t (y = x * s + t), float64.
std::optional<std::pair<Tensor, Tensor>> bn_affine(const GraphIndex& ix, const Node& bn) {
  const Tensor *gamma = ix.init(bn.inputs[1]), *beta = ix.init(bn.inputs[2]), *mean = ix.init(bn.inputs[3]),
               *var = ix.init(bn.inputs[4]);
  if (!gamma || !beta || !mean || !var) return std::nullopt;
  const double eps = std::get<float>(bn.attributes.at("epsilon"));
  const Tensor s = gamma->to(kFloat64) * (var->to(kFloat64) + eps).rsqrt();
  return std::make_pair(s, beta->to(kFloat64) - mean->to(kFloat64) * s);
}

// One fold (into_linear: it was into a product), or false when the graph has nothing more to fold.
bool fold_one(Graph& g, bool& into_linear) {
  into_linear = false;
  const GraphIndex ix(g);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& bn = g.nodes[i];
    if (bn.op_type != "BatchNormalization" || bn.inputs.size() != 5 || bn.outputs.size() != 1) continue;
    const auto aff = bn_affine(ix, bn);
    const auto p = ix.producer_of(bn.inputs[0]);
    if (!aff || !p || ix.sole_reader(bn.inputs[0]) != i) continue;
    const auto& [s, t] = *aff;
    const int64_t c = s.size(0);
    const std::string base = bn.module.empty() ? bn.name : bn.module;
    const std::string bn_out = bn.outputs[0], bn_name = bn.name, bn_op = bn.op_type;
    Node& prod = g.nodes[*p];
    if (prod.op_type == "Conv" && prod.outputs.size() == 1) {
      const Tensor* w = ix.init(prod.inputs[1]);
      const bool has_b = prod.inputs.size() > 2 && !prod.inputs[2].empty();
      const Tensor* b = has_b ? ix.init(prod.inputs[2]) : nullptr;
      if (!w || (has_b && !b) || w->size(0) != c) continue;
      const Tensor w2 = w->to(kFloat64) * s.reshape({c, 1, 1, 1});
      const Tensor b2 = (b ? b->to(kFloat64) : zeros({c}, TensorOptions(kFloat64))) * s + t;
      prod.inputs.resize(3);
      prod.inputs[1] = detail::add_initializer(g, base + ".folded_weight", w2);
      prod.inputs[2] = detail::add_initializer(g, base + ".folded_bias", b2);
      prod.outputs[0] = bn_out;
      prod.name += "+" + bn_op;
      detail::compact(g, {i});
      return true;
    }
    // A Linear followed by BatchNorm1d: [N, C] only (on [N, C, L] BatchNorm1d
    // normalises dim 1, not the product's features).
    if (g.values.at(bn.inputs[0]).shape.size() != 2) continue;
    std::set<size_t> removed{i};
    size_t product = *p;
    std::string bias_name;
    if (g.nodes[product].op_type == "Add") {
      // MatMul + Add(bias): the Add's other operand is the bias initializer.
      const Node& add = g.nodes[product];
      const int which = ix.init(add.inputs[1]) ? 1 : (ix.init(add.inputs[0]) ? 0 : -1);
      if (which < 0) continue;
      const auto mm = ix.producer_of(add.inputs[1 - which]);
      if (!mm || g.nodes[*mm].op_type != "MatMul" || ix.sole_reader(add.inputs[1 - which]) != product) continue;
      bias_name = add.inputs[which];
      removed.insert(product);
      product = *mm;
    }
    const Node& pn = g.nodes[product];
    Tensor w_oi;  // [out, in], float64
    Tensor b0 = zeros({c}, TensorOptions(kFloat64));
    if (pn.op_type == "Gemm" && gemm_is_linear(pn) && bias_name.empty()) {
      const Tensor* w = ix.init(pn.inputs[1]);
      const bool has_b = pn.inputs.size() > 2 && !pn.inputs[2].empty();
      const Tensor* b = has_b ? ix.init(pn.inputs[2]) : nullptr;
      if (!w || w->dim() != 2 || (has_b && (!b || b->numel() != c))) continue;
      w_oi = w->to(kFloat64);
      if (b) b0 = b->to(kFloat64).reshape({c});
    } else if (pn.op_type == "MatMul") {
      const Tensor* w = ix.init(pn.inputs[1]);
      if (!w || w->dim() != 2) continue;
      w_oi = w->to(kFloat64).t();
      if (!bias_name.empty()) {
        const Tensor* b = ix.init(bias_name);
        if (b->numel() != c) continue;
        b0 = b->to(kFloat64).reshape({c});
      }
    } else {
      continue;
    }
    if (w_oi.size(0) != c) continue;
    Node gemm = pn;
    gemm.op_type = "Gemm";
    gemm.name = pn.name + "+" + bn_op;
    gemm.attributes = {{"transB", int64_t{1}}};
    gemm.inputs = {pn.inputs[0], detail::add_initializer(g, base + ".folded_weight", w_oi * s.reshape({c, 1})),
                   detail::add_initializer(g, base + ".folded_bias", b0 * s + t)};
    gemm.outputs = {bn_out};
    removed.insert(product);
    removed.erase(i);
    g.nodes[i] = std::move(gemm);  // at the BatchNorm's place: after everything it reads
    detail::compact(g, removed);
    (void)bn_name;
    into_linear = true;
    return true;
  }
  return false;
}

}  // namespace

FoldReport fold_batch_norm(Graph& g) {
  FoldReport r;
  r.nodes_before = static_cast<int64_t>(g.nodes.size());
  const NoGradGuard no_grad;
  for (bool linear = false; fold_one(g, linear);) {
    ++r.folded;
    r.into_linear += linear ? 1 : 0;
  }
  r.nodes_after = static_cast<int64_t>(g.nodes.size());
  g.validate();
  return r;
}

int64_t remove_identities(Graph& g) {
  int64_t removed_count = 0;
  for (bool again = true; again;) {
    again = false;
    const GraphIndex ix(g);
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      const Node& n = g.nodes[i];
      if (n.op_type != "Identity" && n.op_type != "Dropout") continue;
      if (n.inputs.empty() || n.outputs.empty()) continue;
      if (n.outputs.size() > 1 && ix.readers.count(n.outputs[1])) continue;  // a Dropout mask someone reads
      if (n.outputs.size() > 1 && ix.graph_outputs.count(n.outputs[1])) continue;
      const std::string in = n.inputs[0], out = n.outputs[0];
      if (ix.graph_outputs.count(out)) {
        // The output keeps its name: the input's producer writes it instead,
        // when the input is a node's output that nothing else reads.
        const auto p = ix.producer_of(in);
        if (!p || ix.readers.at(in).size() != 1 || ix.graph_outputs.count(in)) continue;
        for (std::string& o : g.nodes[*p].outputs)
          if (o == in) o = out;
        for (ModuleOutput& m : g.module_outputs)
          if (m.value == in) m.value = out;
      } else {
        for (Node& other : g.nodes)
          for (std::string& x : other.inputs)
            if (x == out) x = in;
        for (ModuleOutput& m : g.module_outputs)
          if (m.value == out) m.value = in;
      }
      detail::compact(g, {i});
      ++removed_count;
      again = true;
      break;
    }
  }
  return removed_count;
}

int64_t remove_dead(Graph& g) {
  int64_t dropped = 0;
  for (bool again = true; again;) {
    again = false;
    const GraphIndex ix(g);
    std::set<size_t> dead;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      bool live = false;
      for (const std::string& o : g.nodes[i].outputs) live |= ix.readers.count(o) > 0 || ix.graph_outputs.count(o) > 0;
      if (!live) dead.insert(i);
    }
    if (!dead.empty()) {
      dropped += static_cast<int64_t>(dead.size());
      detail::compact(g, dead);
      again = true;
    }
  }
  detail::compact(g, {});
  return dropped;
}

StandardReport optimize_standard(Graph& g) {
  StandardReport r;
  r.nodes_before = static_cast<int64_t>(g.nodes.size());
  r.fold = fold_batch_norm(g);
  r.identities_removed = remove_identities(g);
  r.nodes_after = static_cast<int64_t>(g.nodes.size());
  return r;
}

}  // namespace kiln::exporter
