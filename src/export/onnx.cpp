// ONNX writing (include/kiln/export/onnx.h): export::Graph -> onnx::ModelProto
// through the protobuf classes of Debian's libonnx-dev (DESIGN.md §7: never
// hand-written protobuf).
#include "kiln/export/onnx.h"

#include <onnx/onnx_pb.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string_view>

#include "kiln/core/error.h"

namespace kiln::exporter {
namespace {

// `int8`: the value is named in Graph::int8_values, its uint8 bytes are int8.
int32_t onnx_dtype(DType t, bool int8 = false) {
  switch (t) {
    case kFloat32: return onnx::TensorProto::FLOAT;
    case kInt64: return onnx::TensorProto::INT64;
    case kBool: return onnx::TensorProto::BOOL;
    case kUInt8: return int8 ? onnx::TensorProto::INT8 : onnx::TensorProto::UINT8;
    default:
      throw DTypeError("export: ONNX values of dtype " + std::string(dtype_name(t)) +
                       " are not written (float32, int64, uint8 / int8 and bool are)");
  }
}

void set_type(onnx::ValueInfoProto& vi, const Value& v, const Graph& g) {
  vi.set_name(v.name);
  auto* tt = vi.mutable_type()->mutable_tensor_type();
  tt->set_elem_type(onnx_dtype(v.dtype, g.int8_values.count(v.name) > 0));
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

// Name, type and dims; the bytes go in raw_data or the side file.
void set_tensor_header(onnx::TensorProto& p, const std::string& name, const Tensor& t, const Graph& g) {
  p.set_name(name);
  p.set_data_type(onnx_dtype(t.dtype(), g.int8_values.count(name) > 0));
  for (int64_t d : t.sizes()) p.add_dims(d);
}

void add_entry(onnx::TensorProto& p, const std::string& key, const std::string& value) {
  auto* e = p.add_external_data();
  e->set_key(key);
  e->set_value(value);
}

// The written bytes of one tensor: contiguous, little-endian (the machines kiln builds for).
std::string_view bytes_of(const Tensor& c) {
  return {static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes())};
}

void write_file(const std::string& path, const std::function<void(std::ofstream&)>& body) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  KILN_CHECK(f.good(), IOError, "export: cannot open ", path, " for writing: ", std::strerror(errno));
  body(f);
  f.close();
  KILN_CHECK(f.good(), IOError, "export: writing ", path, " failed: ", std::strerror(errno));
}

void check_external_options(const ExternalDataOptions& o, const std::string& location) {
  KILN_CHECK(o.min_bytes >= 0, ValueError, "export: external data min_bytes must be >= 0, got ", o.min_bytes);
  KILN_CHECK(o.alignment >= 1 && o.alignment <= (int64_t{1} << 30), ValueError,
             "export: external data alignment must be 1 to 2^30 bytes, got ", o.alignment);
  KILN_CHECK(o.limit_bytes >= 1, ValueError, "export: external data limit_bytes must be >= 1, got ", o.limit_bytes);
  // The location is resolved against the model's directory by every reader:
  // a plain file name keeps the pair movable together.
  KILN_CHECK(!location.empty() && location != "." && location != ".." &&
                 location.find_first_of(std::string("/\\\0", 3)) == std::string::npos,
             ValueError, "export: the external data location must be a plain file name (no directories), got \"",
             location, "\"");
}

}  // namespace

bool use_external_data(int64_t inline_bytes, const ExternalDataOptions& options) {
  switch (options.mode) {
    case ExternalDataOptions::Mode::kAlways: return true;
    case ExternalDataOptions::Mode::kNever: return false;
    case ExternalDataOptions::Mode::kAutomatic: break;
  }
  return inline_bytes >= options.limit_bytes;
}

