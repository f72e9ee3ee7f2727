// DistributedDataParallel over the MPI process group, one rank per process:
// run on 2 and 4 ranks (ctest dist_2, dist_4). Every rank computes the
// one-process reference itself from the same seeded data.
#include <gtest/gtest.h>

#include "dist/ddp_nets.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"

namespace kiln {
namespace {

using dist::DistributedDataParallel;
using test::make_net;
using test::mse;
using test::Net;

class DDPMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's DDPMpi cases run under mpirun: ctest -R dist_";
    pg = dist::world();
    n = pg->size();
    rank = pg->rank();
  }
  dist::ProcessGroupPtr pg;
  int n = 1, rank = 0;
};

constexpr double kSmallCap = 1024.0 / (1024 * 1024);  // ~1 fc weight per bucket: several buckets

TEST_F(DDPMpi, MatchesOneProcessOnTheWholeBatch) {
  const int64_t B = 3, K = 4;
  auto batches = test::make_batches(n * B, K, 42);
  auto ref = make_net(7);
  ref->use_extra = false;
  test::train_reference(*ref, batches);
  // Only rank 0 starts from the reference's weights: the broadcast at construction must fix the others.
  auto net = make_net(rank == 0 ? 7 : 100 + rank);
  net->use_extra = false;
  test::train_rank(net, pg, batches, B, {.bucket_cap_mb = kSmallCap, .find_unused_parameters = true});
  test::expect_same_parameters(*net, *ref, "rank " + std::to_string(rank) + " of " + std::to_string(n));
}

TEST_F(DDPMpi, MatchesWithTheDefaultBucketAndNoUnusedParameters) {
  const int64_t B = 2, K = 3;
  auto batches = test::make_batches(n * B, K, 43);
  auto ref = make_net(8);
  ref->use_extra = true;
  ref->use_never = true;
  test::train_reference(*ref, batches);
  auto net = make_net(rank == 0 ? 8 : 200 + rank);
  net->use_extra = true;
  net->use_never = true;
  test::train_rank(net, pg, batches, B, {});
  test::expect_same_parameters(*net, *ref, "rank " + std::to_string(rank));
}

TEST_F(DDPMpi, FirstAllreduceStartsBeforeBackwardEnds) {
  auto net = make_net(1);
  DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = kSmallCap, .find_unused_parameters = true});
  mse(ddp(ones({4, 6})), zeros({4, 3})).backward();
  const auto& s = ddp.stats();
  ASSERT_GT(ddp.buckets().size(), 2u);
  EXPECT_EQ(s.allreduces, static_cast<int64_t>(ddp.buckets().size()));
  EXPECT_GT(s.pending_at_first_allreduce, 0);
  EXPECT_LE(s.first_allreduce_start, s.last_gradient_ready);
  EXPECT_LE(s.last_gradient_ready, s.backward_end);
}

TEST_F(DDPMpi, NoSyncAccumulationMatchesOneProcess) {
  const int64_t B = 2, A = 3;
  auto batches = test::make_batches(n * B, A, 5);
  auto ref = make_net(3);
  ref->use_extra = false;
  for (int64_t a = 0; a < A; ++a) mse((*ref)(batches.xs[a]), batches.ys[a]).backward();
  auto net = make_net(3);
  net->use_extra = false;
  DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = kSmallCap, .find_unused_parameters = true});
  auto shard = [&](const Tensor& t) { return t.narrow(0, rank * B, B); };
  {
    auto guard = ddp.no_sync();
    for (int64_t a = 0; a < A - 1; ++a) mse(ddp(shard(batches.xs[a])), shard(batches.ys[a])).backward();
  }
  mse(ddp(shard(batches.xs[A - 1])), shard(batches.ys[A - 1])).backward();
  auto got = net->named_parameters();
  auto want = ref->named_parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].second.grad().defined(), want[i].second.grad().defined()) << want[i].first;
    if (want[i].second.grad().defined()) {
      test::expect_close(got[i].second.grad(), want[i].second.grad(), test::kRtol, test::kAtol, want[i].first);
    }
  }
}

