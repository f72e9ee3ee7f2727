// dist::SyncBatchNorm and dist::convert_sync_batchnorm on real ranks (ctest
// dist_2, dist_4, dist_2_debug): each rank runs a slice of a global batch
// (even and uneven slices) and must match one process running plain
// BatchNorm2d on the whole batch, which every rank computes itself from the
// same seeded data. Tolerances: float64 nets agree to 1e-10 relative (the
// statistics are combined in another order than one process sums them);
// the float32 ResNet under DDP to 1e-4 relative, 1e-5 absolute after two
// steps (float32 rounding of the per-rank sums, amplified by BN's 1/std).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dist/ddp_nets.h"
#include "kiln/core/generator.h"
#include "kiln/autograd/engine.h"
#include "kiln/core/guards.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/sync_batch_norm.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"

namespace kiln {
namespace {

constexpr double kRtol64 = 1e-10, kAtol64 = 1e-12;

void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  test::expect_close(got, want, rtol, atol, what);
}

/// The sum over the group of a float64 tensor (the backends reduce float32
/// and int64 only): an allgather of its bits, summed in group-rank order.
Tensor sum_over(dist::ProcessGroup& g, const Tensor& t) {
  const Tensor c = t.contiguous();
  Tensor in = empty({c.numel()}, TensorOptions().dtype(kInt64));
  std::memcpy(in.data_ptr<int64_t>(), c.data_ptr<double>(), static_cast<size_t>(c.numel()) * sizeof(double));
  std::vector<Tensor> out;
  for (int r = 0; r < g.size(); ++r) out.push_back(empty({c.numel()}, TensorOptions().dtype(kInt64)));
  g.allgather(out, in)->wait();
  Tensor acc = zeros({c.numel()}, TensorOptions().dtype(kFloat64));
  for (auto& o : out) {
    Tensor d = empty({c.numel()}, TensorOptions().dtype(kFloat64));
    std::memcpy(d.data_ptr<double>(), o.data_ptr<int64_t>(), static_cast<size_t>(c.numel()) * sizeof(double));
    acc = acc + d;
  }
  return acc.view(t.sizes());
}

/// conv -> BN -> ReLU -> conv -> BN (the second with momentum None: a cumulative average), float64.
std::shared_ptr<nn::Sequential> conv_bn_net(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
          .in_channels = 2, .out_channels = 3, .kernel_size = {3}, .padding = {1}, .bias = false, .dtype = kFloat64}),
      std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = 3, .dtype = kFloat64}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Conv2d>(
          nn::Conv2dOptions{.in_channels = 3, .out_channels = 2, .kernel_size = {1}, .dtype = kFloat64}),
      std::make_shared<nn::BatchNorm2d>(
          nn::BatchNormOptions{.num_features = 2, .momentum = std::nullopt, .dtype = kFloat64}),
  });
}

void expect_same_state(nn::Module& got, nn::Module& want, double rtol, double atol, const std::string& who) {
  const auto g = got.state_dict(), w = want.state_dict();
  ASSERT_EQ(g.size(), w.size()) << who;
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ(g[i].first, w[i].first) << who;
    expect_close(g[i].second, w[i].second, rtol, atol, who + ": " + w[i].first);
  }
}

