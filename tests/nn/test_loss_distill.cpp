// Distillation losses (kiln/nn/distillation.h) against PyTorch 1.13 written
// out with F.kl_div(log_softmax(s/T), softmax(t/T), reduction="batchmean") and
// F.cross_entropy: values and student gradients over a grid of temperatures
// and alphas, DeiT's hard variant, float64 central differences (gradcheck and
// gradgradcheck), the teacher never receiving a gradient, and the errors.
// Tolerance float32: rtol 1e-5, atol 1e-6 (values), rtol 1e-4, atol 1e-5 (gradients).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <sstream>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/nn/distillation.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/gradcheck.h"
#include "support/compare.h"
#include "support/oracle.h"

using namespace kiln;
namespace F = kiln::nn::F;

namespace {

Tensor rn(IntArrayRef s, uint64_t seed, double scale = 1.0) {
  Generator g(seed);
  return randn(s, TensorOptions().dtype(kFloat32), &g) * scale;
}
Tensor labels(int64_t C, int64_t n, uint64_t seed) {
  Generator g(seed);
  return randint(0, C, {n}, TensorOptions().dtype(kInt64), &g);
}

struct DistillCase {
  std::string id, expr;  // torch, over x0 (student), x1 (teacher), x2 (target)
  std::vector<Tensor> inputs;
  std::function<Tensor(const TensorList&)> fn;
};

std::string num(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::vector<DistillCase> build_cases() {
  std::vector<DistillCase> cs;
  uint64_t seed = 100;
  for (double T : {1.0, 2.0, 4.0, 0.5})
    for (double a : {0.0, 0.5, 0.9, 1.0}) {
      // Teacher logits sharper than the student's, as a trained teacher's are.
      const Tensor s = rn({7, 10}, seed++), t = rn({7, 10}, seed++, 3.0), y = labels(10, 7, seed++);
      const std::string Ts = num(T), as = num(a);
      cs.push_back({"soft_T" + Ts + "_a" + as,
                    as + "*" + Ts + "*" + Ts + "*F.kl_div(F.log_softmax(x0/" + Ts + ", 1), F.softmax(x1/" + Ts +
                        ", 1), reduction='batchmean') + (1-" + as + ")*F.cross_entropy(x0, x2)",
                    {s, t, y}, [=](const TensorList& in) { return F::distillation_loss(in[0], in[1], in[2], T, a); }});
    }
  // One row, and many classes.
  cs.push_back({"soft_one_row", "0.7*9.0*F.kl_div(F.log_softmax(x0/3.0, 1), F.softmax(x1/3.0, 1), "
                                "reduction='batchmean') + 0.3*F.cross_entropy(x0, x2)",
                {rn({1, 5}, 200), rn({1, 5}, 201), labels(5, 1, 202)},
                [](const TensorList& in) { return F::distillation_loss(in[0], in[1], in[2], 3.0, 0.7); }});
  cs.push_back({"soft_100_classes", "0.9*16.0*F.kl_div(F.log_softmax(x0/4.0, 1), F.softmax(x1/4.0, 1), "
                                    "reduction='batchmean') + 0.1*F.cross_entropy(x0, x2)",
                {rn({4, 100}, 210), rn({4, 100}, 211, 5.0), labels(100, 4, 212)},
                [](const TensorList& in) { return F::distillation_loss(in[0], in[1], in[2], 4.0, 0.9); }});
  for (int k = 0; k < 2; ++k)
    cs.push_back({"hard_" + std::to_string(k), "0.5*F.cross_entropy(x0, x2) + 0.5*F.cross_entropy(x0, x1.argmax(1))",
                  {rn({9, 6}, 300 + k), rn({9, 6}, 310 + k, 2.0), labels(6, 9, 320 + k)},
                  [](const TensorList& in) { return F::hard_distillation_loss(in[0], in[1], in[2]); }});
  return cs;
}

struct Table {
  std::vector<DistillCase> cases = build_cases();
  std::vector<Tensor> grad_outs;
  std::vector<size_t> value_idx, grad_idx;
  test::OracleBatch batch;
  Table() {
    Generator g(7);
    for (const auto& c : cases) {
      Tensor go = randn({}, TensorOptions().dtype(kFloat32), &g);
      grad_outs.push_back(go);
      value_idx.push_back(batch.add(c.id, c.expr, c.inputs));
      grad_idx.push_back(batch.add_grad(c.id + "_grad", c.expr, c.inputs, {0}, {go}));
    }
    batch.run();
  }
};

Table& table() {
  static std::unique_ptr<Table> t = std::make_unique<Table>();
  return *t;
}

TEST(DistillLoss, ValuesAndStudentGradientsMatchTorch) {
  Table& tb = table();
  ASSERT_EQ(tb.cases.size(), 20u);
  for (size_t i = 0; i < tb.cases.size(); ++i) {
    const DistillCase& c = tb.cases[i];
    const test::OracleOutcome& want = tb.batch.outcome(tb.value_idx[i]);
    ASSERT_TRUE(want.ok) << c.id << ": " << want.error;
    const Tensor got = c.fn(c.inputs);
    EXPECT_EQ(got.dim(), 0) << c.id;
    const auto cmp = test::compare_tensors(got, want.outputs[0], 1e-5, 1e-6);
    EXPECT_TRUE(cmp.ok) << c.id << " value: " << cmp.message;

    TensorList in(c.inputs.begin(), c.inputs.end());
    in[0] = c.inputs[0].detach().clone().requires_grad_();
    const TensorList g = autograd::grad({c.fn(in)}, {in[0]}, {tb.grad_outs[i]});
    const test::OracleOutcome& wg = tb.batch.outcome(tb.grad_idx[i]);
    ASSERT_TRUE(wg.ok) << c.id << ": " << wg.error;
    const auto gc = test::compare_tensors(g[0], wg.outputs[0], 1e-4, 1e-5);
    EXPECT_TRUE(gc.ok) << c.id << " student gradient: " << gc.message;
  }
}

TEST(DistillLoss, GradcheckAndGradgradcheckFloat64) {
  for (const DistillCase& c : build_cases()) {
    TensorList base;
    for (const Tensor& t : c.inputs) base.push_back(t.is_floating_point() ? t.to(kFloat64) : t);
    auto fn = [&](const TensorList& xs) {
      TensorList in = base;
      in[0] = xs[0];
      return TensorList{c.fn(in)};
    };
    const TensorList student{base[0].detach().clone().requires_grad_()};
    EXPECT_NO_THROW(autograd::gradcheck(fn, student)) << c.id;
    EXPECT_NO_THROW(autograd::gradgradcheck(fn, student)) << c.id << " (gradgradcheck)";
  }
}

// The loss is alpha-linear between its two ends: alpha 0 is the plain cross-entropy, alpha 1 the scaled KL alone.
TEST(DistillLoss, EndsOfAlphaAreTheirTerms) {
  const Tensor s = rn({5, 4}, 1), t = rn({5, 4}, 2), y = labels(4, 5, 3);
  EXPECT_EQ(F::distillation_loss(s, t, y, 2.0, 0.0).item<float>(), F::cross_entropy(s, y).item<float>());
  const double kl = F::kl_div((s / 2.0).log_softmax(1), (t / 2.0).softmax(1), {.reduction = "batchmean"}).item<double>();
  EXPECT_NEAR(F::distillation_loss(s, t, y, 2.0, 1.0).item<double>(), 4.0 * kl, 1e-5);
  // A student that already matches the teacher has nothing left to learn from it.
  EXPECT_NEAR(F::distillation_loss(t, t, y, 3.0, 1.0).item<double>(), 0.0, 1e-6);
}

TEST(DistillLoss, TeacherGetsNoGradient) {
  Tensor s = rn({6, 5}, 11).requires_grad_(), t = rn({6, 5}, 12).requires_grad_();
  const Tensor y = labels(5, 6, 13);
  Tensor loss = F::distillation_loss(s, t, y, 4.0, 0.9) + F::hard_distillation_loss(s, t, y);
  EXPECT_TRUE(loss.requires_grad());
  loss.backward();
  EXPECT_TRUE(s.grad().defined());
  EXPECT_FALSE(t.grad().defined());
}

// Confident teachers at a low temperature: softmax(t / T) underflows to 0 for
// most classes, where a naive log(0) would give inf or NaN.
TEST(DistillLoss, FiniteForSaturatedTeacher) {
  Tensor s = rn({4, 10}, 21).requires_grad_();
  const Tensor t = rn({4, 10}, 22, 200.0), y = labels(10, 4, 23);
  Tensor loss = F::distillation_loss(s, t, y, 0.5, 0.9);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  loss.backward();
  EXPECT_TRUE(std::isfinite(s.grad().abs().sum().item<double>()));
}

TEST(DistillLoss, ErrorsNameWhatWasExpected) {
  const Tensor s = rn({3, 4}, 31), t = rn({3, 4}, 32), y = labels(4, 3, 33);
  auto msg = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg([&] { F::distillation_loss(s, rn({3, 5}, 1), y, 2, 0.5); }).find("teacher logits of the student's shape"),
            std::string::npos);
  EXPECT_NE(msg([&] { F::distillation_loss(s, t, y, 0.0, 0.5); }).find("temperature > 0, got 0"), std::string::npos);
  EXPECT_NE(msg([&] { F::distillation_loss(s, t, y, 2.0, 1.5); }).find("alpha in [0, 1], got 1.5"), std::string::npos);
  EXPECT_NE(msg([&] { F::distillation_loss(s, t, y.to(kFloat32), 2.0, 0.5); }).find("int64 class indices"),
            std::string::npos);
  EXPECT_NE(msg([&] { F::hard_distillation_loss(s, t, labels(4, 2, 1)); }).find("target of shape [3]"),
            std::string::npos);
  EXPECT_NE(msg([&] { F::hard_distillation_loss(s.reshape({12}), t.reshape({12}), y); }).find("shape [N, C]"),
            std::string::npos);
}

}  // namespace
