// kiln::compile's ReLU-pooling rewrite (docs/compile.md, "Rewrites"): a ReLU
// that only a channels-last max pool reads runs inside the pool, on each
// maximum, and its backward inside the pool's backward. Training steps replayed with it match eager
// bitwise, in float32 and under bfloat16 autocast (random data has no exact
// zeros for the sign-of-zero difference);
// NaN in the input propagates to the same values and gradients; a ReLU output
// that anything else reads (through a view too), that outlives the step, or
// whose gradient a hook reads, is left alone. And the pool backward read
// through by the first convolution's weight gradient (Note [Pool backward
// into the weight gradient]): the same bits, only where that convolution's
// input needs no gradient; and that convolution run inside the pool (Note
// [Convolution inside the pool]).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>

#include "kiln/core/autocast.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/export/compile.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/models/cnn.h"
#include "kiln/nn/checkpoint.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

struct Twin {
  std::shared_ptr<models::CNN> model;
  std::unique_ptr<optim::Optimizer> opt;
};

Twin make_cnn() {
  manual_seed(11);
  Twin t;
  t.model = std::make_shared<models::CNN>(
      models::CNNOptions{.in_channels = 1, .channels1 = 8, .channels2 = 16, .hidden = 32, .input_size = {12, 12}});
  optim::ParamGroup g;
  for (const auto& [n, p] : t.model->named_parameters()) g.params.emplace_back(n, p);
  t.opt = std::make_unique<optim::Adam>(std::vector<optim::ParamGroup>{g}, optim::AdamOptions{.lr = 1e-2});
  return t;
}

std::function<Tensor()> train_step(Twin& t, const Tensor& x, const Tensor& y) {
  return [&t, &x, &y] {
    t.opt->zero_grad();
    Tensor loss = nn::functional::cross_entropy((*t.model)(x), y);
    loss.backward();
    t.opt->step();
    return loss;
  };
}

// Equal numbers, NaN where the other has NaN (the sign of a zero aside).
::testing::AssertionResult same_numbers(const Tensor& a, const Tensor& b) {
  const std::vector<double> u = to_doubles(a), v = to_doubles(b);
  if (u.size() != v.size()) return ::testing::AssertionFailure() << "sizes " << u.size() << " and " << v.size();
  for (size_t i = 0; i < u.size(); ++i)
    if (!(u[i] == v[i] || (std::isnan(u[i]) && std::isnan(v[i]))))
      return ::testing::AssertionFailure() << "element " << i << ": " << u[i] << " against " << v[i];
  return ::testing::AssertionSuccess();
}

void expect_same_model(const Twin& e, const Twin& c, bool bitwise) {
  const auto pe = e.model->named_parameters(), pc = c.model->named_parameters();
  ASSERT_EQ(pe.size(), pc.size());
  for (size_t i = 0; i < pe.size(); ++i) {
    if (bitwise) {
      EXPECT_TRUE(bitwise_equal(pe[i].second, pc[i].second)) << pe[i].first;
      EXPECT_TRUE(bitwise_equal(pe[i].second.grad(), pc[i].second.grad())) << pe[i].first << ".grad";
    } else {
      EXPECT_TRUE(same_numbers(pe[i].second, pc[i].second)) << pe[i].first;
      EXPECT_TRUE(same_numbers(pe[i].second.grad(), pc[i].second.grad())) << pe[i].first << ".grad";
    }
  }
}

