// exporter::Session (include/kiln/export/runtime.h): compiles each node of a
// Graph into a kernel once, then runs them in node order over a vector of
// value slots, releasing each intermediate after its last reader.
#include "kiln/export/runtime.h"

#include <set>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "qdq.h"
#include "runtime_kernels.h"

namespace kiln::exporter {

using detail::node_label;

namespace {

template <typename T>
const T* attr_of(const Node& node, const std::string& name, const char* kind) {
  auto it = node.attributes.find(name);
  if (it == node.attributes.end()) return nullptr;
  const T* v = std::get_if<T>(&it->second);
  KILN_CHECK(v != nullptr, ValueError, node_label(node), ": expected attribute '", name, "' to be ", kind,
             ", got another kind");
  return v;
}

}  // namespace

int64_t attr_int(const Node& node, const std::string& name, int64_t fallback) {
  const auto* v = attr_of<int64_t>(node, name, "an int");
  return v ? *v : fallback;
}
float attr_float(const Node& node, const std::string& name, float fallback) {
  const auto* v = attr_of<float>(node, name, "a float");
  return v ? *v : fallback;
}
std::string attr_string(const Node& node, const std::string& name, const std::string& fallback) {
  const auto* v = attr_of<std::string>(node, name, "a string");
  return v ? *v : fallback;
}
std::vector<int64_t> attr_ints(const Node& node, const std::string& name, const std::vector<int64_t>& fallback) {
  const auto* v = attr_of<std::vector<int64_t>>(node, name, "a list of ints");
  return v ? *v : fallback;
}

const Tensor* find_initializer(const Graph& graph, const std::string& name) {
  for (const auto& [n, t] : graph.initializers)
    if (n == name) return &t;
  return nullptr;
}

std::vector<std::string> supported_ops() {
  std::vector<std::string> ops;
  for (const auto& [op, f] : detail::builtin_kernels()) ops.push_back(op);
  return ops;
}

KernelFactory builtin_kernel(const std::string& op_type) {
  const auto& t = detail::builtin_kernels();
  auto it = t.find(op_type);
  KILN_CHECK(it != t.end(), ValueError, "runtime: no built-in kernel for op type ", op_type);
  return it->second;
}

Session::Session(Graph graph, SessionOptions options) : graph_(std::move(graph)) {
  graph_.validate();
  if (options.fuse_qdq) detail::fuse_qdq(graph_, options.uint8_between_layers);
  std::map<std::string, int64_t> slot;
  auto define = [&](const std::string& name) { slot[name] = num_slots_++; };
  for (const Value& v : graph_.inputs) {
    define(v.name);
    input_slots_.push_back(slot[v.name]);
  }
  for (const auto& [name, t] : graph_.initializers) {
    define(name);
    constants_.emplace_back(slot[name], t);
  }
  const auto& builtin = detail::builtin_kernels();
  for (size_t i = 0; i < graph_.nodes.size(); ++i) {
    const Node& n = graph_.nodes[i];
    auto it = options.kernels.find(n.op_type);
    const KernelFactory* factory = nullptr;
    if (it != options.kernels.end()) {
      factory = &it->second;
    } else {
      auto b = builtin.find(n.op_type);
      KILN_CHECK(b != builtin.end(), ValueError, "runtime: ", node_label(n), " of module '", n.module,
                 "': no kernel for op type ", n.op_type, " (the built-in kernels cover ", builtin.size(),
                 " ONNX ops; see exporter::supported_ops())");
      factory = &b->second;
    }
    try {
      kernels_.push_back((*factory)(n, graph_));
    } catch (const Error& e) {
      const std::string what = e.what();
      // A factory's error may already name the node.
      throw ValueError(what.find(n.name) != std::string::npos ? "runtime: " + what
                                                              : "runtime: " + node_label(n) + ": " + what);
    }
    std::vector<int64_t> ins, outs;
    for (const std::string& in : n.inputs) ins.push_back(in.empty() ? -1 : slot.at(in));
    for (const std::string& out : n.outputs) {
      if (out.empty()) {
        outs.push_back(-1);
        continue;
      }
      define(out);
      outs.push_back(slot[out]);
    }
    node_inputs_.push_back(std::move(ins));
    node_outputs_.push_back(std::move(outs));
  }
  for (const Value& v : graph_.outputs) output_slots_.push_back(slot.at(v.name));

  // Each intermediate is released after its last reader (never a graph output,
  // input or initializer: those are owned elsewhere or returned).
  std::vector<int64_t> last(static_cast<size_t>(num_slots_), -1);
  for (size_t i = 0; i < node_inputs_.size(); ++i)
    for (int64_t s : node_inputs_[i])
      if (s >= 0) last[static_cast<size_t>(s)] = static_cast<int64_t>(i);
  std::set<int64_t> kept(output_slots_.begin(), output_slots_.end());
  release_after_.assign(graph_.nodes.size(), {});
  for (size_t i = 0; i < node_outputs_.size(); ++i)
    for (int64_t s : node_outputs_[i]) {
      if (s < 0 || kept.count(s)) continue;
      const int64_t l = last[static_cast<size_t>(s)];
      // A value nothing reads is dropped right after the node that made it.
      release_after_[static_cast<size_t>(l >= 0 ? l : static_cast<int64_t>(i))].push_back(s);
    }
}

const Graph& Session::graph() const { return graph_; }

std::vector<Tensor> Session::run(const std::vector<Tensor>& inputs) const {
  KILN_CHECK(inputs.size() == graph_.inputs.size(), ValueError, "runtime: graph '", graph_.name, "' expects ",
             graph_.inputs.size(), " inputs, got ", inputs.size());
  std::map<std::string, int64_t> bound;  // symbolic dim -> size
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = graph_.inputs[i];
    const Tensor& t = inputs[i];
    KILN_CHECK(t.defined(), ValueError, "runtime: input '", v.name, "' is an undefined tensor");
    KILN_CHECK(t.dtype() == v.dtype, DTypeError, "runtime: input '", v.name, "' expects dtype ", dtype_name(v.dtype),
               ", got ", dtype_name(t.dtype()));
    bool ok = t.dim() == static_cast<int64_t>(v.shape.size());
    for (size_t d = 0; ok && d < v.shape.size(); ++d) {
      const Dim& dim = v.shape[d];
      const int64_t got = t.size(static_cast<int64_t>(d));
      if (dim.is_fixed()) {
        ok = dim.size < 0 || got == dim.size;  // (a dim of unknown size, -1, takes any)
      } else {
        auto [it, fresh] = bound.emplace(dim.symbol, got);
        KILN_CHECK(fresh || it->second == got, ShapeError, "runtime: input '", v.name, "' dim ", d, " (\"", dim.symbol,
                   "\") is ", got, ", but \"", dim.symbol, "\" is ", it->second, " in an earlier dim or input");
      }
    }
    KILN_CHECK(ok, ShapeError, "runtime: input '", v.name, "' expects shape ", shape_string(v.shape), ", got ",
               t.shape_string());
  }

