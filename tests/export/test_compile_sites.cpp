// kiln::compile at the host-side capture sites: factories, indexing, one_hot, cross_entropy
// (ignored targets, weights, smoothing), prod, batch norm running stats, GradScaler, and the
// graph breaks that name what a replay cannot repeat.
#include <gtest/gtest.h>


#include "kiln/amp/grad_scaler.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/compile.h"
#include "kiln/models/mlp.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/loss.h"
#include "kiln/ops/batch_norm.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

void same(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(a, b)) << what << " differs\n" << a << "\n" << b;
}

std::string reasons(const CompiledFunction& f) {
  std::string s;
  for (const auto& b : f.stats().graph_breaks) s += b.reason + "; ";
  return s;
}

// Replays fn on each input set and compares with eager fn.
void check(const CompiledFunction::Fn& fn, const std::vector<std::vector<Tensor>>& inputs, int want_replays) {
  auto step = compile(fn);
  for (size_t k = 0; k < inputs.size(); ++k) {
    const auto e = fn(inputs[k]);
    // Churn the allocator between calls so stale pool blocks would show.
    const auto c = step(inputs[k]);
    ASSERT_EQ(e.size(), c.size());
    for (size_t i = 0; i < e.size(); ++i) same(e[i], c[i], "call " + std::to_string(k) + " output " + std::to_string(i));
  }
  EXPECT_TRUE(step.stats().graph_breaks.empty()) << reasons(step);
  EXPECT_EQ(step.stats().replays, want_replays) << step.explain();
}

TEST(CompileSites, FactoriesReplay) {
  NoGradGuard ng;
  auto fn = [](const std::vector<Tensor>& in) {
    Tensor junk = in[0] * 7.0;  // freed: its block is reused by the factories below
    junk = Tensor();
    Tensor a = arange(0, 6, 1, kFloat32);
    Tensor l = linspace(0.0, 1.0, 6, kFloat32);
    Tensor e = eye(2, 3, kFloat32).reshape({6});
    Tensor t = tensor(std::vector<float>{1, 2, 3, 4, 5, 6});
    Tensor ti = tensor(std::vector<int>{1, 2, 3, 4, 5, 6}).to(kFloat32);
    return std::vector<Tensor>{in[0] + a + l + e + t + ti};
  };
  check(fn, {{randn({6})}, {randn({6})}, {randn({6})}}, 2);
}

TEST(CompileSites, IndexAndIndexPutFollowNewIndices) {
  NoGradGuard ng;
  auto fn = [](const std::vector<Tensor>& in) {
    Tensor x = zeros({5, 3});
    x.index_put_({in[1]}, in[0]);
    Tensor y = arange(0, 15, 1, kFloat32).reshape({5, 3});
    y.index_put_({in[1]}, in[0], /*accumulate=*/true);
    Tensor z = y.index({in[1]});
    Tensor w = y.index({Tensor(), in[2]});
    return std::vector<Tensor>{x, y, z, w};
  };
  check(fn,
        {{randn({2, 3}), tensor(std::vector<int64_t>{0, 3}), tensor(std::vector<int64_t>{2, 0})},
         {randn({2, 3}), tensor(std::vector<int64_t>{4, -1}), tensor(std::vector<int64_t>{1, 1})},
         {randn({2, 3}), tensor(std::vector<int64_t>{1, 2}), tensor(std::vector<int64_t>{-1, 0})}},
        2);
}

TEST(CompileSites, BadIndexOnReplayRaises) {
  NoGradGuard ng;
  auto step = compile([](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].index({in[1]})}; });
  step({randn({4}), tensor(std::vector<int64_t>{1, 2})});
  step({randn({4}), tensor(std::vector<int64_t>{3, 0})});
  EXPECT_THROW(step({randn({4}), tensor(std::vector<int64_t>{3, 9})}), IndexError);
}

TEST(CompileSites, MaskIndexingBreaks) {
  NoGradGuard ng;
  auto step = compile([](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0].index({in[0].gt(0)})}; });
  step({randn({6})});
  ASSERT_EQ(step.stats().graph_breaks.size(), 1u) << reasons(step);
  EXPECT_NE(reasons(step).find("boolean mask"), std::string::npos);
}

