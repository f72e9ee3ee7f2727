// Autocast: every row of the policy table gives the output dtype its class
// promises, guards nest and disable, parameter casts are cached per region,
// gradients reach float32 parameters, and docs/amp.md lists the same table.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "kiln/kiln.h"
#include "kiln/ops/autocast.h"
#include "support/oracle.h"
#include "support/test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

Tensor param(IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, {}, &g).requires_grad_();
}
Tensor data(IntArrayRef shape, uint64_t seed, DType dt = kFloat32) {
  Generator g(seed);
  return randn(shape, {}, &g).to(dt);
}

// max |got - want| / max |want|.
double rel_max(const Tensor& got, const Tensor& want) {
  const NoGradGuard ng;
  const double scale = want.abs().max().to(kFloat64).item<double>();
  return (got - want).abs().max().to(kFloat64).item<double>() / (scale > 0 ? scale : 1.0);
}

// One runner per policy row: builds float32 inputs for lower-precision ops
// (what a model feeds them), bf16 inputs for float32 ops (what a preceding
// lower-precision op hands them) and mixed inputs for promote ops.
using Runner = std::function<Tensor()>;
std::map<std::string, Runner> runners() {
  const DType lp = kBFloat16;
  std::map<std::string, Runner> r;
  r["mm"] = [] { return mm(data({3, 4}, 1), param({4, 5}, 2)); };
  r["bmm"] = [] { return bmm(data({2, 3, 4}, 1), data({2, 4, 5}, 2)); };
  r["matmul"] = [] { return matmul(data({2, 3, 4}, 1), param({4, 5}, 2)); };
  r["linear"] = [] { return linear(data({3, 4}, 1), param({5, 4}, 2), param({5}, 3)); };
  r["conv2d"] = [] { return conv2d(data({1, 2, 5, 5}, 1), param({3, 2, 3, 3}, 2), param({3}, 3)); };
  r["scaled_dot_product_attention"] = [] {
    return nn::functional::scaled_dot_product_attention(data({1, 2, 4, 8}, 1), data({1, 2, 4, 8}, 2),
                                                        data({1, 2, 4, 8}, 3));
  };
  r["softmax"] = [lp] { return data({3, 4}, 1, lp).softmax(1); };
  r["log_softmax"] = [lp] { return data({3, 4}, 1, lp).log_softmax(1); };
  r["logsumexp"] = [lp] { return data({3, 4}, 1, lp).logsumexp({1}); };
  r["norm"] = [lp] { return data({3, 4}, 1, lp).norm(); };
  r["exp"] = [lp] { return data({3, 4}, 1, lp).exp(); };
  r["log"] = [lp] { return data({3, 4}, 1, lp).abs().log(); };
  r["layer_norm"] = [lp] { return nn::LayerNorm({.normalized_shape = {4}}).forward(data({3, 4}, 1, lp)); };
  r["batch_norm"] = [lp] { return nn::BatchNorm2d({.num_features = 2}).forward(data({2, 2, 3, 3}, 1, lp)); };
  r["rms_norm"] = [lp] { return nn::RMSNorm({.normalized_shape = {4}}).forward(data({3, 4}, 1, lp)); };
  r["group_norm"] = [lp] {
    return nn::GroupNorm({.num_groups = 2, .num_channels = 4}).forward(data({2, 4, 3}, 1, lp));
  };
  const auto classes = [] { return tensor<int64_t>({0, 2, 1}); };
  r["cross_entropy"] = [=] { return F::cross_entropy(data({3, 4}, 1, lp), classes()); };
  r["nll_loss"] = [=] { return F::nll_loss(data({3, 4}, 1, lp).log_softmax(1), classes()); };
  r["mse_loss"] = [lp] { return F::mse_loss(data({3, 4}, 1, lp), data({3, 4}, 2)); };
  r["l1_loss"] = [lp] { return F::l1_loss(data({3, 4}, 1, lp), data({3, 4}, 2)); };
  r["smooth_l1_loss"] = [lp] { return F::smooth_l1_loss(data({3, 4}, 1, lp), data({3, 4}, 2)); };
  r["binary_cross_entropy_with_logits"] = [lp] {
    return F::binary_cross_entropy_with_logits(data({3, 4}, 1, lp), rand({3, 4}));
  };
  r["kl_div"] = [lp] { return F::kl_div(data({3, 4}, 1, lp).log_softmax(1), rand({3, 4})); };
  r["cat"] = [lp] { return cat({data({2, 3}, 1, lp), data({2, 3}, 2)}); };
  r["stack"] = [lp] { return stack({data({2, 3}, 1, lp), data({2, 3}, 2)}); };
  return r;
}

