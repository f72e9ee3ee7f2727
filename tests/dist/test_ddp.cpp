// DistributedDataParallel on the in-process fake group (tests/dist/fake_group.h):
// bucket assignment, overlap, equivalence with one process on the whole batch,
// no_sync accumulation, unused parameters and buffer broadcast.
#include <gtest/gtest.h>

#include <set>

#include "dist/ddp_nets.h"
#include "dist/fake_group.h"
#include "kiln/autograd/engine.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/dist/ddp.h"
#include "kiln/nn/layers.h"
#include "kiln/optim/optimizer.h"
#include "support/compare.h"

namespace kiln {
namespace {

using dist::DDPOptions;
using dist::DistributedDataParallel;
using test::FakeGroup;
using test::FakeWorld;
using test::Blocks;
using test::Net;
using test::make_net;
using test::mse;
using test::expect_close;
using test::kRtol;
using test::kAtol;

std::vector<std::shared_ptr<FakeGroup>> groups(int n) {
  auto world = std::make_shared<FakeWorld>(n);
  std::vector<std::shared_ptr<FakeGroup>> gs;
  for (int r = 0; r < n; ++r) gs.push_back(std::make_shared<FakeGroup>(world, r));
  return gs;
}

TEST(DDP, BucketsInReverseOrderWithinTheCap) {
  auto gs = groups(1);
  auto m = std::make_shared<Blocks>(std::vector<int64_t>{100, 200, 50, 300, 10});
  // Cap of 1000 bytes: p4 (40 B), then p3 (1200 B) alone, p2 + p1 (200 + 800 B), p0 (400 B).
  DistributedDataParallel ddp(m, gs[0], {.bucket_cap_mb = 1000.0 / (1024 * 1024)});
  std::vector<std::vector<size_t>> got;
  for (auto& b : ddp.buckets()) {
    got.push_back(b.params);
    if (b.params.size() > 1) {
      EXPECT_LE(b.bytes, 1000);
    }
  }
  EXPECT_EQ(got, (std::vector<std::vector<size_t>>{{4}, {3}, {2, 1}, {0}}));
  EXPECT_EQ(ddp.parameter_names()[0], "p0");

  // gradient_as_bucket_view: p1's gradient sits right after p2's in their bucket.
  ddp(ones({3})).backward();
  auto ps = m->parameters();
  EXPECT_EQ(static_cast<char*>(ps[1].grad().data_ptr()), static_cast<char*>(ps[2].grad().data_ptr()) + 200);
  // The default cap puts everything in one bucket.
  auto m2 = std::make_shared<Blocks>(std::vector<int64_t>{100, 200, 50});
  DistributedDataParallel ddp2(m2, gs[0]);
  ASSERT_EQ(ddp2.buckets().size(), 1u);
  EXPECT_EQ(ddp2.buckets()[0].params, (std::vector<size_t>{2, 1, 0}));
}

TEST(DDP, FirstAllreduceStartsBeforeBackwardEnds) {
  auto gs = groups(2);
  std::vector<dist::DDPStats> stats(2);
  std::vector<size_t> nbuckets(2);
  FakeWorld(2).run([&](int r) {
    auto net = make_net(1);
    net->use_extra = true;
    // ~1.1 KB per fc weight: a 1 KB cap gives several buckets.
    DistributedDataParallel ddp(net, gs[r], {.bucket_cap_mb = 1024.0 / (1024 * 1024), .find_unused_parameters = true});
    Tensor out = ddp(ones({4, 6}));
    out.sum().backward();
    stats[r] = ddp.stats();
    nbuckets[r] = ddp.buckets().size();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_GT(nbuckets[r], 2u);
    // The first bucket (fc3's parameters) launched while earlier layers' gradients were still to come.
    EXPECT_GT(stats[r].pending_at_first_allreduce, 0);
    EXPECT_LE(stats[r].first_allreduce_start, stats[r].last_gradient_ready);
    EXPECT_LE(stats[r].last_gradient_ready, stats[r].backward_end);
    std::vector<size_t> order(nbuckets[r]);
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    EXPECT_EQ(stats[r].launch_order, order);
  }
}

// N ranks with per-rank batch B, K SGD steps == one process with batch N*B.
void check_equivalence(int n) {
  const int64_t B = 3, K = 4;
  auto batches = test::make_batches(n * B, K, 42);
  auto ref = make_net(7);
  ref->use_extra = false;
  test::train_reference(*ref, batches);
  // Rank 0 starts from the reference's initial weights, the others from other draws: the broadcast fixes them.
  std::vector<std::shared_ptr<Net>> nets;
  for (int r = 0; r < n; ++r) {
    nets.push_back(make_net(r == 0 ? 7 : 100 + r));
    nets.back()->use_extra = false;
  }
  auto gs = groups(n);
  FakeWorld(n).run([&](int r) {
    test::train_rank(nets[r], gs[r], batches, B,
                     {.bucket_cap_mb = 1024.0 / (1024 * 1024), .find_unused_parameters = true});
  });
  for (int r = 0; r < n; ++r) test::expect_same_parameters(*nets[r], *ref, "rank " + std::to_string(r) + " of " + std::to_string(n));
}

TEST(DDP, TwoRanksMatchOneProcessOnTheWholeBatch) { check_equivalence(2); }
TEST(DDP, FourRanksMatchOneProcessOnTheWholeBatch) { check_equivalence(4); }

TEST(DDP, NoSyncAccumulatesLocallyThenAveragesEverything) {
  const int n = 2;
  const int64_t B = 2, A = 3;  // A micro-batches, the first A-1 under no_sync
  manual_seed(5);
  std::vector<Tensor> xs, ys;
  for (int a = 0; a < A; ++a) {
    xs.push_back(randn({n * B, 6}));
    ys.push_back(randn({n * B, 3}));
  }
  auto ref = make_net(3);
  ref->use_extra = false;
  for (int a = 0; a < A; ++a) mse((*ref)(xs[a]), ys[a]).backward();
  std::vector<std::shared_ptr<Net>> nets{make_net(3), make_net(3)};
  auto gs = groups(n);
  std::vector<size_t> collectives_in_no_sync(n);
  std::vector<Tensor> local_grad(n);
  FakeWorld(n).run([&](int r) {
    nets[r]->use_extra = false;
    DistributedDataParallel ddp(nets[r], gs[r], {.bucket_cap_mb = 1024.0 / (1024 * 1024),
                                                 .find_unused_parameters = true});
    const size_t before = gs[r]->log.size();
    {
      auto guard = ddp.no_sync();
      for (int a = 0; a < A - 1; ++a) {
        mse(ddp(xs[a].narrow(0, r * B, B)), ys[a].narrow(0, r * B, B)).backward();
      }
    }
    collectives_in_no_sync[r] = gs[r]->log.size() - before;
    local_grad[r] = nets[r]->fc1->weight.grad().clone();
    mse(ddp(xs[A - 1].narrow(0, r * B, B)), ys[A - 1].narrow(0, r * B, B)).backward();
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(collectives_in_no_sync[r], 0u);
  // Before the synced step the ranks' gradients were their own.
  EXPECT_FALSE(test::compare_tensors(local_grad[0], local_grad[1], 1e-3, 1e-6).ok);
  auto want = ref->named_parameters();
  for (int r = 0; r < n; ++r) {
    auto got = nets[r]->named_parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      if (!want[i].second.grad().defined()) {
        EXPECT_FALSE(got[i].second.grad().defined()) << want[i].first;
        continue;
      }
      ASSERT_TRUE(got[i].second.grad().defined()) << want[i].first;
      expect_close(got[i].second.grad(), want[i].second.grad(), kRtol, kAtol, "grad of " + want[i].first);
    }
  }
}

TEST(DDP, UnusedParametersAreAnErrorNamingThem) {
  auto gs = groups(1);
  auto net = make_net(1);
  net->use_extra = false;
  DistributedDataParallel ddp(net, gs[0]);
  Tensor loss = ddp(ones({2, 6})).sum();
  try {
    loss.backward();
    FAIL() << "expected an error about unused parameters";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("4 of 10 parameters got no gradient"), std::string::npos) << msg;
    for (const char* name : {"'extra.weight'", "'extra.bias'", "'never.weight'", "'never.bias'"}) {
      EXPECT_NE(msg.find(name), std::string::npos) << name << " missing in: " << msg;
    }
    EXPECT_EQ(msg.find("fc1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("find_unused_parameters = true"), std::string::npos) << msg;
  }
  // The next iteration, with every parameter used, averages as usual.
  net->use_extra = true;
  net->use_never = true;
  ddp(ones({2, 6})).sum().backward();
  EXPECT_EQ(ddp.stats().allreduces, static_cast<int64_t>(ddp.buckets().size()));
  EXPECT_TRUE(net->never->weight.grad().defined());
}

TEST(DDP, FindUnusedParametersTakesTheirGradientAsZero) {
  // Rank 1 uses `extra`, rank 0 does not; no rank uses `never`.
  const int n = 2;
  manual_seed(9);
  Tensor x = randn({n * 2, 6});
  Tensor y = randn({n * 2, 3});
  auto ref = make_net(4);
  for (int r = 0; r < n; ++r) {
    ref->use_extra = r == 1;
    (mse((*ref)(x.narrow(0, r * 2, 2)), y.narrow(0, r * 2, 2)) * (1.0 / n)).backward();
  }
  std::vector<std::shared_ptr<Net>> nets{make_net(4), make_net(4)};
  auto gs = groups(n);
  FakeWorld(n).run([&](int r) {
    nets[r]->use_extra = r == 1;
    DistributedDataParallel ddp(nets[r], gs[r], {.bucket_cap_mb = 1024.0 / (1024 * 1024),
                                                 .find_unused_parameters = true});
    mse(ddp(x.narrow(0, r * 2, 2)), y.narrow(0, r * 2, 2)).backward();
  });
  auto want = ref->named_parameters();
  for (int r = 0; r < n; ++r) {
    auto got = nets[r]->named_parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      const bool never = want[i].first.starts_with("never.");
      EXPECT_EQ(got[i].second.grad().defined(), !never) << want[i].first;
      if (!never) expect_close(got[i].second.grad(), want[i].second.grad(), kRtol, kAtol, want[i].first);
    }
  }
}

TEST(DDP, WithoutBucketViewsGradientsAreCopiedBack) {
  const int n = 2;
  manual_seed(11);
  Tensor x = randn({n * 2, 6});
  Tensor y = randn({n * 2, 3});
  auto ref = make_net(2);
  ref->use_extra = false;
  mse((*ref)(x), y).backward();
  std::vector<std::shared_ptr<Net>> nets{make_net(2), make_net(2)};
  auto gs = groups(n);
  FakeWorld(n).run([&](int r) {
    nets[r]->use_extra = false;
    DistributedDataParallel ddp(nets[r], gs[r], {.find_unused_parameters = true, .gradient_as_bucket_view = false});
    mse(ddp(x.narrow(0, r * 2, 2)), y.narrow(0, r * 2, 2)).backward();
  });
  expect_close(nets[1]->fc1->weight.grad(), ref->fc1->weight.grad(), kRtol, kAtol, "fc1.weight grad");
  expect_close(nets[0]->fc3->bias.grad(), ref->fc3->bias.grad(), kRtol, kAtol, "fc3.bias grad");
}

TEST(DDP, BuffersFollowRankZeroAtEachForward) {
  const int n = 3;
  std::vector<std::shared_ptr<Net>> nets{make_net(1), make_net(2), make_net(3)};
  auto gs = groups(n);
  std::vector<Tensor> seen(n), after_no_sync(n);
  FakeWorld(n).run([&](int r) {
    DistributedDataParallel ddp(nets[r], gs[r], {.find_unused_parameters = true});
    auto bufs = nets[r]->named_buffers();
    bufs[0].second.fill_(static_cast<double>(r + 1));
    ddp(ones({1, 6}));
    seen[r] = bufs[0].second.clone();
    bufs[0].second.fill_(static_cast<double>(10 * (r + 1)));
    {
      auto guard = ddp.no_sync();
      ddp(ones({1, 6}));  // torch does not broadcast buffers under no_sync
    }
    after_no_sync[r] = bufs[0].second.clone();
  });
  for (int r = 0; r < n; ++r) {
    expect_close(seen[r], full({2}, 1.0), 0, 0, "buffer after forward on rank " + std::to_string(r));
    expect_close(after_no_sync[r], full({2}, 10.0 * (r + 1)), 0, 0, "buffer under no_sync");
    // Construction broadcast rank 0's parameters.
    expect_close(nets[r]->fc2->weight, nets[0]->fc2->weight, 0, 0, "fc2.weight");
  }
}

TEST(DDP, RejectsAModuleWithoutTrainableParameters) {
  auto gs = groups(1);
  auto m = std::make_shared<Blocks>(std::vector<int64_t>{4});
  for (auto& p : m->parameters()) p.requires_grad_(false);
  EXPECT_THROW(DistributedDataParallel(m, gs[0]), ValueError);
}

TEST(EngineCallback, RunsOnceAfterEveryGradientWasAccumulated) {
  Tensor a = ones({3}).requires_grad_(true);
  Tensor b = ones({3}).requires_grad_(true);
  std::vector<std::string> events;
  auto queue = [&](Tensor&) {
    events.push_back("hook");
    if (events.size() == 1) autograd::queue_callback([&] { events.push_back("callback"); });
  };
  auto h1 = a.register_post_accumulate_grad_hook(queue);
  auto h2 = b.register_post_accumulate_grad_hook(queue);
  ((a * 2).sum() + (b * 3).sum()).backward();
  EXPECT_EQ(events, (std::vector<std::string>{"hook", "hook", "callback"}));
  EXPECT_THROW(autograd::queue_callback([] {}), ValueError);
}

}  // namespace
}  // namespace kiln
