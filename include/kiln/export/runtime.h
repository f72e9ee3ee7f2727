// A graph runtime for export::Graph: runs an inference graph (captured from a
// kiln module, or read from an ONNX file by load_onnx) with kiln's own ops, so
// an exported or foreign ONNX model can be executed, checked node by node and
// optimised without another runtime.
//
//   exporter::Session s(exporter::load_onnx("resnet.onnx"));
//   Tensor logits = s.run({images})[0];
//
// Each node is compiled once into a Kernel when the Session is built (its
// attributes validated, constant inputs readable for pre-packing); kernels
// follow the ONNX operator specification at opsets 13 to 18 (numpy-style
// broadcasting, the attribute defaults of those opsets). Other code (the
// inference optimiser's fused nodes) adds or overrides kernels by op type
// through SessionOptions.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/export/graph.h"

namespace kiln::exporter {

/// A compiled node: called once per run with the node's inputs (an undefined Tensor for an omitted
/// optional input), returns its outputs in order.
using Kernel = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
/// Compiles one node once, when a Session is built: it may read constant inputs (initializers) through
/// `graph` to pre-pack weights, and validate attributes (errors name the node and op).
using KernelFactory = std::function<Kernel(const Node& node, const Graph& graph)>;

struct SessionOptions {
  /// Extra or overriding kernels by op_type (e.g. "kiln.FusedConv" from the inference optimiser).
  std::map<std::string, KernelFactory> kernels;
  /// Run an int8 QDQ pattern (QuantizeLinear -> DequantizeLinear -> Conv / Gemm reading an int8 weight
  /// through DequantizeLinear, as export::capture writes a quantized layer) as one int8 kernel: the
  /// numbers of the eager int8 layer, at int8 speed. Off: each Q / DQ node runs on its own, in float.
  bool fuse_qdq = true;
  /// With fuse_qdq: between two fused int8 layers, pass uint8. A layer whose output only fused int8
  /// layers read (at one input scale and zero point) requantizes in its epilogue, so the float output is
  /// never written and the readers skip their quantization pass. oneDNN scales by sx·sw/sy in one step
  /// where the eager model scales by sx·sw and then by 1/sy, so a value within float rounding of a
  /// rounding boundary can land one code away (docs/quantization.md gives the measured effect); off, the
  /// runtime computes the eager int8 model's numbers exactly.
  bool uint8_between_layers = true;
};

/// Runs an export::Graph with kiln's ops, in node order, under InferenceMode; intermediates are released
/// after their last reader. Inputs are checked against the graph's input dtypes and shapes (symbolic dims
/// bind consistently: two "batch" dims must agree), with errors naming the input, expected and got.
class Session {
 public:
  /// Validates the graph and compiles every node; throws ValueError naming a node whose op has no kernel
  /// or whose attributes its kernel refuses.
  explicit Session(Graph graph, SessionOptions options = {});
  /// One tensor per graph input, in the graph's order; returns one per graph output.
  std::vector<Tensor> run(const std::vector<Tensor>& inputs) const;
  const Graph& graph() const;

 private:
  Graph graph_;
  std::vector<Kernel> kernels_;
  // Every value gets a slot; a node reads and writes slots by index.
  std::vector<std::vector<int64_t>> node_inputs_, node_outputs_;
  std::vector<std::vector<int64_t>> release_after_;  // per node: slots read for the last time
  std::vector<std::pair<int64_t, Tensor>> constants_;
  std::vector<int64_t> input_slots_, output_slots_;
  int64_t num_slots_ = 0;
};

/// Runs `graph` once on `inputs` and returns every value its nodes compute, by
/// name (nothing released): what a node-by-node comparison with another
/// runtime, or with kiln's own modules (check.h's compare_module_outputs), reads.
std::map<std::string, Tensor> run_all_values(const Graph& graph, const std::vector<Tensor>& inputs,
                                             SessionOptions options = {});

/// The op types the built-in kernels implement.
std::vector<std::string> supported_ops();
/// The built-in kernel factory of `op_type`; throws ValueError when there is none.
/// (What an optimiser's factory falls back to for a node it does not rewrite.)
KernelFactory builtin_kernel(const std::string& op_type);

/// The initializer named `name` of `graph`, or nullptr: what a KernelFactory
/// reads to pre-pack a constant input.
const Tensor* find_initializer(const Graph& graph, const std::string& name);

/// A node's attribute of the given kind, or `fallback` when absent; a present
/// attribute of another kind throws ValueError naming the node, op and attribute.
int64_t attr_int(const Node& node, const std::string& name, int64_t fallback);
float attr_float(const Node& node, const std::string& name, float fallback);
std::string attr_string(const Node& node, const std::string& name, const std::string& fallback);
std::vector<int64_t> attr_ints(const Node& node, const std::string& name, const std::vector<int64_t>& fallback);

/// Reads an ONNX file (through Debian's ONNX protobuf classes, as the writer does) into a Graph:
/// inputs/outputs with symbolic dims, initializers (raw_data, typed fields, or external data in a file
/// relative to the model's directory: a location that is absolute, has "..", or resolves outside that
/// directory through a symlink is refused, as is an offset + length past the file's end or unequal to
/// the tensor's byte size; a missing file is an IOError naming it), attributes. Refuses an op outside supported_ops()
/// naming node and op type, a hostile or truncated file with a clear error (never a crash).
Graph load_onnx(const std::string& path);

/// Reads one serialized onnx::TensorProto file (the test_data_set_*/input_0.pb
/// files of ONNX's backend tests) into a tensor (INT8 as its bytes, kUInt8). Throws FormatError for a file
/// that is not one, DTypeError for an element type kiln has no dtype for.
Tensor load_onnx_tensor(const std::string& path);

}  // namespace kiln::exporter