TEST(AutocastPolicy, EveryRowGivesItsClassDtype) {
  const auto r = runners();
  for (DType lp : {kBFloat16, kFloat16}) {
    for (const AutocastRule& rule : kAutocastPolicy) {
      SCOPED_TRACE(std::string(rule.name) + " under " + std::string(dtype_name(lp)));
      ASSERT_TRUE(r.count(std::string(rule.name))) << "a policy row without a test runner";
      const AutocastGuard amp(lp);
      const Tensor out = r.at(std::string(rule.name))();
      const DType want = rule.policy == AutocastPolicy::LowerPrecision ? lp : kFloat32;
      EXPECT_EQ(out.dtype(), want);
    }
  }
  EXPECT_EQ(r.size(), kAutocastPolicy.size());
}

TEST(AutocastPolicy, OutsideARegionNothingIsCast) {
  EXPECT_FALSE(autocast_enabled());
  EXPECT_EQ(linear(data({3, 4}, 1), param({5, 4}, 2)).dtype(), kFloat32);
  EXPECT_EQ(data({3, 4}, 1, kBFloat16).softmax(1).dtype(), kBFloat16);
}

TEST(AutocastPolicy, Float64IsNeverNarrowed) {
  const AutocastGuard amp(kBFloat16);
  EXPECT_EQ(mm(data({3, 4}, 1, kFloat64), data({4, 2}, 2, kFloat64)).dtype(), kFloat64);
  EXPECT_EQ(data({3, 4}, 1, kFloat64).softmax(1).dtype(), kFloat64);
}

TEST(AutocastPolicy, MixedLowerPrecisionTypesPromoteToFloat32) {
  const AutocastGuard amp(kBFloat16);
  EXPECT_EQ(cat({data({2}, 1, kBFloat16), data({2}, 2, kFloat16)}).dtype(), kFloat32);
  EXPECT_EQ(cat({data({2}, 1, kBFloat16), data({2}, 2, kBFloat16)}).dtype(), kBFloat16);
}

TEST(AutocastGuard, NestsAndDisablesInARegion) {
  const Tensor x = data({3, 4}, 1), w = param({5, 4}, 2);
  {
    const AutocastGuard outer(kBFloat16);
    EXPECT_EQ(linear(x, w).dtype(), kBFloat16);
    {
      const AutocastGuard off(false);
      EXPECT_FALSE(autocast_enabled());
      EXPECT_EQ(linear(x, w).dtype(), kFloat32);
      {
        const AutocastGuard fp16(kFloat16);
        EXPECT_EQ(linear(x, w).dtype(), kFloat16);
      }
      EXPECT_EQ(linear(x, w).dtype(), kFloat32);
    }
    EXPECT_EQ(autocast_dtype(), kBFloat16);
    EXPECT_EQ(linear(x, w).dtype(), kBFloat16);
  }
  EXPECT_FALSE(autocast_enabled());
  EXPECT_EQ(linear(x, w).dtype(), kFloat32);
}

TEST(AutocastGuard, RejectsAFullPrecisionDtype) {
  EXPECT_THROW({ const AutocastGuard bad(kFloat32); }, DTypeError);
  EXPECT_FALSE(autocast_enabled());
}

TEST(AutocastCache, AWeightUsedTwiceIsCastOnce) {
  const Tensor x = data({3, 4}, 1), w = param({4, 4}, 2);
  reset_autocast_counters();
  {
    const AutocastGuard amp(kBFloat16);
    const Tensor y = linear(linear(x, w), w);
    EXPECT_EQ(autocast_counters().param_casts, 1);
    EXPECT_EQ(autocast_counters().cache_hits, 1);
    // The activation x (no grad) is cast on each use, never cached.
    linear(x, w);
    EXPECT_EQ(autocast_counters().param_casts, 1);
    EXPECT_EQ(autocast_counters().cache_hits, 2);
    {
      const AutocastGuard off(false);  // a nested region keeps the cache
      const AutocastGuard again(kBFloat16);
      linear(x, w);
      EXPECT_EQ(autocast_counters().param_casts, 1);
    }
  }
  // The outermost exit cleared the cache: a new region casts afresh.
  {
    const AutocastGuard amp(kBFloat16);
    linear(x, w);
    EXPECT_EQ(autocast_counters().param_casts, 2);
  }
}