OnnxReport write_onnx(const Graph& graph, const std::string& path, int64_t opset, const std::string& doc,
                      const ExternalDataOptions& external) {
  graph.validate();
  const std::string location =
      external.location.empty() ? std::filesystem::path(path).filename().string() + ".data" : external.location;
  check_external_options(external, location);
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
  for (const Value& v : graph.inputs) set_type(*g->add_input(), v, graph);
  for (const Value& v : graph.outputs) set_type(*g->add_output(), v, graph);
  std::vector<Tensor> weights;  // contiguous, in initializer order
  for (const auto& [name, t] : graph.initializers) {
    set_tensor_header(*g->add_initializer(), name, t, graph);
    weights.push_back(t.contiguous());
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
  // The model's size with every weight inline, bounded from above without
  // copying the weights into the message: each raw_data adds its bytes, a tag
  // and a length varint (<= 11), and the enclosing lengths grow by <= 5 bytes.
  int64_t inline_bytes = static_cast<int64_t>(model.ByteSizeLong()) + 16;
  for (const Tensor& w : weights) inline_bytes += w.nbytes() + 16;
  const bool to_side_file = use_external_data(inline_bytes, external);
  // Per initializer, its offset in the side file, or -1 when inline.
  std::vector<int64_t> offsets(weights.size(), -1);
  int64_t end = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto& p = *g->mutable_initializer(static_cast<int>(i));
    const int64_t n = weights[i].nbytes();
    if (to_side_file && n > 0 && n >= external.min_bytes) {
      const int64_t offset = (end + external.alignment - 1) / external.alignment * external.alignment;
      p.set_data_location(onnx::TensorProto::EXTERNAL);
      add_entry(p, "location", location);
      add_entry(p, "offset", std::to_string(offset));
      add_entry(p, "length", std::to_string(n));
      offsets[i] = offset;
      end = offset + n;
      ++r.external_initializers;
    } else {
      p.set_raw_data(std::string(bytes_of(weights[i])));
    }
  }
  const size_t bytes = model.ByteSizeLong();
  KILN_CHECK(bytes < static_cast<size_t>(std::numeric_limits<int32_t>::max()), ValueError, "export: the model is ",
             bytes, " bytes, past protobuf's 2 GiB limit for one message",
             external.mode == ExternalDataOptions::Mode::kNever
                 ? "; let its weights go to a side file (external data: automatic or always)"
                 : " even with its weights in a side file");
  const std::string tmp = path + ".tmp";
  std::string data_path, data_tmp;
  std::error_code ec;
  try {
    if (r.external_initializers > 0) {
      data_path = (std::filesystem::path(path).parent_path() / location).string();
      KILN_CHECK(std::filesystem::absolute(data_path) != std::filesystem::absolute(path), ValueError,
                 "export: the external data location ", location, " is the model file itself");
      data_tmp = data_path + ".tmp";
      write_file(data_tmp, [&](std::ofstream& f) {
        const std::string zeros(static_cast<size_t>(std::min<int64_t>(external.alignment, 1 << 20)), '\0');
        int64_t at = 0;
        for (size_t i = 0; i < weights.size(); ++i) {
          if (offsets[i] < 0) continue;
          while (at < offsets[i]) {
            const int64_t pad = std::min<int64_t>(offsets[i] - at, static_cast<int64_t>(zeros.size()));
            f.write(zeros.data(), pad);
            at += pad;
          }
          const std::string_view b = bytes_of(weights[i]);
          f.write(b.data(), static_cast<std::streamsize>(b.size()));
          at += static_cast<int64_t>(b.size());
        }
      });
    }
    write_file(tmp, [&](std::ofstream& f) {
      KILN_CHECK(model.SerializeToOstream(&f), IOError, "export: writing ", tmp, " failed");
    });
    // Side file first: the model that refers to it appears only once it is whole.
    if (!data_tmp.empty()) {
      std::filesystem::rename(data_tmp, data_path, ec);
      KILN_CHECK(!ec, IOError, "export: cannot move ", data_tmp, " to ", data_path, ": ", ec.message());
    }
    std::filesystem::rename(tmp, path, ec);
    KILN_CHECK(!ec, IOError, "export: cannot move ", tmp, " to ", path, ": ", ec.message());
  } catch (...) {
    std::filesystem::remove(tmp, ec);
    if (!data_tmp.empty()) std::filesystem::remove(data_tmp, ec);
    throw;
  }
  if (!data_path.empty()) {
    r.data_path = data_path;
    r.data_bytes = end;
  }
  r.bytes = static_cast<int64_t>(bytes);
  return r;
}

OnnxReport to_onnx(nn::Module& module, const std::vector<Tensor>& example_inputs, const std::string& path,
                   const OnnxOptions& options) {
  const Graph g = capture(module, example_inputs, {.dynamic_axes = options.dynamic_axes, .opset = options.opset});
  return write_onnx(g, path, options.opset, options.doc, options.external_data);
}

}  // namespace kiln::exporter
