// quant: int8 inference for GPT's linears with dynamic per-token activation
// quantization (no calibration), over ops::Int8DynamicLinear's oneDNN int8 kernel.
//
//   quant::quantize_linears_int8_dynamic(model, quant::gpt_int4_targets());
//   model(idx);  // every c_attn / c_proj / c_fc computes u8 × s8 → s32
//
// Weights: int8, symmetric, one scale per output channel (absmax / 127).
// Activations: each token's row x_t gets its own scale a_t = max|x_t| / 127
// and is coded as round(x_t / a_t) + 128 (uint8, zero point 128 for every
// row). The kernel is built once with zero point 128, so it returns
// sw[o] · Σ (xq - 128) · wq[o]; row t is multiplied by a_t and the bias added
// in the primitive's epilogue. A per-token zero point would need a kernel per
// call; the fixed 128 costs one bit of range (codes use [1, 255]).
// The transformer block's fused paths reach the layer through
// forward_gelu / forward_add, so c_fc's GELU and c_proj's residual add run in
// the same epilogue (one pass over the output), as in the float model.
// Inference only; the lm_head (tied to the embedding) stays float.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kiln/nn/layers.h"
#include "kiln/ops/int8.h"

namespace kiln::quant {

class DynamicInt8Linear : public nn::Linear {
 public:
  /// Quantizes src's weight per output channel; src is unchanged.
  explicit DynamicInt8Linear(const nn::Linear& src);
  Tensor forward(const Tensor& x) override;
  Tensor forward_gelu(const Tensor& x, const std::string& approximate) override;
  Tensor forward_add(const Tensor& x, const Tensor& residual) override;
  std::string extra_repr() const override;
  /// Bytes of the int8 weight and its scales.
  int64_t weight_bytes() const;

 private:
  Tensor w_s8_, w_scales_;
  std::shared_ptr<ops::Int8DynamicLinear> kernel_;
  Tensor run(const Tensor& x, ops::Int8DynamicLinear::Activation act, const Tensor& residual) const;
};

/// Replaces the float Linears matching `targets` (nn::lora's patterns) by
/// DynamicInt8Linear in their parents (as quantize_linears_int4); returns their paths.
std::vector<std::string> quantize_linears_int8_dynamic(nn::Module& model, const std::vector<std::string>& targets);

}  // namespace kiln::quant