TEST(CompileRewrite, ACNNTrainingStepPoolsBeforeItsReLUsAndMatchesEagerBitwise) {
  const int before = get_num_threads();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    Twin eager = make_cnn(), comp = make_cnn();
    manual_seed(3);
    const Tensor x = randn({8, 1, 12, 12}), y = randint(0, 10, {8});
    auto eager_step = train_step(eager, x, y);
    auto step = compile(train_step(comp, x, y), {.name = "cnn step", .modules = {comp.model.get()}});
    for (int i = 0; i < 5; ++i) EXPECT_TRUE(bitwise_equal(eager_step(), step()[0])) << "loss of step " << i;
    EXPECT_EQ(step.stats().replays, 4);
    // Both ReLU → pool pairs; fc1's ReLU feeds no pool and stays.
    EXPECT_EQ(step.stats().rewrites, 2) << step.explain();
    // conv1 (one input channel) runs inside the first pool, and its weight gradient reads the first pool's
    // gradient through the pool (its input needs no gradient), where the build has the direct kernels.
    const int64_t direct = direct_conv_kernels_built() ? 1 : 0;
    EXPECT_EQ(step.stats().conv_pool_rewrites, direct) << step.explain();
    EXPECT_EQ(step.stats().pool_weight_grad_rewrites, direct) << step.explain();
    // Each pair no longer writes its ReLU's output nor that output's gradient (float32, 8 × C × 12² and 6²),
    // nor conv1 its output, nor the first pool's backward its full-size gradient.
    EXPECT_EQ(step.stats().rewrite_unwritten_bytes,
              2 * 4 * 8 * (8 * 144 + 16 * 36) + direct * 2 * 4 * 8 * 8 * 144);
    if (direct) {
      EXPECT_NE(step.explain().find("conv2d -> max_pool2d pair run as one"), std::string::npos) << step.explain();
      EXPECT_NE(step.explain().find("read through by the conv2d weight gradient"), std::string::npos)
          << step.explain();
    }
    EXPECT_NE(step.explain().find("run as max_pool2d(relu)"), std::string::npos) << step.explain();
    expect_same_model(eager, comp, /*bitwise=*/true);

    // Off: the same record without the rewrite.
    Twin plain = make_cnn();
    auto unrewritten =
        compile(train_step(plain, x, y), {.name = "cnn step", .modules = {plain.model.get()}, .rewrite = false});
    for (int i = 0; i < 5; ++i) unrewritten();
    EXPECT_EQ(unrewritten.stats().rewrites, 0);
    EXPECT_EQ(unrewritten.stats().pool_weight_grad_rewrites, 0);
    EXPECT_EQ(unrewritten.stats().conv_pool_rewrites, 0);
    expect_same_model(plain, comp, /*bitwise=*/true);
  }
  set_num_threads(before);
}

TEST(CompileRewrite, UnderBfloat16AutocastTheStepMatchesEagerBitwise) {
  // The convolutions run in bfloat16, so the ReLUs, pools and their backward do too.
  Twin eager = make_cnn(), comp = make_cnn();
  manual_seed(4);
  const Tensor x = randn({8, 1, 12, 12}), y = randint(0, 10, {8});
  auto amp_step = [&x, &y](Twin& t) {
    return [&t, &x, &y] {
      t.opt->zero_grad();
      Tensor loss;
      {
        const AutocastGuard amp(kBFloat16);
        loss = nn::functional::cross_entropy((*t.model)(x), y);
      }
      loss.backward();
      t.opt->step();
      return loss;
    };
  };
  auto eager_step = amp_step(eager);
  auto step = compile(amp_step(comp), {.name = "bf16 cnn step", .modules = {comp.model.get()}});
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(bitwise_equal(eager_step(), step()[0])) << "loss of step " << i;
  // The rewrites need the bf16 kernels they fuse: the direct convolution, and the convolutions' outputs
  // in bf16 (where oneDNN has no bf16 kernel or a slower one than float32's, a convolution
  // computes in float32 and a cast follows it).
  if (direct_conv_kernels_built() && kernels::bf16_products_on_dnnl()) {
    EXPECT_EQ(step.stats().rewrites, 2) << step.explain();
    EXPECT_EQ(step.stats().pool_weight_grad_rewrites, 1) << step.explain();
    EXPECT_EQ(step.stats().conv_pool_rewrites, 1) << step.explain();
    EXPECT_EQ(step.stats().rewrite_unwritten_bytes, 2 * 2 * 8 * (8 * 144 + 16 * 36) + 2 * 2 * 8 * 8 * 144);
  }
  expect_same_model(eager, comp, /*bitwise=*/true);
}

// Where the first convolution's input needs a gradient, its backward computes
// both gradients from the pool's full-size one: the pool's backward stays.
TEST(CompileRewrite, AFirstConvolutionWhoseInputNeedsAGradientKeepsThePoolBackward) {
  Twin eager = make_cnn(), comp = make_cnn();
  manual_seed(5);
  const Tensor x = randn({8, 1, 12, 12}).requires_grad_(), y = randint(0, 10, {8});
  auto eager_step = train_step(eager, x, y);
  auto step = compile(train_step(comp, x, y), {.name = "cnn step", .modules = {comp.model.get()}});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(eager_step(), step()[0])) << "loss of step " << i;
  EXPECT_EQ(step.stats().rewrites, 2) << step.explain();
  EXPECT_EQ(step.stats().pool_weight_grad_rewrites, 0) << step.explain();
  // The forward is the same either way (where the build has the direct kernels).
  EXPECT_EQ(step.stats().conv_pool_rewrites, direct_conv_kernels_built() ? 1 : 0) << step.explain();
  expect_same_model(eager, comp, /*bitwise=*/true);
}

