// Internal to the kernels layer: kiln's own channels-last max pooling (Note
// [Channels-last max pooling] in pool_max_nhwc.cpp), which pool2d.cpp runs
// instead of oneDNN's where it applies.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::detail {

/// Whether the NHWC max pool p runs here: float32 (any windows) or bfloat16
/// (windows that do not overlap), no dilation, at most 255 positions a window.
bool max_pool_nhwc_applies(const Pool2dParams& p);

/// Bytes of the workspace the forward writes for the backward: one byte per
/// output element, the maximum's position in its window.
size_t max_pool_nhwc_workspace_bytes(const Pool2dParams& p);

/// output (and, when not null, the workspace) of an NHWC max pool, torch's
/// values: the first maximum in the window, NaN wins. With `relu_threshold`
/// (kiln::compile's ReLU-pooling rewrite, where max_pool_nhwc_relu_applies):
/// the ReLU of each maximum, and position bytes with bit 7 set where the
/// maximum is <= the threshold, so the backward routes no gradient there.
void max_pool_nhwc_forward(const Pool2dParams& p, const void* input, void* output, uint8_t* workspace,
                           const float* relu_threshold = nullptr);

/// Whether the forward takes a relu_threshold: windows of at most 128 positions.
bool max_pool_nhwc_relu_applies(const Pool2dParams& p);

/// grad_input (NHWC, overwritten) from grad_output and the forward's workspace.
void max_pool_nhwc_backward(const Pool2dParams& p, const void* grad_output, const uint8_t* workspace, void* grad_input);

}  // namespace kiln::kernels::detail
