// Int8 inference kernels on oneDNN's int8 primitives (the ops layer's
// ops::Int8Conv2d / ops::Int8Linear call these; issue 22's post-training
// quantization runs on them). Forward only.
//
// Note [Int8 kernel arithmetic]
// Activations are uint8 with one scale sx and zero point zx per tensor,
// weights int8 symmetric with one scale sw[o] per output channel (zero point 0),
// so the product accumulates exactly in int32:
//   acc[o] = Σ (xq - zx) · wq[o]
//   y[o]   = act(sx · sw[o] · acc[o] + bias[o])            float32 output, or
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
void int8_conv_forward(const Int8ConvArgs& a, const void* input, const void* packed, const void* bias, void* output);
/// oneDNN's name for the implementation it chose ("brg:avx512_core_vnni", ...).
const char* int8_conv_impl(const Int8ConvArgs& a);

/// Linear: y[m, n] from x[m, k] uint8 (contiguous rows) and W [n, k] int8.
struct Int8LinearArgs {
  int64_t m = 0, n = 0, k = 0;
  Int8Epilogue e;
};

FusedWeightLayout int8_linear_weight_layout(const Int8LinearArgs& a);
void int8_linear_pack_weight(const Int8LinearArgs& a, const void* weight, void* packed);
void int8_linear_forward(const Int8LinearArgs& a, const void* x, const void* packed, const void* bias, void* y);
const char* int8_linear_impl(const Int8LinearArgs& a);

/// out[i] = clamp(round_half_even(x[i] · inv_scale) + zero_point, 0, 255), as
/// torch.quantize_per_tensor to quint8.
void quantize_u8(const float* x, int64_t n, float inv_scale, int32_t zero_point, uint8_t* out);

}  // namespace kiln::kernels