TEST(CompileRewrite, NaNInTheInputGivesTheEagerValuesAndGradients) {
  // A NaN pixel: its window pools to NaN in both orders, and the ReLU's backward passes a NaN
  // value's gradient (torch's threshold_backward), routed to the same element.
  Twin eager = make_cnn(), comp = make_cnn();
  manual_seed(5);
  Tensor x = randn({8, 1, 12, 12});
  const Tensor y = randint(0, 10, {8});
  auto grads_only = [&x, &y](Twin& t) {
    return [&t, &x, &y] {
      t.opt->zero_grad();
      Tensor loss = nn::functional::cross_entropy((*t.model)(x), y);
      loss.backward();
      return loss;
    };
  };
  auto eager_step = grads_only(eager);
  auto step = compile(grads_only(comp), {.name = "grads", .modules = {comp.model.get()}});
  step();  // captured on finite data
  EXPECT_EQ(step.stats().rewrites, 2) << step.explain();
  {
    const NoGradGuard ng;
    x.data_ptr<float>()[5 * 144 + 3 * 12 + 7] = std::nanf("");
  }
  EXPECT_TRUE(same_numbers(eager_step(), step()[0]));
  EXPECT_EQ(step.stats().replays, 1);
  expect_same_model(eager, comp, /*bitwise=*/false);
}

// A step of twin convolutions (the same seed), `pooled` making the pooled output from the
// conv and the input, run eagerly and compiled for three calls: losses and gradients bit for
// bit, and `rewrites` pairs rewritten.
void expect_conv_step(int64_t in_channels, uint64_t seed, const Tensor& x,
                      const std::function<Tensor(nn::Conv2d&, const Tensor&)>& pooled, int64_t rewrites) {
  auto make = [&] {
    manual_seed(seed);
    return std::make_shared<nn::Conv2d>(
        nn::Conv2dOptions{.in_channels = in_channels, .out_channels = 16, .kernel_size = {3}, .padding = {1}});
  };
  auto eager = make(), comp = make();
  auto step_of = [&x, &pooled](const std::shared_ptr<nn::Conv2d>& conv) {
    return [conv, &x, &pooled] {
      conv->zero_grad();
      const Tensor p = pooled(*conv, x);
      Tensor loss = (p * p).mean();
      loss.backward();
      return loss;
    };
  };
  auto eager_step = step_of(eager);
  auto step = compile(step_of(comp), {.name = "conv step", .modules = {comp.get()}});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(eager_step(), step()[0])) << "call " << i;
  EXPECT_EQ(step.stats().rewrites, rewrites) << step.explain();
  EXPECT_TRUE(bitwise_equal(eager->weight.grad(), comp->weight.grad()));
  EXPECT_TRUE(bitwise_equal(eager->bias.grad(), comp->bias.grad()));
}

TEST(CompileRewrite, OverlappingPaddedWindowsMatchEagerBitwise) {
  // 3×3 windows, stride 2, padding 1 (ResNet's stem pool): an element can be the maximum of
  // several windows, and the pool's backward sums their masked gradients in torch's order.
  manual_seed(8);
  const Tensor x = randn({4, 3, 11, 11});
  expect_conv_step(
      3, 9, x, [](nn::Conv2d& conv, const Tensor& in) { return max_pool2d(conv(in).relu(), {3}, {2}, {1}); }, 1);
}

TEST(CompileRewrite, UnderActivationCheckpointingTheRecomputedPairIsRewritten) {
  // The forward's pair is not rewritten (its ReLU output is read in no backward: the
  // checkpoint keeps nothing); the backward recomputes conv → ReLU → pool, and that pair is.
  manual_seed(13);
  const Tensor x = randn({4, 2, 10, 10});
  expect_conv_step(
      2, 12, x,
      [](nn::Conv2d& conv, const Tensor& in) {
        return nn::checkpoint([&conv](const Tensor& t) { return max_pool2d(conv(t).relu(), {2}); }, in);
      },
      1);
}

