// The loss functions, with PyTorch 1.13's formulas. cross_entropy with
// class-index targets is the fused op of kiln/ops/loss.h (its kernel and
// backward node live there); with class-probability targets it is log_softmax
// composed with kiln ops here. nll_loss, mse_loss, l1_loss, smooth_l1_loss,
// binary_cross_entropy_with_logits and kl_div are composed of differentiable
// kiln ops, so their gradients (and second derivatives) are the ops' own.
#include <algorithm>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/loss.h"
#include "loss_common.h"

namespace kiln::nn::functional {

using detail::apply_reduction;
using detail::parse_reduction;
using detail::Reduction;

namespace {

void check_same_shape(const char* fn, const Tensor& input, const Tensor& target) {
  KILN_CHECK(target.defined() && target.sizes().equals(input.sizes()), ShapeError, fn,
             ": expected target of the input's shape ", input.sizes(), ", got ",
             target.defined() ? shape_str(target.sizes()) : std::string("an undefined tensor"));
}

// Cross-entropy against class probabilities [N, C, ...] of the input's shape.
Tensor cross_entropy_probs(const Tensor& input, const Tensor& target, const CrossEntropyOptions& o, Reduction red,
                           int64_t C) {
  const int64_t cdim = input.dim() == 1 ? 0 : 1;
  Tensor t = target;
  if (o.label_smoothing > 0) t = t * (1.0 - o.label_smoothing) + o.label_smoothing / static_cast<double>(C);
  Tensor prod = input.log_softmax(cdim) * t;
  if (o.weight.defined()) {
    std::vector<int64_t> wshape(static_cast<size_t>(input.dim() - cdim), 1);
    wshape[0] = C;
    prod = prod * o.weight.reshape(wshape);
  }
  Tensor per = -prod.sum({cdim});
  switch (red) {
    case Reduction::None: return per;
    case Reduction::Sum: return per.sum();
    default: return per.sum() / static_cast<double>(input.numel() / std::max<int64_t>(C, 1));
  }
}

}  // namespace

Tensor nll_loss(const Tensor& input, const Tensor& target, const NLLLossOptions& o, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::nll_loss, [&](const Tensor& x, const Tensor& t) { return nll_loss(x, t, o, loc); }, input, target);
  detail::check_floating("nll_loss", "input", input);
  const Reduction red = parse_reduction("nll_loss", o.reduction);
  KILN_CHECK(input.dim() >= 1, ShapeError, "nll_loss: expected input of shape [N, C], [N, C, d1, ...] or [C], got ",
             input.sizes());
  KILN_CHECK(target.defined() && target.dtype() == kInt64, DTypeError,
             "nll_loss: expected target of dtype int64 (class indices), got ",
             target.defined() ? std::string(dtype_name(target.dtype())) : "an undefined tensor");
  const int64_t cdim = input.dim() == 1 ? 0 : 1;
  const int64_t C = input.size(cdim);
  std::vector<int64_t> want;
  if (input.dim() >= 2) {
    want.push_back(input.size(0));
    for (int64_t d = 2; d < input.dim(); ++d) want.push_back(input.size(d));
  }
  KILN_CHECK(target.sizes().equals(IntArrayRef(want)), ShapeError, "nll_loss: expected target of shape ",
             IntArrayRef(want), " for input of shape ", input.sizes(), ", got target of shape ", target.sizes());
  Tensor tc = target.contiguous();
  capture::sync("nll_loss's target check");  // the targets may come from kernels a compiled function has not run yet
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t i = 0; i < tc.numel(); ++i) {
    KILN_CHECK(tp[i] == o.ignore_index || (tp[i] >= 0 && tp[i] < C), IndexError, "nll_loss: target ", tp[i],
               " (at flat position ", i, ") is out of bounds for ", C, " classes: expected 0 <= target < ", C,
               " or target == ignore_index (", o.ignore_index, ")");
  }
  if (o.weight.defined()) {
    KILN_CHECK(o.weight.dim() == 1 && o.weight.size(0) == C, ShapeError, "nll_loss: expected weight of shape [", C,
               "] (one per class), got ", o.weight.sizes());
  }
  Tensor ignored = target.eq(o.ignore_index);
  Tensor tsafe = target.masked_fill(ignored, 0);
  Tensor valid = ignored.logical_not().to(input.dtype());
  Tensor picked = input.gather(cdim, tsafe.unsqueeze(cdim), loc).squeeze(cdim, loc);
  Tensor wt = o.weight.defined() ? o.weight.to(input.dtype()).index_select(0, tsafe.reshape({-1})).reshape(want) * valid
                                 : valid;
  Tensor per = -(picked * wt);
  switch (red) {
    case Reduction::None: return per;
    case Reduction::Sum: return per.sum();
    default: return per.sum() / wt.sum();
  }
}

Tensor mse_loss(const Tensor& input, const Tensor& target, const LossOptions& o, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::mse_loss, [&](const Tensor& x, const Tensor& t) { return mse_loss(x, t, o, loc); }, input, target);
  detail::check_floating("mse_loss", "input", input);
  check_same_shape("mse_loss", input, target);
  const Tensor d = input.sub(target, 1, loc);
  return apply_reduction(d * d, parse_reduction("mse_loss", o.reduction));
}

