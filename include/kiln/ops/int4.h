// ops: int4 weight-only linear algebra, the arithmetic under quant::Int4Linear
// (include/kiln/quant/int4.h), for GPT's linears at 4 bits per weight.
//
//   Tensor packed = ops::int4_pack(codes);                        // uint8 [n, k] in [0, 15] -> [n, k / 2]
//   Tensor y = ops::int4_linear(x, packed, scales, zeros, bias, 128);
//
// A weight W [n, k] is cut into groups of `group_size` consecutive inputs of a
// row; each group has a float32 scale s and a uint8 zero point z in [0, 15],
// and each weight a code q in [0, 15]: W[o, i] = (q - z) · s. Codes are packed
// two per byte, element 2j in the high nibble (as quant::NF4 packs its codes).
// int4_linear computes x Wᵀ + b with W dequantized a tile of rows at a time
// inside the product, never as a whole float matrix. Inference only: inputs
// must not require grad.
#pragma once

#include <cstdint>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// codes uint8 [..., k] (k even, values in [0, 15]) -> uint8 [..., k / 2]. ValueError otherwise.
Tensor int4_pack(const Tensor& codes);
/// packed uint8 [..., k / 2] -> codes uint8 [..., k].
Tensor int4_unpack(const Tensor& packed);

/// The float32 weight [n, k] that packed [n, k / 2], scales float32 [n, k / g]
/// and zeros uint8 [n, k / g] stand for. ShapeError / DTypeError / ValueError
/// (zero points above 15, g not dividing k or odd) naming what was expected.
Tensor int4_dequantize(const Tensor& packed, const Tensor& scales, const Tensor& zeros, int64_t group_size);

/// y [..., n] = x [..., k] · Wᵀ + bias (bias float32 [n] or undefined); x any
/// float dtype (computed in float32), y float32.
Tensor int4_linear(const Tensor& x, const Tensor& packed, const Tensor& scales, const Tensor& zeros, const Tensor& bias,
                   int64_t group_size);

}  // namespace kiln::ops
