// int8 models in ONNX's QDQ form (issue 22), private to src/export.
//
// Capture side (capture_qdq.cpp): a quant::QuantizedConv2d / QuantizedLinear
// is written as the float Conv / Gemm (MatMul) it approximates, with its input
// passed through QuantizeLinear -> DequantizeLinear (uint8, per tensor: the
// layer's input_qparams) and its weight an int8 initializer read through
// DequantizeLinear (per output channel, axis 0, zero points 0). That is the
// pattern ONNX Runtime's QDQ transformer recognises, and any consumer without
// int8 kernels still computes the same numbers in float.
//
// Runtime side (runtime_qdq.cpp): the QuantizeLinear / DequantizeLinear
// kernels, and fuse_qdq, which turns each Q -> DQ -> Conv/Gemm <- DQ(int8
// weight) pattern back into one node run by ops::Int8Conv2d / Int8Linear, so
// kiln's own runtime computes exactly what the eager int8 model computes.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "builder.h"
#include "kiln/export/runtime.h"
#include "kiln/nn/module.h"

namespace kiln::exporter::detail {

/// What a quantized layer's QDQ nodes need: its input's uint8 parameters and
/// its int8 weight (kUInt8 bytes) with one scale per output channel.
struct QuantizedLayer {
  float input_scale = 1.0f;
  int64_t input_zero_point = 0;
  Tensor weight_int8;    // the float weight's shape
  Tensor weight_scales;  // float32 [out]
};

/// The QDQ parameters of `m` when it is a quant::QuantizedConv2d or
/// QuantizedLinear, else nullopt.
std::optional<QuantizedLayer> quantized_layer(const nn::Module& m);

/// x -> QuantizeLinear -> DequantizeLinear with the layer's input parameters;
/// returns the float value the Conv / Gemm reads.
std::string qdq_input(GraphBuilder& b, const std::string& x, const QuantizedLayer& q);

/// The int8 weight initializer "<path>.weight_int8" (named in
/// Graph::int8_values) through DequantizeLinear(axis 0); returns the float
/// weight value.
std::string qdq_weight(GraphBuilder& b, const std::string& path, const QuantizedLayer& q);

/// QuantizeLinear, DequantizeLinear (opset 13: per tensor or per axis; uint8,
/// int8 by Graph::int8_values, and int32 for DequantizeLinear), and the fused
/// kOpInt8Conv / kOpInt8Gemm that fuse_qdq writes.
std::map<std::string, KernelFactory> qdq_kernels();

/// The op types of fused int8 layers. Inputs: x (float), the int8 weight, its
/// scales, the bias (optional); attributes: the Conv's or Gemm's, plus
/// "input_scale" (float) and "input_zero_point" (int), "relu" (int, 1: a Relu that was the
/// product's only reader, now in the int8 kernel's epilogue) and, on a Conv, "residual" (int, 1: a
/// residual Add that read the convolution, now in its epilogue; the addend is input 4).
inline constexpr const char* kOpInt8Conv = "kiln.Int8Conv";
inline constexpr const char* kOpInt8Gemm = "kiln.Int8Gemm";

/// Rewrites every Q -> DQ -> Conv/Gemm pattern whose weight is an int8
/// initializer through a per-channel DQ (zero points 0) and whose
/// intermediate values nothing else reads (and no graph output names) into
/// one kOpInt8Conv / kOpInt8Gemm node, taking in the Relu that alone reads
/// its output, or for a convolution a residual Add (and the Relu after it)
/// whose other operand is computed earlier. Returns how many were fused.
/// With uint8_chain, a fused layer (without a residual) whose output is read only as input 0 of fused
/// layers that share one input scale and zero point gets "output_scale" / "output_zero_point"
/// attributes (it writes those readers' uint8 codes; SessionOptions::uint8_between_layers).
int64_t fuse_qdq(Graph& graph, bool uint8_chain = false);

}  // namespace kiln::exporter::detail
