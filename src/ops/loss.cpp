// Cross-entropy with class-index targets (include/kiln/ops/loss.h): the
// checks, the fused kernel of kernels/cpu/cross_entropy.cpp (kiln/kernels/
// loss.h) and the CrossEntropyLossBackward0 node beside the forward. The node
// saves the input itself (not the [rows, C] copy the kernel reads), so its
// create_graph branch differentiates through the caller's layout; the class
// weight is a constant (a weight that requires grad is refused, as torch's
// nll_loss does).
//
// Reductions follow PyTorch 1.13 exactly, label smoothing included:
//   loss = (1 - ls) * nll_loss(logp, target, weight) + (ls / C) * smooth,
//   smooth_r = -sum_c w_c logp_rc (0 on ignored rows), and for "mean" nll
//   and smooth are both divided by the sum of the non-ignored targets' weights
//   (their count when unweighted).
#include "kiln/ops/loss.h"

#include <cmath>
#include <memory>
#include <vector>

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/loss.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "op_record.h"

namespace kiln::ops {

namespace {

// [N, C, d1, ...] -> [N * d1 * ..., C] (class dim last); [C] -> [1, C].
Tensor to_rows(const Tensor& x, int64_t C) {
  if (x.dim() <= 2) return x.reshape({-1, C});
  std::vector<int64_t> perm{0};
  for (int64_t d = 2; d < x.dim(); ++d) perm.push_back(d);
  perm.push_back(1);
  return x.permute(perm).reshape({-1, C});
}

// Inverse of to_rows for a [R, C] gradient.
Tensor from_rows(const Tensor& g, const std::vector<int64_t>& in_sizes) {
  const int64_t k = static_cast<int64_t>(in_sizes.size());
  if (k == 1) return g.reshape({in_sizes[0]});
  if (k == 2) return g;
  std::vector<int64_t> sizes{in_sizes[0]};
  for (int64_t d = 2; d < k; ++d) sizes.push_back(in_sizes[d]);
  sizes.push_back(in_sizes[1]);
  std::vector<int64_t> inv{0, k - 1};
  for (int64_t d = 1; d < k - 1; ++d) inv.push_back(d);
  return g.reshape(sizes).permute(inv);
}

// Note [cross_entropy reduces on the host]: the forward sums the kernel's
// per-row losses and weights on the host, and a "mean" divides by the total
// weight of the non-ignored targets, which depends on the targets. So the sum,
// the write of the loss and the per-row coefficients the backward needs are one
// closure that kiln::compile records and a replay runs on the new rows
// (capture::host_write); it leaves the coefficients here, shared with the backward's
// closure, which builds its per-row factors from them and g on every run.
struct CrossEntropyScales {
  double a = 1, b = 0;  // per-row coefficients of the nll and smoothing terms, before g
  double loss = 0;      // the reduced loss, for the eager range check
};

struct CrossEntropyLossBackward final : autograd::Node {
  autograd::SavedVariable input;
  Tensor target;  // int64 [R], contiguous
  Tensor weight;  // [C] in the input's dtype, contiguous, or undefined
  Tensor lse;     // float64 [R]
  std::vector<int64_t> in_sizes;
  int64_t rows = 0, classes = 0, ignore_index = -100;
  double ls = 0;
  LossReduction red = LossReduction::Mean;
  std::shared_ptr<const CrossEntropyScales> scales;

  const char* name() const override { return "CrossEntropyLossBackward0"; }
  void release_variables() override {
    input.reset();
    lse = Tensor();
  }

  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    const Tensor x = input.unpack(this);
    const Tensor& g = grads[0];
    if (grad_mode_enabled()) return {composed(x, g)};
    // Fused: per-row coefficients from g on the host, then one pass per row;
    // recorded together for a replay (Note [cross_entropy reduces on the host]).
    Tensor gd = g.to(kFloat64).contiguous();
    Tensor xr = to_rows(x, classes).contiguous();
    Tensor out = empty({rows, classes}, TensorOptions().dtype(x.dtype()));
    const kernels::CrossEntropyRows a{rows, classes, target.data_ptr<int64_t>(),
                                      weight.defined() ? weight.data_ptr() : nullptr, ignore_index};
    capture::host_write("cross_entropy_backward",
                        [dt = x.dtype(), a, gp = gd.data_ptr<double>(), xp = xr.data_ptr(), lp = lse.data_ptr<double>(),
                         op = out.data_ptr(), s = scales, rows = rows, ls = ls, red = red]() {
                          std::vector<double> ca(rows), cb(ls > 0 ? rows : 0);
                          for (int64_t r = 0; r < rows; ++r) {
                            const double gr = red == LossReduction::None ? gp[r] : gp[0];
                            ca[r] = gr * s->a;
                            if (ls > 0) cb[r] = gr * s->b;
                          }
                          kernels::cross_entropy_backward(dt, a, xp, lp, ca.data(), ls > 0 ? cb.data() : nullptr, op);
                        });
    return {from_rows(out, in_sizes)};
  }

