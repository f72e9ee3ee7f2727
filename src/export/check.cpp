// The per-node and per-module checks (include/kiln/export/check.h).
#include "kiln/export/check.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <limits>
#include <set>

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

namespace {

// `consumer` against `kiln` (one value each side): the max abs difference over
// the elements finite on both sides, scaled by the largest finite |kiln|.
// Equal infinities agree (a mask's -inf); a NaN or inf on one side only, a
// shape or dtype that differs, is a divergence whatever the tolerance.
ValueDiff diff_values(const Tensor& kiln, const Tensor& consumer, double tolerance) {
  ValueDiff d;
  if (kiln.sizes() != consumer.sizes()) {
    d.diverges = true;
    d.note = "shape " + consumer.shape_string() + " where kiln has " + kiln.shape_string();
    return d;
  }
  if (is_floating_point(kiln.dtype()) != is_floating_point(consumer.dtype())) {
    d.diverges = true;
    d.note = "dtype " + std::string(dtype_name(consumer.dtype())) + " where kiln has " +
             std::string(dtype_name(kiln.dtype()));
    return d;
  }
  const Tensor a = kiln.to(kFloat64).contiguous(), b = consumer.to(kFloat64).contiguous();
  const double* pa = a.data_ptr<double>();
  const double* pb = b.data_ptr<double>();
  double scale = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const bool fa = std::isfinite(pa[i]), fb = std::isfinite(pb[i]);
    if (fa && fb) {
      d.max_abs = std::max(d.max_abs, std::abs(pa[i] - pb[i]));
    } else if (std::isnan(pa[i]) != std::isnan(pb[i])) {
      d.note = "NaN on one side only";
    } else if (!std::isnan(pa[i]) && pa[i] != pb[i]) {
      d.note = "inf on one side only, or of the other sign";
    }
    if (fa) scale = std::max(scale, std::abs(pa[i]));
  }
  d.scaled = d.max_abs / std::max(scale, 1e-12);
  d.diverges = !d.note.empty() || d.scaled > tolerance;
  return d;
}

// The worse of two comparisons of a node's outputs: a divergence first, then
// the larger scaled difference.
void keep_worse(ValueDiff& into, const ValueDiff& d) {
  if (d.diverges && !into.diverges) {
    into = d;
  } else if (d.diverges == into.diverges) {
    into.max_abs = std::max(into.max_abs, d.max_abs);
    into.scaled = std::max(into.scaled, d.scaled);
    if (into.note.empty()) into.note = d.note;
  }
}

std::string with_root(const std::string& module) { return module.empty() ? "<root>" : module; }

}  // namespace

CheckReport compare_module_outputs(const Graph& graph, const std::map<std::string, Tensor>& kiln,
                                   const std::map<std::string, Tensor>& runtime, double tolerance) {
  std::map<std::string, const Node*> producer;
  for (const Node& n : graph.nodes)
    for (const std::string& o : n.outputs) producer[o] = &n;
  CheckReport r;
  r.tolerance = tolerance;
  for (const auto& entry : graph.module_outputs) {
    ModuleDiff d;
    d.module = with_root(entry.module);
    d.module_type = entry.type;
    const Node* n = producer.count(entry.value) ? producer.at(entry.value) : nullptr;
    d.node = n ? n->name : entry.value;
    d.op_type = n ? n->op_type : "";
    auto k = kiln.find(entry.value);
    auto rt = runtime.find(entry.value);
    if (k == kiln.end() || rt == runtime.end()) {
      d.diverges = true;
      d.note = k == kiln.end() ? "kiln never ran this module" : "the runtime returned no value";
    } else {
      const ValueDiff v = diff_values(k->second, rt->second, tolerance);
      d.max_abs = v.max_abs;
      d.scaled = v.scaled;
      d.diverges = v.diverges;
      d.note = v.note;
    }
    if (d.diverges && !r.first_divergent) r.first_divergent = r.rows.size();
    r.rows.push_back(std::move(d));
  }
  return r;
}