TEST(AutocastCache, AnInPlaceUpdateInvalidatesTheCast) {
  Tensor w = param({4, 4}, 2);
  const Tensor x = data({3, 4}, 1);
  reset_autocast_counters();
  const AutocastGuard amp(kBFloat16);
  const Tensor before = linear(x, w).to(kFloat32);
  {
    const NoGradGuard ng;
    w.mul_(2.0);  // e.g. an optimizer step inside the region bumps the version
  }
  const Tensor after = linear(x, w).to(kFloat32);
  EXPECT_EQ(autocast_counters().param_casts, 2);
  EXPECT_EQ(autocast_counters().cache_hits, 0);
  // Doubling is exact in bf16, so the recast weight gives exactly twice the output.
  EXPECT_TRUE(test::bitwise_equal(after, before * 2.0));
}

TEST(AutocastCache, ANoGradCastDoesNotServeADifferentiableUse) {
  const Tensor x = data({3, 4}, 1), w = param({4, 4}, 2);
  const AutocastGuard amp(kBFloat16);
  {
    const NoGradGuard ng;
    EXPECT_FALSE(linear(x, w).requires_grad());
  }
  const Tensor y = linear(x, w);
  EXPECT_TRUE(y.requires_grad());
  y.sum().backward();
  ASSERT_TRUE(w.grad().defined());
}

TEST(AutocastGrad, GradientsReachFloat32ParametersAndMatchFloat32) {
  const Tensor x = data({8, 16}, 1);
  Tensor w1 = param({32, 16}, 2), w2 = param({4, 32}, 3);
  const Tensor target = tensor<int64_t>({0, 1, 2, 3, 0, 1, 2, 3});
  auto loss_of = [&] { return F::cross_entropy(linear(linear(x, w1).relu(), w2), target); };
  Tensor ref_loss = loss_of();
  ref_loss.backward();
  const Tensor g1 = w1.grad().clone(), g2 = w2.grad().clone();
  w1.mutable_grad() = {};
  w2.mutable_grad() = {};
  Tensor loss;
  {
    const AutocastGuard amp(kBFloat16);
    loss = loss_of();
  }
  EXPECT_EQ(loss.dtype(), kFloat32);
  loss.backward();
  ASSERT_EQ(w1.grad().dtype(), kFloat32);
  ASSERT_EQ(w2.grad().dtype(), kFloat32);
  // bf16 keeps 8 mantissa bits: relative error ~2^-8 per rounding, a few roundings deep.
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 0.02 * std::abs(ref_loss.item<double>()));
  const double rel1 = (w1.grad() - g1).norm().item<double>() / g1.norm().item<double>();
  const double rel2 = (w2.grad() - g2).norm().item<double>() / g2.norm().item<double>();
  EXPECT_LT(rel1, 0.03);
  EXPECT_LT(rel2, 0.03);
  EXPECT_GT(rel1 + rel2, 0.0);  // the bf16 path really ran (it rounds)
}

// linear(x, w, b) inside an autocast region to `dt`.
Tensor linear_under(DType dt, const Tensor& x, const Tensor& w, const Tensor& b = {}) {
  const AutocastGuard amp(dt);
  return linear(x, w, b);
}

