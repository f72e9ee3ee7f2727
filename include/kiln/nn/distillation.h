// Knowledge-distillation losses (Hinton et al. 2015; DeiT's hard variant,
// Touvron et al. 2021) for training a student classifier against a teacher's
// logits. Both take the teacher's logits as data: no gradient ever flows into
// the teacher, whatever its logits' requires_grad says.
#pragma once

#include <source_location>

#include "kiln/core/tensor.h"

namespace kiln::nn::functional {

/// alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * cross_entropy(student, target).
/// student_logits, teacher_logits [N, C] of one shape; target int64 [N] class indices. The KL term is
/// F.kl_div(log_softmax(s / T), softmax(t / T), reduction="batchmean"): summed over classes, averaged over
/// the batch; T^2 keeps its gradient on the cross-entropy's scale as T grows. T > 0, alpha in [0, 1].
Tensor distillation_loss(const Tensor& student_logits, const Tensor& teacher_logits, const Tensor& target,
                         double temperature, double alpha, std::source_location loc = std::source_location::current());

/// DeiT's hard distillation: 0.5 * cross_entropy(student, target) + 0.5 * cross_entropy(student, teacher's
/// argmax). The teacher's decision stands in for a second label, so no temperature is involved.
Tensor hard_distillation_loss(const Tensor& student_logits, const Tensor& teacher_logits, const Tensor& target,
                              std::source_location loc = std::source_location::current());

}  // namespace kiln::nn::functional
