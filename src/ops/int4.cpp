// ops::int4_* (include/kiln/ops/int4.h): argument checks and the calls into
// kernels/cpu/int4.cpp.
#include "kiln/ops/int4.h"

#include <string>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/int4.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln::ops {
namespace {

std::string describe(const Tensor& t) {
  return t.defined() ? std::string(dtype_name(t.dtype())) + " " + t.shape_string() : std::string("an undefined tensor");
}

// Checks the weight's three tensors against each other; returns the args' n, k and g.
kernels::Int4LinearArgs check_weight(const char* op, const Tensor& packed, const Tensor& scales, const Tensor& zeros,
                                     int64_t group_size) {
  KILN_CHECK(packed.defined() && packed.dtype() == kUInt8 && packed.dim() == 2, ShapeError, op,
             ": expected packed codes uint8 [n, k / 2], got ", describe(packed));
  kernels::Int4LinearArgs a;
  a.n = packed.size(0);
  a.k = packed.size(1) * 2;
  a.group_size = group_size;
  KILN_CHECK(group_size > 0 && group_size % 2 == 0 && a.k % group_size == 0, ValueError, op,
             ": expected an even group size dividing k = ", a.k, ", got ", group_size);
  const int64_t groups = a.k / group_size;
  KILN_CHECK(scales.defined() && scales.dtype() == kFloat32 && scales.dim() == 2 && scales.size(0) == a.n &&
                 scales.size(1) == groups,
             ShapeError, op, ": expected scales float32 [", a.n, ", ", groups, "], got ", describe(scales));
  KILN_CHECK(
      zeros.defined() && zeros.dtype() == kUInt8 && zeros.dim() == 2 && zeros.size(0) == a.n && zeros.size(1) == groups,
      ShapeError, op, ": expected zero points uint8 [", a.n, ", ", groups, "], got ", describe(zeros));
  return a;
}

Tensor contiguous_u8(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

}  // namespace

Tensor int4_pack(const Tensor& codes) {
  OpScope scope("int4_pack", {&codes});
  KILN_CHECK(codes.defined() && codes.dtype() == kUInt8 && codes.dim() >= 1 && codes.size(-1) % 2 == 0, ValueError,
             "int4_pack: expected uint8 codes [..., k] with k even, got ", describe(codes));
  const NoGradGuard ng;
  const Tensor c = contiguous_u8(codes);
  const uint8_t* p = c.data_ptr<uint8_t>();
  for (int64_t i = 0; i < c.numel(); ++i)
    KILN_CHECK(p[i] <= 15, ValueError, "int4_pack: expected codes in [0, 15], got ", static_cast<int>(p[i]),
               " at element ", i);
  auto shape = c.shape();
  std::vector<int64_t> out_shape(shape.begin(), shape.end());
  out_shape.back() /= 2;
  Tensor out = empty(out_shape, TensorOptions(kUInt8));
  kernels::int4_pack(p, c.numel(), out.data_ptr<uint8_t>());
  return out;
}

Tensor int4_unpack(const Tensor& packed) {
  OpScope scope("int4_unpack", {&packed});
  KILN_CHECK(packed.defined() && packed.dtype() == kUInt8 && packed.dim() >= 1, ValueError,
             "int4_unpack: expected uint8 packed codes [..., k / 2], got ", describe(packed));
  const NoGradGuard ng;
  const Tensor c = contiguous_u8(packed);
  auto shape = c.shape();
  std::vector<int64_t> out_shape(shape.begin(), shape.end());
  out_shape.back() *= 2;
  Tensor out = empty(out_shape, TensorOptions(kUInt8));
  kernels::int4_unpack(c.data_ptr<uint8_t>(), c.numel() * 2, out.data_ptr<uint8_t>());
  return out;
}

namespace {

void check_zero_points(const char* op, const Tensor& zeros) {
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  for (int64_t i = 0; i < zeros.numel(); ++i)
    KILN_CHECK(z[i] <= 15, ValueError, op, ": expected zero points in [0, 15], got ", static_cast<int>(z[i]),
               " at element ", i);
}

}  // namespace

Tensor int4_dequantize(const Tensor& packed, const Tensor& scales, const Tensor& zeros, int64_t group_size) {
  OpScope scope("int4_dequantize", {&packed, &scales, &zeros});
  const kernels::Int4LinearArgs a = check_weight("int4_dequantize", packed, scales, zeros, group_size);
  const NoGradGuard ng;
  const Tensor p = contiguous_u8(packed), s = scales.contiguous(), z = contiguous_u8(zeros);
  check_zero_points("int4_dequantize", z);
  Tensor out = empty({a.n, a.k}, TensorOptions(kFloat32));
  kernels::int4_dequantize_rows(a, p.data_ptr<uint8_t>(), s.data_ptr<float>(), z.data_ptr<uint8_t>(), 0, a.n,
                                out.data_ptr<float>());
  return out;
}

Tensor int4_linear(const Tensor& x, const Tensor& packed, const Tensor& scales, const Tensor& zeros, const Tensor& bias,
                   int64_t group_size) {
  OpScope scope("int4_linear", {&x, &packed, &scales, &zeros});
  kernels::Int4LinearArgs a = check_weight("int4_linear", packed, scales, zeros, group_size);
  KILN_CHECK(x.defined() && is_floating_point(x.dtype()) && x.dim() >= 1 && x.size(-1) == a.k, ShapeError,
             "int4_linear: expected a float input [..., ", a.k, "], got ", describe(x));
  KILN_CHECK(!x.requires_grad(), ValueError,
             "int4_linear is inference-only, but its input requires grad; run it under NoGradGuard / "
             "InferenceModeGuard");
  KILN_CHECK(!bias.defined() || (bias.dtype() == kFloat32 && bias.dim() == 1 && bias.size(0) == a.n), ShapeError,
             "int4_linear: expected a bias float32 [", a.n, "] or none, got ", describe(bias));
  const NoGradGuard ng;
  Tensor xf = x.dtype() == kFloat32 ? x : x.to(kFloat32);
  if (!xf.is_contiguous()) xf = xf.contiguous();
  a.m = a.k > 0 ? xf.numel() / a.k : 0;
  auto shape = xf.shape();
  std::vector<int64_t> out_shape(shape.begin(), shape.end());
  out_shape.back() = a.n;
  Tensor y = empty(out_shape, TensorOptions(kFloat32));
  if (a.m == 0 || a.n == 0) return y;
  const Tensor p = contiguous_u8(packed), s = scales.contiguous(), z = contiguous_u8(zeros);
  const Tensor b = bias.defined() ? bias.contiguous() : Tensor();
  kernels::int4_linear_forward(a, xf.data_ptr<float>(), p.data_ptr<uint8_t>(), s.data_ptr<float>(),
                               z.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

}  // namespace kiln::ops
