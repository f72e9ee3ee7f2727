// The model-zoo parity check shared by test_models.cpp and test_models_gpt.cpp:
// kiln writes a model's state_dict, an input and targets to safetensors; a
// torch twin (tests/parity/<script>) loads the state dict with strict=True,
// returns its eval/train outputs, loss, gradients and state, and the state of
// a torch-initialised twin, which must load into kiln strictly and exactly.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kiln/nn/module.h"

namespace kiln::test {

/// Float32 agreement used by every zoo parity test: |kiln - torch| <= 1e-5 + 1e-4 |torch|.
inline constexpr double kTwinRtol = 1e-4, kTwinAtol = 1e-5;

/// Empty when a and b (torch) agree within tolerance; otherwise the worst element.
std::string mismatch(const Tensor& a, const Tensor& b);
std::vector<std::string> keys(const nn::NamedTensors& t);

using LossFn = std::function<Tensor(const Tensor& out, const Tensor& target)>;
void check_against_twin(nn::Module& model, const std::string& script, const std::string& name,
                        const std::string& config, const Tensor& x, const Tensor& target, const LossFn& loss_fn);

}  // namespace kiln::test
