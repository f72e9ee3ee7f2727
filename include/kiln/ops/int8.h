// Int8 inference convolution and linear on oneDNN's int8 primitives (VNNI),
// with weights quantized and packed once: what quant::QuantizedConv2d and
// quant::QuantizedLinear (include/kiln/quant/ptq.h) run.
//
//   ops::Int8Linear fc(w_s8, w_scales, bias, {.input_scale = 0.02f, .input_zero_point = 3});
//   Tensor y = fc(x);  // x float: quantized to uint8 first; y float32
//
// Weights: int8, symmetric, one scale per output channel (zero point 0), held
// as a kUInt8 tensor of the int8 bytes (quant::QTensor's convention).
// Activations: uint8, one scale and zero point per tensor. A float input is
// quantized on the way in (round half to even, as torch.quantize_per_tensor);
// a kUInt8 input is taken as already quantized with the layer's input
// parameters. The output is float32, or uint8 requantized with output_scale
// and output_zero_point when those are set (the next layer's input). Bias and
// ReLU are applied in the primitive's epilogue. Kernel arithmetic: Note [Int8
// kernel arithmetic] in the int8 kernel's header under src/kernels. Inference
// only; objects are cheap to copy (shared state) and safe to call from
// several threads.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "kiln/core/tensor.h"

namespace kiln::ops {

struct Int8Quantization {
  float input_scale = 1.0f;
  int64_t input_zero_point = 0;  // [0, 255]
  bool relu = false;
  /// > 0: the output is uint8 with these parameters; else float32.
  float output_scale = 0.0f;
  int64_t output_zero_point = 0;
};

struct Int8Conv2dOptions {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
  Int8Quantization q;
};

/// weight_s8 [out, in / groups, kH, kW] (kUInt8 bytes of int8), weight_scales float [out],
/// bias float [out] or undefined. Input [N, C, H, W]; output [N, out, H_out, W_out], channels-last.
class Int8Conv2d {
 public:
  Int8Conv2d(const Tensor& weight_s8, const Tensor& weight_scales, const Tensor& bias, Int8Conv2dOptions options);
  Tensor operator()(const Tensor& input) const;
  /// The same plus `residual` (float32 of the output's shape), added in the kernel's epilogue after the
  /// scales and bias and before the ReLU: a residual block's add (and ReLU) without a pass of their own.
  /// Float output only.
  Tensor operator()(const Tensor& input, const Tensor& residual) const;
  const Int8Conv2dOptions& options() const;
  /// The oneDNN implementation chosen for this input shape (for reports and benchmarks).
  std::string implementation(const Tensor& input) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// weight_s8 [out, in]; input [..., in]; output [..., out].
class Int8Linear {
 public:
  Int8Linear(const Tensor& weight_s8, const Tensor& weight_scales, const Tensor& bias, Int8Quantization q);
  Tensor operator()(const Tensor& input) const;
  const Int8Quantization& quantization() const;
  std::string implementation(const Tensor& input) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// Int8 linear with dynamic per-row activation quantization (quant::DynamicInt8Linear runs it): no
/// calibration; each row x_t of the float input gets its own scale a_t = max|x_t| / 127 and is coded as
/// round(x_t / a_t) + 128 (uint8), multiplied u8 × s8 → s32 on VNNI, and
///   y_t = act(a_t · sw ⊙ acc_t + bias) (+ residual_t)
/// is formed in the primitive's epilogue, one pass over y: the activation (GELU, ReLU) and the
/// residual add are what a transformer block runs after c_fc and c_proj. Inference only.
class Int8DynamicLinear {
 public:
  enum class Activation { None, Relu, GeluTanh, GeluErf };
  /// weight_s8 [out, in] (kUInt8 bytes of int8), weight_scales float [out] (> 0).
  Int8DynamicLinear(const Tensor& weight_s8, const Tensor& weight_scales);
  /// input float32 [..., in]; bias undefined or float32 [out] (read at each call); residual undefined
  /// or float32 of the output's shape [..., out].
  Tensor operator()(const Tensor& input, const Tensor& bias, Activation act = Activation::None,
                    const Tensor& residual = {}) const;
  std::string implementation(const Tensor& input) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// Whether this CPU runs int8 products on oneDNN's integer kernels (VNNI);
/// else they widen to float32 and sum there, exactly, and more slowly than
/// float32 layers: a run can then say that int8 saves weight memory here, not
/// time. implementation() names the path per layer.
bool int8_products_native();

}  // namespace kiln::ops