TEST(CompileRewrite, AReLUOutputReadByAnotherOpOrKeptIsLeftAlone) {
  manual_seed(2);
  auto conv = std::make_shared<nn::Conv2d>(
      nn::Conv2dOptions{.in_channels = 1, .out_channels = 8, .kernel_size = {3}, .padding = {1}});
  const Tensor x = randn({4, 1, 8, 8});
  Tensor kept;
  auto step_of = [&](int variant) {
    return [&, variant] {
      conv->zero_grad();
      const Tensor r = (*conv)(x).relu();
      Tensor loss = max_pool2d(r, {2}).mean();
      if (variant == 0) loss = loss + r.mean();  // a second reader of the ReLU's output
      if (variant == 1) kept = r;                // the output outlives the step
      if (variant == 3) loss = loss + r.flatten(1).narrow(1, 0, 5).sum();  // a view of it, read
      if (variant == 4)  // a hook that reads the gradient of the ReLU's output before its backward
        r.register_hook([&kept](const Tensor& g) {
          kept = g.sum();
          return Tensor();
        });
      loss.backward();
      return loss;
    };
  };
  for (int variant : {0, 1, 3, 4}) {
    const Tensor want = step_of(variant)();
    const Tensor want_grad = conv->weight.grad().clone();
    auto step = compile(step_of(variant), {.name = "conv", .modules = {conv.get()}});
    step();
    EXPECT_TRUE(bitwise_equal(want, step()[0])) << "variant " << variant;
    EXPECT_TRUE(bitwise_equal(want_grad, conv->weight.grad())) << "variant " << variant;
    EXPECT_EQ(step.stats().rewrites, 0) << "variant " << variant << "\n" << step.explain();
  }
  // The control: the same function with neither has its pair rewritten.
  auto step = compile(step_of(2), {.name = "conv", .modules = {conv.get()}});
  step();
  EXPECT_EQ(step.stats().rewrites, 1) << step.explain();
}

// The first convolution's rewrites watch what they stop writing: a convolution
// output that a second op reads keeps the convolution out of the pool (and its
// gradient, summed from both branches, keeps the pool's backward), and a hook
// that reads the convolution output's gradient keeps the pool's backward,
// while the forward still joins. The same bits as eager in each.
TEST(CompileRewrite, TheFirstConvolutionsRewritesLeaveWhatAnotherOpReads) {
  manual_seed(6);
  auto conv = std::make_shared<nn::Conv2d>(
      nn::Conv2dOptions{.in_channels = 1, .out_channels = 8, .kernel_size = {3}, .padding = {1}});
  const Tensor x = randn({4, 1, 8, 8});
  Tensor kept;
  auto step_of = [&](int variant) {
    return [&, variant] {
      conv->zero_grad();
      const Tensor y = (*conv)(x);
      Tensor loss = max_pool2d(y.relu(), {2}).mean();
      if (variant == 0) loss = loss + y.mean();  // a second reader of the convolution's output
      if (variant == 1)                          // a hook that reads the gradient the pool's backward writes
        y.register_hook([&kept](const Tensor& g) {
          kept = g.sum();
          return Tensor();
        });
      loss.backward();
      return loss;
    };
  };
  struct Want {
    int64_t conv_pools, pool_weight_grads;
  };
  const Want wants[] = {{0, 0}, {1, 0}, {1, 1}};  // variant 2: neither, both rewrites
  for (int variant : {0, 1, 2}) {
    const Tensor want = step_of(variant)();
    const Tensor want_grad = conv->weight.grad().clone(), want_bias = conv->bias.grad().clone();
    auto step = compile(step_of(variant), {.name = "conv", .modules = {conv.get()}});
    step();
    EXPECT_TRUE(bitwise_equal(want, step()[0])) << "variant " << variant;
    EXPECT_TRUE(bitwise_equal(want_grad, conv->weight.grad())) << "variant " << variant;
    EXPECT_TRUE(bitwise_equal(want_bias, conv->bias.grad())) << "variant " << variant;
    const int64_t direct = direct_conv_kernels_built() ? 1 : 0;  // none without the direct kernels
    EXPECT_EQ(step.stats().conv_pool_rewrites, direct * wants[variant].conv_pools) << "variant " << variant << "\n"
                                                                                   << step.explain();
    EXPECT_EQ(step.stats().pool_weight_grad_rewrites, direct * wants[variant].pool_weight_grads)
        << "variant " << variant << "\n"
        << step.explain();
  }
}

}  // namespace
}  // namespace kiln::test