Tensor l1_loss(const Tensor& input, const Tensor& target, const LossOptions& o, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::l1_loss, [&](const Tensor& x, const Tensor& t) { return l1_loss(x, t, o, loc); }, input, target);
  detail::check_floating("l1_loss", "input", input);
  check_same_shape("l1_loss", input, target);
  return apply_reduction(input.sub(target, 1, loc).abs(), parse_reduction("l1_loss", o.reduction));
}

Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, const SmoothL1LossOptions& o,
                      std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::smooth_l1_loss, [&](const Tensor& x, const Tensor& t) { return smooth_l1_loss(x, t, o, loc); },
        input, target);
  detail::check_floating("smooth_l1_loss", "input", input);
  check_same_shape("smooth_l1_loss", input, target);
  KILN_CHECK(o.beta >= 0, ValueError, "smooth_l1_loss: expected beta >= 0, got ", o.beta);
  const Reduction red = parse_reduction("smooth_l1_loss", o.reduction);
  const Tensor d = input.sub(target, 1, loc);
  const Tensor ad = d.abs();
  if (o.beta == 0) return apply_reduction(ad, red);
  return apply_reduction(where(ad.lt(o.beta), d * d * (0.5 / o.beta), ad - 0.5 * o.beta), red);
}

Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target, const BCEWithLogitsOptions& o,
                                        std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::binary_cross_entropy_with_logits,
        [&](const Tensor& x, const Tensor& t) { return binary_cross_entropy_with_logits(x, t, o, loc); }, input,
        target);
  detail::check_floating("binary_cross_entropy_with_logits", "input", input);
  check_same_shape("binary_cross_entropy_with_logits", input, target);
  const Reduction red = parse_reduction("binary_cross_entropy_with_logits", o.reduction);
  // PyTorch's stable form: log(1 + exp(-x)) = m + log(exp(-m) + exp(-x - m)), m = max(-x, 0).
  const Tensor m = input.neg().clamp(0.0);
  const Tensor softplus_neg = (m.neg().exp() + (input.neg() - m).exp()).log() + m;
  Tensor loss = (1.0 - target) * input;
  if (o.pos_weight.defined()) {
    const Tensor log_weight = (o.pos_weight - 1.0) * target + 1.0;
    loss = loss + log_weight * softplus_neg;
  } else {
    loss = loss + softplus_neg;
  }
  if (o.weight.defined()) loss = loss * o.weight;
  return apply_reduction(loss, red);
}

Tensor kl_div(const Tensor& input, const Tensor& target, const KLDivOptions& o, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::kl_div, [&](const Tensor& x, const Tensor& t) { return kl_div(x, t, o, loc); }, input, target);
  detail::check_floating("kl_div", "input", input);
  check_same_shape("kl_div", input, target);
  const Reduction red = parse_reduction("kl_div", o.reduction, /*allow_batchmean=*/true);
  Tensor loss;
  if (o.log_target) {
    loss = target.exp() * (target - input);
  } else {
    // xlogy(t, t) - t * input, with 0 log 0 = 0 (and a finite gradient there).
    const Tensor pos = target.gt(0.0);
    const Tensor tsafe = where(pos, target, 1.0);
    loss = target * tsafe.log() - target * input;
  }
  return apply_reduction(loss, red);
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& o,
                     std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::cross_entropy, [&](const Tensor& x, const Tensor& t) { return cross_entropy(x, t, o, loc); }, input,
        target);
  detail::check_floating("cross_entropy", "input", input);
  KILN_CHECK(target.defined(), ValueError, "cross_entropy: expected a target tensor, got an undefined one");
  const Reduction red = detail::parse_reduction("cross_entropy", o.reduction);
  KILN_CHECK(input.dim() >= 1, ShapeError,
             "cross_entropy: expected input of shape [N, C], [N, C, d1, ...] or [C], got ", input.sizes());
  KILN_CHECK(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0, ValueError,
             "cross_entropy: expected label_smoothing in [0, 1], got ", o.label_smoothing);
  const int64_t C = input.dim() == 1 ? input.size(0) : input.size(1);
  if (o.weight.defined()) {
    KILN_CHECK(o.weight.dim() == 1 && o.weight.size(0) == C, ShapeError, "cross_entropy: expected weight of shape [", C,
               "] (one per class), got ", o.weight.sizes());
    detail::check_floating("cross_entropy", "weight", o.weight);
  }
  if (target.is_floating_point()) {
    KILN_CHECK(target.sizes().equals(input.sizes()), ShapeError,
               "cross_entropy: class-probability target must have the input's shape ", input.sizes(), ", got ",
               target.sizes());
    KILN_CHECK(target.dtype() == input.dtype(), DTypeError,
               "cross_entropy: expected a probability target of the input's dtype ", dtype_name(input.dtype()),
               ", got ", dtype_name(target.dtype()));
    return cross_entropy_probs(input, target, o, red, C);
  }
  KILN_CHECK(target.dtype() == kInt64, DTypeError,
             "cross_entropy: expected target of dtype int64 (class indices) or the input's floating dtype "
             "(class probabilities), got target ",
             dtype_name(target.dtype()), " for input ", dtype_name(input.dtype()));
  const ops::LossReduction r = red == Reduction::None  ? ops::LossReduction::None
                               : red == Reduction::Sum ? ops::LossReduction::Sum
                                                       : ops::LossReduction::Mean;
  return ops::cross_entropy(input, target, o.weight, o.ignore_index, r, o.label_smoothing, loc);
}

}  // namespace kiln::nn::functional
