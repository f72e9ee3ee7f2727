// nn::checkpoint / checkpoint_sequential and the zoo's checkpointing policies.
// The oracle is the same model without checkpointing: with the same seed, the
// gradients (parameters and inputs) must be BITWISE identical, dropout
// included (the recomputation replays the default Generator), and the state a
// forward updates (BatchNorm's running statistics, the Generator) must end the
// step the same.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/allocator.h"
#include "kiln/core/autocast.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/gpt.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/nn/checkpoint.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"

using namespace kiln;

namespace {

::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return ::testing::AssertionFailure() << "one tensor is undefined";
  if (!a.defined()) return ::testing::AssertionSuccess();
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "shape/dtype " << a.sizes() << " vs " << b.sizes();
  Tensor x = a.contiguous(), y = b.contiguous();
  if (std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.nbytes())) != 0)
    return ::testing::AssertionFailure() << "values differ (max |a-b| = "
                                         << (x.to(kFloat64) - y.to(kFloat64)).abs().max().item<double>() << ")";
  return ::testing::AssertionSuccess();
}

struct Step {
  std::vector<Tensor> grads;  // parameters in order, then the input's
  std::vector<Tensor> buffers;
  GeneratorState rng_after;
  Tensor loss;
};

// One seeded training step of `model` on `make_loss`; returns every gradient.
Step run_step(nn::Module& model, const std::function<Tensor(Tensor&)>& make_loss, bool input_grad) {
  model.zero_grad();
  manual_seed(1234);
  Tensor input;
  Tensor loss = make_loss(input);
  loss.backward();
  Step s;
  s.loss = loss.detach();
  for (const Tensor& p : model.parameters()) s.grads.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
  if (input_grad) s.grads.push_back(input.grad().clone());
  for (const Tensor& b : model.buffers()) s.buffers.push_back(b.defined() ? b.clone() : Tensor());
  s.rng_after = default_generator().get_state();
  return s;
}

void expect_same_step(const Step& a, const Step& b) {
  EXPECT_TRUE(bitwise_equal(a.loss, b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined()) << "gradient " << i << " missing";
    EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << "gradient " << i;
  }
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (size_t i = 0; i < a.buffers.size(); ++i) EXPECT_TRUE(bitwise_equal(a.buffers[i], b.buffers[i])) << "buffer " << i;
  EXPECT_EQ(a.rng_after, b.rng_after);
}

models::GPTOptions small_gpt() {
  models::GPTOptions o;
  o.vocab_size = 32;
  o.block_size = 16;
  o.n_layer = 3;
  o.n_head = 2;
  o.n_embd = 32;
  o.dropout = 0.1;
  return o;
}

}  // namespace

TEST(Checkpoint, GPTGradientsBitwiseWithDropout) {
  manual_seed(0);
  models::GPT gpt(small_gpt());
  gpt.train();
  Tensor idx = randint(0, 32, {2, 16}, TensorOptions(kInt64));
  Tensor tgt = randint(0, 32, {2, 16}, TensorOptions(kInt64));
  auto loss = [&](Tensor&) { return gpt.loss(idx, tgt); };
  gpt.checkpointing = nn::CheckpointPolicy::none();
  Step plain = run_step(gpt, loss, false);
  for (int64_t k : {1, 2}) {  // 3 layers: blocks 0 and 1 checkpointed alone, or 0-1 together
    gpt.checkpointing = nn::CheckpointPolicy::every_k(k);
    Step ck = run_step(gpt, loss, false);
    SCOPED_TRACE("every " + std::to_string(k));
    expect_same_step(plain, ck);
  }
  // Dropout did act: another seed gives another loss.
  manual_seed(99);
  EXPECT_FALSE(bitwise_equal(gpt.loss(idx, tgt).detach(), plain.loss));
}

TEST(Checkpoint, GPTAutogradGradPath) {
  manual_seed(0);
  models::GPT gpt(small_gpt());
  Tensor idx = randint(0, 32, {2, 16}, TensorOptions(kInt64));
  Tensor tgt = randint(0, 32, {2, 16}, TensorOptions(kInt64));
  Step plain = run_step(gpt, [&](Tensor&) { return gpt.loss(idx, tgt); }, false);
  gpt.zero_grad();
  gpt.checkpointing = nn::CheckpointPolicy::blocks();
  manual_seed(1234);
  std::vector<Tensor> params = gpt.parameters();
  TensorList g = autograd::grad({gpt.loss(idx, tgt)}, params);
  ASSERT_EQ(g.size(), plain.grads.size());
  for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(bitwise_equal(g[i], plain.grads[i])) << "parameter " << i;
  for (const Tensor& p : params) EXPECT_FALSE(p.grad().defined()) << "autograd::grad must not touch .grad";
}