// Note [Float32 weight gradients under autocast] (src/ops/linalg.cpp): under
// bf16 autocast a linear records its node against the float32 weight and bias,
// and the weight gradient is the bf16 product's float32 sums, not rounded.
TEST(AutocastGrad, Bf16LinearGivesTheWeightItsUnroundedFloat32Gradient) {
  const Tensor x = data({24, 40}, 1);
  Tensor w = param({12, 40}, 2), b = param({12}, 3);
  const Tensor gout = data({24, 12}, 4, kBFloat16);
  const Tensor y = linear_under(kBFloat16, x, w, b);
  ASSERT_EQ(y.dtype(), kBFloat16);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "LinearBackward0");
  // The weight and bias edges lead straight to their accumulators: no cast node between.
  ASSERT_EQ(y.grad_fn()->next_edges().size(), 3u);
  EXPECT_STREQ(y.grad_fn()->next_edges()[1].function->name(), "AccumulateGrad");
  EXPECT_STREQ(y.grad_fn()->next_edges()[2].function->name(), "AccumulateGrad");
  y.backward(gout);
  ASSERT_EQ(w.grad().dtype(), kFloat32);
  ASSERT_EQ(b.grad().dtype(), kFloat32);
  // The reference: the exact products of the bf16 operands summed in float64.
  // 24 float32 additions of terms of size <= max|g| max|x| bound the error.
  const NoGradGuard ng;
  const Tensor g64 = gout.to(kFloat64), x64 = x.to(kBFloat16).to(kFloat64);
  const Tensor want = g64.t().matmul(x64);
  const double bound = 24 * std::ldexp(1.0, -24) * g64.abs().max().item<double>() * x64.abs().max().item<double>() * 24;
  EXPECT_LE((w.grad().to(kFloat64) - want).abs().max().item<double>(), bound);
  // Not rounded to bf16: some entries carry bits a bf16 cannot hold.
  EXPECT_FALSE(w.grad().equal(w.grad().to(kBFloat16).to(kFloat32)));
  // The bias gradient is torch's: the bf16 row sum, widened.
  EXPECT_TRUE(test::bitwise_equal(b.grad(), gout.sum(0).to(kFloat32)));
}

// Against torch's autocast (the oracle): torch casts x, w and b to bf16, its
// weight gradient is the bf16 product rounded to bf16 and widened by the
// cast's backward. kiln's differs from it by at most half a bf16 ulp (plus
// float32 summation order), is closer to the float64 sum of the same bf16
// operands, and the bias gradient is torch's.
TEST(AutocastGrad, Bf16LinearGradientsAgainstTorchAutocast) {
  const Tensor x = data({64, 48}, 11);
  Tensor w = param({20, 48}, 12), b = param({20}, 13);
  const Tensor gout = data({64, 20}, 14, kBFloat16);
  linear_under(kBFloat16, x, w, b).backward(gout);
  test::OracleBatch batch;
  batch.add_grad("autocast_linear",
                 "F.linear(x0.to(torch.bfloat16), x1.to(torch.bfloat16), x2.to(torch.bfloat16))",
                 {x, w.detach(), b.detach()}, {1, 2}, {gout});
  batch.run();
  const test::OracleOutcome& r = batch.outcome(0);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.outputs.size(), 2u);
  const Tensor torch_gw = r.outputs[0].to(kFloat64), torch_gb = r.outputs[1];
  ASSERT_EQ(r.outputs[0].dtype(), kFloat32);
  const NoGradGuard ng;
  const Tensor got = w.grad().to(kFloat64);
  const Tensor want = gout.to(kFloat64).t().matmul(x.to(kBFloat16).to(kFloat64));
  const double scale = torch_gw.abs().max().item<double>();
  // Half a bf16 ulp of each element (2^-8 of its magnitude bounds it), and float32 order.
  auto within_half_ulp = [&](const Tensor& t, const Tensor& ref) {
    return (t - ref).abs().le(ref.abs() * std::ldexp(1.0, -8) + 1e-6 * scale).all().item<bool>();
  };
  // torch sums in float32 where oneDNN has bf16 kernels (AVX-512); on an
  // AVX2-only CPU torch 1.13's own bf16 gemm adds in bf16, and its gradient is
  // then further from the float64 sum than half an ulp: only float64 judges.
  if (within_half_ulp(torch_gw, want)) {
    EXPECT_TRUE(within_half_ulp(got, torch_gw)) << "max |kiln - torch| " << (got - torch_gw).abs().max().item<double>();
  }
  EXPECT_TRUE(within_half_ulp(got, want)) << "max |kiln - float64| " << (got - want).abs().max().item<double>();
  EXPECT_LT((got - want).abs().max().item<double>(), (torch_gw - want).abs().max().item<double>());
  EXPECT_TRUE(test::bitwise_equal(b.grad(), torch_gb)) << "the bias gradient is torch's bf16 row sum, widened";
}

