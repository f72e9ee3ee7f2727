// Observers (include/kiln/quant/observer.h).
#include "kiln/quant/observer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::quant {
namespace {

Tensor as_float(const Tensor& x, const char* who) {
  KILN_CHECK(x.defined() && x.numel() > 0, ValueError, who, ": expected a non-empty tensor to observe");
  KILN_CHECK(is_floating_point(x.dtype()), DTypeError, who, ": expected a floating-point tensor, got ",
             dtype_name(x.dtype()));
  const NoGradGuard no_grad;
  return x.detach().to(kFloat32).contiguous();
}

void min_max(const Tensor& xf, float& lo, float& hi) {
  const float* p = xf.data_ptr<float>();
  lo = hi = p[0];
  for (int64_t i = 1; i < xf.numel(); ++i) {
    lo = std::min(lo, p[i]);
    hi = std::max(hi, p[i]);
  }
}

QParams per_tensor(float lo, float hi, const ObserverOptions& o) {
  QParams p;
  p.dtype = o.dtype;
  p.scales.resize(1);
  p.zero_points.resize(1);
  calculate_qparams(lo, hi, o.dtype, o.symmetric, p.scales[0], p.zero_points[0]);
  return p;
}

}  // namespace

void calculate_qparams(float min_val, float max_val, QDType dtype, bool symmetric, float& scale, int64_t& zero_point) {
  const float lo = std::min(min_val, 0.0f), hi = std::max(max_val, 0.0f);
  const int64_t qlo = qmin(dtype), qhi = qmax(dtype);
  const float eps = std::numeric_limits<float>::epsilon();
  if (symmetric) {
    const float m = std::max(-lo, hi);
    scale = std::max(m / (static_cast<float>(qhi - qlo) / 2.0f), eps);
    zero_point = dtype == QDType::QUInt8 ? 128 : 0;
    return;
  }
  scale = std::max((hi - lo) / static_cast<float>(qhi - qlo), eps);
  zero_point = qlo - static_cast<int64_t>(std::nearbyint(lo / scale));
  zero_point = std::clamp(zero_point, qlo, qhi);
}

QTensor quantize(const Tensor& x, const QParams& p) {
  if (p.axis < 0) return quantize_per_tensor(x, p.scales.at(0), p.zero_points.at(0), p.dtype);
  const auto c = static_cast<int64_t>(p.scales.size());
  return quantize_per_channel(x, tensor(p.scales, {c}), tensor(p.zero_points, {c}), p.axis, p.dtype);
}

// ---- min / max ----

MinMaxObserver::MinMaxObserver(ObserverOptions o) : options_(o) {}

void MinMaxObserver::observe(const Tensor& x) {
  float lo, hi;
  min_max(as_float(x, "MinMaxObserver"), lo, hi);
  min_ = observed_ ? std::min(min_, lo) : lo;
  max_ = observed_ ? std::max(max_, hi) : hi;
  observed_ = true;
}

std::pair<float, float> MinMaxObserver::range() const {
  KILN_CHECK(observed_, ValueError, name(), " observer: nothing observed yet (run calibration batches first)");
  return {min_, max_};
}

QParams MinMaxObserver::qparams() const {
  const auto [lo, hi] = range();
  return per_tensor(lo, hi, options_);
}

MovingAverageMinMaxObserver::MovingAverageMinMaxObserver(ObserverOptions o, float averaging_constant)
    : MinMaxObserver(o), c_(averaging_constant) {
  KILN_CHECK(c_ > 0 && c_ <= 1, ValueError,
             "MovingAverageMinMaxObserver: expected an averaging constant in (0, 1], got ", c_);
}

void MovingAverageMinMaxObserver::observe(const Tensor& x) {
  float lo, hi;
  min_max(as_float(x, "MovingAverageMinMaxObserver"), lo, hi);
  if (!observed_) {
    min_ = lo;
    max_ = hi;
  } else {
    // As torch: min + c · (cur - min), each step rounded to float32.
    const float dlo = lo - min_, dhi = hi - max_;
    const float slo = c_ * dlo, shi = c_ * dhi;
    min_ = min_ + slo;
    max_ = max_ + shi;
  }
  observed_ = true;
}

// ---- per channel ----

PerChannelMinMaxObserver::PerChannelMinMaxObserver(int64_t axis, ObserverOptions o) : axis_(axis), options_(o) {}