class SyncBN : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's SyncBN cases run under mpirun: ctest -R dist_";
    world = dist::world();
  }

  /// Two SGD steps of the conv net on `group`, this rank taking rows
  /// [offset(r), offset(r) + sizes[r]) of each global batch, against one
  /// process with plain BatchNorm2d on the whole batch: forward outputs,
  /// input gradients, the group's summed parameter gradients, parameters and
  /// running statistics after each step, then eval mode.
  void conv_net_matches(const dist::ProcessGroupPtr& group, const std::vector<int64_t>& sizes, uint64_t seed) {
    const int r = group->rank();
    ASSERT_EQ(static_cast<int>(sizes.size()), group->size());
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    const int64_t off = std::accumulate(sizes.begin(), sizes.begin() + r, int64_t{0});
    const std::string who = "group rank " + std::to_string(r) + " of " + group->describe();
    auto ref = conv_bn_net(seed);
    auto net = conv_bn_net(seed);
    auto converted = dist::convert_sync_batchnorm(net, group);
    ASSERT_EQ(converted, net);
    ASSERT_NE(std::dynamic_pointer_cast<dist::SyncBatchNorm>(net->children()[1]), nullptr);
    ASSERT_NE(std::dynamic_pointer_cast<dist::SyncBatchNorm>(net->children()[4]), nullptr);
    optim::SGD ref_opt(ref->named_parameters(), {.lr = 0.1});
    optim::SGD opt(net->named_parameters(), {.lr = 0.1});
    manual_seed(seed + 1000);
    for (int step = 0; step < 2; ++step) {
      const std::string at = who + ", step " + std::to_string(step);
      Tensor x = randn({total, 2, 4, 4}, TensorOptions().dtype(kFloat64));
      Tensor target = randn({total, 2, 4, 4}, TensorOptions().dtype(kFloat64));
      Tensor xr = x.detach().requires_grad_();
      Tensor want = (*ref)(xr);
      (want * target).sum().backward();
      Tensor xl = x.narrow(0, off, sizes[static_cast<size_t>(r)]).contiguous().requires_grad_();
      Tensor got = (*net)(xl);
      // The ranks' losses sum to the reference's.
      (got * target.narrow(0, off, sizes[static_cast<size_t>(r)])).sum().backward();
      expect_close(got, want.narrow(0, off, sizes[static_cast<size_t>(r)]), kRtol64, kAtol64, at + ": output");
      expect_close(xl.grad(), xr.grad().narrow(0, off, sizes[static_cast<size_t>(r)]), kRtol64, kAtol64,
                   at + ": input gradient");
      auto ps = net->named_parameters();
      auto ref_ps = ref->named_parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        Tensor summed = sum_over(*group, ps[i].second.grad());
        expect_close(summed, ref_ps[i].second.grad(), kRtol64, kAtol64, at + ": gradient of " + ps[i].first);
        ps[i].second.mutable_grad() = summed;
      }
      ref_opt.step();
      opt.step();
      ref_opt.zero_grad();
      opt.zero_grad();
      expect_same_state(*net, *ref, kRtol64, kAtol64, at);
    }
    // Eval: the running statistics, no communication (the barriers' sequence numbers are consecutive).
    net->eval();
    ref->eval();
    Tensor x = randn({total, 2, 4, 4}, TensorOptions().dtype(kFloat64));
    auto w0 = group->barrier();
    w0->wait();
    Tensor got = (*net)(x.narrow(0, off, sizes[static_cast<size_t>(r)]));
    auto w1 = group->barrier();
    w1->wait();
    EXPECT_EQ(w1->sequence(), w0->sequence() + 1) << who << ": eval mode communicated";
    expect_close(got, (*ref)(x).narrow(0, off, sizes[static_cast<size_t>(r)]), kRtol64, kAtol64, who + ": eval output");
  }

  dist::ProcessGroupPtr world;
};

TEST_F(SyncBN, ConvNetMatchesOneProcessOnTheGlobalBatch) {
  conv_net_matches(world, std::vector<int64_t>(static_cast<size_t>(world->size()), 2), 11);
}

TEST_F(SyncBN, ConvNetMatchesWithUnevenSlices) {
  std::vector<int64_t> sizes;
  for (int r = 0; r < world->size(); ++r) sizes.push_back(r % 2 == 0 ? r + 1 : 3 * r);  // 1, 3, 3, 9
  conv_net_matches(world, sizes, 12);
}

