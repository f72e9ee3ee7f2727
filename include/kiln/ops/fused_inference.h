// Inference-only fused convolution and linear with pre-packed weights: what
// kiln's inference runtime (infer::optimize, include/kiln/export/infer.h) runs
// for the graph's kiln.FusedConv and kiln.FusedGemm nodes.
//
//   ops::PackedConv2d conv(w, b, {.padding = {1, 1}, .activation = ops::InferenceActivation::Relu});
//   Tensor y = conv(x, shortcut);  // relu(conv2d(x, w, b, 1, 1) + shortcut), one pass
//
// Each object copies its weight once into the layout oneDNN's primitive reads
// fastest (format_tag::any) and keeps it; later changes to the source weight
// are not seen (build a new object). The bias, an optional residual and the
// activation are applied inside the primitive (oneDNN post-ops): y =
// act(op(x) + bias + residual). float32 only. Inference only: an input that
// requires grad is refused (nothing here records a backward node).
// Objects are cheap to copy (they share their packed weights) and safe to
// call from several threads.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// The activation applied last: none, ReLU, GELU exact (erf) or GELU's tanh approximation.
enum class InferenceActivation : uint8_t { None, Relu, GeluErf, GeluTanh };

/// "none", "relu", "gelu", "gelu_tanh".
const char* activation_name(InferenceActivation a);

struct PackedConv2dOptions {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};        // top, left
  std::array<int64_t, 2> padding_end{-1, -1};  // bottom, right; -1: as `padding` (torch's symmetric padding)
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
  InferenceActivation activation = InferenceActivation::None;
};

/// y = act(conv2d(x, weight, bias) + residual). weight [out, in / groups, kH, kW];
/// bias [out] or undefined. Output [N, out, H_out, W_out], channels-last in
/// memory (as conv2d's); the input may be contiguous or channels-last.
class PackedConv2d {
 public:
  PackedConv2d(const Tensor& weight, const Tensor& bias, PackedConv2dOptions options = {});
  /// input [N, C, H, W]; residual undefined or the output's shape.
  Tensor operator()(const Tensor& input, const Tensor& residual = {}) const;
  const PackedConv2dOptions& options() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// y = act(x · weightᵀ + bias + residual): torch's Linear with an epilogue.
/// weight [out, in]; bias [out] or undefined.
class PackedLinear {
 public:
  PackedLinear(const Tensor& weight, const Tensor& bias, InferenceActivation activation = InferenceActivation::None);
  /// x [..., in]; residual undefined or [..., out] (the output's shape).
  Tensor operator()(const Tensor& x, const Tensor& residual = {}) const;
  InferenceActivation activation() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kiln::ops