namespace {
// Identity blocks, a downsample block that blocks() splits (layer2.0) and a
// downsample block that runs last, plainly (layer3.0).
models::ResNetOptions small_resnet_options() {
  models::ResNetOptions o;
  o.widths = {8, 16, 16};
  o.blocks = {2, 1, 1};
  o.stem_channels = 8;
  return o;
}
}  // namespace

TEST(Checkpoint, ResNetGradientsAndRunningStatsBitwise) {
  manual_seed(0);
  models::ResNet net(small_resnet_options());
  net.train();
  Tensor x0 = randn({2, 3, 8, 8});
  Tensor y = randint(0, 10, {2}, TensorOptions(kInt64));
  auto fresh_stats = [&] {
    NoGradGuard ng;
    for (Tensor& b : net.buffers()) b.is_floating_point() ? (void)b.copy_(zeros_like(b)) : (void)b.zero_();
  };
  // With the input requiring grad, and without (the usual image batch: the stem's segment then has
  // only parameters on its boundary).
  for (bool input_grad : {true, false}) {
    SCOPED_TRACE(input_grad ? "input requires grad" : "input requires no grad");
    auto loss = [&](Tensor& in) {
      in = input_grad ? x0.clone().requires_grad_() : x0.clone();
      return nn::functional::cross_entropy(net(in), y);
    };
    net.checkpointing = nn::CheckpointPolicy::none();
    fresh_stats();
    Step plain = run_step(net, loss, input_grad);
    for (int64_t k : {1, 2, 3}) {
      fresh_stats();
      net.checkpointing = nn::CheckpointPolicy::every_k(k);
      Step ck = run_step(net, loss, input_grad);
      SCOPED_TRACE("every " + std::to_string(k));
      expect_same_step(plain, ck);
      // Two steps: the running statistics keep counting each batch once.
      Step ck2 = run_step(net, loss, input_grad);
      net.checkpointing = nn::CheckpointPolicy::none();
      fresh_stats();
      run_step(net, loss, input_grad);
      Step plain2 = run_step(net, loss, input_grad);
      expect_same_step(plain2, ck2);
    }
  }
}

