// quant: post-training int8 quantization of a model's Conv2d and Linear
// layers, as torch.ao.quantization's eager-mode prepare / calibrate / convert.
//
//   auto prepared = quant::prepare(model, {.observer = "histogram", .keep_float = {"fc2"}});
//   for (batch : calibration) model(batch.x);           // the observers watch the inputs
//   quant::ConvertReport r = quant::convert(model, *prepared);
//   std::cout << r.table();                              // per-layer error vs float
//   model(x);                                            // int8 where quantized
//
// prepare puts a forward hook on every nn::Conv2d and nn::Linear (groups,
// stride, padding and dilation as the layer has them; padding modes other than
// zeros do not exist in kiln) whose input it observes with the chosen observer
// (uint8, affine); a few calibration inputs per layer are kept for the report.
// convert quantizes each weight per output channel (symmetric int8), replaces
// the layer in its parent with a QuantizedConv2d / QuantizedLinear (subclasses
// of nn::Conv2d / nn::Linear, so typed pointers in kiln's models keep working)
// and measures each layer alone: its float output and its int8 output on the
// kept inputs, as a relative L2 error and SQNR. Layers named in keep_float
// (nn::lora's path patterns), layers never called during calibration, and
// layers under a parent whose typed member kiln does not know stay float, and
// the report says why.
//
// Quantized layers compute in int8 (ops::Int8Conv2d / ops::Int8Linear:
// uint8 activations quantized on entry with the observed parameters, int8
// weights, int32 accumulation, float32 output) and are inference-only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/int8.h"
#include "kiln/quant/observer.h"
#include "kiln/quant/qtensor.h"

namespace kiln::quant {

/// nn::Conv2d computing in int8 (see the header comment). state_dict: "weight_int8"
/// (int8 bytes as uint8), "weight_scales", "bias", "input_qparams" ([scale, zero point]).
class QuantizedConv2d : public nn::Conv2d {
 public:
  QuantizedConv2d(const nn::Conv2d& src, const QTensor& weight, float input_scale, int64_t input_zero_point);
  /// With `bias` (float32 [out_channels], or undefined for none) instead of src's: load_quantized's.
  QuantizedConv2d(const nn::Conv2d& src, const QTensor& weight, const Tensor& bias, float input_scale,
                  int64_t input_zero_point);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const ops::Int8Conv2d& kernel() const { return *kernel_; }

 private:
  std::shared_ptr<ops::Int8Conv2d> kernel_;
};

/// nn::Linear computing in int8; state_dict as QuantizedConv2d's.
class QuantizedLinear : public nn::Linear {
 public:
  QuantizedLinear(const nn::Linear& src, const QTensor& weight, float input_scale, int64_t input_zero_point);
  /// With `bias` instead of src's, as QuantizedConv2d's.
  QuantizedLinear(const nn::Linear& src, const QTensor& weight, const Tensor& bias, float input_scale,
                  int64_t input_zero_point);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const ops::Int8Linear& kernel() const { return *kernel_; }

 private:
  std::shared_ptr<ops::Int8Linear> kernel_;
};

struct PrepareOptions {
  /// An observer_names() entry, for the activations.
  std::string observer = "histogram";
  /// Module-path patterns (nn::lora's) of layers to keep in float.
  std::vector<std::string> keep_float;
  /// Calibration inputs kept per layer for the error report (the first ones seen).
  int64_t report_batches = 2;
  /// Fold eval-mode BatchNorms into their convolutions first (quant::fuse_conv_bn, kiln/quant/fuse.h).
  bool fuse_bn = false;
};

/// The observers prepare attached; convert consumes them.
class Prepared {
 public:
  struct Layer {
    std::string path;
    nn::Module* module = nullptr;
    bool conv = false;
    std::unique_ptr<Observer> observer;
    std::vector<Tensor> samples;
    HookHandle hook;
    int64_t calls = 0;
    // Fixed parameters (quantization-aware training's, kiln/quant/qat.h): convert uses
    // these instead of the observer's (input) and instead of observing the weight.
    std::optional<QParams> input_qparams, weight_qparams;
  };
  ~Prepared();
  std::vector<Layer> layers;
  std::vector<std::string> kept_float;  // paths matched by keep_float
  PrepareOptions options;
  bool converted = false;
};

std::shared_ptr<Prepared> prepare(nn::Module& model, const PrepareOptions& options = {});

struct LayerReport {
  std::string path, kind;  // "Conv2d" / "Linear"
  bool quantized = false;
  std::string note;  // why it stayed float
  float input_scale = 0;
  int64_t input_zero_point = 0;
  float range_min = 0, range_max = 0;  // the observer's activation range
  double rel_error = 0;                // ||y_int8 - y_float|| / ||y_float|| on the kept inputs
  double sqnr_db = 0;                  // 20 log10 of its inverse
  std::string implementation;          // oneDNN's kernel
};

struct ConvertReport {
  std::vector<LayerReport> layers;
  int64_t float_weight_bytes = 0, int8_weight_bytes = 0;  // of the quantized layers
  std::string table() const;
};

/// Replaces the observed layers by quantized ones (see the header comment) and removes the hooks.
ConvertReport convert(nn::Module& model, Prepared& prepared);

// ---- quantized checkpoints ----
//
// A quantized model's file is its state_dict in safetensors with metadata
// "kiln.quantized" = "int8-ptq" (extra metadata is kept as given). Everything
// a quantized layer needs is a tensor under its path, so the file alone says
// which layers are int8 (those with "<path>.weight_int8") and which stayed
// float (those with "<path>.weight"):
//   weight_int8    uint8, the float weight's shape: qint8 bytes (two's complement)
//   weight_scales  float32 [out], finite and > 0; per output channel (axis 0),
//                  symmetric: the weight zero points are all 0 and not stored
//   input_qparams  float32 [2]: the activation's quint8 scale (finite, > 0) and
//                  zero point (an integer in [0, 255])
//   bias           float32 [out] where the float layer has one

/// Writes model.state_dict() with the metadata above.
void save_quantized(const nn::Module& model, const std::string& path, io::Metadata metadata = {});

/// Turns a fresh float `model` (same architecture as the one saved) into the
/// quantized one `path` holds: the layers with weight_int8 become
/// QuantizedConv2d / QuantizedLinear, everything else loads as load_state_dict
/// (strict). Outputs equal the saving model's bit for bit. Every tensor is
/// checked before the model is touched: on any error (FormatError for a file
/// that is not safetensors or not a quantized model, ValueError naming the
/// tensor, what was expected and what was got) the model is unchanged.
/// Returns the paths of the quantized layers, in model order.
std::vector<std::string> load_quantized(nn::Module& model, const std::string& path);

}  // namespace kiln::quant
