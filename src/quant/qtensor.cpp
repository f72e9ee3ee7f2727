// Quantize / dequantize (include/kiln/quant/qtensor.h).
#include "kiln/quant/qtensor.h"

#include <cmath>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::quant {
namespace {

Tensor as_float(const Tensor& x, const char* op) {
  KILN_CHECK(x.defined(), ValueError, op, ": expected a defined tensor");
  KILN_CHECK(is_floating_point(x.dtype()), DTypeError, op, ": expected a floating-point tensor, got ",
             dtype_name(x.dtype()));
  const NoGradGuard no_grad;
  return x.detach().to(kFloat32).contiguous();
}

// torch's quantize_val: the reciprocal in float, nearbyint (half to even under
// the default rounding mode), the zero point added in int64, then the clamp.
inline int64_t quantize_one(float v, float inv_scale, int64_t zp, int64_t lo, int64_t hi) {
  const int64_t q = zp + static_cast<int64_t>(std::nearbyint(v * inv_scale));
  return q < lo ? lo : (q > hi ? hi : q);
}

inline void store(uint8_t* out, int64_t q, QDType t) {
  *out = t == QDType::QInt8 ? static_cast<uint8_t>(static_cast<int8_t>(q)) : static_cast<uint8_t>(q);
}

inline int64_t load(const uint8_t* in, QDType t) {
  return t == QDType::QInt8 ? static_cast<int64_t>(static_cast<int8_t>(*in)) : static_cast<int64_t>(*in);
}

// Elements per slice before the axis, the axis' size, and elements after it.
struct Slices {
  int64_t outer = 1, channels = 1, inner = 1;
};

Slices slices(const Tensor& x, int64_t axis) {
  Slices s;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < axis) s.outer *= x.size(d);
    if (d == axis) s.channels = x.size(d);
    if (d > axis) s.inner *= x.size(d);
  }
  return s;
}

}  // namespace

const char* qdtype_name(QDType t) { return t == QDType::QInt8 ? "qint8" : "quint8"; }
int64_t qmin(QDType t) { return t == QDType::QInt8 ? -128 : 0; }
int64_t qmax(QDType t) { return t == QDType::QInt8 ? 127 : 255; }

Tensor QTensor::int_repr() const {
  Tensor out = empty(data.sizes(), TensorOptions(kInt32));
  const auto* in = data.data_ptr<uint8_t>();
  auto* o = out.data_ptr<int32_t>();
  for (int64_t i = 0; i < data.numel(); ++i) o[i] = static_cast<int32_t>(load(in + i, qdtype));
  return out;
}

std::string QTensor::describe() const {
  std::ostringstream s;
  s << qdtype_name(qdtype) << data.shape_string();
  if (per_channel())
    s << " per channel (axis " << axis << ", " << scales.numel() << " scales)";
  else
    s << " scale " << scales.data_ptr<float>()[0] << " zero point " << zero_points.data_ptr<int64_t>()[0];
  return s.str();
}

QTensor quantize_per_tensor(const Tensor& x, double scale, int64_t zero_point, QDType dtype) {
  constexpr const char* op = "quantize_per_tensor";
  KILN_CHECK(scale > 0 && std::isfinite(scale), ValueError, op, ": expected a positive finite scale, got ", scale);
  KILN_CHECK(zero_point >= qmin(dtype) && zero_point <= qmax(dtype), ValueError, op, ": zero point ", zero_point,
             " is outside ", qdtype_name(dtype), "'s range [", qmin(dtype), ", ", qmax(dtype), "]");
  const Tensor xf = as_float(x, op);
  QTensor q;
  q.qdtype = dtype;
  q.data = empty(xf.sizes(), TensorOptions(kUInt8));
  q.scales = full({1}, static_cast<float>(scale), TensorOptions(kFloat32));
  q.zero_points = full({1}, zero_point, TensorOptions(kInt64));
  const float inv = 1.0f / static_cast<float>(scale);
  const float* in = xf.data_ptr<float>();
  uint8_t* out = q.data.data_ptr<uint8_t>();
  const int64_t lo = qmin(dtype), hi = qmax(dtype);
  for (int64_t i = 0; i < xf.numel(); ++i) store(out + i, quantize_one(in[i], inv, zero_point, lo, hi), dtype);
  return q;
}

