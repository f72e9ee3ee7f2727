// export::Graph's own checks and summaries (include/kiln/export/graph.h) and
// the GraphBuilder the emitters write through (builder.h).
#include "kiln/export/graph.h"

#include <set>

#include "builder.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::exporter {

std::string shape_string(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + s[i].str();
  return out + "]";
}

std::map<std::string, int64_t> Graph::op_counts() const {
  std::map<std::string, int64_t> counts;
  for (const Node& n : nodes) ++counts[n.op_type];
  return counts;
}

void Graph::validate() const {
  std::set<std::string> defined;
  auto define = [&](const std::string& name, const std::string& what) {
    KILN_CHECK(defined.insert(name).second, InternalError, "export graph '", this->name, "': value '", name,
               "' is defined twice (again by ", what, ")");
  };
  for (const Value& v : inputs) define(v.name, "a graph input");
  for (const auto& [name, t] : initializers) define(name, "an initializer");
  for (const Node& n : nodes) {
    for (const std::string& in : n.inputs)
      KILN_CHECK(in.empty() || defined.count(in), InternalError, "export graph '", this->name, "': node ", n.name, " (",
                 n.op_type, ", module '", n.module, "') reads '", in, "', which nothing defined before it");
    for (const std::string& out : n.outputs) define(out, "node " + n.name);
  }
  for (const Value& v : outputs)
    KILN_CHECK(defined.count(v.name), InternalError, "export graph '", this->name, "': output '", v.name,
               "' is never computed");
}

namespace detail {

std::string GraphBuilder::fresh(const std::string& hint) {
  const std::string base = module_.empty() ? hint : module_ + "/" + hint;
  const int64_t k = counters_[base]++;
  return k == 0 ? base : base + "_" + std::to_string(k);
}

std::pair<std::string, std::string> GraphBuilder::enter(const std::string& path, const std::string& type) {
  std::pair<std::string, std::string> previous{module_, module_type_};
  module_ = path;
  module_type_ = type;
  return previous;
}

const Value& GraphBuilder::value(const std::string& name) const {
  auto it = graph.values.find(name);
  KILN_ASSERT(it != graph.values.end(), "export: no value named ", name);
  return it->second;
}

std::vector<std::string> GraphBuilder::node_n(const std::string& op, std::vector<std::string> inputs,
                                              const std::vector<Shape>& shapes, DType dtype,
                                              std::map<std::string, Attribute> attributes) {
  Node n;
  n.name = fresh(op);
  n.op_type = op;
  n.inputs = std::move(inputs);
  n.attributes = std::move(attributes);
  n.module = module_;
  n.module_type = module_type_;
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::string out = shapes.size() == 1 ? n.name : n.name + ":" + std::to_string(i);
    graph.values[out] = Value{out, dtype, shapes[i]};
    n.outputs.push_back(std::move(out));
  }
  graph.nodes.push_back(std::move(n));
  return graph.nodes.back().outputs;
}

std::string GraphBuilder::node(const std::string& op, std::vector<std::string> inputs, Shape shape, DType dtype,
                               std::map<std::string, Attribute> attributes) {
  return node_n(op, std::move(inputs), {std::move(shape)}, dtype, std::move(attributes))[0];
}

namespace {
Shape fixed_shape(const Tensor& t) {
  Shape s;
  for (int64_t d : t.sizes()) s.push_back(Dim::fixed(d));
  return s;
}
}  // namespace

std::string GraphBuilder::weight(const std::string& name, const Tensor& t) {
  KILN_ASSERT(t.defined(), "export: weight ", name, " is undefined");
  auto it = weights_.find(t.impl());
  if (it != weights_.end()) return it->second;
  const NoGradGuard no_grad;
  Tensor c = t.detach();
  if (is_floating_point(c.dtype()) && c.dtype() != kFloat32) c = c.to(kFloat32);
  c = c.contiguous().clone();
  KILN_CHECK(!graph.values.count(name), InternalError, "export: initializer name ", name, " is taken");
  graph.initializers.emplace_back(name, c);
  graph.values[name] = Value{name, c.dtype(), fixed_shape(c)};
  weights_[t.impl()] = name;
  return name;
}

std::string GraphBuilder::constant(const std::string& hint, const Tensor& t) {
  std::string name = fresh(hint);
  graph.initializers.emplace_back(name, t.contiguous());
  graph.values[name] = Value{name, t.dtype(), fixed_shape(t)};
  return name;
}

std::string GraphBuilder::ints(const std::vector<int64_t>& v) {
  return constant("const", tensor(v, {static_cast<int64_t>(v.size())}));
}

std::string GraphBuilder::scalar(float v) { return constant("const", full({}, v, TensorOptions(kFloat32))); }

}  // namespace detail
}  // namespace kiln::exporter
