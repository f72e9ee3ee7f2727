// ONNX reading (include/kiln/export/runtime.h: load_onnx, load_onnx_tensor):
// an onnx::ModelProto parsed by Debian's libonnx protobuf classes, checked
// field by field and turned into an export::Graph. A file is untrusted input:
// every size, type and reference is checked before it is used, and every
// failure is a FormatError (or DTypeError) naming the file and what was wrong.
#include <onnx/onnx_pb.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "kiln/core/error.h"
#include "kiln/export/runtime.h"
#include "kiln/ops/factory.h"
#include "runtime_kernels.h"

namespace kiln::exporter {
namespace {

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  KILN_CHECK(f.good(), IOError, what, ": cannot open ", path, ": ", std::strerror(errno));
  const std::streamoff size = f.tellg();
  KILN_CHECK(size >= 0 && size < std::numeric_limits<int32_t>::max(), FormatError, what, ": ", path, " is ", size,
             " bytes, past protobuf's 2 GiB limit for one message (a larger model keeps its weights as external "
             "data, in a side file)");
  std::string bytes(static_cast<size_t>(size), '\0');
  f.seekg(0);
  f.read(bytes.data(), size);
  KILN_CHECK(f.good(), IOError, what, ": reading ", path, " failed");
  return bytes;
}

DType dtype_of(int32_t onnx_type, const std::string& where) {
  switch (onnx_type) {
    case onnx::TensorProto::FLOAT: return kFloat32;
    case onnx::TensorProto::DOUBLE: return kFloat64;
    case onnx::TensorProto::FLOAT16: return kFloat16;
    case onnx::TensorProto::BFLOAT16: return DType::BFloat16;
    case onnx::TensorProto::INT64: return kInt64;
    case onnx::TensorProto::INT32: return kInt32;
    case onnx::TensorProto::UINT8: return DType::UInt8;
    // int8 as its bytes; load_onnx names such values in Graph::int8_values.
    case onnx::TensorProto::INT8: return DType::UInt8;
    case onnx::TensorProto::BOOL: return kBool;
    default:
      throw DTypeError(where + ": ONNX element type " +
                       (onnx::TensorProto::DataType_IsValid(onnx_type)
                            ? onnx::TensorProto::DataType_Name(static_cast<onnx::TensorProto::DataType>(onnx_type))
                            : std::to_string(onnx_type)) +
                       " has no kiln dtype (kiln has float32/64, float16, bfloat16, int64, int32, uint8 and bool)");
  }
}

// Where a model's external data may live: the directory of the model file,
// resolved once (symlinks included) so that every location is checked against it.
struct ExternalDir {
  std::filesystem::path dir;  // canonical
};

int64_t parse_offset(const std::string& s, const std::string& what) {
  // Digits only: no sign, no spaces, no hex; at most 18 so it cannot overflow.
  KILN_CHECK(!s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos, FormatError, what,
             " expects a non-negative decimal byte count, got \"", s, "\"");
  return std::stoll(s);
}

struct ExternalSpan {
  std::filesystem::path file;
  int64_t offset = 0, length = 0;
};

// Where an EXTERNAL tensor's bytes are, checked before anything is allocated
// or read: the location stays inside the model's directory (no absolute path,
// no "..", no symlink out of it), the file exists, and offset + length lie
// within it and cover exactly `nbytes`.
ExternalSpan locate_external(const onnx::TensorProto& p, const ExternalDir& ext, int64_t nbytes,
                             const std::string& where) {
  namespace fs = std::filesystem;
  const std::string at = where + ": tensor '" + p.name() + "' (external data)";
  std::optional<std::string> location;
  std::optional<int64_t> offset, length;
  for (const auto& e : p.external_data()) {
    const std::string& k = e.key();
    KILN_CHECK(k == "location" || k == "offset" || k == "length" || k == "checksum", FormatError, at,
               ": unknown external_data key \"", k, "\" (expected location, offset, length, checksum)");
    KILN_CHECK(!(k == "location" && location) && !(k == "offset" && offset) && !(k == "length" && length), FormatError,
               at, ": external_data key \"", k, "\" is given twice");
    if (k == "location") location = e.value();
    if (k == "offset") offset = parse_offset(e.value(), at + ": offset");
    if (k == "length") length = parse_offset(e.value(), at + ": length");
  }
  KILN_CHECK(location && !location->empty(), FormatError, at, ": external_data has no location");
  const fs::path rel(*location);
  KILN_CHECK(location->find('\0') == std::string::npos && !rel.is_absolute() && !rel.has_root_name() &&
                 !rel.has_root_directory(),
             FormatError, at, ": location \"", *location,
             "\" is absolute; it must be a path relative to the model's directory");
  for (const auto& part : rel)
    KILN_CHECK(part != "..", FormatError, at, ": location \"", *location,
               "\" leaves the model's directory (\"..\"); it must stay inside it");
  const fs::path file = ext.dir / rel;
  std::error_code ec;
  const fs::path real = fs::canonical(file, ec);
  KILN_CHECK(!ec, IOError, at, ": its data file ", file.string(), " (location \"", *location,
             "\") cannot be found: ", ec.message());
  // A symlink may point anywhere: the resolved file must still be inside the directory.
  const auto common = std::mismatch(ext.dir.begin(), ext.dir.end(), real.begin(), real.end());
  KILN_CHECK(common.first == ext.dir.end() && common.second != real.end(), FormatError, at, ": location \"", *location,
             "\" resolves to ", real.string(), ", outside the model's directory ", ext.dir.string());
  KILN_CHECK(fs::is_regular_file(real, ec), FormatError, at, ": location \"", *location, "\" (", real.string(),
             ") is not a regular file");
  const auto size = static_cast<int64_t>(fs::file_size(real, ec));
  KILN_CHECK(!ec, IOError, at, ": cannot read the size of ", real.string(), ": ", ec.message());
  const int64_t off = offset.value_or(0);
  const int64_t len = length.value_or(nbytes);
  KILN_CHECK(len == nbytes, FormatError, at, ": length ", len, " but its dtype and shape need ", nbytes, " bytes");
  KILN_CHECK(off <= size && len <= size - off, FormatError, at, ": offset ", off, " + length ", len,
             " lies past the end of ", real.string(), " (", size, " bytes)");
  return {real, off, len};
}

void read_external(const ExternalSpan& span, void* out, const std::string& where) {
  if (span.length == 0) return;
  std::ifstream f(span.file, std::ios::binary);
  KILN_CHECK(f.good(), IOError, where, ": cannot open ", span.file.string(), ": ", std::strerror(errno));
  f.seekg(span.offset);
  f.read(static_cast<char*>(out), span.length);
  KILN_CHECK(f.good() && f.gcount() == span.length, IOError, where, ": reading ", span.length, " bytes at ",
             span.offset, " of ", span.file.string(), " failed");
}

// A TensorProto as a tensor: raw_data, the typed field its type uses, or (with
// `ext`, for a model's tensors) external data in a file beside the model.
Tensor to_tensor(const onnx::TensorProto& p, const std::string& where, const ExternalDir* ext = nullptr) {
  const bool external = p.data_location() == onnx::TensorProto::EXTERNAL;
  KILN_CHECK(external || p.external_data_size() == 0, FormatError, where, ": tensor '", p.name(),
             "' has external_data entries but its data_location is not EXTERNAL");
  KILN_CHECK(!external || ext, FormatError, where, ": tensor '", p.name(),
             "' keeps its data in an external file, which is read only for a model's tensors (load_onnx)");
  KILN_CHECK(!external || (!p.has_raw_data() && p.float_data_size() == 0 && p.int32_data_size() == 0 &&
                           p.int64_data_size() == 0 && p.double_data_size() == 0),
             FormatError, where, ": tensor '", p.name(), "' is EXTERNAL but also holds data in the model");
  KILN_CHECK(!p.has_segment(), FormatError, where, ": tensor '", p.name(), "' is segmented, which is not supported");
  const DType dt = dtype_of(p.data_type(), where + ": tensor '" + p.name() + "'");
  std::vector<int64_t> sizes;
  int64_t numel = 1;
  for (int64_t d : p.dims()) {
    KILN_CHECK(d >= 0 && (d == 0 || numel <= std::numeric_limits<int64_t>::max() / 16 / d), FormatError, where,
               ": tensor '", p.name(), "' has a dim of ", d, " (negative, or its element count overflows)");
    sizes.push_back(d);
    numel *= d;
  }
  const int64_t elem = element_size(dt);
  auto wrong_size = [&](int64_t got, const char* field) {
    return where + ": tensor '" + p.name() + "' of shape " + shape_str(IntArrayRef(sizes)) + " needs " +
           std::to_string(numel) + " elements, its " + field + " holds " + std::to_string(got);
  };
  if (external) {
    const ExternalSpan span = locate_external(p, *ext, numel * elem, where);
    Tensor t = empty(sizes, TensorOptions(dt));
    read_external(span, t.data_ptr(), where + ": tensor '" + p.name() + "'");
    return t;
  }
  // The data's size is checked before anything is allocated: the dims of a
  // hostile file may promise far more than it holds.
  if (p.has_raw_data()) {
    const std::string& raw = p.raw_data();
    KILN_CHECK(static_cast<int64_t>(raw.size()) == numel * elem, FormatError,
               wrong_size(static_cast<int64_t>(raw.size()) / elem, "raw_data"), " (", raw.size(), " bytes)");
  }
  auto check = [&](int64_t got, const char* field) { KILN_CHECK(got == numel, FormatError, wrong_size(got, field)); };
  if (!p.has_raw_data()) {
    switch (dt) {
      case kFloat32: check(p.float_data_size(), "float_data"); break;
      case kFloat64: check(p.double_data_size(), "double_data"); break;
      case kInt64: check(p.int64_data_size(), "int64_data"); break;
      default: check(p.int32_data_size(), "int32_data");
    }
  }
  Tensor t = empty(sizes, TensorOptions(dt));
  if (p.has_raw_data()) {
    const std::string& raw = p.raw_data();
    if (numel > 0) std::memcpy(t.data_ptr(), raw.data(), raw.size());
    return t;
  }
  switch (dt) {
    case kFloat32:
      if (numel) std::memcpy(t.data_ptr(), p.float_data().data(), static_cast<size_t>(numel) * 4);
      break;
    case kFloat64:
      if (numel) std::memcpy(t.data_ptr(), p.double_data().data(), static_cast<size_t>(numel) * 8);
      break;
    case kInt64:
      if (numel) std::memcpy(t.data_ptr(), p.int64_data().data(), static_cast<size_t>(numel) * 8);
      break;
    case kInt32:
      if (numel) std::memcpy(t.data_ptr(), p.int32_data().data(), static_cast<size_t>(numel) * 4);
      break;
    default: {
      // uint8, bool, float16, bfloat16: one element per int32_data entry (the
      // 16-bit types as their bit patterns).
      auto* out = static_cast<unsigned char*>(t.data_ptr());
      for (int64_t i = 0; i < numel; ++i) {
        const auto v = static_cast<uint32_t>(p.int32_data(static_cast<int>(i)));
        if (elem == 1) {
          out[i] = static_cast<unsigned char>(dt == kBool ? (v != 0) : v);
        } else {
          const auto bits = static_cast<uint16_t>(v);
          std::memcpy(out + 2 * i, &bits, 2);
        }
      }
    }
  }
  return t;
}

Value to_value(const onnx::ValueInfoProto& vi, const std::string& where, bool need_shape) {
  Value v;
  v.name = vi.name();
  KILN_CHECK(vi.type().has_tensor_type(), FormatError, where, ": value '", vi.name(),
             "' is not a tensor (sequences, maps and optionals are not supported)");
  const auto& tt = vi.type().tensor_type();
  v.dtype = dtype_of(tt.elem_type(), where + ": value '" + vi.name() + "'");
  KILN_CHECK(tt.has_shape() || !need_shape, FormatError, where, ": input '", vi.name(),
             "' has no shape; the runtime checks inputs against a shape (its dims may be symbolic)");
  for (const auto& d : tt.shape().dim()) {
    if (d.has_dim_value()) {
      KILN_CHECK(d.dim_value() >= 0, FormatError, where, ": value '", vi.name(), "' has a dim of ", d.dim_value());
      v.shape.push_back(Dim::fixed(d.dim_value()));
    } else if (d.has_dim_param() && !d.dim_param().empty()) {
      v.shape.push_back(Dim::sym(d.dim_param()));
    } else {
      v.shape.push_back(Dim{-1, {}});  // unknown and unnamed: any size
    }
  }
  return v;
}

Attribute to_attribute(const onnx::AttributeProto& a, const std::string& where) {
  switch (a.type()) {
    case onnx::AttributeProto::INT: return a.i();
    case onnx::AttributeProto::FLOAT: return a.f();
    case onnx::AttributeProto::STRING: return a.s();
    case onnx::AttributeProto::INTS: return std::vector<int64_t>(a.ints().begin(), a.ints().end());
    case onnx::AttributeProto::FLOATS: return std::vector<float>(a.floats().begin(), a.floats().end());
    default:
      throw FormatError(where + ": attribute '" + a.name() + "' is of type " +
                        onnx::AttributeProto::AttributeType_Name(a.type()) +
                        ", which the runtime does not take (ints, floats, strings and their lists)");
  }
}

// A Constant node's value as a tensor (value or value_float/_floats/_int/_ints).
Tensor constant_value(const onnx::NodeProto& n, const std::string& where, const ExternalDir* ext) {
  KILN_CHECK(n.attribute_size() == 1, FormatError, where, ": a Constant needs exactly one value attribute, got ",
             n.attribute_size());
  const auto& a = n.attribute(0);
  if (a.name() == "value" && a.type() == onnx::AttributeProto::TENSOR) return to_tensor(a.t(), where, ext);
  if (a.name() == "value_float" && a.type() == onnx::AttributeProto::FLOAT)
    return full({}, a.f(), TensorOptions(kFloat32));
  if (a.name() == "value_int" && a.type() == onnx::AttributeProto::INT) return full({}, a.i(), TensorOptions(kInt64));
  if (a.name() == "value_floats" && a.type() == onnx::AttributeProto::FLOATS)
    return tensor(std::vector<float>(a.floats().begin(), a.floats().end()), {a.floats_size()});
  if (a.name() == "value_ints" && a.type() == onnx::AttributeProto::INTS)
    return tensor(std::vector<int64_t>(a.ints().begin(), a.ints().end()), {a.ints_size()});
  throw FormatError(where + ": Constant with attribute '" + a.name() + "' is not supported");
}

// The lowest model opset at which each op has the semantics its kernel
// implements (the kernels follow opsets 13 to 18; an op whose definition did
// not change in a way the kernel misses runs from the version it last did).
// E.g. Softmax before 13 flattened its input at `axis`; Conv is as in opset 1.
int64_t min_opset(const std::string& op) {
  static const std::map<std::string, int64_t> since{
      {"Abs", 6},
      {"Add", 7},
      {"AveragePool", 10},
      {"BatchNormalization", 9},
      {"Cast", 6},
      {"Clip", 11},
      {"Concat", 4},
      {"Constant", 1},
      {"Conv", 1},
      {"Div", 7},
      {"Dropout", 7},
      {"Equal", 7},
      {"Erf", 9},
      {"Exp", 6},
      {"Expand", 8},
      {"Flatten", 1},
      {"Gather", 11},
      {"Gemm", 7},
      {"GlobalAveragePool", 1},
      {"GlobalMaxPool", 1},
      {"Greater", 7},
      {"GreaterOrEqual", 12},
      {"Identity", 1},
      {"LayerNormalization", 17},
      {"QuantizeLinear", 10},
      {"DequantizeLinear", 10},
      {"LeakyRelu", 6},
      {"Less", 7},
      {"LessOrEqual", 12},
      {"Log", 6},
      {"LogSoftmax", 13},
      {"MatMul", 1},
      {"Max", 8},
      {"MaxPool", 10},
      {"Mean", 8},
      {"Min", 8},
      {"Mul", 7},
      {"Neg", 6},
      {"Not", 1},
      {"Pow", 7},
      {"Reciprocal", 6},
      {"ReduceMax", 1},
      {"ReduceMean", 1},
      {"ReduceMin", 1},
      {"ReduceSum", 1},
      {"Relu", 6},
      {"Reshape", 5},
      {"Shape", 1},
      {"Sigmoid", 6},
      {"Slice", 10},
      {"Softmax", 13},
      {"Split", 2},
      {"Sqrt", 6},
      {"Squeeze", 11},
      {"Sub", 7},
      {"Sum", 8},
      {"Tanh", 6},
      {"Transpose", 1},
      {"Unsqueeze", 11},
      {"Where", 9},
      {"Floor", 6},
      {"Ceil", 6},
      {"Round", 11},
      {"Sign", 9},
      {"Sin", 7},
      {"Cos", 7},
      {"IsNaN", 9},
      {"IsInf", 10},
      {"Elu", 6},
      {"Selu", 6},
      {"Celu", 12},
      {"HardSigmoid", 6},
      {"HardSwish", 14},
      {"ThresholdedRelu", 10},
      {"Softsign", 1},
      {"Softplus", 1},
      {"Mish", 18},
      {"PRelu", 9},
      {"And", 7},
      {"Or", 7},
      {"Xor", 7},
      {"ArgMax", 11},
      {"ArgMin", 11},
      {"Tile", 6},
      {"Range", 11},
      {"Size", 1},
      {"ConstantOfShape", 9},
      {"Pad", 11},
      {"InstanceNormalization", 6},
      {"DepthToSpace", 11},
      {"SpaceToDepth", 1},
      {"Einsum", 12},
      {"ReduceProd", 1},
      {"ReduceL1", 1},
      {"ReduceL2", 1},
      {"ReduceSumSquare", 1},
      {"ReduceLogSum", 1},
      {"ReduceLogSumExp", 1},
      {"CastLike", 15},
      {"Trilu", 14},
      {"GatherElements", 11},
      {"ScatterElements", 11},
      {"Hardmax", 13},
      {"Mod", 10},
  };
  auto it = since.find(op);
  return it == since.end() ? 13 : it->second;
}

}  // namespace

