// The capture side of QDQ export (qdq.h): a quantized layer's input and
// weight as QuantizeLinear / DequantizeLinear nodes around the float op.
#include <cstring>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/ptq.h"
#include "qdq.h"

namespace kiln::exporter::detail {
namespace {

Tensor buffer(const nn::Module& m, const std::string& name) {
  for (const auto& [n, t] : m.named_buffers(false))
    if (n == name) return t;
  throw InternalError("export: quantized layer of type " + m.type_name() + " has no buffer '" + name + "'");
}

QuantizedLayer from(const nn::Module& m, float scale, int64_t zero_point) {
  return {scale, zero_point, buffer(m, "weight_int8"), buffer(m, "weight_scales")};
}

}  // namespace

std::optional<QuantizedLayer> quantized_layer(const nn::Module& m) {
  if (const auto* c = dynamic_cast<const quant::QuantizedConv2d*>(&m)) {
    const auto& q = c->kernel().options().q;
    return from(m, q.input_scale, q.input_zero_point);
  }
  if (const auto* l = dynamic_cast<const quant::QuantizedLinear*>(&m)) {
    const auto& q = l->kernel().quantization();
    return from(m, q.input_scale, q.input_zero_point);
  }
  return std::nullopt;
}

std::string qdq_input(GraphBuilder& b, const std::string& x, const QuantizedLayer& q) {
  KILN_CHECK(b.value(x).dtype == kFloat32, DTypeError, "export: a quantized layer in '", b.module_path(),
             "' expects a float32 input, got ", dtype_name(b.value(x).dtype));
  const std::string scale = b.scalar(q.input_scale);
  Tensor zp = zeros({}, TensorOptions(kUInt8));
  *zp.data_ptr<uint8_t>() = static_cast<uint8_t>(q.input_zero_point);
  const std::string zero_point = b.constant("input_zero_point", zp);
  const Shape s = b.shape(x);
  const std::string qx = b.node("QuantizeLinear", {x, scale, zero_point}, s, kUInt8);
  return b.node("DequantizeLinear", {qx, scale, zero_point}, s, kFloat32);
}

std::string qdq_weight(GraphBuilder& b, const std::string& path, const QuantizedLayer& q) {
  const std::string w = b.weight(path.empty() ? "weight_int8" : path + ".weight_int8", q.weight_int8);
  b.graph.int8_values.insert(w);
  const std::string scales = b.weight(path.empty() ? "weight_scales" : path + ".weight_scales", q.weight_scales);
  // Symmetric weights: zero points 0, written out since ONNX reads the int8
  // type of the weight's DequantizeLinear from its zero point's.
  const std::string zero_points =
      b.constant("weight_zero_points", zeros({q.weight_scales.numel()}, TensorOptions(kUInt8)));
  b.graph.int8_values.insert(zero_points);
  return b.node("DequantizeLinear", {w, scales, zero_points}, b.shape(w), kFloat32, {{"axis", int64_t{0}}});
}

}  // namespace kiln::exporter::detail
