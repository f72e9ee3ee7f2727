// Internal to the kernels layer: a convolution's weight gradient as one
// product over the unfolded input (Note [Weight gradient by unfolding] in
// conv_weight_gemm.cpp), for the shapes where that beats oneDNN's own
// backward-weights primitive.
#pragma once

#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::detail {

/// Whether conv2d's weight gradient for `p` runs as unfold + product here.
bool conv_weight_grad_by_product(const Conv2dParams& p);

/// grad_weight [o, c, kh, kw] (and grad_bias [o] when not null), overwritten,
/// for NHWC input and grad_output; `p` as conv_weight_grad_by_product accepts.
void conv_weight_grad_product(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                              void* grad_bias);

}  // namespace kiln::kernels::detail
