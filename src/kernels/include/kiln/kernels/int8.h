// Int8 inference kernels on oneDNN's int8 primitives (the ops layer's
// ops::Int8Conv2d / ops::Int8Linear call these; issue 22's post-training
// quantization runs on them). Forward only.
//
// Note [Int8 kernel arithmetic]
// Activations are uint8 with one scale sx and zero point zx per tensor,
// weights int8 symmetric with one scale sw[o] per output channel (zero point 0),
// so the product accumulates exactly in int32:
//   acc[o] = Σ (xq - zx) · wq[o]
//   y[o]   = act(sx · sw[o] · acc[o] + bias[o] (+ r[o]))   float32 output, or
//   yq[o]  = clamp(round(y[o] / sy) + zy, 0, 255)           requantized uint8.
// oneDNN applies zx as a source zero point (so padding reads the zero point,
// i.e. real 0), the product sx · sw[o] (/ sy) as per-channel output scales and
// the bias, ReLU and zy in its epilogue; VNNI (vpdpbusd) multiplies u8 × s8
// into s32 four at a time. The scales are fixed when a primitive is created,
// so they are part of its cache key: one primitive per layer and shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kiln/kernels/dnnl.h"
#include "kiln/kernels/fused_inference.h"

namespace kiln::kernels {

/// What a quantized layer's primitive is fixed by besides its shape.
struct Int8Epilogue {
  int32_t src_zero_point = 0;
  std::vector<float> out_scales;  // [o]: sx · sw[o], divided by sy for a uint8 output
  bool bias = false;              // float32 bias [o], pre-divided by sx · sw[o] (oneDNN adds it before scaling)
  bool residual = false;  // float32 addend of the output's shape and layout, added after the scales, before ReLU
  bool relu = false;
  bool u8_out = false;         // else float32
  int32_t dst_zero_point = 0;  // uint8 output only
};

/// Convolution: p's shape (dtype ignored); input uint8 NHWC, output NHWC.
struct Int8ConvArgs {
  Conv2dParams p;
  Int8Epilogue e;
};

FusedWeightLayout int8_conv_weight_layout(const Int8ConvArgs& a);
/// Reorders the OIHW (goihw for groups > 1) int8 weight into `packed`.
void int8_conv_pack_weight(const Int8ConvArgs& a, const void* weight, void* packed);
/// `residual` (float32 NHWC, the output's shape) is read when a.e.residual.
void int8_conv_forward(const Int8ConvArgs& a, const void* input, const void* packed, const void* bias, void* output,
                       const void* residual = nullptr);
/// oneDNN's name for the implementation it chose ("brg:avx512_core_vnni", ...).
const char* int8_conv_impl(const Int8ConvArgs& a);

/// Whether int8 products run on oneDNN's integer kernels (u8 x s8 multiplied
/// and summed in int32 with VNNI) or widen to float32 and sum there (exact as
/// well, and slower: oneDNN may use no VNNI on this CPU).
bool int8_products_native();

/// Linear: y[m, n] from x[m, k] uint8 (contiguous rows) and W [n, k] int8.
struct Int8LinearArgs {
  int64_t m = 0, n = 0, k = 0;
  Int8Epilogue e;
};

FusedWeightLayout int8_linear_weight_layout(const Int8LinearArgs& a);
void int8_linear_pack_weight(const Int8LinearArgs& a, const void* weight, void* packed);
void int8_linear_forward(const Int8LinearArgs& a, const void* x, const void* packed, const void* bias, void* y);
const char* int8_linear_impl(const Int8LinearArgs& a);

/// The epilogue of a linear with dynamic per-row activation quantization (quant::DynamicInt8Linear):
/// int8_linear_forward with src zero point 128 and out_scales sw gives z[t, o] = sw[o] · acc[t, o];
/// this pass turns it, in place, into
///   y[t, o] = act(row_scales[t] · z[t, o] + bias[o]) + residual[t, o]
/// (bias and residual may be null; residual [m, n] contiguous). oneDNN 2.6's int8 matmul has no
/// per-row scale (a [m, 1] binary post-op sends it to its reference kernel), hence one pass of ours,
/// vectorised (GELU's tanh / erf through libmvec).
void int8_dynamic_epilogue(int64_t m, int64_t n, const float* row_scales, const float* bias, FusedActivation act,
                           const float* residual, float* y);

/// Per row t of x[rows, k]: scales[t] = max|x[t]| / 127 (1 for an all-zero row) and
/// out[t, i] = round_half_even(x[t, i] / scales[t]) + 128, codes in [1, 255]. NaN codes as 128 (zero);
/// an infinite entry makes the row's scale inf (the caller checks).
void quantize_rows_absmax_u8(const float* x, int64_t rows, int64_t k, uint8_t* out, float* scales);

/// out[i] = clamp(round_half_even(x[i] · inv_scale) + zero_point, 0, 255), as
/// torch.quantize_per_tensor to quint8.
void quantize_u8(const float* x, int64_t n, float inv_scale, int32_t zero_point, uint8_t* out);
/// The same over a contiguous NCHW x [n, c, hw], written NHWC (what an int8 convolution reads): the
/// layout change and the quantization in one pass over x.
void quantize_u8_nchw_to_nhwc(const float* x, int64_t n, int64_t c, int64_t hw, float inv_scale, int32_t zero_point,
                              uint8_t* out);

}  // namespace kiln::kernels
