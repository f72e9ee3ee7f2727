// Internal to the ops layer: conv2d and pooling once conv_pool.cpp has
// parsed their arguments into the kernel parameter structs. conv_grad.cpp and
// pool_grad.cpp run the kernels and record the backward nodes.
//
// Note [Differentiable backward of conv2d and pooling]
// Each backward is itself an op with a node, so create_graph gives correct
// higher derivatives without other families' ops:
//   conv2d:   y = conv(x, w) + b. The input gradient Bx(g, w) is conv's
//             adjoint in x, so d<gg, Bx(g, w)> is conv(gg, w) for g and
//             Bw(g, gg) for w; the weight gradient (Bw, Bb)(g, x) gives
//             conv(x, ggw, ggb) for g and Bx(g, ggw) for x.
//   pooling:  the backward is linear in g (for max pooling, with the
//             argmaxes fixed), so its adjoint is the forward again: an
//             average pool of gg, or a gather of gg at the argmax indices.
//             Their derivative in the pooled input is zero (almost
//             everywhere for max pooling), as in torch.
// Every op here takes an input of dtype float16 (or bfloat16) where its
// kernel dtype (p.dtype) is float32: it converts around the kernel and
// returns the input's dtype.
#pragma once

#include <tuple>

#include "kiln/autograd/node.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::ops::conv_detail {

/// The dtype a convolution or pooling kernel computes in for a floating input
/// of dtype `dt`: float16 in float32, and bfloat16 too where oneDNN's
/// bfloat16 kernels are missing or slower than float32 on this CPU
/// (kernels::bf16_products_on_dnnl; Note [bf16 products where bf16 is slow]).
DType kernel_dtype(DType dt);

/// The tensor a kernel reads: contiguous, in the kernel's dtype (call under a NoGradGuard).
Tensor kernel_operand(const Tensor& t, DType kernel_dtype);

/// conv2d over input [N, C, H, W] or unbatched [C, H, W] (p.n == 1); records ConvolutionBackward0.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, const kernels::Conv2dParams& p,
              autograd::CallSite site);

/// input [N, C, H, W] or [C, H, W]; records MaxPool2DWithIndicesBackward0.
Tensor max_pool2d(const Tensor& input, const kernels::Pool2dParams& p, autograd::CallSite site);
std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, const kernels::Pool2dParams& p,
                                                   autograd::CallSite site);
/// p.kind AvgIncludePad or AvgExcludePad; records AvgPool2DBackward0.
Tensor avg_pool2d(const Tensor& input, const kernels::Pool2dParams& p, autograd::CallSite site);
/// Output [..., oh, ow]; records AdaptiveAvgPool2DBackward0.
Tensor adaptive_avg_pool2d(const Tensor& input, int64_t oh, int64_t ow, autograd::CallSite site);

}  // namespace kiln::ops::conv_detail
