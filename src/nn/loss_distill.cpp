// The distillation losses of kiln/nn/distillation.h, composed of kiln's
// differentiable losses, so their gradients (and second derivatives) are
// those of log_softmax, kl_div and cross_entropy.
#include <cmath>

#include "kiln/nn/distillation.h"
#include "kiln/nn/functional.h"
#include "loss_common.h"

namespace kiln::nn::functional {

namespace {

void check_logits(const char* fn, const Tensor& student, const Tensor& teacher, const Tensor& target) {
  detail::check_floating(fn, "student logits", student);
  detail::check_floating(fn, "teacher logits", teacher);
  KILN_CHECK(student.dim() == 2, ShapeError, fn, ": expected student logits of shape [N, C], got ", student.sizes());
  KILN_CHECK(teacher.sizes().equals(student.sizes()), ShapeError, fn,
             ": expected teacher logits of the student's shape ", student.sizes(), ", got ", teacher.sizes());
  KILN_CHECK(target.defined() && target.dtype() == kInt64, DTypeError, fn,
             ": expected target of int64 class indices, got ",
             target.defined() ? std::string(dtype_name(target.dtype())) : std::string("an undefined tensor"));
  KILN_CHECK(target.dim() == 1 && target.size(0) == student.size(0), ShapeError, fn, ": expected target of shape [",
             student.size(0), "] (one class per row), got ", target.sizes());
}

}  // namespace

Tensor distillation_loss(const Tensor& student_logits, const Tensor& teacher_logits, const Tensor& target,
                         double temperature, double alpha, std::source_location loc) {
  check_logits("distillation_loss", student_logits, teacher_logits, target);
  KILN_CHECK(std::isfinite(temperature) && temperature > 0, ValueError,
             "distillation_loss: expected a temperature > 0, got ", temperature);
  KILN_CHECK(alpha >= 0 && alpha <= 1, ValueError, "distillation_loss: expected alpha in [0, 1], got ", alpha);
  const Tensor hard = cross_entropy(student_logits, target, {}, loc);
  if (alpha == 0) return hard;
  // The teacher's distribution as log-probabilities (log_target): exp() of a
  // log_softmax never meets log(0), where softmax probabilities underflow at low T.
  const Tensor log_p_teacher = (teacher_logits.detach() / temperature).log_softmax(1);
  const Tensor log_p_student = (student_logits / temperature).log_softmax(1);
  const Tensor soft = kl_div(log_p_student, log_p_teacher, {.reduction = "batchmean", .log_target = true}, loc);
  const Tensor soft_term = soft * (alpha * temperature * temperature);
  return alpha == 1 ? soft_term : soft_term + hard * (1.0 - alpha);
}

Tensor hard_distillation_loss(const Tensor& student_logits, const Tensor& teacher_logits, const Tensor& target,
                              std::source_location loc) {
  check_logits("hard_distillation_loss", student_logits, teacher_logits, target);
  const Tensor teacher_label = teacher_logits.detach().argmax(1);
  return (cross_entropy(student_logits, target, {}, loc) + cross_entropy(student_logits, teacher_label, {}, loc)) * 0.5;
}

}  // namespace kiln::nn::functional