TEST(AutocastGrad, Bf16LinearGradientsMatchWhereTheInputIsBf16AndTheThreadsDiffer) {
  // A bf16 input (an earlier op's output) takes the same path; the weight
  // gradient of a deep product (split across threads on two) agrees within
  // float32 rounding whatever the thread count.
  // [256, 256] over 2048 rows: on two threads each thread sums its half of
  // the rows (Note [Shares of a product on one thread each]).
  const Tensor x = data({2048, 256}, 5, kBFloat16).requires_grad_();
  Tensor w = param({256, 256}, 6);
  const Tensor gout = data({2048, 256}, 7, kBFloat16);
  auto grads = [&](int threads) {
    const int saved = get_num_threads();
    set_num_threads(threads);
    w.mutable_grad() = {};
    x.mutable_grad() = {};
    linear_under(kBFloat16, x, w).backward(gout);
    set_num_threads(saved);
    return std::pair{w.grad().clone(), x.grad().clone()};
  };
  const auto [w1, x1] = grads(1);
  const auto [w2, x2] = grads(2);
  ASSERT_EQ(w1.dtype(), kFloat32);
  ASSERT_EQ(x1.dtype(), kBFloat16);
  EXPECT_LT(rel_max(w2, w1), 1e-5);
  const NoGradGuard ng;
  const Tensor want = gout.to(kFloat64).t().matmul(x.to(kFloat64));
  EXPECT_LT(rel_max(w1.to(kFloat64), want), 1e-5);
}

TEST(AutocastGrad, Bf16LinearOverAnEmptyBatchGivesAZeroFloat32WeightGradient) {
  // No rows: the weight gradient is an empty sum, written as float32 zeros.
  Tensor w = param({5, 7}, 2);
  const Tensor y = linear_under(kBFloat16, data({0, 7}, 1), w);
  // A freed block of nonzero floats of the gradient's size, which the allocator may hand back.
  for (int i = 0; i < 4; ++i) full({5, 7}, 3.0).sum();
  y.backward(zeros({0, 5}, TensorOptions(kBFloat16)));
  ASSERT_EQ(w.grad().dtype(), kFloat32);
  EXPECT_TRUE(w.grad().equal(zeros({5, 7})));
}

TEST(AutocastGrad, Float16LinearKeepsTheCastNodes) {
  Tensor w = param({3, 8}, 2);
  const Tensor y = linear_under(kFloat16, data({4, 8}, 1), w);
  ASSERT_EQ(y.dtype(), kFloat16);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->next_edges()[1].function->name(), "ToCopyBackward0");
  y.sum().backward();
  EXPECT_EQ(w.grad().dtype(), kFloat32);
}

TEST(AutocastGrad, Bf16LinearDifferentiatesTwice) {
  // create_graph: the weight gradient is the differentiable bf16 product, widened.
  Tensor w = param({4, 5}, 2);
  const Tensor y = linear_under(kBFloat16, data({6, 5}, 1), w);
  const Tensor gw = autograd::grad({y.to(kFloat32).pow(2).sum()}, {w}, {}, std::nullopt, /*create_graph=*/true)[0];
  ASSERT_EQ(gw.dtype(), kFloat32);
  ASSERT_TRUE(gw.requires_grad());
  gw.sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), kFloat32);
  EXPECT_GT(w.grad().abs().sum().item<double>(), 0.0);
}

// Calling backward() inside the autocast region (a common PyTorch habit) must not
// change the gradients: backward runs in the dtypes the forward recorded.
TEST(AutocastGrad, BackwardInsideTheRegionEqualsBackwardOutside) {
  const Tensor x = data({8, 16}, 1);
  Tensor w1 = param({32, 16}, 2), w2 = param({4, 32}, 3);
  const Tensor target = tensor<int64_t>({0, 1, 2, 3, 0, 1, 2, 3});
  auto loss_of = [&] { return F::cross_entropy(linear(linear(x, w1).relu(), w2), target); };
  {
    const AutocastGuard amp(kBFloat16);
    Tensor loss = loss_of();
    loss.backward();  // inside
  }
  const Tensor g1 = w1.grad().clone(), g2 = w2.grad().clone();
  w1.mutable_grad() = {};
  w2.mutable_grad() = {};
  Tensor loss;
  {
    const AutocastGuard amp(kBFloat16);
    loss = loss_of();
  }
  loss.backward();  // outside
  ASSERT_EQ(g1.dtype(), kFloat32);
  EXPECT_TRUE(w1.grad().equal(g1));
  EXPECT_TRUE(w2.grad().equal(g2));
}