  // The same formula with kiln ops, so that create_graph=true can differentiate it again.
  Tensor composed(const Tensor& x, const Tensor& g) {
    // The coefficients enter these ops as constants; a "mean"'s depend on the targets.
    if (red == LossReduction::Mean) {
      capture::graph_break_if_recording(
          "cross_entropy's double backward (create_graph) with reduction='mean' uses the targets' total weight "
          "as a host value");
    }
    const double scale_a = scales->a, scale_b = scales->b;
    const TensorOptions o = TensorOptions().dtype(x.dtype());
    Tensor xr = to_rows(x, classes);
    Tensor p = xr.softmax(1);
    Tensor ignored = target.eq(ignore_index);
    Tensor valid = ignored.logical_not().to(x.dtype());
    Tensor tsafe = target.masked_fill(ignored, 0);
    Tensor onehot = zeros({rows, classes}, o).scatter(1, tsafe.unsqueeze(1), 1.0);
    Tensor w = weight.defined() ? weight : ones({classes}, o);
    Tensor wt = w.index_select(0, tsafe) * valid;
    Tensor gr = red == LossReduction::None ? g.reshape({rows}) : g.reshape({1}).expand({rows});
    Tensor grad = (gr * wt * scale_a).unsqueeze(1) * (p - onehot);
    if (ls > 0) grad = grad + (gr * valid * scale_b).unsqueeze(1) * (p * w.sum() - w.unsqueeze(0));
    return from_rows(grad, in_sizes);
  }
};

}  // namespace

Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                     LossReduction red, double label_smoothing, std::source_location loc) {
  OpScope rs("cross_entropy", {&input, &target, &weight});
  KILN_CHECK(input.defined() && target.defined(), ValueError,
             "cross_entropy: expected defined input and target tensors");
  KILN_CHECK(input.dim() >= 1, ShapeError,
             "cross_entropy: expected input of shape [N, C], [N, C, d1, ...] or [C], got ", input.sizes());
  KILN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
             "cross_entropy: expected label_smoothing in [0, 1], got ", label_smoothing);
  const int64_t C = input.dim() == 1 ? input.size(0) : input.size(1);
  KILN_CHECK(!weight.defined() || (weight.dim() == 1 && weight.size(0) == C), ShapeError,
             "cross_entropy: expected weight of shape [", C, "] (one per class), got ", weight.sizes());
  KILN_CHECK(!weight.defined() || weight.is_floating_point(), DTypeError,
             "cross_entropy: expected weight of a floating dtype, got ", dtype_name(weight.dtype()));
  KILN_CHECK(target.dtype() == kInt64, DTypeError, "cross_entropy: expected class-index targets of dtype int64, got ",
             dtype_name(target.dtype()));
  // The fused kernel's gradient is for the input only; a class weight that
  // requires grad would silently get none (torch refuses it the same way).
  KILN_CHECK(!(weight.defined() && weight.requires_grad() && grad_mode_enabled()), ValueError,
             "cross_entropy: expected a class weight that does not require grad with class-index targets (the "
             "fused loss is not differentiable with respect to weight), got ",
             autograd::describe(weight),
             "; hint: pass weight.detach(), or class-probability targets, whose path differentiates the weight");
  const DType dt = input.dtype();
  KILN_CHECK(dt == kFloat32 || dt == kFloat64 || dt == kBFloat16, DTypeError,
             "cross_entropy: expected input of dtype float32, float64 or bfloat16, got ", dtype_name(dt));
  std::vector<int64_t> want;
  if (input.dim() >= 2) {
    want.push_back(input.size(0));
    for (int64_t d = 2; d < input.dim(); ++d) want.push_back(input.size(d));
  }
  KILN_CHECK(target.sizes().equals(IntArrayRef(want)), ShapeError, "cross_entropy: expected target of shape ",
             IntArrayRef(want), " for input of shape ", input.sizes(), ", got target of shape ", target.sizes());

  const bool record = autograd::compute_requires_grad({&input});
  const double ls = label_smoothing;
  Tensor out, lse, trows, w;
  auto scales = std::make_shared<CrossEntropyScales>();
  int64_t R = 0;
  {
    NoGradGuard no_grad;
    Tensor xr = to_rows(input, C).contiguous();
    R = xr.size(0);
    trows = target.reshape({-1}).contiguous();
    if (weight.defined()) w = weight.to(dt).contiguous();
    const TensorOptions f64 = TensorOptions().dtype(kFloat64);
    lse = empty({R}, f64);
    Tensor nll = empty({R}, f64), wrow = empty({R}, f64), smooth = empty({R}, f64);
    kernels::CrossEntropyRows a{R, C, trows.data_ptr<int64_t>(), w.defined() ? w.data_ptr() : nullptr, ignore_index};
    const int64_t bad =
        kernels::cross_entropy_forward(dt, a, xr.data_ptr(), lse.data_ptr<double>(), nll.data_ptr<double>(),
                                       wrow.data_ptr<double>(), ls > 0 ? smooth.data_ptr<double>() : nullptr);
    KILN_CHECK(bad < 0, IndexError, "cross_entropy: target ", bad < 0 ? 0 : trows.data_ptr<int64_t>()[bad],
               " (at flat position ", bad, ") is out of bounds for ", C, " classes: expected 0 <= target < ", C,
               " or target == ignore_index (", ignore_index, ")");
    const double* pn = nll.data_ptr<double>();
    const double* pw = wrow.data_ptr<double>();
    const double* ps = smooth.data_ptr<double>();
    if (red == LossReduction::None) {
      Tensor per = ls > 0 ? nll * (1.0 - ls) + smooth * (ls / static_cast<double>(C)) : nll;
      out = per.to(dt).reshape(want);
      scales->a = 1.0 - ls;
      scales->b = ls / static_cast<double>(C);
    } else {
      // Note [cross_entropy reduces on the host].
      out = empty({}, TensorOptions().dtype(dt));
      capture::host_write("cross_entropy (reduction)",
                          [pn, pw, ps, R, C, ls, red, dt, dst = out.data_ptr(), s = scales]() {
                            double sn = 0, sw = 0, ss = 0;
                            for (int64_t r = 0; r < R; ++r) {
                              sn += pn[r];
                              sw += pw[r];
                              if (ls > 0) ss += ps[r];
                            }
                            double den_a = 1, den_b = 1;
                            if (red == LossReduction::Mean) {
                              den_a = sw;
                              den_b = sw;
                            }
                            double v = (1.0 - ls) * (sn / den_a);
                            if (ls > 0) v += ls / static_cast<double>(C) * (ss / den_b);
                            // As scalar_tensor(v) would store it.
                            visit_dtype<DTypeSet{kFloat32, kFloat64, kBFloat16}>(
                                dt, "cross_entropy", [&]<typename T>() { *static_cast<T*>(dst) = Scalar(v).to<T>(); });
                            s->loss = v;
                            // An all-ignored batch: the rows contribute nothing whatever the scale.
                            s->a = den_a == 0 ? 0.0 : (1.0 - ls) / den_a;
                            s->b = den_b == 0 ? 0.0 : ls / static_cast<double>(C) / den_b;
                          });
      check_scalar_fits(scales->loss, dt, "cross_entropy");
    }
  }
  if (record) {
    auto node = make_intrusive<CrossEntropyLossBackward>();
    node->input = autograd::SavedVariable(input, false);
    node->target = trows;
    node->weight = w;
    node->lse = lse;
    node->in_sizes.assign(input.sizes().begin(), input.sizes().end());
    node->rows = R;
    node->classes = C;
    node->ignore_index = ignore_index;
    node->ls = ls;
    node->red = red;
    node->scales = scales;
    autograd::set_history(out, node, {&input}, autograd::CallSite::from(loc));
  }
  return out;
}

}  // namespace kiln::ops