TEST_F(SyncBN, SubgroupsSyncSeparately) {
  // [0, 1] and [2, 3] at 4 ranks ([0] and [1] at 2: a group of one runs plain BatchNorm); each
  // half has its own data, so a statistic that leaked across halves would show.
  const int n = world->size();
  ASSERT_EQ(n % 2, 0);
  std::vector<int> lo, hi;
  for (int r = 0; r < n; ++r) (r < n / 2 ? lo : hi).push_back(r);
  auto g_lo = dist::new_group(lo);
  auto g_hi = dist::new_group(hi);
  const bool in_lo = world->rank() < n / 2;
  auto& mine = in_lo ? g_lo : g_hi;
  std::vector<int64_t> sizes;
  for (int r = 0; r < mine->size(); ++r) sizes.push_back(r + 2);
  conv_net_matches(mine, sizes, in_lo ? 21 : 22);
}

TEST_F(SyncBN, TrainingForwardCommunicatesOnceAndBackwardOnce) {
  auto bn = std::make_shared<dist::SyncBatchNorm>(nn::BatchNormOptions{.num_features = 2}, world);
  manual_seed(5);
  Tensor x = randn({2, 2, 3, 3}).requires_grad_();
  auto w0 = world->barrier();
  w0->wait();
  Tensor y = (*bn)(x);
  auto w1 = world->barrier();
  w1->wait();
  EXPECT_EQ(w1->sequence(), w0->sequence() + 2);  // the statistics' allgather
  (y * y).sum().backward();
  auto w2 = world->barrier();
  w2->wait();
  EXPECT_EQ(w2->sequence(), w1->sequence() + 2);  // sum(dy), sum(dy * xmu)
}

TEST_F(SyncBN, ConvertKeepsTensorsKeysAndRefusesTheOldModule) {
  auto bn = std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = 3});
  auto bn1d = std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = 4, .affine = false});
  auto seq = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{bn, bn1d});
  seq->eval();
  const auto keys_before = seq->state_dict();
  dist::convert_sync_batchnorm(seq, world);
  auto s = std::dynamic_pointer_cast<dist::SyncBatchNorm>(seq->children()[0]);
  auto s1 = std::dynamic_pointer_cast<dist::SyncBatchNorm1d>(seq->children()[1]);
  ASSERT_NE(s, nullptr);
  ASSERT_NE(s1, nullptr);
  EXPECT_FALSE(s->is_training());
  EXPECT_EQ(s->weight.data_ptr(), bn->weight.data_ptr());
  EXPECT_EQ(s->running_var.data_ptr(), bn->running_var.data_ptr());
  EXPECT_FALSE(s1->weight.defined());
  const auto keys_after = seq->state_dict();
  ASSERT_EQ(keys_after.size(), keys_before.size());
  for (size_t i = 0; i < keys_after.size(); ++i) EXPECT_EQ(keys_after[i].first, keys_before[i].first);
  EXPECT_NE(s->to_string().find("process_group="), std::string::npos) << s->to_string();
  // A parent that kept a typed pointer to the old norm would bypass the sync: calling it throws.
  try {
    (*bn)(zeros({2, 3, 2, 2}));
    ADD_FAILURE() << "the replaced BatchNorm2d ran";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("convert_sync_batchnorm"), std::string::npos) << e.what();
  }
  // SyncBatchNorm1d in training on [N, C] and [N, C, L]: as BatchNorm1d on the global batch.
  seq->train();
  auto ref = std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = 4, .affine = false});
  manual_seed(9);
  const int n = world->size(), r = world->rank();
  Tensor x = randn({2 * n, 4, 3}, TensorOptions().dtype(kFloat64));
  ref->to(kFloat64);
  s1->to(kFloat64);
  Tensor want = (*ref)(x);
  Tensor got = (*s1)(x.narrow(0, 2 * r, 2));
  expect_close(got, want.narrow(0, 2 * r, 2), kRtol64, kAtol64, "SyncBatchNorm1d [N, C, L]");
  expect_close(s1->running_var, ref->running_var, kRtol64, kAtol64, "SyncBatchNorm1d running_var");
}

