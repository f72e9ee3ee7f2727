// quant: quantization-aware training (QAT) of a model's Conv2d and Linear
// layers, as torch.ao.quantization's eager-mode prepare_qat / convert:
//
//   auto qat = quant::prepare_qat(model, {.observer = "moving_average", .fuse_bn = true});
//   qat->freeze_observers_after(300);
//   for (batch : train) { loss(model(batch.x)).backward(); opt.step(); qat->step(); }
//   quant::ConvertReport r = quant::convert_qat(model, *qat);   // the PTQ int8 layers
//
// The fake-quantize ops round to the integer grid and back in float, so the
// float model trains while seeing int8's rounding and clipping. Their gradient
// is torch's straight-through estimator: the incoming gradient passes where the
// rounded value (before clamping) lies in [qmin, qmax] and is zero elsewhere.
// Scales and zero points are constants to the gradient (torch's
// fake_quantize_per_tensor_affine / per_channel_affine; the learnable variant,
// LSQ, is not built).
//
// prepare_qat replaces each nn::Conv2d / nn::Linear (not kept float, under a
// parent quant knows, as PTQ's convert) by a QatConv2d / QatLinear that shares
// its weight and bias tensors (an optimizer built before or after keeps
// working) and runs
//     y = conv(fq_input(x), fq_weight(W)) + b
// fq_input: uint8 affine with the chosen observer (moving-average min-max by
// default); fq_weight: int8 symmetric per output channel (axis 0) with a
// min-max observer, the parameters PTQ's convert would choose. BatchNorms are
// folded into their convolutions first when asked (fuse_bn; the BatchNorms
// must be in eval mode), so ResNet trains and quantizes with one weight per conv.
//
// Observers watch every forward while enabled (train or eval mode alike, as
// torch's); step() counts optimizer steps and, after freeze_observers_after(K),
// the K-th disables every observer so the parameters stop moving and the
// weights adapt to fixed grids. convert_qat disables the observers and turns
// each QAT layer into PTQ's QuantizedConv2d / QuantizedLinear with exactly the
// parameters the fake quantizers last used, so the int8 model computes what
// the QAT model did up to int32 accumulation and float rounding.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/nn/layers.h"
#include "kiln/quant/observer.h"
#include "kiln/quant/ptq.h"

namespace kiln::quant {

/// torch.fake_quantize_per_tensor_affine: (clamp(round(x / scale) + zp, qmin, qmax) - zp) * scale,
/// the reciprocal of scale taken in float32, rounding half to even. x float32.
/// Differentiable in x (straight-through where round(x / scale) + zp lies in [qmin, qmax]).
Tensor fake_quantize_per_tensor_affine(const Tensor& x, float scale, int64_t zero_point, int64_t qmin, int64_t qmax);

/// torch.fake_quantize_per_channel_affine: as above with scales (float32 [C]) and
/// zero points (int64 [C]) along `axis` (C = x.size(axis)).
Tensor fake_quantize_per_channel_affine(const Tensor& x, const Tensor& scales, const Tensor& zero_points, int64_t axis,
                                        int64_t qmin, int64_t qmax);

/// The integer range of a quantized dtype: [0, 255] (QUInt8) or [-128, 127] (QInt8).
std::pair<int64_t, int64_t> qrange(QDType dtype);

/// An observer and a fake quantizer, as torch.ao.quantization.FakeQuantize:
/// forward observes its input while the observer is enabled (and takes the
/// observer's new parameters), then fake-quantizes it while fake quant is
/// enabled (the identity otherwise). Per tensor or per channel as the
/// observer's parameters are. Buffers "scale" (float32) and "zero_point"
/// (int64), [1] or [C], hold the parameters in use (so a state_dict has them).
class FakeQuantize : public nn::Module {
 public:
  /// `dtype` gives the integer range; the observer must produce parameters of that dtype.
  FakeQuantize(std::unique_ptr<Observer> observer, QDType dtype);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

