// ONNX writing (include/kiln/export/onnx.h): export::Graph -> onnx::ModelProto
// through the protobuf classes of Debian's libonnx-dev (DESIGN.md §7: never
// hand-written protobuf).
#include "kiln/export/onnx.h"

#include <onnx/onnx_pb.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "kiln/core/error.h"

namespace kiln::exporter {
namespace {

int32_t onnx_dtype(DType t) {
  switch (t) {
    case kFloat32: return onnx::TensorProto::FLOAT;
    case kInt64: return onnx::TensorProto::INT64;
    case kBool: return onnx::TensorProto::BOOL;
    default:
      throw DTypeError("export: ONNX values of dtype " + std::string(dtype_name(t)) +
                       " are not written (float32, int64 and bool are)");
  }
}

void set_type(onnx::ValueInfoProto& vi, const Value& v) {
  vi.set_name(v.name);
  auto* tt = vi.mutable_type()->mutable_tensor_type();
  tt->set_elem_type(onnx_dtype(v.dtype));
  auto* shape = tt->mutable_shape();
  for (const Dim& d : v.shape) {
    auto* dim = shape->add_dim();
    if (d.is_fixed())
      dim->set_dim_value(d.size);
    else
      dim->set_dim_param(d.symbol);
  }
}

void set_attribute(onnx::AttributeProto& a, const std::string& name, const Attribute& value) {
  a.set_name(name);
  if (const auto* i = std::get_if<int64_t>(&value)) {
    a.set_type(onnx::AttributeProto::INT);
    a.set_i(*i);
  } else if (const auto* f = std::get_if<float>(&value)) {
    a.set_type(onnx::AttributeProto::FLOAT);
    a.set_f(*f);
  } else if (const auto* s = std::get_if<std::string>(&value)) {
    a.set_type(onnx::AttributeProto::STRING);
    a.set_s(*s);
  } else if (const auto* is = std::get_if<std::vector<int64_t>>(&value)) {
    a.set_type(onnx::AttributeProto::INTS);
    for (int64_t v : *is) a.add_ints(v);
  } else {
    a.set_type(onnx::AttributeProto::FLOATS);
    for (float v : std::get<std::vector<float>>(value)) a.add_floats(v);
  }
}

void set_tensor(onnx::TensorProto& p, const std::string& name, const Tensor& t) {
  p.set_name(name);
  p.set_data_type(onnx_dtype(t.dtype()));
  for (int64_t d : t.sizes()) p.add_dims(d);
  const Tensor c = t.contiguous();
  // raw_data is little-endian, as the machines kiln builds for.
  p.set_raw_data(std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes())));
}

}  // namespace

OnnxReport write_onnx(const Graph& graph, const std::string& path, int64_t opset, const std::string& doc) {
  graph.validate();
  onnx::ModelProto model;
  model.set_ir_version(8);
  model.set_producer_name("kiln");
  model.set_producer_version("0.1.0");
  if (!doc.empty()) model.set_doc_string(doc);
  auto* op = model.add_opset_import();
  op->set_domain("");
  op->set_version(opset);
  auto* g = model.mutable_graph();
  g->set_name(graph.name);
  OnnxReport r;
  r.path = path;
  for (const Value& v : graph.inputs) set_type(*g->add_input(), v);
  for (const Value& v : graph.outputs) set_type(*g->add_output(), v);
  for (const auto& [name, t] : graph.initializers) {
    set_tensor(*g->add_initializer(), name, t);
    r.parameters += t.numel();
  }
  for (const Node& n : graph.nodes) {
    auto* p = g->add_node();
    p->set_name(n.name);
    p->set_op_type(n.op_type);
    for (const std::string& in : n.inputs) p->add_input(in);
    for (const std::string& out : n.outputs) p->add_output(out);
    for (const auto& [name, value] : n.attributes) set_attribute(*p->add_attribute(), name, value);
    // Which kiln module the node stands for ("module layer1.0.bn1 (BatchNorm2d)"):
    // ONNX 1.12's NodeProto has no metadata, its doc string carries it.
    if (!n.module_type.empty())
      p->set_doc_string("module " + (n.module.empty() ? "<root>" : n.module) + " (" + n.module_type + ")");
  }
  r.nodes = static_cast<int64_t>(graph.nodes.size());
  r.initializers = static_cast<int64_t>(graph.initializers.size());
  r.op_counts = graph.op_counts();
  const size_t bytes = model.ByteSizeLong();
  KILN_CHECK(bytes < static_cast<size_t>(std::numeric_limits<int32_t>::max()), ValueError, "export: the model is ",
             bytes,
             " bytes, past protobuf's 2 GiB limit for one message; weights as external data are not written "
             "yet");
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    KILN_CHECK(f.good(), IOError, "export: cannot open ", tmp, " for writing: ", std::strerror(errno));
    KILN_CHECK(model.SerializeToOstream(&f), IOError, "export: writing ", tmp, " failed");
    f.close();
    KILN_CHECK(f.good(), IOError, "export: writing ", tmp, " failed: ", std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KILN_CHECK(!ec, IOError, "export: cannot move ", tmp, " to ", path, ": ", ec.message());
  r.bytes = static_cast<int64_t>(bytes);
  return r;
}

OnnxReport to_onnx(nn::Module& module, const std::vector<Tensor>& example_inputs, const std::string& path,
                   const OnnxOptions& options) {
  const Graph g = capture(module, example_inputs, {.dynamic_axes = options.dynamic_axes, .opset = options.opset});
  return write_onnx(g, path, options.opset, options.doc);
}

}  // namespace kiln::exporter
