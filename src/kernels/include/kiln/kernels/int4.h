// Int4 weight-only linear on the CPU (ops::Int4Linear calls it; issue 22's
// INT4 path for GPT's linears). Forward only.
//
// Note [Int4 weight layout]
// W [n, k] is quantized in groups of g consecutive inputs of one output row
// (g divides k), asymmetric and unsigned: q in [0, 15] with a float scale s
// and an integer zero point z in [0, 15] per (row, group), standing for
//   W[o, i] = (q[o, i] - z[o, i / g]) · s[o, i / g].
// Codes are packed two per byte along the row, element 2j in the high nibble
// and 2j + 1 in the low one (quant::NF4's convention), so a row is k / 2 bytes.
//
// The product dequantizes W in tiles of a few rows by all of k (about 256 KiB
// of float, so the tile stays in L2 while a float GEMM reads it once per tile)
// and multiplies each tile with oneDNN's float matmul (bias in its epilogue): the whole float matrix never exists.
#pragma once

#include <cstdint>

namespace kiln::kernels {

struct Int4LinearArgs {
  int64_t m = 0, n = 0, k = 0;  // y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias[n])
  int64_t group_size = 128;
};

/// The two codes of a byte: element 2j (high nibble) and 2j + 1 (low).
inline uint8_t int4_pack_pair(uint8_t even, uint8_t odd) { return static_cast<uint8_t>((even << 4) | (odd & 0x0F)); }

/// Packs `count` codes (each in [0, 15], count even) into count / 2 bytes.
void int4_pack(const uint8_t* codes, int64_t count, uint8_t* packed);
/// The inverse of int4_pack.
void int4_unpack(const uint8_t* packed, int64_t count, uint8_t* codes);

/// Dequantizes rows [row0, row1) of W into out[(row1 - row0), k] (row-major).
void int4_dequantize_rows(const Int4LinearArgs& a, const uint8_t* packed, const float* scales, const uint8_t* zeros,
                          int64_t row0, int64_t row1, float* out);

/// y[m, n] (row-major, contiguous) from x[m, k] (contiguous), the packed W,
/// scales and zero points [n, k / g], and bias [n] or null.
void int4_linear_forward(const Int4LinearArgs& a, const float* x, const uint8_t* packed, const float* scales,
                         const uint8_t* zeros, const float* bias, float* y);

/// The rows of W one tile holds for this k (a multiple of 8, at least 8).
int64_t int4_tile_rows(int64_t k);

}  // namespace kiln::kernels
