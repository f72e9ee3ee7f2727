// The per-module check (include/kiln/export/check.h).
#include "kiln/export/check.h"

#include <cmath>
#include <cstdio>
#include <limits>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"

namespace kiln::exporter {

std::map<std::string, Tensor> module_values(nn::Module& module, const Graph& graph, const Tensor& input) {
  std::map<std::string, nn::Module*> by_path;
  for (const auto& entry : module.named_modules()) by_path[entry.first] = entry.second;
  std::map<std::string, Tensor> values;
  std::vector<HookHandle> handles;
  for (const auto& entry : graph.module_outputs) {
    auto it = by_path.find(entry.module);
    KILN_CHECK(it != by_path.end(), ValueError, "export check: the graph names module '", entry.module,
               "', which the model does not have (was the graph captured from another model?)");
    const std::string value = entry.value;
    std::map<std::string, Tensor>* out = &values;
    handles.push_back(it->second->register_forward_hook([out, value](nn::Module&, const Tensor&, const Tensor& y) {
      (*out)[value] = y.detach().contiguous();
      return Tensor();
    }));
  }
  const bool was_training = module.is_training();
  module.eval();
  try {
    const NoGradGuard no_grad;
    module(input);
  } catch (...) {
    for (HookHandle& h : handles) h.remove();
    module.train(was_training);
    throw;
  }
  for (HookHandle& h : handles) h.remove();
  module.train(was_training);
  return values;
}

Graph with_module_outputs(const Graph& graph) {
  Graph g = graph;
  for (const auto& entry : graph.module_outputs) {
    bool present = false;
    for (const Value& v : g.outputs) present = present || v.name == entry.value;
    if (!present) g.outputs.push_back(g.values.at(entry.value));
  }
  return g;
}

CheckReport compare_module_outputs(const Graph& graph, const std::map<std::string, Tensor>& kiln,
                                   const std::map<std::string, Tensor>& runtime, double tolerance) {
  std::map<std::string, const Node*> producer;
  for (const Node& n : graph.nodes)
    for (const std::string& o : n.outputs) producer[o] = &n;
  CheckReport r;
  r.tolerance = tolerance;
  for (const auto& entry : graph.module_outputs) {
    ModuleDiff d;
    d.module = entry.module.empty() ? "<root>" : entry.module;
    d.module_type = entry.type;
    const Node* n = producer.count(entry.value) ? producer.at(entry.value) : nullptr;
    d.node = n ? n->name : entry.value;
    d.op_type = n ? n->op_type : "";
    auto k = kiln.find(entry.value);
    auto rt = runtime.find(entry.value);
    if (k == kiln.end() || rt == runtime.end()) {
      d.diverges = true;
      d.note = k == kiln.end() ? "kiln never ran this module" : "the runtime returned no value";
    } else if (k->second.sizes() != rt->second.sizes()) {
      d.diverges = true;
      d.note = "shape " + rt->second.shape_string() + " where kiln has " + k->second.shape_string();
    } else {
      const Tensor a = k->second.to(kFloat64).contiguous(), b = rt->second.to(kFloat64).contiguous();
      const double* pa = a.data_ptr<double>();
      const double* pb = b.data_ptr<double>();
      double scale = 0;
      for (int64_t i = 0; i < a.numel(); ++i) {
        if (std::isnan(pa[i]) != std::isnan(pb[i])) d.note = "NaN on one side only";
        if (!std::isnan(pa[i]) && !std::isnan(pb[i])) d.max_abs = std::max(d.max_abs, std::abs(pa[i] - pb[i]));
        if (!std::isnan(pa[i])) scale = std::max(scale, std::abs(pa[i]));
      }
      d.scaled = d.max_abs / std::max(scale, 1e-12);
      d.diverges = !d.note.empty() || d.scaled > tolerance;
    }
    if (d.diverges && !r.first_divergent) r.first_divergent = r.rows.size();
    r.rows.push_back(std::move(d));
  }
  return r;
}

std::string CheckReport::str() const {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-32s %-20s %-20s %11s %11s\n", "module", "type", "node op", "max abs", "max rel");
  out += line;
  for (const ModuleDiff& d : rows) {
    std::snprintf(line, sizeof line, "%-32s %-20s %-20s %11.3e %11.3e%s%s\n", d.module.c_str(), d.module_type.c_str(),
                  d.op_type.c_str(), d.max_abs, d.scaled, d.diverges ? "  <- diverges" : "",
                  d.note.empty() ? "" : (" (" + d.note + ")").c_str());
    out += line;
  }
  if (first_divergent) {
    const ModuleDiff& d = rows[*first_divergent];
    std::snprintf(line, sizeof line,
                  "first divergence past %.0e (relative to the output's scale): module %s (%s), node %s (%s): max "
                  "abs %.3e, relative %.3e\n",
                  tolerance, d.module.c_str(), d.module_type.c_str(), d.node.c_str(), d.op_type.c_str(), d.max_abs,
                  d.scaled);
  } else {
    std::snprintf(line, sizeof line, "every module's output agrees within %.0e (relative to its scale)\n", tolerance);
  }
  out += line;
  return out;
}

}  // namespace kiln::exporter