void PerChannelMinMaxObserver::observe(const Tensor& x) {
  const Tensor xf = as_float(x, "PerChannelMinMaxObserver");
  const int64_t axis = axis_ < 0 ? axis_ + xf.dim() : axis_;
  KILN_CHECK(axis >= 0 && axis < xf.dim(), ValueError, "PerChannelMinMaxObserver: axis ", axis_,
             " is out of range for a tensor ", xf.shape_string());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= xf.size(d);
  for (int64_t d = axis + 1; d < xf.dim(); ++d) inner *= xf.size(d);
  const int64_t c = xf.size(axis);
  KILN_CHECK(!observed_ || static_cast<int64_t>(min_.size()) == c, ShapeError, "PerChannelMinMaxObserver: expected ",
             min_.size(), " channels along axis ", axis, " as before, got ", c);
  const float* p = xf.data_ptr<float>();
  std::vector<float> lo(c, std::numeric_limits<float>::infinity()), hi(c, -std::numeric_limits<float>::infinity());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t i = 0; i < inner; ++i) {
        const float v = p[(o * c + ch) * inner + i];
        lo[ch] = std::min(lo[ch], v);
        hi[ch] = std::max(hi[ch], v);
      }
  if (!observed_) {
    min_ = lo;
    max_ = hi;
  } else {
    for (int64_t ch = 0; ch < c; ++ch) {
      min_[ch] = std::min(min_[ch], lo[ch]);
      max_[ch] = std::max(max_[ch], hi[ch]);
    }
  }
  observed_ = true;
}

std::pair<float, float> PerChannelMinMaxObserver::range() const {
  KILN_CHECK(observed_, ValueError, name(), " observer: nothing observed yet");
  return {*std::min_element(min_.begin(), min_.end()), *std::max_element(max_.begin(), max_.end())};
}

QParams PerChannelMinMaxObserver::qparams() const {
  KILN_CHECK(observed_, ValueError, name(), " observer: nothing observed yet");
  QParams p;
  p.dtype = options_.dtype;
  p.axis = axis_;
  p.scales.resize(min_.size());
  p.zero_points.resize(min_.size());
  for (size_t ch = 0; ch < min_.size(); ++ch)
    calculate_qparams(min_[ch], max_[ch], options_.dtype, options_.symmetric, p.scales[ch], p.zero_points[ch]);
  return p;
}

// ---- histograms ----

HistogramBase::HistogramBase(int64_t bins, ObserverOptions o) : bins_(bins), options_(o), hist_(bins, 0.0) {
  KILN_CHECK(bins >= 256, ValueError, "histogram observer: expected at least 256 bins, got ", bins);
}

void HistogramBase::observe(const Tensor& x) {
  const Tensor xf = as_float(x, "histogram observer");
  float lo, hi;
  min_max(xf, lo, hi);
  if (!observed_) {
    min_ = lo;
    max_ = hi;
  } else if (lo < min_ || hi > max_) {
    // Widen: each old bin's count is spread over the new bins it overlaps, in
    // proportion to the overlap (torch upsamples instead; the same on one batch).
    const float nlo = std::min(lo, min_), nhi = std::max(hi, max_);
    std::vector<double> h(bins_, 0.0);
    const double ow = (static_cast<double>(max_) - min_) / bins_, nw = (static_cast<double>(nhi) - nlo) / bins_;
    for (int64_t b = 0; b < bins_; ++b) {
      if (hist_[b] == 0) continue;
      const double a = min_ + b * ow, e = a + ow;
      if (ow == 0) {
        h[std::min<int64_t>(bins_ - 1, static_cast<int64_t>((a - nlo) / nw))] += hist_[b];
        continue;
      }
      int64_t i = std::clamp<int64_t>(static_cast<int64_t>((a - nlo) / nw), 0, bins_ - 1);
      for (; i < bins_; ++i) {
        const double s = nlo + i * nw, t = s + nw;
        const double overlap = std::min(e, t) - std::max(a, s);
        if (overlap > 0) h[i] += hist_[b] * overlap / ow;
        if (t >= e) break;
      }
    }
    hist_ = std::move(h);
    min_ = nlo;
    max_ = nhi;
  }
  observed_ = true;
  // torch.histc: bin = (x - min) · bins / (max - min), the maximum in the last bin.
  const float* p = xf.data_ptr<float>();
  const float width = max_ - min_;
  for (int64_t i = 0; i < xf.numel(); ++i) {
    int64_t b = width > 0 ? static_cast<int64_t>((p[i] - min_) * static_cast<float>(bins_) / width) : 0;
    hist_[std::clamp<int64_t>(b, 0, bins_ - 1)] += 1;
  }
}

