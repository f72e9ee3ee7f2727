// Cross-entropy with class-index targets as one op, so that a classifier's or
// language model's loss reads the [rows, classes] logits once forward and once
// backward and keeps only a log-sum-exp per row, instead of materialising the
// log-probabilities that log_softmax + nll_loss keep for backward.
// nn::functional::cross_entropy and nn::CrossEntropyLoss call it for integer
// targets; class-probability targets stay a composite of kiln ops there.
#pragma once

#include <cstdint>
#include <source_location>

#include "kiln/core/tensor.h"

namespace kiln::ops {

/// How the per-element losses become the result: kept, averaged or summed.
enum class LossReduction { None, Mean, Sum };

/// torch.nn.functional.cross_entropy for class-index targets, label smoothing
/// included (PyTorch 1.13's reductions exactly). input [N, C], [N, C, d1, ...]
/// or [C], float32, float64 or bfloat16; target int64 [N, d1, ...] (or [] for
/// a [C] input), each in [0, C) or equal to ignore_index; weight undefined or
/// [C], a constant (one that requires grad is refused). Mean divides by the
/// summed weights of the non-ignored targets. Differentiable in input
/// (CrossEntropyLossBackward0, to any order: under create_graph its backward
/// is the same formula in kiln ops).
Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight = {}, int64_t ignore_index = -100,
                     LossReduction reduction = LossReduction::Mean, double label_smoothing = 0.0,
                     std::source_location loc = std::source_location::current());

}  // namespace kiln::ops