Tensor load_onnx_tensor(const std::string& path) {
  const std::string bytes = read_file(path, "load_onnx_tensor");
  onnx::TensorProto p;
  KILN_CHECK(p.ParseFromString(bytes), FormatError, "load_onnx_tensor: ", path,
             " is not a serialized ONNX TensorProto (the protobuf parse failed: truncated or not ONNX)");
  return to_tensor(p, "load_onnx_tensor: " + path);
}

Graph load_onnx(const std::string& path) {
  const std::string bytes = read_file(path, "load_onnx");
  const std::string where = "load_onnx: " + path;
  onnx::ModelProto model;
  KILN_CHECK(model.ParseFromString(bytes), FormatError, where,
             ": not an ONNX model (the protobuf parse failed: the file is truncated, corrupt or not ONNX)");
  KILN_CHECK(model.has_graph(), FormatError, where, ": the model has no graph (is this an ONNX model file?)");
  int64_t opset = -1;
  for (const auto& o : model.opset_import())
    if (o.domain().empty() || o.domain() == "ai.onnx") opset = o.version();
  // 18 as well: of the runtime's ops only the Reduce* (axes as an input) and
  // Split (num_outputs) changed there, and their kernels take both forms.
  KILN_CHECK(opset >= 1 && opset <= 18, FormatError, where, ": the model imports ONNX opset ", opset,
             "; the runtime's kernels follow opsets up to 18");
  const onnx::GraphProto& gp = model.graph();
  // External data is resolved against the model's own directory (symlinks resolved).
  std::error_code ec;
  ExternalDir ext{std::filesystem::canonical(std::filesystem::absolute(path).parent_path(), ec)};
  KILN_CHECK(!ec, IOError, where, ": cannot resolve the model's directory: ", ec.message());
  Graph g;
  g.name = gp.name();

  std::set<std::string> initialized;
  for (const auto& t : gp.initializer()) {
    KILN_CHECK(!t.name().empty(), FormatError, where, ": an initializer has no name");
    KILN_CHECK(initialized.insert(t.name()).second, FormatError, where, ": initializer '", t.name(),
               "' is defined twice");
    Tensor v = to_tensor(t, where, &ext);
    if (t.data_type() == onnx::TensorProto::INT8) g.int8_values.insert(t.name());
    g.values[t.name()] = Value{t.name(), v.dtype(), {}};
    for (int64_t d : v.sizes()) g.values[t.name()].shape.push_back(Dim::fixed(d));
    g.initializers.emplace_back(t.name(), std::move(v));
  }
  KILN_CHECK(gp.sparse_initializer_size() == 0, FormatError, where, ": sparse initializers are not supported");
  // Inputs that an initializer also names are constants (IR < 4 lists weights as inputs).
  for (const auto& vi : gp.input()) {
    if (initialized.count(vi.name())) continue;
    KILN_CHECK(!vi.name().empty(), FormatError, where, ": a graph input has no name");
    Value v = to_value(vi, where, true);
    if (vi.type().tensor_type().elem_type() == onnx::TensorProto::INT8) g.int8_values.insert(v.name);
    g.values[v.name] = v;
    g.inputs.push_back(std::move(v));
  }
  for (const auto& vi : gp.value_info()) {
    if (vi.type().has_tensor_type() && !vi.name().empty()) {
      try {
        g.values[vi.name()] = to_value(vi, where, false);
      } catch (const Error&) {
        // value_info is a hint; a value of a type kiln lacks fails where a node makes it.
      }
    }
  }

  const auto& builtin = detail::builtin_kernels();
  for (int i = 0; i < gp.node_size(); ++i) {
    const onnx::NodeProto& np = gp.node(i);
    Node n;
    n.name = np.name().empty() ? np.op_type() + "_" + std::to_string(i) : np.name();
    n.op_type = np.op_type();
    const std::string at = where + ": node '" + n.name + "' (" + n.op_type + ")";
    const bool default_domain = np.domain().empty() || np.domain() == "ai.onnx";
    // kiln.* nodes are what the runtime's own fusions write; a file does not get to name them.
    KILN_CHECK(default_domain && builtin.count(n.op_type) && n.op_type.rfind("kiln.", 0) != 0, ValueError, at,
               default_domain ? "" : " of domain ", default_domain ? "" : np.domain(),
               ": the runtime has no kernel for this op (supported_ops() lists the ", builtin.size(), " it has)");
    KILN_CHECK(opset >= min_opset(n.op_type), ValueError, at, ": at the model's opset ", opset, ", ", n.op_type,
               " has an older definition than the runtime's kernel, which implements it from opset ",
               min_opset(n.op_type));
    if (n.op_type == "Constant") {
      KILN_CHECK(np.output_size() == 1 && !np.output(0).empty(), FormatError, at, ": expected one output");
      KILN_CHECK(!g.values.count(np.output(0)), FormatError, at, ": value '", np.output(0), "' is defined twice");
      Tensor v = constant_value(np, at, &ext);
      g.values[np.output(0)] = Value{np.output(0), v.dtype(), {}};
      for (int64_t d : v.sizes()) g.values[np.output(0)].shape.push_back(Dim::fixed(d));
      g.initializers.emplace_back(np.output(0), std::move(v));
      continue;
    }
    n.inputs.assign(np.input().begin(), np.input().end());
    n.outputs.assign(np.output().begin(), np.output().end());
    for (const auto& a : np.attribute()) {
      KILN_CHECK(!a.name().empty(), FormatError, at, ": an attribute has no name");
      if (n.op_type == "ConstantOfShape" && a.name() == "value" && a.type() == onnx::AttributeProto::TENSOR) {
        // The value tensor becomes an initializer, read as the node's second input.
        const std::string name = n.name + "/value";
        KILN_CHECK(!g.values.count(name), FormatError, at, ": value '", name, "' is defined twice");
        Tensor v = to_tensor(a.t(), at, &ext);
        g.values[name] = Value{name, v.dtype(), {}};
        g.initializers.emplace_back(name, std::move(v));
        n.inputs.resize(1);
        n.inputs.push_back(name);
        continue;
      }
      n.attributes[a.name()] = to_attribute(a, at);
    }
    if (np.has_doc_string()) {
      // kiln's writer notes the module a node stands for: "module layer1.0.bn1 (BatchNorm2d)".
      const std::string& d = np.doc_string();
      const auto open = d.rfind(" (");
      if (d.rfind("module ", 0) == 0 && open != std::string::npos && d.back() == ')') {
        n.module = d.substr(7, open - 7);
        if (n.module == "<root>") n.module.clear();
        n.module_type = d.substr(open + 2, d.size() - open - 3);
      }
    }
    g.nodes.push_back(std::move(n));
  }
  for (const auto& vi : gp.output()) {
    KILN_CHECK(!vi.name().empty(), FormatError, where, ": a graph output has no name");
    g.outputs.push_back(to_value(vi, where, false));
  }
  try {
    g.validate();
  } catch (const InternalError& e) {
    throw FormatError(where + ": " + e.what());
  }
  return g;
}

}  // namespace kiln::exporter