QParams HistogramBase::qparams() const {
  const auto [lo, hi] = range();
  return per_tensor(lo, hi, options_);
}

// The L2 norm of quantizing the histogram's mass with 256 levels spread over
// bins [start_bin, end_bin]: torch's _compute_quantization_error, each source
// bin's mass taken as uniform over it.
double HistogramObserver::l2_error(int64_t start_bin, int64_t end_bin) const {
  const double bin_width = (static_cast<double>(max_) - min_) / bins_;
  constexpr int64_t dst_nbins = 256;
  const double dst_w = bin_width * static_cast<double>(end_bin - start_bin + 1) / dst_nbins;
  if (dst_w == 0.0) return 0.0;
  auto get_norm = [](double db, double de, double density) { return density * (de * de * de - db * db * db) / 3; };
  double norm = 0;
  for (int64_t b = 0; b < bins_; ++b) {
    const double density = hist_[b] / bin_width;
    const double src_begin = static_cast<double>(b - start_bin) * bin_width, src_end = src_begin + bin_width;
    const double dst_begin = std::clamp(std::floor(src_begin / dst_w), 0.0, static_cast<double>(dst_nbins - 1));
    const double dst_end = std::clamp(std::floor(src_end / dst_w), 0.0, static_cast<double>(dst_nbins - 1));
    const double dst_begin_center = (dst_begin + 0.5) * dst_w;
    norm += get_norm(src_begin - dst_begin_center, dst_w / 2, density);
    norm += (dst_end - dst_begin - 1) * get_norm(-dst_w / 2, dst_w / 2, density);
    const double dst_end_center = dst_end * dst_w + dst_w / 2;
    norm += get_norm(-dst_w / 2, src_end - dst_end_center, density);
  }
  return norm;
}

// torch's _non_linear_param_search: shrink the range from whichever end holds
// less mass, 1e-5 of the total at a time, while the L2 error keeps falling.
std::pair<float, float> HistogramObserver::range() const {
  KILN_CHECK(observed_, ValueError, name(), " observer: nothing observed yet");
  const double bin_width = (static_cast<double>(max_) - min_) / bins_;
  std::vector<double> csum(bins_);
  double total = 0;
  for (int64_t b = 0; b < bins_; ++b) csum[b] = (total += hist_[b]);
  constexpr double step = 1e-5;
  double alpha = 0, beta = 1, norm_min = std::numeric_limits<double>::infinity();
  int64_t start_bin = 0, end_bin = bins_ - 1;
  while (alpha < beta) {
    const double next_alpha = alpha + step, next_beta = beta - step;
    int64_t l = start_bin, r = end_bin;
    while (l < end_bin && csum[l] < next_alpha * total) ++l;
    while (r > start_bin && csum[r] > next_beta * total) --r;
    int64_t next_start = start_bin, next_end = end_bin;
    if (l - start_bin > end_bin - r) {
      next_start = l;
      alpha = next_alpha;
    } else {
      next_end = r;
      beta = next_beta;
    }
    if (next_start == start_bin && next_end == end_bin) continue;
    const double norm = l2_error(next_start, next_end);
    if (norm > norm_min) break;
    norm_min = norm;
    start_bin = next_start;
    end_bin = next_end;
  }
  return {static_cast<float>(min_ + bin_width * start_bin), static_cast<float>(min_ + bin_width * (end_bin + 1))};
}

PercentileObserver::PercentileObserver(double percentile, ObserverOptions o, int64_t bins)
    : HistogramBase(bins, o), percentile_(percentile) {
  KILN_CHECK(percentile > 50 && percentile <= 100, ValueError,
             "PercentileObserver: expected a percentile in (50, 100], got ", percentile);
}

float PercentileObserver::quantile(double fraction) const {
  KILN_CHECK(observed_, ValueError, name(), " observer: nothing observed yet");
  double total = 0;
  for (double h : hist_) total += h;
  const double target = fraction * total, w = (static_cast<double>(max_) - min_) / bins_;
  double acc = 0;
  for (int64_t b = 0; b < bins_; ++b) {
    if (hist_[b] > 0 && acc + hist_[b] >= target)
      return static_cast<float>(min_ + w * (b + std::clamp((target - acc) / hist_[b], 0.0, 1.0)));
    acc += hist_[b];
  }
  return max_;
}

