// nn::init: parameter initialisers with torch.nn.init's formulas.
#include "kiln/nn/init.h"

#include <cmath>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::nn::init {

double calculate_gain(std::string_view nl, double param) {
  if (nl == "linear" || nl == "conv1d" || nl == "conv2d" || nl == "conv3d" || nl == "sigmoid") return 1.0;
  if (nl == "tanh") return 5.0 / 3.0;
  if (nl == "relu") return std::sqrt(2.0);
  if (nl == "leaky_relu") return std::sqrt(2.0 / (1.0 + param * param));
  if (nl == "selu") return 3.0 / 4.0;
  KILN_CHECK(false, ValueError, "calculate_gain: unsupported nonlinearity \"", nl,
             "\" (expected linear, conv2d, sigmoid, tanh, relu, leaky_relu or selu)");
  return 0;
}

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t) {
  KILN_CHECK(t.dim() >= 2, ShapeError, "fan in and fan out need a tensor with at least 2 dims, got shape ",
             t.shape_string());
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

Tensor& uniform_(Tensor& t, double a, double b, Generator* gen) {
  NoGradGuard g;
  return kiln::uniform_(t, a, b, gen);
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  NoGradGuard g;
  return kiln::normal_(t, mean, std, gen);
}

Tensor& trunc_normal_(Tensor& t, double mean, double std, double a, double b, Generator* gen) {
  KILN_CHECK(a < b, ValueError, "trunc_normal_: expected a < b, got a=", a, ", b=", b);
  NoGradGuard g;
  const int64_t n = t.numel();
  std::vector<double> vals;
  vals.reserve(static_cast<size_t>(n));
  // Rejection sampling; bounded attempts so a far-off interval cannot hang.
  for (int round = 0; round < 1000 && static_cast<int64_t>(vals.size()) < n; ++round) {
    Tensor d = randn({std::max<int64_t>(n, 16)}, kFloat64, gen);
    const double* p = d.data_ptr<double>();
    for (int64_t i = 0; i < d.numel() && static_cast<int64_t>(vals.size()) < n; ++i) {
      double v = mean + std * p[i];
      if (v >= a && v <= b) vals.push_back(v);
    }
  }
  KILN_CHECK(static_cast<int64_t>(vals.size()) == n, ValueError, "trunc_normal_: [a, b] = [", a, ", ", b,
             "] holds too little of Normal(", mean, ", ", std, ")");
  Tensor src = kiln::tensor(vals).view(t.sizes());
  t.copy_(src);
  return t;
}

Tensor& constant_(Tensor& t, double value) {
  NoGradGuard g;
  t.fill_(value);
  return t;
}
Tensor& zeros_(Tensor& t) { return constant_(t, 0.0); }
Tensor& ones_(Tensor& t) { return constant_(t, 1.0); }

namespace {
double kaiming_std(const Tensor& t, double a, std::string_view mode, std::string_view nl) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  KILN_CHECK(mode == "fan_in" || mode == "fan_out", ValueError, "kaiming init: mode must be fan_in or fan_out, got \"",
             mode, "\"");
  int64_t fan = mode == "fan_in" ? fan_in : fan_out;
  KILN_CHECK(fan > 0, ValueError, "kaiming init of a zero-element tensor of shape ", t.shape_string());
  return calculate_gain(nl, a) / std::sqrt(static_cast<double>(fan));
}
}  // namespace

Tensor& kaiming_uniform_(Tensor& t, double a, std::string_view mode, std::string_view nl, Generator* gen) {
  double bound = std::sqrt(3.0) * kaiming_std(t, a, mode, nl);
  return init::uniform_(t, -bound, bound, gen);
}

Tensor& kaiming_normal_(Tensor& t, double a, std::string_view mode, std::string_view nl, Generator* gen) {
  return init::normal_(t, 0.0, kaiming_std(t, a, mode, nl), gen);
}

Tensor& xavier_uniform_(Tensor& t, double gain, Generator* gen) {
  auto [fi, fo] = calculate_fan_in_and_fan_out(t);
  double a = gain * std::sqrt(6.0 / static_cast<double>(fi + fo));
  return init::uniform_(t, -a, a, gen);
}

Tensor& xavier_normal_(Tensor& t, double gain, Generator* gen) {
  auto [fi, fo] = calculate_fan_in_and_fan_out(t);
  return init::normal_(t, 0.0, gain * std::sqrt(2.0 / static_cast<double>(fi + fo)), gen);
}

}  // namespace kiln::nn::init