Graph with_node_outputs(const Graph& graph) {
  Graph g = graph;
  std::set<std::string> present;
  for (const Value& v : g.outputs) present.insert(v.name);
  for (const Node& n : graph.nodes)
    for (const std::string& o : n.outputs) {
      if (o.empty() || !present.insert(o).second) continue;
      auto it = g.values.find(o);
      KILN_CHECK(it != g.values.end(), InternalError, "export check: node ", n.name, " (", n.op_type, ") has output '",
                 o, "' with no dtype or shape in the graph's values");
      g.outputs.push_back(it->second);
    }
  return g;
}

std::string NodeDiff::verdict() const {
  const bool m = eager && eager->diverges;
  if (runtime.diverges && m) return "both";
  if (runtime.diverges) return "runtime";
  return m ? "module" : "ok";
}

NodeCheckReport compare_nodes(const Graph& graph, const std::map<std::string, Tensor>& consumer,
                              const std::map<std::string, Tensor>& kiln_runtime,
                              const std::map<std::string, Tensor>& kiln_eager, double tolerance) {
  // A value can be several modules' output (a Sequential's is its last
  // child's); module_outputs lists children first, so the first is innermost.
  std::map<std::string, std::vector<const ModuleOutput*>> modules_of;
  for (const ModuleOutput& m : graph.module_outputs) modules_of[m.value].push_back(&m);
  NodeCheckReport r;
  r.tolerance = tolerance;
  for (const Node& n : graph.nodes) {
    NodeDiff d;
    d.node = n.name;
    d.op_type = n.op_type;
    d.module = with_root(n.module);
    d.module_type = n.module_type;
    for (const std::string& o : n.outputs) {
      if (o.empty()) continue;
      d.outputs.push_back(o);
      auto c = consumer.find(o);
      auto k = kiln_runtime.find(o);
      ValueDiff v;
      if (c == consumer.end() || k == kiln_runtime.end()) {
        v.diverges = true;
        v.note = c == consumer.end() ? "the consumer returned no value " + o : "kiln's runtime computed no value " + o;
      } else {
        v = diff_values(k->second, c->second, tolerance);
      }
      keep_worse(d.runtime, v);
      auto mods = modules_of.find(o);
      if (mods == modules_of.end()) continue;
      if (!d.eager) {
        d.eager.emplace();
        d.eager_module = with_root(mods->second.front()->module);
      }
      auto e = kiln_eager.find(o);
      ValueDiff w;
      if (c == consumer.end() || e == kiln_eager.end()) {
        w.diverges = true;
        w.note = e == kiln_eager.end() ? "kiln's forward never ran module " + d.eager_module
                                       : "the consumer returned no value " + o;
      } else {
        w = diff_values(e->second, c->second, tolerance);
      }
      keep_worse(*d.eager, w);
    }
    d.diverges = d.runtime.diverges || (d.eager && d.eager->diverges);
    if (d.diverges && !r.first_divergent) r.first_divergent = r.rows.size();
    r.rows.push_back(std::move(d));
  }
  r.modules = compare_module_outputs(graph, kiln_eager, consumer, tolerance);
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

namespace kiln::exporter {
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

std::string json_diff(const ValueDiff& d) {
  return "{\"max_abs\": " + json_number(d.max_abs) + ", \"scaled\": " + json_number(d.scaled) +
         ", \"diverges\": " + (d.diverges ? "true" : "false") + ", \"note\": " + json_string(d.note) + "}";
}

__attribute__((format(printf, 2, 3))) void appendf(std::string& out, const char* format, ...) {
  char line[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  out += line;
}

std::string cell(const std::optional<ValueDiff>& d, bool scaled) {
  if (!d) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", scaled ? d->scaled : d->max_abs);
  return buf;
}

}  // namespace

std::string NodeCheckReport::str() const {
  std::string out;
  size_t wn = 4, wm = 6;
  for (const NodeDiff& d : rows) {
    wn = std::max(wn, d.node.size());
    wm = std::max(wm, d.module.size() + d.module_type.size() + 3);
  }
  const int n_w = static_cast<int>(std::min<size_t>(wn, 48)), m_w = static_cast<int>(std::min<size_t>(wm, 48));
  out += "per node: ONNX Runtime vs kiln's runtime of the graph (every node) and vs kiln's module (module outputs)\n";
  appendf(out, "%-*s %-18s %-*s %11s %11s %11s %11s  %s\n", n_w, "node", "op", m_w, "kiln module", "rt max abs",
          "rt max rel", "mod max abs", "mod max rel", "verdict");
  for (const NodeDiff& d : rows) {
    const std::string module = d.module + " (" + d.module_type + ")";
    std::string note = d.runtime.note;
    if (d.eager && !d.eager->note.empty()) note += (note.empty() ? "" : "; ") + d.eager->note;
    appendf(out, "%-*s %-18s %-*s %11.3e %11.3e %11s %11s  %s%s\n", n_w, d.node.c_str(), d.op_type.c_str(), m_w,
            module.c_str(), d.runtime.max_abs, d.runtime.scaled, cell(d.eager, false).c_str(),
            cell(d.eager, true).c_str(), d.verdict().c_str(), note.empty() ? "" : (" (" + note + ")").c_str());
  }
  out += "\nper module: ONNX Runtime vs kiln's module output\n";
  out += modules.str();
  if (first_divergent) {
    const NodeDiff& d = rows[*first_divergent];
    const bool rt = d.runtime.diverges, mod = d.eager && d.eager->diverges;
    const char* why = rt && mod ? "ONNX Runtime differs from both kiln's runtime and kiln's module"
                      : rt      ? "ONNX Runtime and kiln's runtime of the same graph disagree"
                           : "the exported graph differs from kiln's module (ONNX Runtime and kiln's runtime agree)";
    const ValueDiff& v = rt ? d.runtime : *d.eager;
    appendf(
        out,
        "first divergent node past %.0e (relative to the value's scale): %s (%s) of kiln module %s (%s): %s: max abs "
        "%.3e, relative %.3e\n",
        tolerance, d.node.c_str(), d.op_type.c_str(), d.module.c_str(), d.module_type.c_str(), why, v.max_abs,
        v.scaled);
  } else {
    appendf(out, "every node agrees within %.0e (relative to its scale): %zu nodes\n", tolerance, rows.size());
  }
  return out;
}

std::string NodeCheckReport::json() const {
  std::string out = "{\"tolerance\": " + json_number(tolerance) + ", \"first_divergent\": ";
  out += first_divergent ? json_string(rows[*first_divergent].node) : "null";
  out += ", \"nodes\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const NodeDiff& d = rows[i];
    std::string outs;
    for (const std::string& o : d.outputs) outs += (outs.empty() ? "" : ", ") + json_string(o);
    out += std::string(i ? ",\n  " : "\n  ") + "{\"node\": " + json_string(d.node) +
           ", \"op_type\": " + json_string(d.op_type) + ", \"module\": " + json_string(d.module) +
           ", \"module_type\": " + json_string(d.module_type) + ", \"outputs\": [" + outs +
           "], \"runtime\": " + json_diff(d.runtime) + ", \"eager\": " + (d.eager ? json_diff(*d.eager) : "null") +
           ", \"eager_module\": " + json_string(d.eager_module) + ", \"verdict\": " + json_string(d.verdict()) + "}";
  }
  out += "],\n \"modules\": [";
  for (size_t i = 0; i < modules.rows.size(); ++i) {
    const ModuleDiff& d = modules.rows[i];
    out += std::string(i ? ",\n  " : "\n  ") + "{\"module\": " + json_string(d.module) +
           ", \"module_type\": " + json_string(d.module_type) + ", \"node\": " + json_string(d.node) +
           ", \"op_type\": " + json_string(d.op_type) + ", \"max_abs\": " + json_number(d.max_abs) +
           ", \"scaled\": " + json_number(d.scaled) + ", \"diverges\": " + (d.diverges ? "true" : "false") +
           ", \"note\": " + json_string(d.note) + "}";
  }
  return out + "]}\n";
}

}  // namespace kiln::exporter