QTensor quantize_per_channel(const Tensor& x, const Tensor& scales, const Tensor& zero_points, int64_t axis,
                             QDType dtype) {
  constexpr const char* op = "quantize_per_channel";
  const Tensor xf = as_float(x, op);
  if (axis < 0) axis += xf.dim();
  KILN_CHECK(axis >= 0 && axis < xf.dim(), ValueError, op, ": axis out of range for a tensor ", xf.shape_string());
  const int64_t c = xf.size(axis);
  KILN_CHECK(scales.defined() && scales.dim() == 1 && scales.size(0) == c, ShapeError, op, ": expected scales [", c,
             "], got ", scales.defined() ? scales.shape_string() : std::string("an undefined tensor"));
  KILN_CHECK(zero_points.defined() && zero_points.dim() == 1 && zero_points.size(0) == c, ShapeError, op,
             ": expected zero points [", c, "], got ",
             zero_points.defined() ? zero_points.shape_string() : std::string("an undefined tensor"));
  QTensor q;
  q.qdtype = dtype;
  q.axis = axis;
  {
    const NoGradGuard no_grad;
    q.scales = scales.detach().to(kFloat32).contiguous().clone();
    q.zero_points = zero_points.detach().to(kInt64).contiguous().clone();
  }
  const float* sc = q.scales.data_ptr<float>();
  const int64_t* zp = q.zero_points.data_ptr<int64_t>();
  const int64_t lo = qmin(dtype), hi = qmax(dtype);
  for (int64_t ch = 0; ch < c; ++ch) {
    KILN_CHECK(sc[ch] > 0 && std::isfinite(sc[ch]), ValueError, op, ": expected positive finite scales, got ", sc[ch],
               " for channel ", ch);
    KILN_CHECK(zp[ch] >= lo && zp[ch] <= hi, ValueError, op, ": zero point ", zp[ch], " of channel ", ch,
               " is outside ", qdtype_name(dtype), "'s range [", lo, ", ", hi, "]");
  }
  q.data = empty(xf.sizes(), TensorOptions(kUInt8));
  const Slices s = slices(xf, axis);
  const float* in = xf.data_ptr<float>();
  uint8_t* out = q.data.data_ptr<uint8_t>();
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t ch = 0; ch < s.channels; ++ch) {
      const float inv = 1.0f / sc[ch];
      const int64_t base = (o * s.channels + ch) * s.inner;
      for (int64_t i = 0; i < s.inner; ++i)
        store(out + base + i, quantize_one(in[base + i], inv, zp[ch], lo, hi), dtype);
    }
  return q;
}

Tensor dequantize(const QTensor& q) {
  KILN_CHECK(q.data.defined() && q.data.dtype() == kUInt8, DTypeError,
             "dequantize: expected a QTensor whose data is a uint8 tensor");
  Tensor out = empty(q.data.sizes(), TensorOptions(kFloat32));
  const Tensor d = q.data.contiguous();
  const uint8_t* in = d.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const float* sc = q.scales.data_ptr<float>();
  const int64_t* zp = q.zero_points.data_ptr<int64_t>();
  const Slices s = q.per_channel() ? slices(d, q.axis) : Slices{1, 1, d.numel()};
  for (int64_t b = 0; b < s.outer; ++b)
    for (int64_t ch = 0; ch < s.channels; ++ch) {
      const int64_t base = (b * s.channels + ch) * s.inner;
      for (int64_t i = 0; i < s.inner; ++i)
        o[base + i] = static_cast<float>(static_cast<double>(load(in + base + i, q.qdtype) - zp[ch]) * sc[ch]);
    }
  return out;
}

}  // namespace kiln::quant