  void enable_observer(bool on = true) { observer_enabled_ = on; }
  void disable_observer() { observer_enabled_ = false; }
  void enable_fake_quant(bool on = true) { fake_quant_enabled_ = on; }
  void disable_fake_quant() { fake_quant_enabled_ = false; }
  bool observer_enabled() const { return observer_enabled_; }
  bool fake_quant_enabled() const { return fake_quant_enabled_; }
  /// Whether parameters exist (an observed batch, or set_qparams).
  bool has_qparams() const { return has_qparams_; }
  /// The parameters in use; ValueError before any.
  QParams qparams() const;
  /// Sets the parameters directly (dtype must match); the observer is untouched.
  void set_qparams(const QParams& p);
  Observer& observer() { return *observer_; }
  QDType dtype() const { return dtype_; }

 private:
  std::unique_ptr<Observer> observer_;
  QDType dtype_;
  int64_t qmin_, qmax_;
  bool observer_enabled_ = true, fake_quant_enabled_ = true, has_qparams_ = false;
  int64_t axis_ = -1;
  Tensor& scale_;
  Tensor& zero_point_;
};

/// nn::Conv2d training with fake-quantized input and weight (see the header comment).
class QatConv2d : public nn::Conv2d {
 public:
  QatConv2d(const nn::Conv2d& src, std::unique_ptr<Observer> input_observer);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<FakeQuantize> input_fake_quant, weight_fake_quant;
};

/// nn::Linear training with fake-quantized input and weight.
class QatLinear : public nn::Linear {
 public:
  QatLinear(const nn::Linear& src, std::unique_ptr<Observer> input_observer);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<FakeQuantize> input_fake_quant, weight_fake_quant;
};

struct QatOptions {
  /// An observer_names() entry, for the activations.
  std::string observer = "moving_average";
  /// Module-path patterns (nn::lora's) of layers to keep in float.
  std::vector<std::string> keep_float;
  /// Fold eval-mode BatchNorms into their convolutions first (quant::fuse_conv_bn).
  bool fuse_bn = false;
  /// Inputs kept per layer (the first ones seen) for convert's report: the
  /// QAT layer's output against the int8 layer's.
  int64_t report_batches = 2;
};

/// The QAT layers prepare_qat put in; step counting and observer freezing.
class QatPrepared {
 public:
  struct Layer {
    std::string path;
    // The QatConv2d / QatLinear and its fake quantizers, owned by the model; null after convert_qat.
    nn::Module* module = nullptr;
    bool conv = false;
    FakeQuantize* input_fq = nullptr;
    FakeQuantize* weight_fq = nullptr;
    std::vector<Tensor> samples;
    HookHandle hook;
  };
  QatPrepared() = default;
  QatPrepared(const QatPrepared&) = delete;
  QatPrepared& operator=(const QatPrepared&) = delete;
  ~QatPrepared();
  std::vector<Layer> layers;
  std::vector<std::string> kept_float;    // by keep_float
  std::vector<LayerReport> not_prepared;  // layers left float for another reason, with the note
  QatOptions options;

  /// Counts one optimizer step; the step that reaches the freeze point disables every observer.
  void step();
  int64_t steps() const { return steps_; }
  /// Observers are disabled once step() has counted `k` steps (now, if it already has).
  /// k >= 0; ValueError otherwise.
  void freeze_observers_after(int64_t k);
  /// Disables every observer now.
  void freeze_observers();
  bool observers_frozen() const { return frozen_; }
  bool converted = false;

 private:
  int64_t steps_ = 0, freeze_after_ = -1;
  bool frozen_ = false;
};

std::shared_ptr<QatPrepared> prepare_qat(nn::Module& model, const QatOptions& options = {});

/// Freezes the observers and replaces every QAT layer by a QuantizedConv2d /
/// QuantizedLinear quantized with its fake quantizers' parameters (PTQ's
/// convert with fixed parameters). A layer never called (no parameters) stays
/// float, with the note in the report.
ConvertReport convert_qat(nn::Module& model, QatPrepared& prepared);

}  // namespace kiln::quant
