// quant: 4-bit NormalFloat (NF4) weights, as QLoRA (Dettmers et al. 2023) and
// bitsandbytes store a frozen base model under LoRA adapters.
//
// NF4 is a 16-value code whose levels are quantiles of the standard normal
// distribution, rescaled to [-1, 1] with an exact zero: pretrained weights are
// close to normally distributed, so each level is used about equally often
// (information-theoretically optimal for normal data). A weight tensor is cut
// into blocks of 64 consecutive elements (row-major); each block stores its
// absmax as the scale and every element as the index of the level nearest to
// x / absmax, two indices per byte. That is 4 bits plus 32/64 = 0.5 bits of scale
// per weight; "double quantization" then quantizes the scales themselves: the
// mean of all scales is subtracted and the centred scales are coded with 8 bits
// per scale and one float32 factor per block of 256 scales, 8/64 + 32/(64·256) ≈
// 0.127 bits per weight (the QLoRA paper's figure). kiln codes the centred scales
// linearly (round(c / s) with s = max|c| / 127 in the block) where bitsandbytes
// uses its dynamic 8-bit map; the size is the same and the error is bounded by s / 2.
//
//   quant::quantize_linears_nf4(model, {"attn.c_attn", "attn.c_proj", "mlp.*"});  // frozen 4-bit base
//   auto lora = nn::lora::apply(model, {...});                                     // QLoRA
//
// NF4Linear is an nn::Linear (so LoRA, printing and the model's typed
// pointers keep working) whose float weight is gone: forward dequantizes the
// weight into a transient float matrix for the product and frees it, and the
// backward dequantizes again for grad_input, so no float copy of the weight
// outlives an op (bitsandbytes' training path does the same). The weight is
// frozen; the bias, if any, is kept in float (frozen too).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/nn/layers.h"

namespace kiln::quant {

/// The 16 NF4 levels in increasing order, -1 ... 0 ... 1 (QLoRA's Appendix E,
/// bitsandbytes' table): 7 negative and 8 positive normal quantiles, exact zero.
const std::array<float, 16>& nf4_levels();

struct NF4Options {
  int64_t block_size = 64;
  /// Quantize the block scales (8 bits each, float32 factor per scale_block_size scales).
  bool double_quant = true;
  int64_t scale_block_size = 256;
};

/// A float tensor quantized to NF4.
struct NF4Tensor {
  std::vector<int64_t> shape;
  NF4Options options;
  /// uint8 [ceil(numel / 2)]: element 2i's level index in the high nibble, 2i + 1's in the low.
  Tensor codes;
  /// float32 [blocks]: the block scales (only without double quantization).
  Tensor absmax;
  /// With double quantization: uint8 [blocks] (scale - offset) / factor + 128,
  /// float32 [ceil(blocks / scale_block_size)] factors, float32 [1] offset.
  Tensor absmax_codes, absmax_factors, absmax_offset;

  int64_t numel() const;
  int64_t num_blocks() const;
  /// Bytes of the tensors above.
  int64_t nbytes() const;
};

/// Quantizes a float tensor (any shape, any float dtype; read as float32).
/// ValueError for a block size that is not positive and even, or a non-float tensor.
NF4Tensor quantize_nf4(const Tensor& t, const NF4Options& options = {});
/// The tensor the codes stand for: level[index] · scale, in `dtype`, shape as quantized.
Tensor dequantize_nf4(const NF4Tensor& q, DType dtype = kFloat32);
/// The block scales as dequantization uses them (float32 [blocks]): with double
/// quantization, the decoded 8-bit scales.
Tensor nf4_block_scales(const NF4Tensor& q);

/// A frozen Linear whose weight is stored as NF4 (see the header comment).
/// state_dict holds "weight_nf4.codes" and the scale tensors as buffers (and
/// "bias"); their memory is charged to MemoryCategory::Parameter, since they
/// are the layer's weight.
class NF4Linear : public nn::Linear {
 public:
  /// Quantizes `src`'s weight and copies its bias; `src` is unchanged.
  NF4Linear(const nn::Linear& src, const NF4Options& options = {});
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const NF4Tensor& weight_nf4() const { return *q_; }
  /// The weight the codes stand for (float32 [out, in]).
  Tensor dequantized_weight() const;

 private:
  std::shared_ptr<NF4Tensor> q_;
};

/// What quantize_linears_nf4 did.
struct QuantizeReport {
  std::vector<std::string> paths;  // the replaced modules, in model order
  int64_t float_bytes = 0;         // their float weights' bytes
  int64_t nf4_bytes = 0;           // their NF4 codes and scales
};

/// Replaces each nn::Linear of `model` whose path matches one of `targets`
/// (nn::lora's patterns) with an NF4Linear, in its parent: the parent's child
/// entry and, for the parents kiln's models use (CausalSelfAttention,
/// TransformerMLP, GPT, ViT), the typed pointer their forward calls; plain
/// containers (Sequential, ModuleList, ModuleDict) need only the entry. A
/// Linear under any other parent, a weight tied to another module (GPT's
/// lm_head) and a target that matches nothing are ValueErrors that name them.
QuantizeReport quantize_linears_nf4(nn::Module& model, const std::vector<std::string>& targets,
                                    const NF4Options& options = {});

}  // namespace kiln::quant
