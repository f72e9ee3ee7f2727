// nn::init: in-place parameter initialisers, as torch.nn.init. Each runs under
// NoGradGuard, draws from the default generator unless one is given, and
// returns its argument.
#pragma once

#include <string_view>
#include <utility>

#include "kiln/core/generator.h"
#include "kiln/core/tensor.h"

namespace kiln::nn::init {

/// torch.nn.init.calculate_gain: "linear", "conv2d", "sigmoid", "tanh", "relu", "leaky_relu", "selu".
double calculate_gain(std::string_view nonlinearity, double param = 0.01);
/// (fan_in, fan_out) of a weight with at least 2 dims, as torch's _calculate_fan_in_and_fan_out.
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t);

Tensor& uniform_(Tensor& t, double a = 0.0, double b = 1.0, Generator* gen = nullptr);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
/// Normal(mean, std) redrawn until inside [a, b].
Tensor& trunc_normal_(Tensor& t, double mean = 0.0, double std = 1.0, double a = -2.0, double b = 2.0,
                      Generator* gen = nullptr);
Tensor& constant_(Tensor& t, double value);
Tensor& zeros_(Tensor& t);
Tensor& ones_(Tensor& t);
/// mode: "fan_in" or "fan_out".
Tensor& kaiming_uniform_(Tensor& t, double a = 0.0, std::string_view mode = "fan_in",
                         std::string_view nonlinearity = "leaky_relu", Generator* gen = nullptr);
Tensor& kaiming_normal_(Tensor& t, double a = 0.0, std::string_view mode = "fan_in",
                        std::string_view nonlinearity = "leaky_relu", Generator* gen = nullptr);
Tensor& xavier_uniform_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);
Tensor& xavier_normal_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);

}  // namespace kiln::nn::init