TEST_F(SyncBN, ConvertedResNetUnderDDPTrainsAsOneProcess) {
  const int n = world->size(), r = world->rank();
  const int64_t B = 2;
  models::ResNetOptions o;
  o.stem_channels = 4;
  o.widths = {4, 8};
  o.blocks = {1, 1};
  o.num_classes = 3;
  manual_seed(31);
  auto ref = std::make_shared<models::ResNet>(o);
  manual_seed(31);
  auto net = std::make_shared<models::ResNet>(o);
  dist::convert_sync_batchnorm(net, world);
  ASSERT_NE(std::dynamic_pointer_cast<dist::SyncBatchNorm>(net->bn1), nullptr);
  auto block = std::dynamic_pointer_cast<models::BasicBlock>(net->stages[1]->children()[0]);
  ASSERT_NE(block, nullptr);
  ASSERT_NE(std::dynamic_pointer_cast<dist::SyncBatchNorm>(block->bn2), nullptr);
  ASSERT_NE(block->downsample, nullptr);
  dist::DistributedDataParallel ddp(net, world);
  optim::SGD ref_opt(ref->named_parameters(), {.lr = 0.1});
  optim::SGD opt(net->named_parameters(), {.lr = 0.1});
  manual_seed(32);
  for (int step = 0; step < 2; ++step) {
    Tensor x = randn({n * B, 3, 8, 8});
    Tensor y = randn({n * B, 3});
    ref_opt.zero_grad();
    test::mse((*ref)(x), y).backward();
    ref_opt.step();
    opt.zero_grad();
    test::mse(ddp(x.narrow(0, r * B, B)), y.narrow(0, r * B, B)).backward();
    opt.step();
    expect_same_state(*net, *ref, 1e-4, 1e-5, "rank " + std::to_string(r) + ", step " + std::to_string(step));
  }
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST_F(SyncBN, ARankWithAnEmptySlice) {
  // Group rank 1 holds no rows (torch allows it): the others' statistics and gradients are the global ones.
  auto world = dist::world();
  const int n = world->size(), r = world->rank();
  std::vector<int64_t> sizes(static_cast<size_t>(n), 2);
  sizes[1] = 0;
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const int64_t off = std::accumulate(sizes.begin(), sizes.begin() + r, int64_t{0});
  const int64_t mine = sizes[static_cast<size_t>(r)];
  auto ref = std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = 2, .dtype = kFloat64});
  auto bn = std::make_shared<dist::SyncBatchNorm>(nn::BatchNormOptions{.num_features = 2, .dtype = kFloat64}, world);
  manual_seed(41);
  Tensor x = randn({total, 2, 3, 3}, TensorOptions().dtype(kFloat64));
  Tensor t = randn({total, 2, 3, 3}, TensorOptions().dtype(kFloat64));
  Tensor xr = x.detach().requires_grad_();
  Tensor want = (*ref)(xr);
  (want * t).sum().backward();
  Tensor xl = x.narrow(0, off, mine).contiguous().requires_grad_();
  Tensor got = (*bn)(xl);
  (got * t.narrow(0, off, mine)).sum().backward();
  EXPECT_EQ(got.size(0), mine);
  if (mine > 0) {
    expect_close(got, want.narrow(0, off, mine), kRtol64, kAtol64, "output");
    expect_close(xl.grad(), xr.grad().narrow(0, off, mine), kRtol64, kAtol64, "input gradient");
  }
  expect_close(bn->running_mean, ref->running_mean, kRtol64, kAtol64, "running_mean");
  expect_close(bn->running_var, ref->running_var, kRtol64, kAtol64, "running_var");
  expect_close(sum_over(*world, bn->weight.grad()), ref->weight.grad(), kRtol64, kAtol64, "weight gradient");
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST_F(SyncBN, DoubleBackwardIsRefused) {
  auto bn = std::make_shared<dist::SyncBatchNorm>(nn::BatchNormOptions{.num_features = 2}, dist::world());
  manual_seed(43);
  Tensor x = randn({2, 2, 2, 2}).requires_grad_();
  Tensor y = (*bn)(x);
  try {
    autograd::grad({(y * y).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    ADD_FAILURE() << "create_graph through SyncBatchNorm did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("double backward"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