namespace {
// How many checkpointed segments the graph of `loss` holds (its CheckpointBackward nodes).
int64_t count_checkpoint_nodes(const Tensor& loss) {
  int64_t n = 0;
  std::vector<const autograd::Node*> stack{loss.grad_fn()};
  std::set<const autograd::Node*> seen{stack[0]};
  while (!stack.empty()) {
    const autograd::Node* node = stack.back();
    stack.pop_back();
    if (std::string(node->name()) == "CheckpointBackward") ++n;
    for (const autograd::Edge& e : node->next_edges()) {
      if (e.is_valid() && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  return n;
}
}  // namespace

TEST(Checkpoint, ResNetSegments) {
  manual_seed(0);
  models::ResNet net(small_resnet_options());
  net.train();
  Tensor x = randn({2, 3, 8, 8});
  auto segments = [&](nn::CheckpointPolicy p) {
    net.checkpointing = p;
    return count_checkpoint_nodes(net(x).sum());
  };
  EXPECT_EQ(segments(nn::CheckpointPolicy::none()), 0);
  // stem; layer1.0; layer1.1; layer2.0 as conv1, downsample, conv2; layer3.0 (last) plain.
  EXPECT_EQ(segments(nn::CheckpointPolicy::blocks()), 6);
  // stem; layer1.0-layer1.1; layer2.0-layer3.0 is the last run: plain.
  EXPECT_EQ(segments(nn::CheckpointPolicy::every_k(2)), 2);
  {
    const NoGradGuard no_grad;
    net.checkpointing = nn::CheckpointPolicy::blocks();
    EXPECT_FALSE(net(x).requires_grad());
  }
}

TEST(Checkpoint, ResNetKeepsFewerActivations) {
  // The resnet workload of bench/WORKLOADS.md (bench/micro/bench_checkpoint.cpp measures it).
  manual_seed(0);
  models::ResNet net;
  net.train();
  Tensor x = randn({32, 3, 32, 32});
  Tensor y = randint(0, 10, {32}, TensorOptions(kInt64));
  auto peak = [&](nn::CheckpointPolicy p) {
    net.checkpointing = p;
    net.zero_grad();
    memory::reset_peak_stats();
    const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
    nn::functional::cross_entropy(net(x), y).backward();
    return memory::stats()[MemoryCategory::Activation].peak_bytes - before;
  };
  const int64_t plain = peak(nn::CheckpointPolicy::none());
  const int64_t blocks = peak(nn::CheckpointPolicy::blocks());
  // Measured 16.0 of 28.6 MiB (56 %); docs/memory.md says why it is not 40 %.
  EXPECT_LT(blocks, plain * 6 / 10) << "plain " << plain << " blocks " << blocks;
  std::printf("resnet activation peak: plain %lld, blocks %lld\n", static_cast<long long>(plain),
              static_cast<long long>(blocks));
}

TEST(Checkpoint, ViTGradientsBitwiseWithDropout) {
  manual_seed(0);
  models::ViTOptions o;
  o.depth = 3;
  o.dropout = 0.1;
  models::ViT vit(o);
  vit.train();
  Tensor x0 = randn({2, 1, 28, 28});
  Tensor y = randint(0, 10, {2}, TensorOptions(kInt64));
  auto loss = [&](Tensor& in) {
    in = x0.clone().requires_grad_();
    return nn::functional::cross_entropy(vit(in), y);
  };
  Step plain = run_step(vit, loss, true);
  vit.checkpointing = nn::CheckpointPolicy::blocks();
  expect_same_step(plain, run_step(vit, loss, true));
}

TEST(Checkpoint, InputsThatNeedNoGradStillGiveParametersGradients) {
  manual_seed(0);
  nn::Linear lin({.in_features = 4, .out_features = 3});
  Tensor x = randn({5, 4});  // requires no grad
  auto f = [&](const Tensor& t) { return nn::functional::dropout(lin(t).tanh(), 0.3, true); };
  manual_seed(7);
  f(x).sum().backward();
  Tensor gw = lin.weight.grad().clone(), gb = lin.bias.grad().clone();
  lin.zero_grad();
  manual_seed(7);
  Tensor out = nn::checkpoint(f, x);
  ASSERT_TRUE(out.requires_grad());
  EXPECT_STREQ(out.grad_fn()->name(), "CheckpointBackward");
  out.sum().backward();
  EXPECT_TRUE(bitwise_equal(lin.weight.grad(), gw));
  EXPECT_TRUE(bitwise_equal(lin.bias.grad(), gb));
}

TEST(Checkpoint, NothingNeedsGradRunsPlain) {
  Tensor x = randn({3});
  Tensor y = nn::checkpoint([](const Tensor& t) { return t.exp(); }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(bitwise_equal(y, x.exp()));
}

TEST(Checkpoint, NoGradGuardJustRunsFn) {
  Tensor x = randn({3, 2}).requires_grad_();
  int calls = 0;
  Tensor y;
  {
    NoGradGuard ng;
    y = nn::checkpoint(
        [&](const Tensor& t) {
          ++calls;
          return (t * 2).sin();
        },
        x);
  }
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(bitwise_equal(y, (x.detach() * 2).sin()));
}

TEST(Checkpoint, NestedCheckpoints) {
  manual_seed(0);
  nn::Linear a({.in_features = 6, .out_features = 6}), b({.in_features = 6, .out_features = 6});
  Tensor x0 = randn({4, 6});
  auto inner = [&](const Tensor& t) { return nn::functional::dropout(b(t).relu(), 0.25, true); };
  auto outer_plain = [&](const Tensor& t) { return inner(nn::functional::dropout(a(t).tanh(), 0.25, true)) * t; };
  auto outer_ck = [&](const Tensor& t) {
    return nn::checkpoint(inner, nn::functional::dropout(a(t).tanh(), 0.25, true)) * t;
  };
  auto grads = [&](const std::function<Tensor(const Tensor&)>& f) {
    a.zero_grad();
    b.zero_grad();
    Tensor x = x0.clone().requires_grad_();
    manual_seed(5);
    f(x).pow(2).sum().backward();
    return std::vector<Tensor>{x.grad(), a.weight.grad(), a.bias.grad(), b.weight.grad(), b.bias.grad()};
  };
  auto want = grads(outer_plain);
  int inner_runs = 0;
  auto got = grads([&](const Tensor& x) {
    return nn::checkpoint(
        [&](const Tensor& t) {
          ++inner_runs;
          return outer_ck(t);
        },
        x);
  });
  EXPECT_EQ(inner_runs, 2);  // forward, then the recomputation in backward
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(bitwise_equal(got[i], want[i])) << "gradient " << i;
}

TEST(Checkpoint, RecomputedShapeMismatchNamesTheSegment) {
  int64_t width = 4;
  Tensor x = randn({2, 8}).requires_grad_();
  TensorList out = nn::checkpoint(
      [&](const TensorList& in) -> TensorList { return {in[0].narrow(1, 0, width) * 2}; }, {x}, "my.block");
  width = 3;  // the segment changed between forward and backward
  try {
    out[0].sum().backward();
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("segment 'my.block'"), std::string::npos) << m;
    EXPECT_NE(m.find("output 0 is [2, 3] float32, the original was [2, 4] float32"), std::string::npos) << m;
  }
}

TEST(Checkpoint, RecomputedCountAndParameterMismatch) {
  Tensor x = randn({2, 3}).requires_grad_();
  bool two = true;
  TensorList out = nn::checkpoint(
      [&](const TensorList& in) -> TensorList {
        if (two) return {in[0] * 2, in[0] * 3};
        return {in[0] * 2};
      },
      {x}, "pair");
  two = false;
  EXPECT_THROW(
      {
        try {
          (out[0].sum() + out[1].sum()).backward();
        } catch (const ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("it returned 1 outputs, the original 2"), std::string::npos)
              << e.what();
          throw;
        }
      },
      ValueError);

  // A module whose parameter was replaced between forward and backward.
  nn::Linear lin({.in_features = 3, .out_features = 2});
  Tensor y = nn::checkpoint([&](const Tensor& t) { return lin(t); }, x);
  Tensor fresh = randn({2, 3}).requires_grad_();
  autograd::set_name(fresh, "swapped.weight");
  lin.weight = fresh;
  try {
    y.sum().backward();
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("swapped.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("which the original did not"), std::string::npos) << m;
  }
}

TEST(Checkpoint, TensorHooks) {
  Tensor x0 = randn({3, 4});
  auto run = [&](bool ck, int& inner_hook_calls) {
    Tensor x = x0.clone().requires_grad_();
    Tensor h = x * 1.5;  // non-leaf input with a hook
    h.register_hook([](const Tensor& g) { return g * 3; });
    auto f = [&](const Tensor& t) {
      Tensor u = t.sin();
      u.register_hook([&](const Tensor& g) {
        ++inner_hook_calls;
        return g + 1;
      });
      return u * t;
    };
    Tensor y = ck ? nn::checkpoint(f, h) : f(h);
    y.register_hook([](const Tensor& g) { return g * 0.5; });
    y.sum().backward();
    return x.grad();
  };
  int plain_calls = 0, ck_calls = 0;
  Tensor want = run(false, plain_calls);
  Tensor got = run(true, ck_calls);
  EXPECT_TRUE(bitwise_equal(got, want));
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(ck_calls, 1);  // the hook of the recomputed graph; the forward's graph was dropped unused
}

TEST(Checkpoint, RetainGraphAndSecondBackward) {
  Tensor x = randn({4}).requires_grad_();
  Tensor y = nn::checkpoint([](const Tensor& t) { return t.exp() * t; }, x);
  y.sum().backward({}, true);
  Tensor g1 = x.grad().clone();
  y.sum().backward();
  EXPECT_TRUE(bitwise_equal(x.grad(), g1 * 2));
  EXPECT_THROW(y.sum().backward(), ValueError);  // released after the non-retaining backward
}

TEST(Checkpoint, DoubleBackward) {
  Tensor x = randn({5}, TensorOptions(kFloat64)).requires_grad_();
  auto f = [](const Tensor& t) { return t.sin() * t; };
  Tensor gp = autograd::grad({f(x).sum()}, {x}, {}, std::nullopt, true)[0];
  Tensor ggp = autograd::grad({gp.sum()}, {x})[0];
  Tensor gc = autograd::grad({nn::checkpoint(f, x).sum()}, {x}, {}, std::nullopt, true)[0];
  ASSERT_TRUE(gc.requires_grad());
  Tensor ggc = autograd::grad({gc.sum()}, {x})[0];
  EXPECT_TRUE(bitwise_equal(gc.detach(), gp.detach()));
  EXPECT_TRUE(bitwise_equal(ggc, ggp));
}

TEST(Checkpoint, AutocastStateIsReplayed) {
  manual_seed(0);
  nn::Linear lin({.in_features = 8, .out_features = 8});
  Tensor x0 = randn({4, 8});
  auto step = [&](bool ck) {
    lin.zero_grad();
    Tensor x = x0.clone().requires_grad_();
    Tensor y;
    {
      AutocastGuard amp(kBFloat16);
      auto f = [&](const Tensor& t) { return lin(lin(t).relu()); };
      y = ck ? nn::checkpoint(f, x) : f(x);
    }
    EXPECT_EQ(y.dtype(), kBFloat16);
    y.to(kFloat32).pow(2).sum().backward();
    return std::vector<Tensor>{x.grad(), lin.weight.grad(), lin.bias.grad()};
  };
  auto want = step(false), got = step(true);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(bitwise_equal(got[i], want[i])) << "gradient " << i;
}

TEST(Checkpoint, CheckpointSequentialMatchesPlain) {
  manual_seed(0);
  nn::Sequential seq;
  for (int i = 0; i < 5; ++i) {
    seq.push_back(std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 6, .out_features = 6}));
    seq.push_back(std::make_shared<nn::Dropout>(0.2));
  }
  Tensor x0 = randn({3, 6});
  auto step = [&](int64_t segments) {
    seq.zero_grad();
    Tensor x = x0.clone().requires_grad_();
    manual_seed(3);
    Tensor y = segments ? nn::checkpoint_sequential(seq, segments, x) : seq(x);
    y.pow(2).sum().backward();
    std::vector<Tensor> g{x.grad()};
    for (const Tensor& p : seq.parameters()) g.push_back(p.grad());
    return g;
  };
  auto want = step(0);
  for (int64_t segments : {1, 2, 3, 10, 20}) {
    auto got = step(segments);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(bitwise_equal(got[i], want[i])) << "segments " << segments << " gradient " << i;
  }
  EXPECT_THROW(nn::checkpoint_sequential(seq, 0, x0), ValueError);
}

TEST(Checkpoint, PolicyValidation) {
  EXPECT_THROW(nn::CheckpointPolicy::every_k(0), ValueError);
  EXPECT_FALSE(nn::CheckpointPolicy::none().enabled());
  EXPECT_EQ(nn::CheckpointPolicy::blocks().every, 1);
}

TEST(Checkpoint, GPTKeepsFewerActivations) {
  manual_seed(0);
  models::GPTOptions o = small_gpt();
  o.n_layer = 6;
  models::GPT gpt(o);
  Tensor idx = randint(0, 32, {4, 16}, TensorOptions(kInt64));
  Tensor tgt = randint(0, 32, {4, 16}, TensorOptions(kInt64));
  auto peak = [&](nn::CheckpointPolicy p) {
    gpt.checkpointing = p;
    gpt.zero_grad();
    memory::reset_peak_stats();
    const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
    gpt.loss(idx, tgt).backward();
    return memory::stats()[MemoryCategory::Activation].peak_bytes - before;
  };
  const int64_t plain = peak(nn::CheckpointPolicy::none());
  const int64_t blocks = peak(nn::CheckpointPolicy::blocks());
  const int64_t every3 = peak(nn::CheckpointPolicy::every_k(3));
  EXPECT_LT(blocks, plain * 6 / 10) << "plain " << plain << " blocks " << blocks;
  EXPECT_LT(every3, plain) << "plain " << plain << " every 3 " << every3;
  RecordProperty("activation_peak_plain", std::to_string(plain));
  RecordProperty("activation_peak_blocks", std::to_string(blocks));
  std::printf("activation peak: plain %lld, blocks %lld, every 3 %lld\n", static_cast<long long>(plain),
              static_cast<long long>(blocks), static_cast<long long>(every3));
}