std::pair<float, float> PercentileObserver::range() const {
  return {quantile(1 - percentile_ / 100), quantile(percentile_ / 100)};
}

// TensorRT's entropy calibration over |x| (or x where nothing is negative):
// for each candidate threshold i bins, P = the first i bins with the mass
// beyond folded into bin i - 1, Q = P's first i bins merged into `levels`
// groups, each group's mass spread evenly over its non-empty bins; the
// threshold with the least KL(P || Q) wins.
std::pair<float, float> EntropyObserver::range() const {
  KILN_CHECK(observed_, ValueError, name(), " observer: nothing observed yet");
  const bool signed_data = min_ < 0;
  const double absmax = std::max(std::fabs(static_cast<double>(min_)), std::fabs(static_cast<double>(max_)));
  if (absmax == 0) return {0.0f, 0.0f};
  // Fold the histogram onto |x| in bins_ bins over [0, absmax].
  std::vector<double> h(bins_, 0.0);
  const double w = (static_cast<double>(max_) - min_) / bins_, aw = absmax / bins_;
  for (int64_t b = 0; b < bins_; ++b) {
    if (hist_[b] == 0) continue;
    const double centre = std::fabs(min_ + (b + 0.5) * w);
    h[std::min<int64_t>(bins_ - 1, static_cast<int64_t>(centre / aw))] += hist_[b];
  }
  // Non-negative data (a ReLU's output) piles its exact zeros into bin 0, which
  // any threshold represents exactly (zero point 0): left in, that one bin
  // dominates both distributions and the search clips far too much (measured:
  // conv2 of fashion_cnn clipped at a quarter of its range, 7.7 dB SQNR).
  if (!signed_data) h[0] = 0;
  const int64_t levels = signed_data ? 128 : 256;
  int64_t best_i = bins_;
  double best_kl = std::numeric_limits<double>::infinity();
  std::vector<double> p, q;
  for (int64_t i = levels; i <= bins_; ++i) {
    p.assign(h.begin(), h.begin() + i);
    for (int64_t b = i; b < bins_; ++b) p[i - 1] += h[b];
    q.assign(i, 0.0);
    for (int64_t g = 0; g < levels; ++g) {
      const int64_t a = g * i / levels, e = (g + 1) * i / levels;
      double mass = 0;
      int64_t nonzero = 0;
      for (int64_t b = a; b < e; ++b) {
        mass += h[b];
        nonzero += h[b] > 0;
      }
      for (int64_t b = a; b < e; ++b)
        if (h[b] > 0) q[b] = mass / nonzero;
    }
    double ps = 0, qs = 0;
    for (int64_t b = 0; b < i; ++b) {
      ps += p[b];
      qs += q[b];
    }
    if (ps == 0 || qs == 0) continue;
    double kl = 0;
    for (int64_t b = 0; b < i; ++b) {
      if (p[b] == 0) continue;
      // Q is empty where P's folded tail lands in an empty bin: a small floor keeps KL finite.
      const double qb = std::max(q[b] / qs, 1e-12);
      kl += p[b] / ps * std::log(p[b] / ps / qb);
    }
    if (kl < best_kl) {
      best_kl = kl;
      best_i = i;
    }
  }
  const auto t = static_cast<float>(aw * best_i);
  return {signed_data ? -t : 0.0f, t};
}

const std::vector<std::string>& observer_names() {
  static const std::vector<std::string> names = {"minmax", "moving_average", "histogram", "percentile", "entropy"};
  return names;
}

std::unique_ptr<Observer> make_observer(const std::string& name, ObserverOptions o) {
  if (name == "minmax") return std::make_unique<MinMaxObserver>(o);
  if (name == "moving_average") return std::make_unique<MovingAverageMinMaxObserver>(o);
  if (name == "histogram") return std::make_unique<HistogramObserver>(o);
  if (name == "percentile") return std::make_unique<PercentileObserver>(99.99, o);
  if (name == "entropy") return std::make_unique<EntropyObserver>(o);
  std::string all;
  for (const auto& n : observer_names()) all += (all.empty() ? "" : ", ") + n;
  KILN_CHECK(false, ValueError, "unknown observer '", name, "': expected one of ", all);
  return nullptr;
}

}  // namespace kiln::quant
