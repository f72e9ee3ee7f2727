// Internal to the kernels layer: the weight gradient of a convolution over a
// few input channels (a network's stem: grayscale or RGB images), summed
// directly over grad_output's channel vectors (Note [Few-channel weight
// gradient] in conv_direct.cpp), where oneDNN's backward-weights
// primitive is slow, and the same sum read through a max pool's backward;
// the forward over one input channel (Note [Few-channel convolution]), and
// the same forward run inside a max pool.
#pragma once

#include <cstdint>

#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::detail {

/// Whether the direct sum takes p: float32 or bfloat16, groups 1, NHWC
/// grad_output, at most 4 input channels and 64 output channels.
bool conv_weight_direct_fits(const Conv2dParams& p);

/// grad_weight [o, c, kh, kw] (and grad_bias [o] when not null), overwritten.
void conv_weight_direct(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                        void* grad_bias);

/// Whether conv2d_forward runs p on the direct forward (Note [Few-channel
/// convolution] in conv_direct.cpp): one input channel, NHWC output.
bool conv_forward_direct(const Conv2dParams& p);
void conv_forward_direct_run(const Conv2dParams& p, const void* input, const void* weight, const void* bias,
                             void* output);
/// Describes a direct forward to kiln::compile's capture (capture::Operands
/// "conv2d_forward_direct": input, weight, bias, output).
void note_forward_operands(const Conv2dParams& p, const void* input, const void* weight, const void* bias,
                           void* output);

/// Describes a direct weight gradient to kiln::compile's capture
/// (capture::Operands "conv2d_backward_weight": grad_output, input,
/// grad_weight, grad_bias), for conv2d_backward_weight_pooled_fusion.
void note_weight_grad_operands(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                               void* grad_bias);

}  // namespace kiln::kernels::detail
