// LayerNorm's fused kernels (kernels layer: raw pointers, no Tensor). The
// composite (mean, var, sub, rsqrt, mul, mul, add) reads and writes the
// [rows, n] activation about eight times forward and twice that backward;
// these make one pass per row forward (statistics, then the normalised,
// scaled and shifted row while it is still in cache) and one pass per row
// backward that forms grad_input and the weight and bias gradients.
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln::kernels {

/// Float32 and float64 (dtype `dt`); every array contiguous, all of dtype `dt`.
/// In: x [rows, n], weight and bias [n]. Out: y [rows, n]; per row, mean and
/// rstd = 1 / sqrt(var + eps) (biased variance), each [rows]; mean and rstd
/// may both be null (inference, where no backward reads them).
/// y = (x - mean) * rstd * weight + bias. Row sums run over 16 independent
/// lanes in the dtype (vectorised; paired at the end).
/// y_dt: y's dtype, `dt` or (for float32) bfloat16. A bf16 y holds the float32
/// y rounded as Tensor::to rounds it: the same bits as writing float32 and
/// casting, without the cast's pass (Note [Layer norm into a product]).
void layer_norm_forward(DType dt, int64_t rows, int64_t n, const void* x, const void* weight, const void* bias,
                        double eps, void* y, void* mean, void* rstd, DType y_dt);
inline void layer_norm_forward(DType dt, int64_t rows, int64_t n, const void* x, const void* weight, const void* bias,
                               double eps, void* y, void* mean, void* rstd) {
  layer_norm_forward(dt, rows, n, x, weight, bias, eps, y, mean, rstd, dt);
}

/// In: g (the output's gradient) and x [rows, n], weight [n], the forward's
/// mean and rstd [rows]. With xhat = (x - mean) * rstd and dxhat = g * weight:
///   gx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) [rows, n],
///   gw = Σ_rows g * xhat, gb = Σ_rows g, each [n].
/// gx may be null (not wanted); gw and gb are both null or both set. The
/// weight and bias sums go per fixed chunk of rows (at most 64 chunks), then
/// over chunks in double, so they do not depend on the thread count.
/// g_dt: g's dtype, `dt` or (for float32) bfloat16, widened exactly as it is read.
void layer_norm_backward(DType dt, int64_t rows, int64_t n, const void* g, const void* x, const void* weight,
                         const void* mean, const void* rstd, void* gx, void* gw, void* gb, DType g_dt);
inline void layer_norm_backward(DType dt, int64_t rows, int64_t n, const void* g, const void* x, const void* weight,
                                const void* mean, const void* rstd, void* gx, void* gw, void* gb) {
  layer_norm_backward(dt, rows, n, g, x, weight, mean, rstd, gx, gw, gb, dt);
}

}  // namespace kiln::kernels
