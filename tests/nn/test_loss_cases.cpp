// Cross-entropy edge cases: ignored rows contribute nothing, an all-ignored
// batch (nan for "mean", as torch), large logits stay finite, bfloat16 within
// tolerance, the threaded path on the gpt workload's logits shape, double
// backward against torch, and error texts.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/nn/functional.h"
#include "support/compare.h"
#include "support/oracle.h"

using namespace kiln;
namespace F = kiln::nn::F;

namespace {

Tensor rn(IntArrayRef s, uint64_t seed, DType dt = kFloat32) {
  Generator g(seed);
  return randn(s, TensorOptions().dtype(dt), &g);
}

template <typename E, typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

TEST(LossCases, IgnoredRowsContributeNothing) {
  Tensor x = rn({5, 4}, 1);
  Tensor t = tensor<int64_t>({1, -100, 3, -100, 0});
  Tensor x2 = x.clone();
  x2.select(0, 1).fill_(1e3);
  x2.select(0, 3).fill_(-7.0);
  for (double ls : {0.0, 0.1}) {
    const F::CrossEntropyOptions o{.weight = rn({4}, 2).abs(), .label_smoothing = ls};
    EXPECT_EQ(F::cross_entropy(x, t, o).item<float>(), F::cross_entropy(x2, t, o).item<float>());
    Tensor leaf = x2.clone().requires_grad_();
    Tensor g = autograd::grad({F::cross_entropy(leaf, t, o)}, {leaf})[0];
    EXPECT_TRUE(g.select(0, 1).eq(0).all().item<bool>());
    EXPECT_TRUE(g.select(0, 3).eq(0).all().item<bool>());
    EXPECT_TRUE(g.select(0, 0).ne(0).any().item<bool>());
  }
}

TEST(LossCases, AllIgnoredBatchMatchesTorch) {
  Tensor x = rn({3, 4}, 3);
  Tensor t = tensor<int64_t>({-100, -100, -100});
  for (const std::string red : {"mean", "sum"}) {
    for (double ls : {0.0, 0.1}) {
      Tensor leaf = x.clone().requires_grad_();
      Tensor loss = F::cross_entropy(leaf, t, {.reduction = red, .label_smoothing = ls});
      auto want = test::torch_eval("F.cross_entropy(x0, x1, reduction='" + red +
                                       "', label_smoothing=" + std::to_string(ls) + ")",
                                   {x, t});
      ASSERT_TRUE(want.ok) << want.error;
      EXPECT_TRUE(test::compare_tensors(loss, want.outputs[0], 0, 0).ok) << red << " " << ls;
      if (red == "mean") {
        EXPECT_TRUE(std::isnan(loss.item<float>()));
      }
      Tensor g = autograd::grad({loss}, {leaf})[0];
      EXPECT_TRUE(g.eq(0).all().item<bool>()) << "ignored rows get a zero gradient (" << red << ")";
    }
  }
}

TEST(LossCases, LargeLogitsStayFinite) {
  Tensor x = rn({4, 6}, 4) * 1e4;
  Tensor t = tensor<int64_t>({0, 5, 2, 3});
  Tensor leaf = x.clone().requires_grad_();
  Tensor loss = F::cross_entropy(leaf, t, {.label_smoothing = 0.1});
  Tensor g = autograd::grad({loss}, {leaf})[0];
  EXPECT_TRUE(std::isfinite(loss.item<float>()));
  EXPECT_TRUE((g - g).eq(0).all().item<bool>()) << "every gradient element finite";
  test::OracleBatch b;
  const size_t v = b.add("big", "F.cross_entropy(x0, x1, label_smoothing=0.1)", {x, t});
  const size_t gi = b.add_grad("big_grad", "F.cross_entropy(x0, x1, label_smoothing=0.1)", {x, t}, {0},
                               {ones({}, TensorOptions().dtype(kFloat32))});
  b.run();
  ASSERT_TRUE(b.outcome(v).ok && b.outcome(gi).ok) << b.outcome(v).error << b.outcome(gi).error;
  EXPECT_TRUE(test::compare_tensors(loss, b.outcome(v).outputs[0], 1e-5, 1e-3).ok);
  const auto c = test::compare_tensors(g, b.outcome(gi).outputs[0], 1e-4, 1e-6);
  EXPECT_TRUE(c.ok) << c.message;
}

// bfloat16 logits: kiln computes in float and rounds once; torch 1.13 on CPU too.
TEST(LossCases, BFloat16WithinTolerance) {
  Tensor x = rn({16, 10}, 5).to(kBFloat16);
  Generator gen(6);
  Tensor t = randint(0, 10, {16}, TensorOptions().dtype(kInt64), &gen);
  const std::string expr = "F.cross_entropy(x0, x1, label_smoothing=0.1)";
  Tensor leaf = x.clone().requires_grad_();
  Tensor loss = F::cross_entropy(leaf, t, {.label_smoothing = 0.1});
  EXPECT_EQ(loss.dtype(), kBFloat16);
  Tensor g = autograd::grad({loss}, {leaf})[0];
  EXPECT_EQ(g.dtype(), kBFloat16);
  test::OracleBatch b;
  const size_t v = b.add("bf16", expr, {x, t});
  const size_t gi = b.add_grad("bf16_grad", expr, {x, t}, {0}, {ones({}, TensorOptions().dtype(kBFloat16))});
  b.run();
  ASSERT_TRUE(b.outcome(v).ok && b.outcome(gi).ok) << b.outcome(v).error << b.outcome(gi).error;
  auto c = test::compare_tensors(loss, b.outcome(v).outputs[0], 1e-2, 1e-2);
  EXPECT_TRUE(c.ok) << c.message;
  c = test::compare_tensors(g, b.outcome(gi).outputs[0], 2e-2, 1e-3);
  EXPECT_TRUE(c.ok) << c.message;
}

// The gpt workload's logits (16*128 rows x 256 vocab): the threaded fused path.
TEST(LossCases, GptLogitsShapeMatchesTorch) {
  Tensor x = rn({2048, 256}, 7) * 3.0;
  Generator gen(8);
  Tensor t = randint(0, 256, {2048}, TensorOptions().dtype(kInt64), &gen);
  Tensor leaf = x.clone().requires_grad_();
  Tensor loss = F::cross_entropy(leaf, t);
  Tensor g = autograd::grad({loss}, {leaf})[0];
  test::OracleBatch b;
  const size_t v = b.add("gpt", "F.cross_entropy(x0, x1)", {x, t});
  const size_t gi = b.add_grad("gpt_grad", "F.cross_entropy(x0, x1)", {x, t}, {0},
                               {ones({}, TensorOptions().dtype(kFloat32))});
  b.run();
  ASSERT_TRUE(b.outcome(v).ok && b.outcome(gi).ok);
  auto c = test::compare_tensors(loss, b.outcome(v).outputs[0], 1e-5, 1e-6);
  EXPECT_TRUE(c.ok) << c.message;
  c = test::compare_tensors(g, b.outcome(gi).outputs[0], 1e-4, 1e-8);
  EXPECT_TRUE(c.ok) << c.message;
}

// d/dx sum((d loss / dx)^2) through create_graph=true, against torch (float64).
TEST(LossCases, DoubleBackwardMatchesTorch) {
  Tensor x = rn({3, 4, 2}, 9, kFloat64);
  Tensor t = tensor<int64_t>({0, -100, 3, 1, 2, 2}).reshape({3, 2});
  Tensor w = rn({4}, 10, kFloat64).abs() + 0.5;
  Tensor leaf = x.clone().requires_grad_();
  Tensor loss = F::cross_entropy(leaf, t, {.weight = w, .label_smoothing = 0.2});
  EXPECT_STREQ(loss.grad_fn()->name(), "CrossEntropyLossBackward0");
  Tensor gx = autograd::grad({loss}, {leaf}, {}, std::nullopt, /*create_graph=*/true)[0];
  ASSERT_TRUE(gx.requires_grad());
  Tensor gg = autograd::grad({(gx * gx).sum()}, {leaf})[0];
  auto want = test::torch_eval(
      "(lambda x: torch.autograd.grad((torch.autograd.grad(F.cross_entropy(x, x1, weight=x2, label_smoothing=0.2), "
      "x, create_graph=True)[0] ** 2).sum(), x)[0])(x0.requires_grad_())",
      {x, t, w});
  ASSERT_TRUE(want.ok) << want.error;
  const auto c = test::compare_tensors(gg, want.outputs[0], 1e-9, 1e-12);
  EXPECT_TRUE(c.ok) << c.message;
}

// The fused backward (create_graph=false) and the kiln-ops formula (create_graph=true)
// agree for every option combination, K-dim and non-contiguous inputs included.
TEST(LossCases, FusedAndComposedBackwardAgree) {
  const Tensor x2 = rn({6, 5}, 20, kFloat64).t().t();
  const Tensor xt = rn({5, 6}, 21, kFloat64).t();  // non-contiguous [6, 5]
  const Tensor xk = rn({2, 5, 3}, 22, kFloat64);
  const Tensor t2 = tensor<int64_t>({0, -100, 4, 2, 2, 1});
  const Tensor tk = tensor<int64_t>({0, 1, -100, 4, 3, 2}).reshape({2, 3});
  const Tensor w = rn({5}, 23, kFloat64).abs() + 0.5;
  int checked = 0;
  for (const auto& [x, t] : {std::pair{x2, t2}, std::pair{xt, t2}, std::pair{xk, tk}})
    for (const std::string red : {"mean", "sum", "none"})
      for (int wgt = 0; wgt < 2; ++wgt)
        for (double ls : {0.0, 0.3}) {
          const F::CrossEntropyOptions o{.weight = wgt ? w : Tensor(), .reduction = red, .label_smoothing = ls};
          Tensor leaf = x.detach().requires_grad_();
          Tensor loss = F::cross_entropy(leaf, t, o);
          Tensor go = rn(loss.sizes(), 24, kFloat64);
          Tensor fused = autograd::grad({loss}, {leaf}, {go}, true)[0];
          Tensor composed = autograd::grad({loss}, {leaf}, {go}, true, /*create_graph=*/true)[0];
          EXPECT_TRUE(composed.requires_grad());
          const auto c = test::compare_tensors(fused, composed.detach(), 1e-12, 1e-14);
          EXPECT_TRUE(c.ok) << red << " w" << wgt << " ls" << ls << ": " << c.message;
          EXPECT_TRUE(fused.sizes().equals(x.sizes()));
          ++checked;
        }
  EXPECT_EQ(checked, 36);
}

TEST(LossCases, NonContiguousInputMatchesTorch) {
  const Tensor x = rn({5, 6}, 25).t();
  const Tensor t = tensor<int64_t>({0, 4, 2, -100, 1, 3});
  Tensor leaf = x.detach().requires_grad_();
  Tensor loss = F::cross_entropy(leaf, t, {.label_smoothing = 0.1});
  Tensor g = autograd::grad({loss}, {leaf})[0];
  test::OracleBatch b;
  const std::string expr = "F.cross_entropy(x0, x1, label_smoothing=0.1)";
  const size_t v = b.add("nc", expr, {x, t});
  const size_t gi = b.add_grad("nc_grad", expr, {x, t}, {0}, {ones({}, TensorOptions().dtype(kFloat32))});
  b.run();
  ASSERT_TRUE(b.outcome(v).ok && b.outcome(gi).ok);
  EXPECT_TRUE(test::compare_tensors(loss, b.outcome(v).outputs[0], 1e-5, 1e-6).ok);
  const auto c = test::compare_tensors(g, b.outcome(gi).outputs[0], 1e-4, 1e-6);
  EXPECT_TRUE(c.ok) << c.message;
}

// binary_cross_entropy_with_logits at |x| = 200 (sigmoid saturates) and kl_div with zero
// target entries (0 log 0 = 0): finite and equal to torch, gradients included.
TEST(LossCases, SaturatedBceAndZeroTargetKlMatchTorch) {
  const Tensor x = tensor<float>({200.f, -200.f, 30.f, -30.f, 0.5f, -0.5f}, {2, 3});
  const Tensor y = tensor<float>({0.f, 1.f, 0.25f, 1.f, 0.f, 0.75f}, {2, 3});
  const Tensor pw = tensor<float>({2.f, 0.5f, 1.5f});
  const Tensor lp = rn({2, 3}, 30).log_softmax(1);
  const Tensor p = tensor<float>({0.f, 0.4f, 0.6f, 1.f, 0.f, 0.f}, {2, 3});
  test::OracleBatch b;
  const std::string bce = "F.binary_cross_entropy_with_logits(x0, x1, pos_weight=x2, reduction='sum')";
  const std::string kl = "F.kl_div(x0, x1, reduction='batchmean')";
  const size_t bv = b.add("bce", bce, {x, y, pw});
  const size_t bg = b.add_grad("bce_g", bce, {x, y, pw}, {0}, {ones({}, TensorOptions().dtype(kFloat32))});
  const size_t kv = b.add("kl", kl, {lp, p});
  const size_t kg = b.add_grad("kl_g", kl, {lp, p}, {0}, {ones({}, TensorOptions().dtype(kFloat32))});
  b.run();
  for (size_t i : {bv, bg, kv, kg}) ASSERT_TRUE(b.outcome(i).ok) << b.outcome(i).error;
  Tensor xl = x.detach().requires_grad_();
  Tensor l = F::binary_cross_entropy_with_logits(xl, y, {.pos_weight = pw, .reduction = "sum"});
  EXPECT_TRUE(std::isfinite(l.item<float>()));
  EXPECT_TRUE(test::compare_tensors(l, b.outcome(bv).outputs[0], 1e-6, 1e-5).ok);
  auto c = test::compare_tensors(autograd::grad({l}, {xl})[0], b.outcome(bg).outputs[0], 1e-5, 1e-6);
  EXPECT_TRUE(c.ok) << c.message;
  Tensor ll = lp.detach().requires_grad_();
  Tensor k = F::kl_div(ll, p, {.reduction = "batchmean"});
  EXPECT_TRUE(test::compare_tensors(k, b.outcome(kv).outputs[0], 1e-5, 1e-6).ok);
  c = test::compare_tensors(autograd::grad({k}, {ll})[0], b.outcome(kg).outputs[0], 1e-5, 1e-6);
  EXPECT_TRUE(c.ok) << c.message;
}

TEST(LossCases, ErrorTexts) {
  Tensor x = rn({3, 5}, 11);
  std::string m = error_of<IndexError>([&] { F::cross_entropy(x, tensor<int64_t>({0, 7, 1})); });
  EXPECT_NE(m.find("target 7"), std::string::npos) << m;
  EXPECT_NE(m.find("5 classes"), std::string::npos) << m;
  m = error_of<IndexError>([&] { F::cross_entropy(x, tensor<int64_t>({0, -1, 1})); });
  EXPECT_NE(m.find("target -1"), std::string::npos) << m;
  m = error_of<IndexError>([&] { F::nll_loss(x, tensor<int64_t>({0, 1, 5})); });
  EXPECT_NE(m.find("target 5"), std::string::npos) << m;
  m = error_of<DTypeError>([&] { F::cross_entropy(x, tensor<int64_t>({0, 1, 2}).to(kInt32)); });
  EXPECT_NE(m.find("int32"), std::string::npos) << m;
  EXPECT_NE(m.find("float32"), std::string::npos) << m;
  m = error_of<ShapeError>([&] { F::cross_entropy(x, tensor<int64_t>({0, 1})); });
  EXPECT_NE(m.find("[3]"), std::string::npos) << m;
  EXPECT_NE(m.find("[2]"), std::string::npos) << m;
  m = error_of<ShapeError>([&] { F::cross_entropy(x, rn({3, 4}, 12)); });
  EXPECT_NE(m.find("[3, 5]"), std::string::npos) << m;
  EXPECT_NE(m.find("[3, 4]"), std::string::npos) << m;
  m = error_of<ShapeError>([&] { F::cross_entropy(x, tensor<int64_t>({0, 1, 2}), {.weight = rn({4}, 13)}); });
  EXPECT_NE(m.find("[5]"), std::string::npos) << m;
  m = error_of<ValueError>([&] { F::mse_loss(x, x, {.reduction = "avg"}); });
  EXPECT_NE(m.find("'avg'"), std::string::npos) << m;
  m = error_of<ShapeError>([&] { F::l1_loss(x, rn({5, 3}, 14)); });
  EXPECT_NE(m.find("[5, 3]"), std::string::npos) << m;
}

}  // namespace