  const InferenceModeGuard inference;
  std::vector<Tensor> slots(static_cast<size_t>(num_slots_));
  for (size_t i = 0; i < inputs.size(); ++i) slots[static_cast<size_t>(input_slots_[i])] = inputs[i];
  for (const auto& [s, t] : constants_) slots[static_cast<size_t>(s)] = t;
  std::vector<Tensor> args;
  for (size_t i = 0; i < kernels_.size(); ++i) {
    args.clear();
    for (int64_t s : node_inputs_[i]) args.push_back(s >= 0 ? slots[static_cast<size_t>(s)] : Tensor());
    std::vector<Tensor> outs = kernels_[i](args);
    const auto& want = node_outputs_[i];
    const Node& n = graph_.nodes[i];
    for (size_t k = 0; k < want.size(); ++k) {
      if (want[k] < 0) continue;
      KILN_CHECK(k < outs.size() && outs[k].defined(), ValueError, "runtime: ", node_label(n), " gave ", outs.size(),
                 " outputs, the graph reads output ", k);
      slots[static_cast<size_t>(want[k])] = std::move(outs[k]);
    }
    for (int64_t s : release_after_[i]) slots[static_cast<size_t>(s)] = Tensor();
  }
  std::vector<Tensor> result;
  for (int64_t s : output_slots_) result.push_back(slots[static_cast<size_t>(s)]);
  return result;
}

std::map<std::string, Tensor> run_all_values(const Graph& graph, const std::vector<Tensor>& inputs,
                                             SessionOptions options) {
  Graph g = graph;
  g.outputs.clear();
  for (const Node& n : graph.nodes)
    for (const std::string& o : n.outputs) {
      if (o.empty()) continue;
      auto it = graph.values.find(o);
      g.outputs.push_back(it != graph.values.end() ? it->second : Value{o, kFloat32, {}});
    }
  const Session s(std::move(g), std::move(options));
  const std::vector<Tensor> got = s.run(inputs);
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < got.size(); ++i) out[s.graph().outputs[i].name] = got[i];
  return out;
}

}  // namespace kiln::exporter