TEST(CompileSites, OneHot) {
  NoGradGuard ng;
  check([](const std::vector<Tensor>& in) { return std::vector<Tensor>{one_hot(in[0], 5)}; },
        {{tensor(std::vector<int64_t>{0, 3})}, {tensor(std::vector<int64_t>{4, 1})}}, 1);
  auto step = compile([](const std::vector<Tensor>& in) { return std::vector<Tensor>{one_hot(in[0])}; });
  step({tensor(std::vector<int64_t>{0, 3})});
  EXPECT_NE(reasons(step).find("one_hot"), std::string::npos) << reasons(step);
}

TEST(CompileSites, CrossEntropyFollowsIgnoredTargetsWeightsAndSmoothing) {
  for (auto red : {ops::LossReduction::Mean, ops::LossReduction::Sum, ops::LossReduction::None}) {
    for (double ls : {0.0, 0.1}) {
      manual_seed(5);
      const Tensor w0 = randn({4}, TensorOptions(kFloat32).requires_grad(true));
      const Tensor cw = rand({4}) + 0.5;
      auto fn = [w0, cw, red, ls](const std::vector<Tensor>& in) {
        if (w0.grad().defined()) w0.mutable_grad() = Tensor();
        Tensor logits = in[0] * w0;
        Tensor loss = ops::cross_entropy(logits, in[1], cw, 1, red, ls);
        (red == ops::LossReduction::None ? loss.sum() : loss).backward();
        return std::vector<Tensor>{loss.detach(), w0.grad().detach().clone()};
      };
      auto step = compile(fn);
      const std::vector<std::vector<Tensor>> ins = {
          {randn({3, 4}), tensor(std::vector<int64_t>{0, 2, 3})},
          {randn({3, 4}), tensor(std::vector<int64_t>{1, 1, 3})},  // two ignored
          {randn({3, 4}), tensor(std::vector<int64_t>{1, 2, 1})},
          {randn({3, 4}), tensor(std::vector<int64_t>{1, 1, 1})}};  // all ignored
      for (size_t k = 0; k < ins.size(); ++k) {
        const auto e = fn(ins[k]);
        const auto c = step(ins[k]);
        same(e[0], c[0], "loss " + std::to_string(k));
        same(e[1], c[1], "grad " + std::to_string(k));
      }
      EXPECT_TRUE(step.stats().graph_breaks.empty()) << reasons(step);
      EXPECT_EQ(step.stats().replays, 3);
    }
  }
}

TEST(CompileSites, ProdBackwardWithZerosLater) {
  const Tensor w = ones({4}, TensorOptions(kFloat32).requires_grad(true));
  auto fn = [w](const std::vector<Tensor>& in) {
    if (w.grad().defined()) w.mutable_grad() = Tensor();
    (w * in[0]).prod().backward();
    return std::vector<Tensor>{w.grad().detach().clone()};
  };
  check(fn,
        {{tensor(std::vector<float>{1, 2, 3, 4})},
         {tensor(std::vector<float>{1, 0, 3, 4})},
         {tensor(std::vector<float>{0, 0, 3, 4})},
         {tensor(std::vector<float>{2, 2, 3, 4})}},
        3);
}

TEST(CompileSites, BatchNormRunningStats) {
  NoGradGuard ng;
  Tensor rm = zeros({3}), rv = ones({3});
  Tensor rm2 = zeros({3}), rv2 = ones({3});
  auto make = [](Tensor& m, Tensor& v) {
    return [&m, &v](const std::vector<Tensor>& in) {
      ops::batch_norm_update_running_stats(m, v, in[0].mean({0}), in[0].var({0}, 0), 0.1, 4);
      return std::vector<Tensor>{in[0].sum()};
    };
  };
  auto eager = make(rm, rv);
  auto step = compile(make(rm2, rv2));
  for (int i = 0; i < 4; ++i) {
    const Tensor x = randn({4, 3});
    eager({x});
    step({x});
    same(rm, rm2, "running_mean");
    same(rv, rv2, "running_var");
  }
  EXPECT_EQ(step.stats().replays, 3);
}

TEST(CompileSites, GradScalerScaleFollowsUpdates) {
  amp::GradScaler sc(amp::GradScalerOptions{.init_scale = 4.0});
  NoGradGuard ng;
  auto step = compile([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{sc.scale(in[0])}; });
  const Tensor x = ones({2});
  for (double s : {4.0, 8.0, 0.5}) {
    sc.update(s);
    same(step({x})[0], x * s, "scaled");
  }
  EXPECT_EQ(step.stats().replays, 2);
}