TEST_F(DDPMpi, UnusedParametersRaiseOnEveryRank) {
  auto net = make_net(1);
  net->use_extra = false;
  DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = kSmallCap});
  Tensor loss = mse(ddp(ones({2, 6})), zeros({2, 3}));
  try {
    loss.backward();
    FAIL() << "expected an error about unused parameters";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'extra.weight', 'extra.bias', 'never.weight', 'never.bias'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("find_unused_parameters = true"), std::string::npos) << msg;
  }
  // The group is still in step: every rank issued the same collectives.
  Tensor t = full({1}, 1.0);
  pg->allreduce(t)->wait();
  EXPECT_EQ(t.data_ptr<float>()[0], static_cast<float>(n));
}

// torch checks at construction that every rank wraps the same model; without
// the check, the first broadcast failed with only MPI_ERR_TRUNCATE, and a
// transposed shape ([3, 4] against [4, 3]) was not noticed at all.
TEST_F(DDPMpi, DifferentModelsAcrossRanksAreRefusedAtWrapNamingTheTensor) {
  auto expect_refused = [&](std::vector<int64_t> rank0_sizes, std::vector<int64_t> last_sizes,
                            const std::string& want) {
    auto m = std::make_shared<test::Blocks>(rank == n - 1 ? last_sizes : rank0_sizes);
    try {
      DistributedDataParallel ddp(m, pg);
      FAIL() << "expected the ranks' different models to be refused";
    } catch (const DistributedError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
      EXPECT_NE(msg.find("on rank " + std::to_string(n - 1)), std::string::npos) << msg;
    }
  };
  expect_refused({4, 5, 6}, {4, 7, 6}, "parameter 'p1' float32 [5]; on rank");
  expect_refused({4, 5}, {4, 5, 6}, "is, on rank 0, absent");

  // Same element count, other shape: a transposed weight.
  struct Mat : nn::Module {
    explicit Mat(bool transposed) : nn::Module("Mat") {
      register_parameter("w", transposed ? ones({4, 3}) : ones({3, 4}));
    }
    Tensor forward(const Tensor& x) override { return x; }
  };
  try {
    DistributedDataParallel ddp(std::make_shared<Mat>(rank == n - 1), pg);
    FAIL() << "expected [3, 4] against [4, 3] to be refused";
  } catch (const DistributedError& e) {
    EXPECT_NE(std::string(e.what()).find("'w' float32 [3, 4]; on rank " + std::to_string(n - 1) +
                                         ", parameter 'w' float32 [4, 3]"),
              std::string::npos)
        << e.what();
  }
  // Every rank threw at the same point, so the group is still in step.
  Tensor t = full({1}, 1.0);
  pg->allreduce(t)->wait();
  EXPECT_EQ(t.data_ptr<float>()[0], static_cast<float>(n));
}

TEST_F(DDPMpi, ParameterUsedOnOneRankIsAveragedWithZeros) {
  Tensor x = [&] {
    manual_seed(9);
    return randn({n * 2, 6});
  }();
  Tensor y = randn({n * 2, 3});
  auto ref = make_net(4);
  for (int r = 0; r < n; ++r) {
    ref->use_extra = r == 1;
    (mse((*ref)(x.narrow(0, r * 2, 2)), y.narrow(0, r * 2, 2)) * (1.0 / n)).backward();
  }
  auto net = make_net(4);
  net->use_extra = rank == 1;
  DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = kSmallCap, .find_unused_parameters = true});
  mse(ddp(x.narrow(0, rank * 2, 2)), y.narrow(0, rank * 2, 2)).backward();
  auto got = net->named_parameters();
  auto want = ref->named_parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    const bool never = want[i].first.starts_with("never.");
    EXPECT_EQ(got[i].second.grad().defined(), !never) << want[i].first;
    if (!never) test::expect_close(got[i].second.grad(), want[i].second.grad(), test::kRtol, test::kAtol, want[i].first);
  }
}

}  // namespace
}  // namespace kiln
