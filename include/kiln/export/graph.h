// export::Graph: the small inference-graph IR that kiln's exporters write and
// read. It is ONNX-shaped on purpose (nodes named by ONNX operator type, with
// ONNX attributes), so writing an ONNX file is a direct translation, and it is
// independent of the protobuf library, so tests and passes (inference
// optimisation, the per-node --check) work on it without touching protobuf.
//
// A graph is captured from a module with export::capture (capture.h): values
// are named edges; each has a dtype and a shape whose dims are either fixed
// sizes or symbols ("batch", "seq") that stay free in the exported file.
// Weights and other constant tensors are initializers, named by their
// state_dict() names where they are a module's parameter or buffer.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::exporter {

/// One dimension of a value's shape: a fixed size, or a symbol left free in the
/// exported graph (the size is then known only when the graph runs).
struct Dim {
  int64_t size = -1;   // >= 0 when fixed
  std::string symbol;  // non-empty when symbolic
  static Dim fixed(int64_t n) { return Dim{n, {}}; }
  static Dim sym(std::string name) { return Dim{-1, std::move(name)}; }
  bool is_fixed() const { return symbol.empty(); }
  bool operator==(const Dim&) const = default;
  /// "4" or "batch".
  std::string str() const { return is_fixed() ? std::to_string(size) : symbol; }
};
using Shape = std::vector<Dim>;
/// "[batch, 3, 32, 32]".
std::string shape_string(const Shape& s);

/// A named edge of the graph: a graph input, a node's output or an initializer.
struct Value {
  std::string name;
  DType dtype = kFloat32;
  Shape shape;
};

/// An ONNX attribute value: int, float, string, ints or floats.
using Attribute = std::variant<int64_t, float, std::string, std::vector<int64_t>, std::vector<float>>;

/// One operator application. `op_type` is the ONNX operator ("Conv", "Gemm");
/// `module` and `module_type` say which kiln module emitted it ("layer1.0.bn1",
/// "BatchNorm2d"), so a report on a node can name the kiln code it stands for.
struct Node {
  std::string name;
  std::string op_type;
  std::vector<std::string> inputs;  // value names; "" for an omitted optional input
  std::vector<std::string> outputs;
  std::map<std::string, Attribute> attributes;
  std::string module;
  std::string module_type;
};

/// A module's output in the graph: the module's path ("" for the root), its
/// type ("LayerNorm") and the value that holds what its forward returns.
struct ModuleOutput {
  std::string module;
  std::string type;
  std::string value;
};

/// A captured inference graph: inputs, nodes in execution order, initializers
/// and outputs. Every node input is a graph input, an initializer or the output
/// of an earlier node (validate() checks it).
struct Graph {
  std::string name;
  std::vector<Value> inputs;
  std::vector<Value> outputs;
  std::vector<Node> nodes;
  /// Constant tensors (weights, buffers, shape constants), contiguous, by value name.
  std::vector<std::pair<std::string, Tensor>> initializers;
  /// Every value's dtype and shape as capture inferred it (inputs, node outputs, initializers).
  std::map<std::string, Value> values;
  /// Each module's output value, in the order the modules finish (children
  /// before their parent; "" is the root, whose output is "output"). Modules
  /// that add no node (Dropout, Identity) are left out. What the per-module
  /// check (check.h) compares against kiln's own forward.
  std::vector<ModuleOutput> module_outputs;
  /// Values whose kUInt8 bytes are int8 (two's complement): kiln's core has no
  /// int8 dtype, so an int8 initializer (a QDQ graph's weight, its zero points)
  /// or an int8 node output is held as uint8 bytes and named here; the ONNX
  /// writer and reader map these names to and from ONNX's INT8.
  std::set<std::string> int8_values;

  /// The node count per ONNX operator type, e.g. {"Conv": 5, "Relu": 5}.
  std::map<std::string, int64_t> op_counts() const;
  /// Throws InternalError naming the node when a node reads a value nothing
  /// defined before it, or a value is defined twice.
  void validate() const;
};

}  // namespace kiln::exporter