TEST(CompileSites, RandomNumbersAreDrawnAfreshOnEveryReplay) {
  // A replay reserves new Philox blocks as the eager call would: the same seed gives the
  // same numbers call by call, and the generators end at the same offsets.
  NoGradGuard ng;
  Generator own(9);
  auto fn = [&own](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{in[0] + rand({64}),
                               randn({3}, kFloat64),
                               randint(0, 9, {4}),
                               randperm(6),
                               rand({2, 3}, kBFloat16),
                               nn::F::dropout(in[0], 0.4),
                               randn({7}, {}, &own)};
  };
  auto run = [&](const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& f) {
    manual_seed(4);
    own.manual_seed(9);
    std::vector<std::vector<Tensor>> calls;
    for (int k = 0; k < 3; ++k) {
      std::vector<Tensor> out;
      for (const Tensor& t : f({full({64}, 1.0f)})) out.push_back(t.clone());  // compiled outputs are static
      calls.push_back(out);
    }
    return std::make_pair(calls, std::make_pair(default_generator().get_state(), own.get_state()));
  };
  auto step = compile(fn);
  const auto [want, want_states] = run(fn);
  const auto [got, got_states] = run([&](const std::vector<Tensor>& in) { return step(in); });
  for (size_t k = 0; k < want.size(); ++k)
    for (size_t i = 0; i < want[k].size(); ++i)
      same(want[k][i], got[k][i], "call " + std::to_string(k) + " output " + std::to_string(i));
  EXPECT_EQ(want_states.first, got_states.first);
  EXPECT_EQ(want_states.second, got_states.second);
  for (size_t i = 0; i < want[0].size(); ++i)
    EXPECT_FALSE(bitwise_equal(got[1][i], got[2][i])) << "output " << i << " repeated its numbers on replay";
  EXPECT_TRUE(step.stats().graph_breaks.empty()) << reasons(step);
  EXPECT_EQ(step.stats().replays, 2) << step.explain();
}

TEST(CompileSites, ForwardHooksBreakUnlessDeclaredTensorOpsOnly) {
  manual_seed(6);
  models::MLP m(models::MLPOptions{.in_features = 6, .hidden = {8}, .out_features = 3});
  NoGradGuard ng;
  const Tensor x = randn({4, 6});
  auto run = [&m](const std::vector<Tensor>& in) { return std::vector<Tensor>{m(in[0])}; };
  // A hook with host state: a replay would not count, so every call runs split at the hook.
  int calls = 0;
  HookHandle counting = m.register_forward_hook([&calls](nn::Module&, const Tensor&, const Tensor&) {
    ++calls;
    return Tensor();
  });
  auto counted = compile(run);
  for (int k = 0; k < 3; ++k) counted({x});
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(counted.stats().replays, 0);
  EXPECT_NE(reasons(counted).find("a forward hook on MLP runs host code"), std::string::npos) << reasons(counted);
  counting.remove();
  // A hook that only computes tensors replays with the step.
  HookHandle doubling = m.register_forward_hook(
      [](nn::Module&, const Tensor&, const Tensor& y) { return y * 2.0; }, nn::Module::HookReplay::TensorOpsOnly);
  check(run, {{x}, {randn({4, 6})}, {randn({4, 6})}}, 2);
  doubling.remove();
}

TEST(CompileSites, BreaksAreNamed) {
  NoGradGuard ng;
  auto expect_break = [](std::function<Tensor(const Tensor&)> body, const std::string& what) {
    auto step = compile([body](const std::vector<Tensor>& in) { return std::vector<Tensor>{body(in[0])}; });
    step({randn({3})});
    EXPECT_NE(reasons(step).find(what), std::string::npos) << what << ": " << reasons(step);
  };
  expect_break([](const Tensor& x) { return x * x.sum().item<float>(); }, "Tensor.item()");
  expect_break([](const Tensor& x) { return x.equal(x) ? x : -x; }, "torch.equal");
  expect_break([](const Tensor& x) { return x.allclose(x) ? x : -x; }, "torch.allclose");
  expect_break([](const Tensor& x) { (void)x.to_string(); return x; }, "printing a tensor");
  expect_break([](const Tensor& x) { return masked_fill(x, x.gt(0), x.sum()); }, "masked_fill");
}

}  // namespace
}  // namespace kiln::test
