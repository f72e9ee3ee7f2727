// Loss functions against PyTorch 1.13 (one oracle batch for the whole table):
// values and gradients for every option combination of cross_entropy (class
// indices and probabilities), nll_loss, mse_loss, l1_loss, smooth_l1_loss,
// binary_cross_entropy_with_logits and kl_div; float64 gradcheck and
// gradgradcheck of each case. Tolerance float32: rtol 1e-5, atol 1e-6
// (values), rtol 1e-4, atol 1e-5 (gradients).
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "kiln/nn/functional.h"
#include "support/compare.h"
#include "support/oracle.h"

using namespace kiln;
namespace F = kiln::nn::F;

namespace {

struct LossCase {
  std::string id;
  std::string expr;  // torch, over x0, x1, ...
  std::vector<Tensor> inputs;
  std::vector<int> grad_inputs;
  std::function<Tensor(const TensorList&)> fn;
  bool gradgrad = true;
};

Tensor rn(IntArrayRef s, uint64_t seed) {
  Generator g(seed);
  return randn(s, TensorOptions().dtype(kFloat32), &g);
}
Tensor targets(int64_t C, IntArrayRef s, uint64_t seed) {
  Generator g(seed);
  return randint(0, C, s, TensorOptions().dtype(kInt64), &g);
}
Tensor with_ignored(Tensor t, int64_t ii) {
  Tensor c = t.clone();
  c.reshape({-1}).narrow(0, 0, 1).fill_(ii);
  if (c.numel() > 3) c.reshape({-1}).narrow(0, 3, 1).fill_(ii);
  return c;
}

std::vector<LossCase> build_cases() {
  std::vector<LossCase> cs;
  const std::vector<std::string> reds{"mean", "sum", "none"};
  // cross_entropy with class indices: reduction x weight x label smoothing x ignored rows, 2-D and K-dim.
  for (int kdim = 0; kdim < 2; ++kdim)
    for (const auto& red : reds)
      for (int wgt = 0; wgt < 2; ++wgt)
        for (double ls : {0.0, 0.2})
          for (int ign = 0; ign < 2; ++ign) {
            const int64_t C = 5;
            Tensor x = kdim ? rn({3, C, 2, 3}, 11) : rn({6, C}, 10);
            Tensor t = kdim ? targets(C, {3, 2, 3}, 12) : targets(C, {6}, 13);
            const int64_t ii = ign ? -100 : 2;  // ignore_index 2 is a real class: its rows drop out
            if (ign) t = with_ignored(t, -100);
            Tensor w = rn({C}, 14).abs() + 0.5;
            std::string id = "ce_" + std::string(kdim ? "kd_" : "") + red + (wgt ? "_w" : "") + (ls > 0 ? "_ls" : "") +
                             (ign ? "_ign" : "_ii2");
            std::string expr = "F.cross_entropy(x0, x1, weight=" + std::string(wgt ? "x2" : "None") +
                               ", ignore_index=" + std::to_string(ii) + ", reduction='" + red +
                               "', label_smoothing=" + std::to_string(ls) + ")";
            cs.push_back({id, expr, {x, t, w}, {0}, [=](const TensorList& in) {
                            return F::cross_entropy(in[0], in[1],
                                                    {.weight = wgt ? in[2] : Tensor(), .ignore_index = ii,
                                                     .reduction = red, .label_smoothing = ls});
                          }});
          }
  // 1-D input [C] with a 0-dim target.
  cs.push_back({"ce_1d", "F.cross_entropy(x0, x1)", {rn({7}, 15), tensor<int64_t>({3}).reshape({})}, {0},
                [](const TensorList& in) { return F::cross_entropy(in[0], in[1]); }});
  // cross_entropy with class probabilities.
  for (int kdim = 0; kdim < 2; ++kdim)
    for (const auto& red : reds)
      for (int wgt = 0; wgt < 2; ++wgt)
        for (double ls : {0.0, 0.3}) {
          Tensor x = kdim ? rn({3, 4, 2}, 20) : rn({5, 4}, 21);
          Tensor p = (kdim ? rn({3, 4, 2}, 22) : rn({5, 4}, 23)).softmax(1);
          Tensor w = rn({4}, 24).abs() + 0.5;
          std::string id = "ceprob_" + std::string(kdim ? "kd_" : "") + red + (wgt ? "_w" : "") + (ls > 0 ? "_ls" : "");
          std::string expr = "F.cross_entropy(x0, x1, weight=" + std::string(wgt ? "x2" : "None") + ", reduction='" +
                             red + "', label_smoothing=" + std::to_string(ls) + ")";
          cs.push_back({id, expr, {x, p, w}, {0, 1}, [=](const TensorList& in) {
                          return F::cross_entropy(in[0], in[1],
                                                  {.weight = wgt ? in[2] : Tensor(), .reduction = red,
                                                   .label_smoothing = ls});
                        }});
        }
  // nll_loss.
  for (int kdim = 0; kdim < 2; ++kdim)
    for (const auto& red : reds)
      for (int wgt = 0; wgt < 2; ++wgt)
        for (int ign = 0; ign < 2; ++ign) {
          const int64_t C = 4;
          Tensor x = (kdim ? rn({2, C, 3}, 30) : rn({6, C}, 31)).log_softmax(1);
          Tensor t = kdim ? targets(C, {2, 3}, 32) : targets(C, {6}, 33);
          if (ign) t = with_ignored(t, 1);
          Tensor w = rn({C}, 34).abs() + 0.5;
          std::string id = "nll_" + std::string(kdim ? "kd_" : "") + red + (wgt ? "_w" : "") + (ign ? "_ign" : "");
          std::string expr = "F.nll_loss(x0, x1, weight=" + std::string(wgt ? "x2" : "None") +
                             ", ignore_index=" + (ign ? "1" : "-100") + ", reduction='" + red + "')";
          cs.push_back({id, expr, {x, t, w}, {0}, [=](const TensorList& in) {
                          return F::nll_loss(in[0], in[1], {.weight = wgt ? in[2] : Tensor(),
                                                            .ignore_index = ign ? 1 : -100, .reduction = red});
                        }});
        }
  // Regression losses.
  for (const auto& red : reds) {
    Tensor a = rn({4, 3}, 40), b = rn({4, 3}, 41);
    cs.push_back({"mse_" + red, "F.mse_loss(x0, x1, reduction='" + red + "')", {a, b}, {0, 1},
                  [=](const TensorList& in) { return F::mse_loss(in[0], in[1], {.reduction = red}); }});
    cs.push_back({"l1_" + red, "F.l1_loss(x0, x1, reduction='" + red + "')", {a, b}, {0, 1},
                  [=](const TensorList& in) { return F::l1_loss(in[0], in[1], {.reduction = red}); }, false});
    for (double beta : {1.0, 0.5, 0.0}) {
      cs.push_back({"smoothl1_" + red + "_b" + std::to_string(static_cast<int>(beta * 10)),
                    "F.smooth_l1_loss(x0, x1, reduction='" + red + "', beta=" + std::to_string(beta) + ")",
                    {a, b}, {0, 1},
                    [=](const TensorList& in) {
                      return F::smooth_l1_loss(in[0], in[1], {.reduction = red, .beta = beta});
                    },
                    beta > 0});
    }
    // binary_cross_entropy_with_logits: weight x pos_weight.
    for (int wgt = 0; wgt < 2; ++wgt)
      for (int pw = 0; pw < 2; ++pw) {
        Tensor x = rn({4, 3}, 50) * 3.0, y = rn({4, 3}, 51).sigmoid();
        Tensor w = rn({4, 3}, 52).abs(), pwt = rn({3}, 53).abs() + 0.5;
        std::string expr = "F.binary_cross_entropy_with_logits(x0, x1, weight=" + std::string(wgt ? "x2" : "None") +
                           ", pos_weight=" + (pw ? "x3" : "None") + ", reduction='" + red + "')";
        cs.push_back({"bce_" + red + (wgt ? "_w" : "") + (pw ? "_pw" : ""), expr, {x, y, w, pwt}, {0, 1},
                      [=](const TensorList& in) {
                        return F::binary_cross_entropy_with_logits(
                            in[0], in[1],
                            {.weight = wgt ? in[2] : Tensor(), .pos_weight = pw ? in[3] : Tensor(), .reduction = red});
                      }});
      }
  }
  for (const std::string red : {"mean", "sum", "none", "batchmean"})
    for (int lt = 0; lt < 2; ++lt) {
      Tensor x = rn({3, 5}, 60).log_softmax(1);
      Tensor t = rn({3, 5}, 61).softmax(1);
      if (lt) t = t.log();
      cs.push_back({"kl_" + red + (lt ? "_logt" : ""),
                    "F.kl_div(x0, x1, reduction='" + red + "', log_target=" + (lt ? "True" : "False") + ")",
                    {x, t}, {0, 1}, [=](const TensorList& in) {
                      return F::kl_div(in[0], in[1], {.reduction = red, .log_target = lt == 1});
                    }});
    }
  return cs;
}

struct Table {
  std::vector<LossCase> cases = build_cases();
  std::vector<Tensor> grad_outs;
  std::vector<size_t> value_idx, grad_idx;
  test::OracleBatch batch;
  Table() {
    Generator g(99);
    for (const auto& c : cases) {
      const Tensor out = c.fn(c.inputs);
      Tensor go = randn(out.sizes(), TensorOptions().dtype(kFloat32), &g);
      grad_outs.push_back(go);
      value_idx.push_back(batch.add(c.id, c.expr, c.inputs));
      grad_idx.push_back(batch.add_grad(c.id + "_grad", c.expr, c.inputs, c.grad_inputs, {go}));
    }
    batch.run();
  }
};

Table& table() {
  static std::unique_ptr<Table> t = std::make_unique<Table>();
  return *t;
}

TEST(Loss, ValuesAndGradientsMatchTorch) {
  Table& tb = table();
  ASSERT_GT(tb.cases.size(), 100u);
  for (size_t i = 0; i < tb.cases.size(); ++i) {
    const LossCase& c = tb.cases[i];
    const test::OracleOutcome& want = tb.batch.outcome(tb.value_idx[i]);
    ASSERT_TRUE(want.ok) << c.id << ": " << want.error;
    const Tensor got = c.fn(c.inputs);
    const auto cmp = test::compare_tensors(got, want.outputs[0], 1e-5, 1e-6);
    EXPECT_TRUE(cmp.ok) << c.id << " value: " << cmp.message;

    TensorList in(c.inputs.begin(), c.inputs.end()), leaves;
    for (int k : c.grad_inputs) {
      in[k] = c.inputs[k].detach().clone().requires_grad_();
      leaves.push_back(in[k]);
    }
    const TensorList g = autograd::grad({c.fn(in)}, leaves, {tb.grad_outs[i]});
    const test::OracleOutcome& wg = tb.batch.outcome(tb.grad_idx[i]);
    ASSERT_TRUE(wg.ok) << c.id << ": " << wg.error;
    for (size_t k = 0; k < leaves.size(); ++k) {
      const auto gc = test::compare_tensors(g[k], wg.outputs[k], 1e-4, 1e-5);
      EXPECT_TRUE(gc.ok) << c.id << " gradient of x" << c.grad_inputs[k] << ": " << gc.message;
    }
  }
}

TEST(Loss, GradcheckAndGradgradcheckFloat64) {
  for (const LossCase& c : build_cases()) {
    TensorList base;
    for (const Tensor& t : c.inputs) base.push_back(t.is_floating_point() ? t.to(kFloat64) : t);
    TensorList gin;
    for (int k : c.grad_inputs) gin.push_back(base[k].detach().clone().requires_grad_());
    auto fn = [&](const TensorList& xs) {
      TensorList in = base;
      for (size_t k = 0; k < xs.size(); ++k) in[c.grad_inputs[k]] = xs[k];
      return TensorList{c.fn(in)};
    };
    EXPECT_NO_THROW(autograd::gradcheck(fn, gin)) << c.id;
    if (c.gradgrad) {
      EXPECT_NO_THROW(autograd::gradgradcheck(fn, gin)) << c.id << " (gradgradcheck)";
    }
  }
}

}  // namespace
