// GraphBuilder: what the module emitters of capture.cpp write nodes through.
// It names values, records each one's dtype and shape, turns parameters into
// initializers (once per tensor, so a tied weight is one initializer) and
// remembers which module is being emitted, so every node carries its module's
// path and type. Private to src/export.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/export/graph.h"

namespace kiln::exporter::detail {

class GraphBuilder {
 public:
  explicit GraphBuilder(int64_t opset) : opset(opset) {}

  /// Adds a node with one output of `dtype` and `shape`; returns the output's name.
  std::string node(const std::string& op, std::vector<std::string> inputs, Shape shape, DType dtype = kFloat32,
                   std::map<std::string, Attribute> attributes = {});
  /// Adds a node with several outputs (Split); returns their names.
  std::vector<std::string> node_n(const std::string& op, std::vector<std::string> inputs,
                                  const std::vector<Shape>& shapes, DType dtype,
                                  std::map<std::string, Attribute> attributes = {});
  /// `t` (a parameter or buffer) as an initializer named `name`, converted to
  /// float32 when floating; the same tensor asked for twice is one initializer.
  std::string weight(const std::string& name, const Tensor& t);
  /// A constant int64 vector (shapes, axes, split sizes).
  std::string ints(const std::vector<int64_t>& v);
  /// A constant float32 scalar (shape []), e.g. GELU's 0.5.
  std::string scalar(float v);
  /// A constant tensor under a fresh name.
  std::string constant(const std::string& hint, const Tensor& t);

  const Value& value(const std::string& name) const;
  const Shape& shape(const std::string& name) const { return value(name).shape; }

  /// Sets the module that the following nodes belong to; returns the previous one.
  std::pair<std::string, std::string> enter(const std::string& path, const std::string& type);
  void leave(const std::pair<std::string, std::string>& previous) {
    module_ = previous.first;
    module_type_ = previous.second;
  }
  const std::string& module_path() const { return module_; }

  Graph graph;
  const int64_t opset;

 private:
  std::string fresh(const std::string& hint);
  std::string module_, module_type_;
  std::map<std::string, int64_t> counters_;
  std::map<const void*, std::string> weights_;  // TensorImpl -> initializer name
};

/// RAII: nodes emitted while it lives belong to module `path` of type `type`.
class ModuleScope {
 public:
  ModuleScope(GraphBuilder& b, const std::string& path, const std::string& type)
      : b_(b), previous_(b.enter(path, type)) {}
  ~ModuleScope() { b_.leave(previous_); }
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

 private:
  GraphBuilder& b_;
  std::pair<std::string, std::string> previous_;
};

}  // namespace kiln::exporter::detail
