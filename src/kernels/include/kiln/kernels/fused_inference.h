// Inference-only dense kernels with pre-packed weights and fused epilogues
// (the ops layer's ops::PackedConv2d / ops::PackedLinear call these; issue 21's
// inference optimisation). float32 only, forward only.
//
// Note [Fused inference epilogue]
// y = act(op(x, W) + bias + residual): the bias, an optional residual of the
// output's shape (a oneDNN binary-add post-op for the matmul; for the
// convolution a sum post-op over the destination, which the residual is copied
// into first: dnnl_fused_inference.cpp says why) and an activation (an eltwise
// post-op) are applied while each output tile is still in registers, so a
// Conv -> Add -> Relu chain of a ResNet block or a Linear -> GELU of a
// transformer MLP is one pass over memory instead of three. The residual goes
// in before the activation because that is where ResNet's block adds it
// (relu(bn2(conv2(y)) + shortcut)); a transformer's residual has no activation
// after it, so one order serves both.
//
// The weight is packed once into the layout oneDNN's primitive asks for
// (format_tag::any) by the caller, who keeps the buffer: the kernel only says
// which layout (a hash id and a size) a problem wants, fills it, and reads it.
// A layout can differ between problem shapes (batch size, rows), so the
// caller keys its buffers by the id.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kiln/kernels/dnnl.h"

namespace kiln::kernels {

enum class FusedActivation : uint8_t { None, Relu, GeluErf, GeluTanh };

/// A weight layout a fused problem reads: equal ids are the same layout.
struct FusedWeightLayout {
  size_t bytes = 0;
  uint64_t id = 0;
};

/// Convolution: p as conv2d_forward's (float32; p.input_nhwc says the input's
/// layout, p.output_nhwc the output's and the residual's).
struct FusedConvArgs {
  Conv2dParams p;
  bool bias = false;
  bool residual = false;
  FusedActivation act = FusedActivation::None;
};

FusedWeightLayout fused_conv_weight_layout(const FusedConvArgs& a);
/// Reorders the OIHW (goihw for groups > 1) float32 weight into `packed`
/// (fused_conv_weight_layout(a).bytes).
void fused_conv_pack_weight(const FusedConvArgs& a, const void* weight, void* packed);
/// output = act(conv(input, W) + bias + residual), W read from `packed`.
void fused_conv_forward(const FusedConvArgs& a, const void* input, const void* packed, const void* bias,
                        const void* residual, void* output);

/// Linear: y[m, n] = act(x[m, k] · Wᵀ + bias + residual) with W [n, k] (torch's
/// Linear weight), x and y contiguous rows, residual contiguous [m, n].
struct FusedLinearArgs {
  int64_t m = 0, n = 0, k = 0;
  bool bias = false;
  bool residual = false;
  FusedActivation act = FusedActivation::None;
};

FusedWeightLayout fused_linear_weight_layout(const FusedLinearArgs& a);
/// Reorders W [n, k] (contiguous float32) into `packed`.
void fused_linear_pack_weight(const FusedLinearArgs& a, const void* weight, void* packed);
void fused_linear_forward(const FusedLinearArgs& a, const void* x, const void* packed, const void* bias,
                          const void* residual, void* y);

}  // namespace kiln::kernels
