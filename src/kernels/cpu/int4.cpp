// Int4 weight-only linear (kiln/kernels/int4.h): tile dequantization and the
// float GEMM over each tile.
#include "kiln/kernels/int4.h"

#include <algorithm>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels {

void int4_pack(const uint8_t* codes, int64_t count, uint8_t* packed) {
  KILN_CAPTURE_KERNEL("int4_pack", int4_pack(codes, count, packed));
  for (int64_t j = 0; j < count / 2; ++j) packed[j] = int4_pack_pair(codes[2 * j], codes[2 * j + 1]);
}

void int4_unpack(const uint8_t* packed, int64_t count, uint8_t* codes) {
  KILN_CAPTURE_KERNEL("int4_unpack", int4_unpack(packed, count, codes));
  for (int64_t j = 0; j < count / 2; ++j) {
    codes[2 * j] = packed[j] >> 4;
    codes[2 * j + 1] = packed[j] & 0x0F;
  }
}

void int4_dequantize_rows(const Int4LinearArgs& a, const uint8_t* packed, const float* scales, const uint8_t* zeros,
                          int64_t row0, int64_t row1, float* out) {
  KILN_CAPTURE_KERNEL("int4_dequantize_rows", int4_dequantize_rows(a, packed, scales, zeros, row0, row1, out));
  const int64_t k = a.k, g = a.group_size, groups = k / g;
  for (int64_t o = row0; o < row1; ++o) {
    const uint8_t* p = packed + o * (k / 2);
    float* w = out + (o - row0) * k;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const float s = scales[o * groups + gi];
      // (q - z) · s = q · s - z · s: one multiply-add per element.
      const float bias = -static_cast<float>(zeros[o * groups + gi]) * s;
      const uint8_t* pg = p + gi * g / 2;
      float* wg = w + gi * g;
      for (int64_t j = 0; j < g / 2; ++j) {
        const uint8_t b = pg[j];
        wg[2 * j] = static_cast<float>(b >> 4) * s + bias;
        wg[2 * j + 1] = static_cast<float>(b & 0x0F) * s + bias;
      }
    }
  }
}

int64_t int4_tile_rows(int64_t k) {
  constexpr int64_t kTileFloats = 64 * 1024;  // 256 KiB: a tile stays in L2 (1-2 MiB per core) while x streams by
  const int64_t rows = kTileFloats / std::max<int64_t>(k, 1);
  return std::max<int64_t>(8, rows / 8 * 8);
}

void int4_linear_forward(const Int4LinearArgs& a, const float* x, const uint8_t* packed, const float* scales,
                         const uint8_t* zeros, const float* bias, float* y) {
  KILN_CAPTURE_KERNEL("int4_linear_forward", int4_linear_forward(a, x, packed, scales, zeros, bias, y));
  const int64_t m = a.m, n = a.n, k = a.k, rows = int4_tile_rows(k);
  const int64_t tiles = (n + rows - 1) / rows;
  // Tiles run one after another and oneDNN spreads each product over the
  // threads: the layers here have a few tiles, fewer than the threads.
  std::vector<float> w(static_cast<size_t>(rows * k));
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = t * rows, r1 = std::min(n, r0 + rows);
    int4_dequantize_rows(a, packed, scales, zeros, r0, r1, w.data());
    // y[:, r0:r1] = x · w[0:r1-r0, :]ᵀ + bias[r0:r1], written in place into y's columns.
    MatmulArgs g;
    g.m = m;
    g.n = r1 - r0;
    g.k = k;
    g.a.data = x;
    g.a.stride[1] = k;
    g.b.data = w.data();
    g.b.stride[1] = 1;  // b [k, rows] is the tile read transposed
    g.b.stride[2] = k;
    g.bias = bias ? bias + r0 : nullptr;
    g.c = y + r0;
    g.c_stride[1] = n;
    matmul(g);
  }
}

}  // namespace kiln::kernels