// Under autocast a BatchNorm runs in float32 with its ReLU and residual add still fused
// (forward_relu / forward_add_relu, what ResNet's blocks call): the same values and gradients as
// the float32 batch norm followed by the add and ReLU as ops of their own, a bf16 residual
// joining as the add's type promotion would (a bf16 value is exact in float32).
TEST(AutocastBatchNorm, FusedReluAndResidualEqualTheUnfusedOps) {
  for (const DType residual_dtype : {kFloat32, kBFloat16}) {
    nn::BatchNorm2d fused({.num_features = 3}), plain({.num_features = 3});
    const Tensor x0 = data({4, 3, 5, 5}, 11, kBFloat16), r0 = data({4, 3, 5, 5}, 12, residual_dtype);
    Tensor x1 = x0.clone().requires_grad_(), r1 = r0.clone().requires_grad_();
    Tensor x2 = x0.clone().requires_grad_(), r2 = r0.clone().requires_grad_();
    Tensor a1, b1, a2, b2;
    {
      const AutocastGuard amp(kBFloat16);
      a1 = fused.forward_relu(x1);
      b1 = fused.forward_add_relu(x1, r1);
      const Tensor y = plain.forward(x2);
      a2 = y.relu();
      b2 = (plain.forward(x2) + r2.to(kFloat32)).relu();
    }
    ASSERT_EQ(a1.dtype(), kFloat32);
    ASSERT_EQ(b1.dtype(), kFloat32);
    EXPECT_LE(rel_max(a1, a2), 1e-6);
    EXPECT_LE(rel_max(b1, b2), 1e-6);
    (a1.sum() + (b1 * b1).sum()).backward();
    (a2.sum() + (b2 * b2).sum()).backward();
    EXPECT_EQ(x1.grad().dtype(), kBFloat16);
    EXPECT_LE(rel_max(x1.grad().to(kFloat32), x2.grad().to(kFloat32)), 1e-2);
    EXPECT_LE(rel_max(r1.grad().to(kFloat32), r2.grad().to(kFloat32)), 1e-2);
    EXPECT_LE(rel_max(fused.weight.grad(), plain.weight.grad()), 1e-5);
    EXPECT_TRUE(fused.running_mean.allclose(plain.running_mean, 1e-6, 1e-7));
  }
}

// What the engine itself runs (here a gradient hook that calls matmul) is not autocast
// either: without the engine's suspension the hook's product would round to bf16.
TEST(AutocastGrad, GradientHooksRunInFloat32InsideTheRegion) {
  Tensor x = data({4, 8}, 5).requires_grad_();
  const Tensor eye = kiln::eye(8);
  x.register_hook([eye](const Tensor& g) { return g.matmul(eye); });
  {
    const AutocastGuard amp(kBFloat16);
    Tensor loss = (x * x).sum();  // float32: mul and sum are not lower-precision ops
    loss.backward();
  }
  ASSERT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(x.grad().equal(x.detach() * 2));  // exact: g·I in float32
}

TEST(AutocastDocs, DocsAmpMdListsThePolicyTable) {
  const std::string doc = test::read_file(test::source_dir() + "/docs/amp.md");
  for (const AutocastRule& rule : kAutocastPolicy) {
    const std::string row = "| `" + std::string(rule.name) + "` | " + std::string(autocast_policy_name(rule.policy)) + " |";
    EXPECT_NE(doc.find(row), std::string::npos) << "docs/amp.md lacks the row " << row;
  }
  // No stale rows: as many policy rows in the doc as in the table.
  size_t rows = 0;
  for (size_t at = doc.find("| `"); at != std::string::npos; at = doc.find("| `", at + 1))
    if (at == 0 || doc[at - 1] == '\n') ++rows;
  EXPECT_EQ(rows, kAutocastPolicy.size());
}

}  // namespace
}  // namespace kiln
