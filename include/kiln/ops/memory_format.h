// Memory formats of 4-D (image) tensors, as torch.memory_format: a tensor of
// shape [N, C, H, W] is either contiguous (NCHW in memory) or channels-last
// (NHWC in memory, strides [H*W*C, 1, W*C, C]). The shape, indexing and values
// are the same either way; only the order in memory differs.
//
// Why kiln cares: oneDNN's convolutions run on channels-last (or blocked)
// activations, so an NCHW tensor is reordered on the way into every conv and
// back out again. kiln's float32/bfloat16 conv2d therefore returns its output
// channels-last, and batch norm, pooling and elementwise ops keep that format
// (torch's rule: an elementwise result follows its inputs' layout), so a
// conv → BN → ReLU → conv chain runs without a single reorder. See
// docs/decisions.md ("conv2d returns channels-last").
//
// Declared and defined in the ops layer (src/ops/memory_format.cpp).
#pragma once

#include <cstdint>
#include <source_location>

#include "kiln/core/tensor.h"

namespace kiln {

enum class MemoryFormat : uint8_t {
  Contiguous,    // torch.contiguous_format: row-major
  ChannelsLast,  // torch.channels_last: 4-D, NHWC in memory
  Preserve,      // torch.preserve_format: keep the source's format (contiguous unless it is channels-last)
};

const char* memory_format_name(MemoryFormat f);

/// torch's t.is_contiguous(memory_format): dense in that format's order
/// (strides of size-1 dims are ignored, so e.g. [N, C, 1, 1] is both).
/// ChannelsLast is false for anything but 4-D.
bool is_contiguous(const Tensor& t, MemoryFormat f);

/// ChannelsLast when `t` is channels-last and not also contiguous, else
/// Contiguous: the format a result computed from `t` should take.
MemoryFormat suggest_memory_format(const Tensor& t);

/// torch's t.contiguous(memory_format): `t` itself when already in that
/// format, else a copy (differentiable, like clone). Preserve keeps a
/// channels-last tensor and makes anything else contiguous.
Tensor contiguous(const Tensor& t, MemoryFormat f, std::source_location loc = std::source_location::current());

/// An uninitialised tensor of `sizes` in format `f` (ChannelsLast needs 4 dims).
Tensor empty(IntArrayRef sizes, TensorOptions options, MemoryFormat f);

}  // namespace kiln
