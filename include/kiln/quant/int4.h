// quant: INT4 weight-only quantization of Linear layers (GPT's attention and
// MLP projections), by round-to-nearest or by GPTQ (Frantar et al. 2022).
//
//   quant::Int4Options o{.group_size = 128};
//   quant::HessianRecorder rec(model, quant::gpt_int4_targets());  // GPTQ only
//   for (batch : calibration) model(batch.x);                         // H = 2 XᵀX / N per layer
//   auto report = quant::quantize_linears_int4(model, quant::gpt_int4_targets(), o, &rec);
//   model(x);                                                          // int4 where quantized
//   quant::save_int4(model, "model.int4.safetensors");
//
// A weight W [out, in] is cut into groups of group_size (64 or 128)
// consecutive inputs of one row; a group stores a float32 scale s and a uint8
// zero point z in [0, 15], each weight a 4-bit code q with W ≈ (q - z) · s
// (asymmetric: the group's [min(w, 0), max(w, 0)] maps onto [0, 15]), two
// codes per byte. That is 4 + 40 / group_size bits per weight: 4.31 at 128.
//
// Round-to-nearest (RTN) rounds every weight alone. GPTQ quantizes a layer
// column by column (input by input) and spreads each column's rounding error
// over the columns not yet quantized, weighted by the inverse Hessian of the
// layer's squared output error, H = 2 XᵀX over calibration inputs X: it keeps
// the layer's output, not the weight, close. As the paper: 1% of H's mean
// diagonal is added as damping, the upper Cholesky factor of H⁻¹ drives the
// updates, columns are processed in blocks of 128 whose updates to later
// columns are applied lazily (one GEMM per block), and a group's scale and
// zero point are chosen from the (already updated) weights when the group's
// first column is reached. Inputs that never fire (H[i, i] = 0) get weight 0.
// The Hessians are all recorded on the float model in one pass (the paper
// feeds each block the outputs of the already-quantized ones; kiln does not).
//
// Int4Linear is an nn::Linear (typed pointers in kiln's models keep working)
// without a float weight: it holds the packed codes, scales and zero points as
// buffers and computes with ops::int4_linear, which dequantizes tiles of the
// weight inside the product. Inference only. GPT's lm_head is tied to the
// token embedding and stays float (quantizing it would untie them).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"

namespace kiln::quant {

struct Int4Options {
  int64_t group_size = 128;  // even, dividing the layer's in_features
  /// GPTQ only: damping as a fraction of H's mean diagonal, and the lazy-update block (a multiple of group_size).
  double damp = 0.01;
  int64_t block_size = 128;
};

/// A weight [out, in] quantized to int4 (see the header comment).
struct Int4Tensor {
  int64_t out = 0, in = 0, group_size = 128;
  Tensor packed;  // uint8 [out, in / 2], element 2j in the high nibble
  Tensor scales;  // float32 [out, in / group_size], finite, > 0
  Tensor zeros;   // uint8 [out, in / group_size], in [0, 15]
  int64_t nbytes() const;
};

/// Round-to-nearest. ValueError for a weight that is not 2-D float, or a group size that does not divide in.
Int4Tensor quantize_int4_rtn(const Tensor& weight, int64_t group_size = 128);
/// GPTQ with `hessian` float64 (or float32) [in, in] = 2 XᵀX / N of the layer's inputs.
Int4Tensor quantize_int4_gptq(const Tensor& weight, const Tensor& hessian, const Int4Options& options = {});
/// The float32 weight the codes stand for.
Tensor dequantize_int4(const Int4Tensor& q);

/// Frozen, inference-only Linear over an Int4Tensor. state_dict: "weight_int4"
/// (packed), "weight_scales", "weight_zeros" and "bias" where the float layer has one.
class Int4Linear : public nn::Linear {
 public:
  /// Takes `q` (its shape must be src's) and copies src's bias; src is unchanged.
  Int4Linear(const nn::Linear& src, Int4Tensor q);
  /// With `bias` (float32 [out] or undefined) in place of src's: load_int4's.
  Int4Linear(const nn::Linear& src, Int4Tensor q, const Tensor& bias);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const Int4Tensor& weight_int4() const { return q_; }

 private:
  Int4Tensor q_;
};

/// The GPT linears INT4 replaces: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj.
std::vector<std::string> gpt_int4_targets();

/// Forward hooks on the Linears `targets` (nn::lora's patterns) match, which
/// accumulate each layer's H = 2 XᵀX / N while the model runs (each call's XᵀX
/// in float32, the sum over calls in float64);
/// removed on destruction.
class HessianRecorder {
 public:
  HessianRecorder(nn::Module& model, const std::vector<std::string>& targets);
  ~HessianRecorder();
  HessianRecorder(const HessianRecorder&) = delete;
  HessianRecorder& operator=(const HessianRecorder&) = delete;
  /// H of the layer at `path`; ValueError if it was never called.
  Tensor hessian(const std::string& path) const;
  /// Input rows seen by the layer at `path`.
  int64_t rows(const std::string& path) const;

  struct Layer;

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
};

struct Int4Report {
  std::vector<std::string> paths;  // replaced modules, in model order
  int64_t float_bytes = 0;         // their float32 weights
  int64_t int4_bytes = 0;          // their codes, scales and zero points
  bool gptq = false;
};

/// Replaces each float Linear matching `targets` by an Int4Linear (in its
/// parent's entry and the typed pointer of CausalSelfAttention /
/// TransformerMLP), by GPTQ when `hessians` is given, else by RTN. A target
/// matching nothing, a tied weight or an unknown parent is a ValueError
/// naming it, raised before the model is touched.
Int4Report quantize_linears_int4(nn::Module& model, const std::vector<std::string>& targets,
                                 const Int4Options& options = {}, const HessianRecorder* hessians = nullptr);

// ---- int4 checkpoints ----
// The model's state_dict in safetensors with metadata "kiln.quantized" =
// "int4-weight-only" (and "kiln.int4.group_size"). A layer is int4 when the
// file has "<path>.weight_int4" (uint8 [out, in / 2]) with "<path>.weight_scales"
// (float32 [out, in / g], finite, > 0) and "<path>.weight_zeros" (uint8 [out,
// in / g], <= 15); every other tensor loads as load_state_dict (strict).

void save_int4(const nn::Module& model, const std::string& path, io::Metadata metadata = {});
/// Turns a fresh float `model` into the int4 one `path` holds. Every tensor is
/// checked before the model is touched (FormatError for a file that is not an
/// int4 model, ValueError naming the tensor, expected and got); on error the
/// model is unchanged. Returns the int4 layers' paths.
std::vector<std::string> load_int4(nn::Module& model, const std::string& path);

}  // namespace kiln::quant
