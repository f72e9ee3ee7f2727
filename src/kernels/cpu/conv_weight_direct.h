// Internal to the kernels layer: the weight gradient of a float32
// convolution over one input channel, computed directly (Note [Direct
// single-channel weight gradient] in conv_weight_direct.cpp), where oneDNN's
// primitives are slowest.
#pragma once

#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::detail {

/// Whether `p` takes the direct kernel: float32, one input channel, groups 1,
/// NHWC grad_output with a multiple of 16 output channels, a 2x2, 3x3 or 5x5
/// window, and the path left at Auto.
bool conv_weight_grad_direct_applies(const Conv2dParams& p);

/// grad_weight [o, 1, kh, kw] and grad_bias [o] (when not null), overwritten.
/// The same bits at any thread count.
void conv_weight_grad_direct(const Conv2dParams& p, const float* grad_output, const float* input, float* grad_weight,
                             float* grad_bias);

}  // namespace kiln::kernels::detail
