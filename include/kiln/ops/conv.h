// 2-D convolution and pooling with torch.nn.functional's names, argument
// order and defaults: conv2d, max_pool2d (and max_pool2d_with_indices),
// avg_pool2d, adaptive_avg_pool2d. Inputs are [N, C, H, W] or unbatched
// [C, H, W]. Size arguments take one int for both dims or two ({kH, kW}):
//   conv2d(x, w, b, /*stride=*/2, /*padding=*/1);  max_pool2d(x, 2);
//
// float32 and bfloat16 run on oneDNN; float64 runs im2col + OpenBLAS for
// conv2d and our own loops for pooling; float16 computes in float32. Input,
// weight and bias must share one dtype (DTypeError otherwise, as torch).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>

#include "kiln/core/tensor.h"

namespace kiln {

/// padding="valid" (none) or "same" (output size = input size; stride 1
/// only; an odd total padding puts the extra row/column at the bottom/right).
enum class PaddingMode { Valid, Same };

/// input [N, C, H, W] (or [C, H, W]), weight [out_channels, C / groups, kH, kW],
/// bias [out_channels] or undefined -> [N, out_channels, H_out, W_out] with
/// H_out = (H + 2 * padding - dilation * (kH - 1) - 1) / stride + 1.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, IntArrayRef stride = 1,
              IntArrayRef padding = 0, IntArrayRef dilation = 1, int64_t groups = 1,
              std::source_location loc = std::source_location::current());
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride, PaddingMode padding,
              IntArrayRef dilation = 1, int64_t groups = 1, std::source_location loc = std::source_location::current());

/// stride defaults to kernel_size (an empty stride means "default", as torch's
/// stride=None). Padding is implicit -inf and may be at most half the kernel.
Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride = {}, IntArrayRef padding = 0,
                  IntArrayRef dilation = 1, bool ceil_mode = false,
                  std::source_location loc = std::source_location::current());
/// As max_pool2d, plus int64 indices of each maximum, flattened over its
/// input plane (row * W + col), as torch's return_indices=True.
std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size,
                                                   IntArrayRef stride = {}, IntArrayRef padding = 0,
                                                   IntArrayRef dilation = 1, bool ceil_mode = false,
                                                   std::source_location loc = std::source_location::current());

/// count_include_pad counts the zero padding in each window's divisor (but
/// not the extra cells ceil_mode adds past it, as torch); divisor_override,
/// when set, replaces the divisor. Also accepts integer tensors, as torch.
Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride = {}, IntArrayRef padding = 0,
                  bool ceil_mode = false, bool count_include_pad = true,
                  std::optional<int64_t> divisor_override = std::nullopt,
                  std::source_location loc = std::source_location::current());

/// An output size {oH, oW} whose entries may be std::nullopt, torch's None:
/// "keep the input's size in that dim", as F.adaptive_avg_pool2d(x, (None, 7)).
using OptionalSize2d = std::array<std::optional<int64_t>, 2>;

/// Output [..., oH, oW]; cell i averages input rows [floor(i * H / oH),
/// ceil((i + 1) * H / oH)) and likewise columns, so bins may overlap.
Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size,
                           std::source_location loc = std::source_location::current());
/// adaptive_avg_pool2d(x, {std::nullopt, 7}): a nullopt entry keeps that dim's input size.
Tensor adaptive_avg_pool2d(const Tensor& input, OptionalSize2d output_size,
                           std::source_location loc = std::source_location::current());
/// adaptive_avg_pool2d(x, {2, 3}) and (x, {1}): a braced list of integers
/// would convert as well to IntArrayRef as to OptionalSize2d (an ambiguous
/// call); this exact match takes it, meaning what IntArrayRef means.
Tensor adaptive_avg_pool2d(const Tensor& input, std::initializer_list<int64_t> output_size,
                           std::source_location loc = std::source_location::current());

}  // namespace kiln
