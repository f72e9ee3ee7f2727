// quant: observers, which watch the values a tensor takes on calibration data
// and choose its quantization parameters (scale, zero point), as
// torch.ao.quantization's observers.
//
//   MinMaxObserver             the observed min and max (torch's MinMaxObserver)
//   MovingAverageMinMaxObserver min and max as exponential moving averages over batches
//                              (torch's, averaging constant 0.01 by default)
//   PerChannelMinMaxObserver   min and max per slice along an axis; symmetric
//                              qint8 for weights (torch's PerChannelMinMaxObserver
//                              with per_channel_symmetric)
//   HistogramObserver          a 2048-bin histogram and the range whose 256-level
//                              quantization minimises the L2 norm of the error, by
//                              torch's search (_non_linear_param_search): torch's
//                              HistogramObserver, which is an L2 method, not KL
//   PercentileObserver         the range between two percentiles of the histogram
//                              (the outermost 0.01 % clipped by default); torch has none
//   EntropyObserver            TensorRT's calibration: the clipping threshold whose
//                              quantized histogram has the least KL divergence from
//                              the clipped histogram (outliers folded into the last
//                              bin); torch has none
//
// The range becomes (scale, zero point) as torch's _calculate_qparams does:
// the range is widened to include 0 (so 0 is exact), affine:
// scale = (max - min) / (qmax - qmin), zero_point = qmin - round(min / scale);
// symmetric: scale = max(|min|, max) / ((qmax - qmin) / 2), zero point 0
// (qint8) or 128 (quint8); scale at least float32's epsilon. All in float32.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/quant/qtensor.h"

namespace kiln::quant {

/// What an observer chose: per tensor (axis -1, one scale) or per channel.
struct QParams {
  QDType dtype = QDType::QUInt8;
  std::vector<float> scales;
  std::vector<int64_t> zero_points;
  int64_t axis = -1;
};

/// torch's _calculate_qparams for one (min, max) pair.
void calculate_qparams(float min_val, float max_val, QDType dtype, bool symmetric, float& scale, int64_t& zero_point);

/// Quantizes x with the parameters an observer chose.
QTensor quantize(const Tensor& x, const QParams& p);

class Observer {
 public:
  virtual ~Observer() = default;
  /// Records a batch of values (any float dtype; read as float32).
  virtual void observe(const Tensor& x) = 0;
  /// The parameters for what was observed. ValueError if nothing was.
  virtual QParams qparams() const = 0;
  /// The range the parameters are computed from (the clipping range for histogram methods).
  virtual std::pair<float, float> range() const = 0;
  virtual std::string name() const = 0;
  bool observed() const { return observed_; }

 protected:
  bool observed_ = false;
};

struct ObserverOptions {
  QDType dtype = QDType::QUInt8;
  bool symmetric = false;
};

class MinMaxObserver : public Observer {
 public:
  explicit MinMaxObserver(ObserverOptions o = {});
  void observe(const Tensor& x) override;
  QParams qparams() const override;
  std::pair<float, float> range() const override;
  std::string name() const override { return "minmax"; }

 protected:
  ObserverOptions options_;
  float min_ = 0, max_ = 0;
};

class MovingAverageMinMaxObserver : public MinMaxObserver {
 public:
  explicit MovingAverageMinMaxObserver(ObserverOptions o = {}, float averaging_constant = 0.01f);
  void observe(const Tensor& x) override;
  std::string name() const override { return "moving_average"; }

 private:
  float c_;
};

class PerChannelMinMaxObserver : public Observer {
 public:
  /// Weights: qint8, symmetric, along axis 0 (output channels).
  explicit PerChannelMinMaxObserver(int64_t axis = 0, ObserverOptions o = {QDType::QInt8, true});
  void observe(const Tensor& x) override;
  QParams qparams() const override;
  /// The widest channel's range.
  std::pair<float, float> range() const override;
  std::string name() const override { return "per_channel_minmax"; }
  const std::vector<float>& mins() const { return min_; }
  const std::vector<float>& maxs() const { return max_; }

 private:
  int64_t axis_;
  ObserverOptions options_;
  std::vector<float> min_, max_;
};

/// A histogram over the observed range, re-binned when a later batch widens it.
class HistogramBase : public Observer {
 public:
  explicit HistogramBase(int64_t bins, ObserverOptions o);
  void observe(const Tensor& x) override;
  QParams qparams() const override;
  const std::vector<double>& histogram() const { return hist_; }
  float hist_min() const { return min_; }
  float hist_max() const { return max_; }

 protected:
  int64_t bins_;
  ObserverOptions options_;
  std::vector<double> hist_;
  float min_ = 0, max_ = 0;
};

/// torch's HistogramObserver (L2 norm of the quantization error minimised).
class HistogramObserver : public HistogramBase {
 public:
  explicit HistogramObserver(ObserverOptions o = {}, int64_t bins = 2048) : HistogramBase(bins, o) {}
  std::pair<float, float> range() const override;
  std::string name() const override { return "histogram"; }

 private:
  double l2_error(int64_t start_bin, int64_t end_bin) const;
};

class PercentileObserver : public HistogramBase {
 public:
  /// The range [percentile (100 - p), percentile p] of the observed values.
  explicit PercentileObserver(double percentile = 99.99, ObserverOptions o = {}, int64_t bins = 2048);
  std::pair<float, float> range() const override;
  std::string name() const override { return "percentile"; }
  /// The value below which `fraction` of the histogram's mass lies (linear within a bin).
  float quantile(double fraction) const;

 private:
  double percentile_;
};

class EntropyObserver : public HistogramBase {
 public:
  explicit EntropyObserver(ObserverOptions o = {}, int64_t bins = 2048) : HistogramBase(bins, o) {}
  std::pair<float, float> range() const override;
  std::string name() const override { return "entropy"; }
};

/// "minmax", "moving_average", "histogram", "percentile", "entropy"; ValueError naming them otherwise.
std::unique_ptr<Observer> make_observer(const std::string& name, ObserverOptions o = {});
const std::vector<std::string>& observer_names();

}  // namespace kiln::quant
