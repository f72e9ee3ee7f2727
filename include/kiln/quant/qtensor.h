// quant: affine-quantized tensors (int8 / uint8) and their quantize /
// dequantize, with PyTorch's semantics (torch.quantize_per_tensor,
// torch.quantize_per_channel, Tensor.dequantize):
//
//   q = clamp(round_half_even(x · (1 / scale)) + zero_point, qmin, qmax)
//   x' = (q - zero_point) · scale
//
// kiln's core has no quantized dtype (docs/decisions.md, "Quantized tensors
// live in the quant layer"): a QTensor holds its integers in a kUInt8 tensor,
// whose bytes are read as int8 (two's complement) when qdtype is QInt8, with
// the quantization parameters beside it. Only the quant layer and the int8
// kernels read those bytes, so no core op ever mistakes them for numbers.
#pragma once

#include <cstdint>
#include <string>

#include "kiln/core/tensor.h"

namespace kiln::quant {

/// The integer type the bytes stand for: torch.qint8 [-128, 127] or torch.quint8 [0, 255].
enum class QDType : uint8_t { QInt8, QUInt8 };

const char* qdtype_name(QDType t);
int64_t qmin(QDType t);
int64_t qmax(QDType t);

/// An affine-quantized tensor. Per tensor: scales [1], zero_points [1], axis -1.
/// Per channel: scales and zero_points [size(axis)], one pair per slice along axis.
struct QTensor {
  Tensor data;  // kUInt8, the float tensor's shape, contiguous
  QDType qdtype = QDType::QUInt8;
  Tensor scales;       // float32
  Tensor zero_points;  // int64
  int64_t axis = -1;   // -1: per tensor

  bool per_channel() const { return axis >= 0; }
  /// The integers as int32 (for printing and tests).
  Tensor int_repr() const;
  std::string describe() const;
};

/// x (any float dtype, read as float32) to a per-tensor QTensor. ValueError for scale <= 0
/// or a zero point outside the dtype's range.
QTensor quantize_per_tensor(const Tensor& x, double scale, int64_t zero_point, QDType dtype);
/// Per channel along `axis` (negative counts from the end): scales float [C], zero_points int [C].
QTensor quantize_per_channel(const Tensor& x, const Tensor& scales, const Tensor& zero_points, int64_t axis,
                             QDType dtype);
/// The float32 tensor q stands for.
Tensor dequantize(const QTensor& q);

}  // namespace kiln::quant
