// kiln::nn::functional (alias kiln::nn::F): stateless activations, dropout and
// loss functions with PyTorch's names, options and semantics (torch.nn.functional). Each returns
// a tensor recorded by autograd; backward formulas are written with kiln ops
// (or a fused kernel when no higher derivative is being built), so double
// backward works where PyTorch's does. `reduction` is "mean", "sum" or "none".
#pragma once

#include <source_location>
#include <string>
#include <string_view>

#include "kiln/core/tensor.h"

namespace kiln::nn::functional {

// ---- activations: the Tensor methods under torch.nn.functional's names ----
inline Tensor relu(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.relu(loc); }
/// approximate: "none" (erf) or "tanh".
inline Tensor gelu(const Tensor& x, std::string_view approximate = "none",
                   std::source_location loc = std::source_location::current()) {
  return x.gelu(approximate, loc);
}
inline Tensor silu(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.silu(loc); }
inline Tensor sigmoid(const Tensor& x, std::source_location loc = std::source_location::current()) {
  return x.sigmoid(loc);
}
inline Tensor tanh(const Tensor& x, std::source_location loc = std::source_location::current()) { return x.tanh(loc); }
inline Tensor softmax(const Tensor& x, int64_t dim, std::source_location loc = std::source_location::current()) {
  return x.softmax(dim, loc);
}
inline Tensor log_softmax(const Tensor& x, int64_t dim, std::source_location loc = std::source_location::current()) {
  return x.log_softmax(dim, loc);
}
/// Zeroes each element with probability p and scales the rest by 1 / (1 - p)
/// when `training` (torch's default is training=true; pass module.is_training()).
/// The mask comes from the default generator, as nn::Dropout's.
Tensor dropout(const Tensor& x, double p = 0.5, bool training = true);

struct CrossEntropyOptions {
  Tensor weight = {};           // [C] class weights, or undefined
  int64_t ignore_index = -100;  // class-index targets equal to it contribute nothing
  std::string reduction = "mean";
  double label_smoothing = 0.0;
};

/// input [N, C], [N, C, d1, ...] or [C]; target class indices (int64, [N, d1, ...] or [])
/// or class probabilities (floating, the input's shape). Fused with log_softmax.
Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& opts = {},
                     std::source_location loc = std::source_location::current());

struct NLLLossOptions {
  Tensor weight = {};
  int64_t ignore_index = -100;
  std::string reduction = "mean";
};

/// input log-probabilities [N, C], [N, C, d1, ...] or [C]; target int64 class indices.
Tensor nll_loss(const Tensor& input, const Tensor& target, const NLLLossOptions& opts = {},
                std::source_location loc = std::source_location::current());

struct LossOptions {
  std::string reduction = "mean";
};

Tensor mse_loss(const Tensor& input, const Tensor& target, const LossOptions& opts = {},
                std::source_location loc = std::source_location::current());
Tensor l1_loss(const Tensor& input, const Tensor& target, const LossOptions& opts = {},
               std::source_location loc = std::source_location::current());

struct SmoothL1LossOptions {
  std::string reduction = "mean";
  double beta = 1.0;
};

Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, const SmoothL1LossOptions& opts = {},
                      std::source_location loc = std::source_location::current());

struct BCEWithLogitsOptions {
  Tensor weight = {};      // broadcast against input, or undefined
  Tensor pos_weight = {};  // broadcast along the last dim (per class), or undefined
  std::string reduction = "mean";
};

/// Numerically stable: never forms sigmoid(input) or log(0).
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const BCEWithLogitsOptions& opts = {},
                                        std::source_location loc = std::source_location::current());

struct KLDivOptions {
  std::string reduction = "mean";  // also "batchmean": the sum divided by input.size(0)
  bool log_target = false;
};

/// input log-probabilities; target probabilities (or log-probabilities with log_target).
Tensor kl_div(const Tensor& input, const Tensor& target, const KLDivOptions& opts = {},
              std::source_location loc = std::source_location::current());

}  // namespace kiln::nn::functional

namespace kiln::nn {
namespace F = functional;
}  // namespace kiln::nn
