// DDP's bucket layout and how its allreduces progress (issue 26 §2): the
// small first bucket, buckets rebuilt in the order gradients became ready
// (rank 0's order, the same on every rank), gradients equal to a plain
// allreduce average, the back-off progress path of the MPI backend, and
// find_unused_parameters keeping its buckets. DDPBuckets.* run on the
// in-process fake group; DDPBucketsMpi.* under mpirun (ctest dist_2, dist_4).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <thread>

#include "dist/ddp_nets.h"
#include "dist/fake_group.h"
#include "dist/mpi_process_group.h"
#include "kiln/core/half.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"

namespace kiln {
namespace {

using dist::DDPOptions;
using dist::DistributedDataParallel;
using test::Blocks;
using test::FakeGroup;
using test::FakeWorld;
using test::mse;

constexpr double kMiB = 1024.0 * 1024.0;

// Linear layers applied in an order chosen per rank, so that backward makes
// the gradients ready in a rank-dependent order: the ranks must still agree
// on one bucket layout.
class Chain : public nn::Module {
 public:
  explicit Chain(std::vector<size_t> order) : nn::Module("Chain"), order_(std::move(order)) {
    for (int i = 0; i < 4; ++i) {
      layers_.push_back(register_module("l" + std::to_string(i), std::make_shared<nn::Linear>(nn::LinearOptions{
                                                                      .in_features = 8, .out_features = 8})));
    }
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (size_t i : order_) h = (*layers_[i])(h).tanh();
    return h;
  }

 private:
  std::vector<size_t> order_;
  std::vector<std::shared_ptr<nn::Linear>> layers_;
};

std::vector<size_t> flat_layout(const DistributedDataParallel& ddp) {
  std::vector<size_t> all;
  for (const auto& b : ddp.buckets()) all.insert(all.end(), b.params.begin(), b.params.end());
  return all;
}

// Runs two synced iterations of a Chain whose use order depends on the rank;
// returns rank 0's ready order of the first backward and checks the layout.
void check_rebuild_agreement(const dist::ProcessGroupPtr& pg, std::vector<size_t>* rank0_first_order,
                             std::vector<size_t>* layout) {
  const int rank = pg->rank();
  std::vector<size_t> use = rank % 2 == 0 ? std::vector<size_t>{2, 0, 3, 1} : std::vector<size_t>{1, 3, 0, 2};
  manual_seed(11);
  auto net = std::make_shared<Chain>(use);
  // 8x8 weights are 256 B: a cap of 600 B makes several buckets.
  DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = 600 / kMiB, .first_bucket_cap_mb = 300 / kMiB});
  manual_seed(20 + static_cast<uint64_t>(rank));
  Tensor x = randn({3, 8});
  mse(ddp(x), zeros({3, 8})).backward();
  EXPECT_FALSE(ddp.buckets_rebuilt());
  const std::vector<size_t> first = ddp.stats().ready_order;
  ASSERT_EQ(first.size(), ddp.parameter_names().size());
  // The ranks' own orders differ (their chains run in other orders).
  EXPECT_NE(first, flat_layout(ddp));
  for (auto& p : net->parameters()) p.mutable_grad() = Tensor();
  mse(ddp(x), zeros({3, 8})).backward();
  EXPECT_TRUE(ddp.buckets_rebuilt());
  // This rank's second backward ran in its own order, but the layout is rank 0's.
  *layout = flat_layout(ddp);
  if (rank == 0) *rank0_first_order = first;
  EXPECT_EQ(ddp.stats().allreduces, static_cast<int64_t>(ddp.buckets().size()));
  EXPECT_NE(ddp.buckets().size(), 0u);
  // Caps hold after the rebuild: the first bucket within the first cap (one
  // parameter may exceed it alone), the others within the cap.
  for (size_t b = 0; b < ddp.buckets().size(); ++b) {
    const auto& info = ddp.buckets()[b];
    if (info.params.size() > 1) EXPECT_LE(info.bytes, b == 0 ? 300 : 600) << "bucket " << b;
  }
}

TEST(DDPBuckets, DefaultsAreASmallFirstBucketAndRebuilding) {
  DDPOptions o;
  EXPECT_EQ(o.first_bucket_cap_mb, 1.0);
  EXPECT_EQ(o.last_bucket_cap_mb, 1.0);
  EXPECT_TRUE(o.rebuild_buckets);
  EXPECT_EQ(o.bucket_cap_mb, 25.0);
}

TEST(DDPBuckets, FirstBucketHoldsAtMostTheFirstCap) {
  auto world = std::make_shared<FakeWorld>(1);
  auto g = std::make_shared<FakeGroup>(world, 0);
  // Ten parameters of 0.25 MiB: backward's first four fill the 1 MiB first
  // bucket exactly; without a last cap (PyTorch's layout) the other six share
  // one bucket under the 25 MiB cap.
  auto m = std::make_shared<Blocks>(std::vector<int64_t>(10, 65536));
  DistributedDataParallel ddp(m, g, {.last_bucket_cap_mb = 0});
  ASSERT_EQ(ddp.buckets().size(), 2u);
  EXPECT_EQ(ddp.buckets()[0].params, (std::vector<size_t>{9, 8, 7, 6}));
  EXPECT_EQ(ddp.buckets()[0].bytes, static_cast<int64_t>(kMiB));
  EXPECT_EQ(ddp.buckets()[1].params.size(), 6u);

  // The first cap is min(first_bucket_cap_mb, bucket_cap_mb): 0.5 MiB here.
  auto m2 = std::make_shared<Blocks>(std::vector<int64_t>(10, 65536));
  DistributedDataParallel ddp2(m2, g, {.bucket_cap_mb = 0.5, .first_bucket_cap_mb = 4});
  ASSERT_EQ(ddp2.buckets().size(), 5u);
  for (const auto& b : ddp2.buckets()) EXPECT_EQ(b.bytes, static_cast<int64_t>(kMiB / 2));

  // A first cap of 0.3 MiB takes one parameter; then 1 MiB buckets of four.
  auto m3 = std::make_shared<Blocks>(std::vector<int64_t>(10, 65536));
  DistributedDataParallel ddp3(m3, g, {.bucket_cap_mb = 1, .first_bucket_cap_mb = 0.3});
  std::vector<size_t> sizes;
  for (const auto& b : ddp3.buckets()) sizes.push_back(b.params.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 4, 4, 1}));

  EXPECT_THROW(DistributedDataParallel(m3, g, {.first_bucket_cap_mb = 0}), ValueError);
}

TEST(DDPBuckets, LastBucketHoldsTheLastGradientsUpToTheLastCap) {
  auto world = std::make_shared<FakeWorld>(1);
  auto g = std::make_shared<FakeGroup>(world, 0);
  // The defaults on ten 0.25 MiB parameters: the 1 MiB first bucket, then the
  // six others, of which the four backward produces last (registered first)
  // go to a last bucket of 1 MiB.
  auto m = std::make_shared<Blocks>(std::vector<int64_t>(10, 65536));
  DistributedDataParallel ddp(m, g, {});
  ASSERT_EQ(ddp.buckets().size(), 3u);
  EXPECT_EQ(ddp.buckets()[0].params, (std::vector<size_t>{9, 8, 7, 6}));
  EXPECT_EQ(ddp.buckets()[1].params, (std::vector<size_t>{5, 4}));
  EXPECT_EQ(ddp.buckets()[2].params, (std::vector<size_t>{3, 2, 1, 0}));
  EXPECT_EQ(ddp.buckets()[1].bytes, static_cast<int64_t>(kMiB / 2));
  EXPECT_EQ(ddp.buckets()[2].bytes, static_cast<int64_t>(kMiB));

  // A last cap below one parameter still takes one; a last bucket already
  // within the cap stays whole.
  auto m2 = std::make_shared<Blocks>(std::vector<int64_t>(10, 65536));
  DistributedDataParallel ddp2(m2, g, {.last_bucket_cap_mb = 0.1});
  std::vector<size_t> sizes;
  for (const auto& b : ddp2.buckets()) sizes.push_back(b.params.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{4, 5, 1}));
  auto m3 = std::make_shared<Blocks>(std::vector<int64_t>(10, 65536));
  DistributedDataParallel ddp3(m3, g, {.bucket_cap_mb = 1, .last_bucket_cap_mb = 2});
  sizes.clear();
  for (const auto& b : ddp3.buckets()) sizes.push_back(b.params.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{4, 4, 2}));

  // A backward through the three buckets launches three allreduces and
  // leaves every gradient (d/dp of sum(p^2) * mean(x) = 2 p * 0.5 = 1).
  ddp(full({4}, 0.5)).backward();
  EXPECT_EQ(ddp.stats().allreduces, 3);
  for (const Tensor& p : m->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().min().item<float>(), 1.0f);
    EXPECT_EQ(p.grad().max().item<float>(), 1.0f);
  }

  EXPECT_THROW(DistributedDataParallel(m3, g, {.last_bucket_cap_mb = -1}), ValueError);
}

TEST(DDPBuckets, RebuildAgreesOnRankZerosOrderOnTheFakeGroup) {
  auto world = std::make_shared<FakeWorld>(2);
  std::vector<std::vector<size_t>> layouts(2);
  std::vector<size_t> rank0;
  world->run([&](int r) {
    auto g = std::make_shared<FakeGroup>(world, r);
    std::vector<size_t> mine;
    check_rebuild_agreement(g, r == 0 ? &rank0 : &mine, &layouts[static_cast<size_t>(r)]);
  });
  EXPECT_EQ(layouts[0], rank0);
  EXPECT_EQ(layouts[1], rank0);
}

TEST(DDPBuckets, FindUnusedParametersAndRebuildOffKeepTheirBuckets) {
  for (const bool find_unused : {true, false}) {
    auto world = std::make_shared<FakeWorld>(2);
    world->run([&](int r) {
      auto g = std::make_shared<FakeGroup>(world, r);
      manual_seed(3);
      auto net = std::make_shared<Chain>(std::vector<size_t>{3, 2, 1, 0});  // ready order = registration order
      DDPOptions o{.bucket_cap_mb = 600 / kMiB, .first_bucket_cap_mb = 300 / kMiB};
      if (find_unused) {
        o.find_unused_parameters = true;
      } else {
        o.rebuild_buckets = false;
      }
      DistributedDataParallel ddp(net, g, o);
      const auto before = flat_layout(ddp);
      for (int it = 0; it < 3; ++it) {
        for (auto& p : net->parameters()) p.mutable_grad() = Tensor();
        mse(ddp(ones({2, 8})), zeros({2, 8})).backward();
      }
      EXPECT_FALSE(ddp.buckets_rebuilt());
      EXPECT_EQ(flat_layout(ddp), before);
      EXPECT_NE(ddp.stats().ready_order, before);  // a rebuild would have changed the layout
    });
  }
}

// Every rank's `t`, in rank order.
std::vector<Tensor> gathered(const dist::ProcessGroupPtr& pg, const Tensor& t) {
  std::vector<Tensor> all(static_cast<size_t>(pg->size()));
  for (auto& a : all) a = empty(t.sizes());
  pg->allgather(all, t)->wait();
  return all;
}

// The fake group's ranks are threads sharing one generator: they draw under this.
std::mutex& draw_mutex() {
  static std::mutex m;
  return m;
}

// Two copies of the test MLP from one seed (every parameter used): one for
// the local reference, one for DDP.
std::pair<std::shared_ptr<test::Net>, std::shared_ptr<test::Net>> twin_nets(std::unique_lock<std::mutex>& lock) {
  lock.lock();
  auto plain = test::make_net(5);
  auto net = test::make_net(5);
  lock.unlock();
  plain->use_never = net->use_never = true;
  return {plain, net};
}

// Buckets of at most 1 KiB after a 300 B first one: several per backward.
const DDPOptions kTwoBuckets{.bucket_cap_mb = 1024 / kMiB, .first_bucket_cap_mb = 300 / kMiB};

// A batch for `rank` at iteration `it`: the fake group's ranks are threads
// sharing one generator, so they draw under `lock`.
std::pair<Tensor, Tensor> batch(std::unique_lock<std::mutex>& lock, uint64_t seed) {
  lock.lock();
  manual_seed(seed);
  Tensor x = randn({4, 6}), y = randn({4, 3});
  lock.unlock();
  return {x, y};
}

// DDP under a compression hook against each rank's local gradients gathered
// here: every gradient rounded to the wire type, the rounded values averaged in
// float32 and rounded once more (Note [Compressed gradients] in ddp.cpp). Bit
// for bit on 2 ranks; on more, the float32 sum's order may move the result by
// one step of the wire type. Half the bytes of the float32 allreduce.
void check_compressed_gradients(const dist::ProcessGroupPtr& pg, dist::CommHook hook) {
  const int n = pg->size(), rank = pg->rank();
  const DType wire = hook == dist::CommHook::Bf16Compress ? kBFloat16 : kFloat16;
  auto round_to = [wire](float x) {
    return wire == kBFloat16 ? static_cast<float>(BFloat16(x)) : static_cast<float>(Half(x));
  };
  std::unique_lock lock(draw_mutex(), std::defer_lock);
  auto [plain, net] = twin_nets(lock);
  DistributedDataParallel ddp(net, pg, kTwoBuckets);
  ddp.register_comm_hook(hook);
  EXPECT_EQ(ddp.options().comm_hook, hook);
  int64_t values = 0;
  for (const auto& p : net->parameters()) values += p.numel();
  for (int it = 0; it < 2; ++it) {
    const auto [x, y] = batch(lock, 300 + static_cast<uint64_t>(10 * it + rank));
    for (auto& p : plain->parameters()) p.mutable_grad() = Tensor();
    for (auto& p : net->parameters()) p.mutable_grad() = Tensor();
    mse((*plain)(x), y).backward();
    mse(ddp(x), y).backward();
    EXPECT_EQ(ddp.stats().wire_bytes, 2 * values) << "two bytes a gradient value";
    auto pp = plain->named_parameters();
    auto dp = net->named_parameters();
    for (size_t k = 0; k < pp.size(); ++k) {
      const Tensor local = pp[k].second.grad().contiguous();
      const std::vector<Tensor> all = gathered(pg, local);
      const float* g = dp[k].second.grad().contiguous().data_ptr<float>();
      for (int64_t i = 0; i < local.numel(); ++i) {
        float sum = 0;
        for (const auto& a : all) sum += round_to(a.data_ptr<float>()[i]);
        const float want = round_to(sum / static_cast<float>(n));
        if (n == 2) {
          ASSERT_EQ(g[i], want) << comm_hook_name(hook) << " " << pp[k].first << "[" << i << "] iteration " << it;
        } else {
          const float step = std::fabs(want) * (wire == kBFloat16 ? 0x1p-7f : 0x1p-10f) + 1e-30f;
          ASSERT_LE(std::fabs(g[i] - want), step) << comm_hook_name(hook) << " " << pp[k].first << "[" << i << "]";
        }
        ASSERT_EQ(g[i], round_to(g[i])) << "a value of the wire type";
      }
    }
  }
}

TEST(DDPBuckets, CompressionHooksOnTheFakeGroup) {
  for (auto hook : {dist::CommHook::Bf16Compress, dist::CommHook::Fp16Compress}) {
    auto world = std::make_shared<FakeWorld>(2);
    world->run([&](int r) { check_compressed_gradients(std::make_shared<FakeGroup>(world, r), hook); });
  }
}

// PowerSGD (torch's powerSGD_hook) against each rank's local gradients
// gathered here:
// - at full rank (r at least every dimension, min_compression_rate 0 so that
//   every gradient, biases as [k, 1], is compressed) P Qᵀ spans the average
//   exactly: equal to it within float32 rounding of the factors;
// - at rank 1 the first backward (before start_powerSGD_iter) is the plain
//   average, the next one gives every matrix rank 1 (all 2 x 2 minors vanish),
//   the same bits on every rank, and fewer bytes than the plain allreduce.
void check_powersgd(const dist::ProcessGroupPtr& pg) {
  const int n = pg->size(), rank = pg->rank();
  std::unique_lock lock(draw_mutex(), std::defer_lock);
  auto [plain, full] = twin_nets(lock);
  auto low = twin_nets(lock).second;
  DistributedDataParallel ddp_full(full, pg, kTwoBuckets), ddp_low(low, pg, kTwoBuckets);
  ddp_full.register_comm_hook(dist::PowerSGDOptions{
      .matrix_approximation_rank = 64, .start_powerSGD_iter = 0, .min_compression_rate = 0, .use_error_feedback = false});
  ddp_low.register_comm_hook(
      dist::PowerSGDOptions{.matrix_approximation_rank = 1, .start_powerSGD_iter = 1, .min_compression_rate = 0});
  int64_t values = 0;
  for (const auto& p : plain->parameters()) values += p.numel();
  for (int it = 0; it < 2; ++it) {
    const auto [x, y] = batch(lock, 500 + static_cast<uint64_t>(10 * it + rank));
    for (auto* m : {static_cast<nn::Module*>(plain.get()), static_cast<nn::Module*>(full.get()),
                    static_cast<nn::Module*>(low.get())}) {
      for (auto& p : m->parameters()) p.mutable_grad() = Tensor();
    }
    mse((*plain)(x), y).backward();
    mse(ddp_full(x), y).backward();
    EXPECT_TRUE(ddp_full.stats().powersgd);
    mse(ddp_low(x), y).backward();
    EXPECT_EQ(ddp_low.stats().powersgd, it == 1);
    if (it == 1) EXPECT_LT(ddp_low.stats().wire_bytes, 4 * values) << "rank-1 factors are smaller than the gradients";
    auto pp = plain->named_parameters();
    auto fp = full->named_parameters();
    auto lp = low->named_parameters();
    for (size_t k = 0; k < pp.size(); ++k) {
      const std::string what = pp[k].first + " iteration " + std::to_string(it);
      const Tensor local = pp[k].second.grad().contiguous();
      const std::vector<Tensor> all = gathered(pg, local);
      Tensor avg = zeros(local.sizes());
      for (const auto& a : all) avg.add_(a);
      avg.div_(static_cast<double>(n));
      const float scale = avg.abs().max().item<float>();
      const Tensor got_full = fp[k].second.grad().contiguous();
      EXPECT_LE((got_full - avg).abs().max().item<float>(), 1e-4f * scale + 1e-12f) << "full rank, " << what;

      const Tensor got = lp[k].second.grad().contiguous();
      if (it == 0) {
        EXPECT_LE((got - avg).abs().max().item<float>(), 4e-7f * scale + 1e-12f) << "plain step, " << what;
        continue;
      }
      const std::vector<Tensor> seen = gathered(pg, got);
      for (const auto& a : seen) EXPECT_TRUE(a.equal(got)) << "every rank has the same approximation, " << what;
      const int64_t rows = got.size(0), cols = got.numel() / rows;
      const float* g = got.data_ptr<float>();
      const float gmax = got.abs().max().item<float>();
      for (int64_t i = 1; i < rows; ++i) {
        for (int64_t j = 1; j < cols; ++j) {
          const float minor = g[0] * g[i * cols + j] - g[j] * g[i * cols];
          ASSERT_LE(std::fabs(minor), 1e-5f * gmax * gmax) << "rank 1: minor (" << i << ", " << j << "), " << what;
        }
      }
    }
  }
}

// Registering PowerSGD again is a new state, as torch's new PowerSGDState:
// its plain steps count again and its factors take the new rank.
TEST(DDPBuckets, RegisteringPowerSgdAgainStartsAFreshState) {
  auto world = std::make_shared<FakeWorld>(2);
  world->run([&](int r) {
    auto g = std::make_shared<FakeGroup>(world, r);
    std::unique_lock lock(draw_mutex(), std::defer_lock);
    auto net = twin_nets(lock).second;
    DistributedDataParallel ddp(net, g, kTwoBuckets);
    const dist::PowerSGDOptions rank1{.matrix_approximation_rank = 1, .start_powerSGD_iter = 1, .min_compression_rate = 0};
    ddp.register_comm_hook(rank1);
    auto step = [&] {
      for (auto& p : net->parameters()) p.mutable_grad() = Tensor();
      mse(ddp(ones({2, 6})), zeros({2, 3})).backward();
      return ddp.stats();
    };
    EXPECT_FALSE(step().powersgd);
    const int64_t rank1_bytes = step().wire_bytes;
    ddp.register_comm_hook(rank1);
    EXPECT_FALSE(step().powersgd) << "start_powerSGD_iter counts again";
    auto rank2 = rank1;
    rank2.matrix_approximation_rank = 2;
    ddp.register_comm_hook(rank2);
    EXPECT_FALSE(step().powersgd);
    const dist::DDPStats s = step();
    EXPECT_TRUE(s.powersgd);
    EXPECT_GT(s.wire_bytes, rank1_bytes) << "rank-2 factors, not the rank-1 layout of before";
  });
}

TEST(DDPBuckets, PowerSgdOnTheFakeGroup) {
  auto world = std::make_shared<FakeWorld>(2);
  world->run([&](int r) { check_powersgd(std::make_shared<FakeGroup>(world, r)); });
}

// Note [PowerSGD state by parameter]: PowerSGD's Qs and errors follow each
// gradient, not its bucket. A wrapper that rebuilds its buckets computes the
// bits of one that does not; a fresh wrapper given powersgd_state() of
// another after three backwards (a resumed run) computes that one's next
// gradients bit for bit, where a fresh state does not.
void check_powersgd_state(const dist::ProcessGroupPtr& pg) {
  const int rank = pg->rank();
  const dist::PowerSGDOptions o{.matrix_approximation_rank = 1, .start_powerSGD_iter = 0, .min_compression_rate = 0};
  std::unique_lock lock(draw_mutex(), std::defer_lock);
  auto [a_net, b_net] = twin_nets(lock);
  auto [c_net, d_net] = twin_nets(lock);
  DDPOptions no_rebuild = kTwoBuckets;
  no_rebuild.rebuild_buckets = false;
  DistributedDataParallel a(a_net, pg, kTwoBuckets), b(b_net, pg, no_rebuild);
  a.register_comm_hook(o);
  b.register_comm_hook(o);
  std::unique_ptr<DistributedDataParallel> c, d;
  auto grads = [&](DistributedDataParallel& ddp, int it) {
    const auto [x, y] = batch(lock, 700 + static_cast<uint64_t>(10 * it + rank));
    for (auto& p : ddp.module()->parameters()) p.mutable_grad() = Tensor();
    mse(ddp(x), y).backward();
    EXPECT_TRUE(ddp.stats().powersgd);
    std::vector<Tensor> out;
    for (auto& p : ddp.module()->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  for (int it = 0; it < 5; ++it) {
    if (it == 3) {
      const dist::PowerSGDState s = a.powersgd_state();
      EXPECT_EQ(s.iter, 3);
      EXPECT_EQ(s.q.size(), a_net->parameters().size()) << "every gradient is compressed at rate 0";
      EXPECT_EQ(s.error.size(), s.q.size());
      c = std::make_unique<DistributedDataParallel>(c_net, pg, kTwoBuckets);
      c->register_comm_hook(o);
      // A state that does not fit is refused whole.
      dist::PowerSGDState bad = s;
      bad.q.begin()->second = zeros({7, 5});  // no gradient of the test net has a Q of this shape
      EXPECT_THROW(c->load_powersgd_state(bad), ValueError);
      bad = s;
      bad.error["no.such.parameter"] = zeros({1, 1});
      EXPECT_THROW(c->load_powersgd_state(bad), ValueError);
      EXPECT_EQ(c->powersgd_state().iter, 0) << "nothing changed";
      c->load_powersgd_state(s);
      EXPECT_EQ(c->powersgd_state().q.size(), s.q.size());
      d = std::make_unique<DistributedDataParallel>(d_net, pg, kTwoBuckets);
      d->register_comm_hook(o);
    }
    const auto ga = grads(a, it), gb = grads(b, it);
    for (size_t k = 0; k < ga.size(); ++k) ASSERT_TRUE(ga[k].equal(gb[k])) << "rebuilt, parameter " << k << ", " << it;
    if (it < 3) continue;
    const auto gc = grads(*c, it), gd = grads(*d, it);
    bool fresh_differs = false;
    for (size_t k = 0; k < ga.size(); ++k) {
      ASSERT_TRUE(ga[k].equal(gc[k])) << "loaded state, parameter " << k << ", iteration " << it;
      fresh_differs = fresh_differs || !ga[k].equal(gd[k]);
    }
    EXPECT_TRUE(fresh_differs) << "a fresh state gives other gradients, iteration " << it;
  }
  EXPECT_TRUE(a.buckets_rebuilt());
  EXPECT_TRUE(c->buckets_rebuilt());
}

TEST(DDPBuckets, PowerSgdStateFollowsItsGradientsAndLoads) {
  auto world = std::make_shared<FakeWorld>(2);
  world->run([&](int r) { check_powersgd_state(std::make_shared<FakeGroup>(world, r)); });
}

// A hook of one's own (CommHookFn, torch's register_comm_hook with a user
// hook): a sum, then the division chained with dist::then, trains as DDP's
// own average (bitwise on 2 ranks: halving is exact); every bucket is handed
// over once per backward, in order, with its parameters, the last one marked;
// a hook that finishes its work before returning may return null.
void check_custom_hook(const dist::ProcessGroupPtr& pg, bool synchronous) {
  const int n = pg->size(), rank = pg->rank();
  std::unique_lock lock(draw_mutex(), std::defer_lock);
  auto [plain, net] = twin_nets(lock);
  DistributedDataParallel ddp(net, pg, kTwoBuckets);
  std::vector<size_t> seen, params;
  std::vector<bool> last;
  ddp.register_comm_hook([&](dist::ProcessGroup& g, dist::GradBucket& b) -> dist::WorkPtr {
    seen.push_back(b.index);
    last.push_back(b.is_last);
    params.insert(params.end(), b.parameters.begin(), b.parameters.end());
    EXPECT_EQ(b.gradients.size(), b.parameters.size());
    Tensor buf = b.buffer;
    const double by = g.size();
    if (synchronous) {
      g.allreduce(buf, dist::ReduceOp::Sum)->wait();
      buf.div_(by);
      return nullptr;
    }
    return dist::then(g.allreduce(buf, dist::ReduceOp::Sum), [buf, by]() mutable { buf.div_(by); });
  });
  EXPECT_EQ(ddp.options().comm_hook, dist::CommHook::Custom);
  for (int it = 0; it < 2; ++it) {
    const auto [x, y] = batch(lock, 700 + static_cast<uint64_t>(10 * it + rank));
    for (auto& p : plain->parameters()) p.mutable_grad() = Tensor();
    for (auto& p : net->parameters()) p.mutable_grad() = Tensor();
    seen.clear(), last.clear(), params.clear();
    mse((*plain)(x), y).backward();
    mse(ddp(x), y).backward();
    ASSERT_EQ(seen.size(), ddp.buckets().size());
    for (size_t b = 0; b < seen.size(); ++b) {
      EXPECT_EQ(seen[b], b);
      EXPECT_EQ(last[b], b + 1 == seen.size());
    }
    std::sort(params.begin(), params.end());
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i], i) << "every parameter once";
    // The bytes the hook handed to collectives, as dist::traffic() counts them (the fake group counts none).
    if (!dynamic_cast<FakeGroup*>(pg.get())) EXPECT_GT(ddp.stats().wire_bytes, 0);
    auto pp = plain->named_parameters();
    auto dp = net->named_parameters();
    for (size_t k = 0; k < pp.size(); ++k) {
      const std::vector<Tensor> all = gathered(pg, pp[k].second.grad().contiguous());
      Tensor avg = zeros(all[0].sizes());
      for (const auto& a : all) avg.add_(a);
      avg.div_(static_cast<double>(n));
      const Tensor got = dp[k].second.grad().contiguous();
      if (n == 2) {
        EXPECT_TRUE(got.equal(avg)) << pp[k].first;
      } else {
        EXPECT_LE((got - avg).abs().max().item<float>(), 1e-6f * (avg.abs().max().item<float>() + 1e-30f))
            << pp[k].first;
      }
    }
  }
}

TEST(DDPBuckets, CustomHooksOnTheFakeGroup) {
  for (bool synchronous : {false, true}) {
    auto world = std::make_shared<FakeWorld>(2);
    world->run([&](int r) { check_custom_hook(std::make_shared<FakeGroup>(world, r), synchronous); });
  }
}

// Ranks whose hooks differ would pair unrelated bytes; the first synced
// backward compares them and every rank throws, naming each rank's hook.
TEST(DDPBuckets, RanksWithDifferentHooksAreRefusedAtTheFirstBackward) {
  auto world = std::make_shared<FakeWorld>(2);
  std::vector<std::string> errors(2);
  world->run([&](int r) {
    auto g = std::make_shared<FakeGroup>(world, r);
    std::unique_lock lock(draw_mutex(), std::defer_lock);
    auto net = twin_nets(lock).second;
    DistributedDataParallel ddp(net, g);
    if (r == 0) ddp.register_comm_hook(dist::PowerSGDOptions{.matrix_approximation_rank = 2});
    try {
      mse(ddp(ones({2, 6})), zeros({2, 3})).backward();
    } catch (const DistributedError& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0 powersgd (matrix_approximation_rank 2, start_powerSGD_iter 1000), rank 1 allreduce"),
              std::string::npos)
        << e;
  }
}

class DDPBucketsMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's DDPBucketsMpi cases run under mpirun: ctest -R dist_";
    pg = dist::world();
  }
  dist::ProcessGroupPtr pg;
};

TEST_F(DDPBucketsMpi, RebuildAgreesOnRankZerosOrderAcrossRanks) {
  std::vector<size_t> rank0, layout;
  check_rebuild_agreement(pg, &rank0, &layout);
  // Every rank's layout is rank 0's first ready order: compare over the wire.
  Tensor mine = empty({static_cast<int64_t>(layout.size())}, kInt64);
  for (size_t i = 0; i < layout.size(); ++i) mine.data_ptr<int64_t>()[i] = static_cast<int64_t>(layout[i]);
  Tensor want = mine.clone();
  if (pg->rank() == 0) {
    for (size_t i = 0; i < rank0.size(); ++i) want.data_ptr<int64_t>()[i] = static_cast<int64_t>(rank0[i]);
  }
  pg->broadcast(want, 0)->wait();
  for (size_t i = 0; i < layout.size(); ++i) {
    EXPECT_EQ(mine.data_ptr<int64_t>()[i], want.data_ptr<int64_t>()[i]) << "rank " << pg->rank() << " slot " << i;
  }
}

// DDP's averaged gradients against each rank's local gradients gathered and
// averaged here in rank order: bit for bit on 2 ranks (a + b is commutative,
// halving exact); otherwise within the rounding of a sum of n terms in
// another order.
TEST_F(DDPBucketsMpi, GradientsEqualThePlainAllreduceAverage) {
  const int n = pg->size(), rank = pg->rank();
  auto plain = test::make_net(5);
  auto net = test::make_net(5);
  plain->use_never = net->use_never = true;  // every parameter takes part
  // Several buckets, so that the rebuild happens at the second iteration.
  DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = 1024 / kMiB, .first_bucket_cap_mb = 300 / kMiB});
  for (int it = 0; it < 2; ++it) {
    manual_seed(100 + static_cast<uint64_t>(10 * it + rank));
    Tensor x = randn({4, 6}), y = randn({4, 3});
    for (auto& p : plain->parameters()) p.mutable_grad() = Tensor();
    for (auto& p : net->parameters()) p.mutable_grad() = Tensor();
    mse((*plain)(x), y).backward();
    mse(ddp(x), y).backward();
    EXPECT_EQ(ddp.buckets_rebuilt(), it == 1);
    auto pp = plain->named_parameters();
    auto dp = net->named_parameters();
    for (size_t k = 0; k < pp.size(); ++k) {
      const Tensor local = pp[k].second.grad().contiguous();
      const std::vector<Tensor> all = gathered(pg, local);
      const Tensor got = dp[k].second.grad().contiguous();
      const float* g = got.data_ptr<float>();
      for (int64_t i = 0; i < local.numel(); ++i) {
        float sum = 0, abs_sum = 0;
        for (const auto& a : all) {
          sum += a.data_ptr<float>()[i];
          abs_sum += std::fabs(a.data_ptr<float>()[i]);
        }
        const float want = sum / static_cast<float>(n);
        if (n == 2) {
          ASSERT_EQ(g[i], want) << pp[k].first << "[" << i << "] iteration " << it;
        } else {
          const float bound = 2.0f * static_cast<float>(n - 1) * std::numeric_limits<float>::epsilon() * abs_sum /
                              static_cast<float>(n);
          ASSERT_LE(std::fabs(g[i] - want), bound) << pp[k].first << "[" << i << "] iteration " << it;
        }
      }
    }
  }
}

TEST_F(DDPBucketsMpi, CompressionHooksAverageRoundedGradients) {
  for (auto hook : {dist::CommHook::Bf16Compress, dist::CommHook::Fp16Compress}) check_compressed_gradients(pg, hook);
}

TEST_F(DDPBucketsMpi, PowerSgdApproximatesTheAverage) { check_powersgd(pg); }
TEST_F(DDPBucketsMpi, PowerSgdStateFollowsItsGradientsAndLoads) { check_powersgd_state(pg); }

TEST_F(DDPBucketsMpi, CustomHooksAverageAsDdp) {
  for (bool synchronous : {false, true}) check_custom_hook(pg, synchronous);
}

// Groups made with KILN_DIST_PROGRESS=backoff complete their allreduces and
// broadcasts through MPI_Iallreduce / MPI_Ibcast tested with back-off: a rank
// that arrives early sleeps between tests instead of polling; "spin" keeps
// the blocking calls. Both give the same results.
TEST_F(DDPBucketsMpi, BackoffProgressPathCompletesCollectives) {
  const int n = pg->size(), rank = pg->rank();
  std::vector<int> all;
  for (int r = 0; r < n; ++r) all.push_back(r);
  const char* saved = std::getenv("KILN_DIST_PROGRESS");
  const std::string restore = saved ? saved : "";
  // The MPI path's waits: the shared-memory all-reduce (test_shm_allreduce.cpp) is off for these groups.
  const char* saved_shm = std::getenv("KILN_DIST_SHM");
  const std::string restore_shm = saved_shm ? saved_shm : "";
  for (const char* mode : {"backoff", "spin"}) {
    setenv("KILN_DIST_PROGRESS", mode, 1);
    setenv("KILN_DIST_SHM", "0", 1);
    auto g = dist::new_group(all, std::string("progress-") + mode);
    if (saved_shm) {
      setenv("KILN_DIST_SHM", restore_shm.c_str(), 1);
    } else {
      unsetenv("KILN_DIST_SHM");
    }
    auto* mpi = dynamic_cast<dist::detail::MPIProcessGroup*>(g.get());
    ASSERT_NE(mpi, nullptr);
    const bool backoff = std::string(mode) == "backoff";
    EXPECT_EQ(mpi->progress_mode(), backoff ? dist::detail::ProgressMode::Backoff : dist::detail::ProgressMode::Spin);
    const auto before = dist::detail::progress_counters();
    // Rank 0 arrives late: the others wait for it (sleeping, with back-off).
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    Tensor t = full({1000}, static_cast<double>(rank + 1));
    g->allreduce(t, dist::ReduceOp::Avg)->wait();
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.data_ptr<float>()[i], (n + 1) / 2.0f) << mode;
    Tensor s = full({3000}, static_cast<double>(rank));
    g->allreduce(s, dist::ReduceOp::Sum)->wait();
    ASSERT_EQ(s.data_ptr<float>()[2999], n * (n - 1) / 2.0f) << mode;
    Tensor b = full({500}, rank == 0 ? 7.0 : -1.0);
    g->broadcast(b, 0)->wait();
    ASSERT_EQ(b.data_ptr<float>()[499], 7.0f) << mode;
    const auto after = dist::detail::progress_counters();
    if (backoff) {
      EXPECT_EQ(after.completed - before.completed, 3) << "allreduce, allreduce, broadcast through the back-off path";
      if (rank != 0) EXPECT_GT(after.sleeps, before.sleeps) << "an early rank sleeps while it waits";
    } else {
      EXPECT_EQ(after.completed, before.completed) << "spin uses the blocking calls";
    }
    g->barrier()->wait();
  }
  if (restore.empty()) {
    unsetenv("KILN_DIST_PROGRESS");
  } else {
    setenv("KILN_DIST_PROGRESS", restore.c_str(), 1);
  }
}

TEST(DDPBuckets, ProgressModeComesFromTheEnvironment) {
  const char* saved = std::getenv("KILN_DIST_PROGRESS");
  const std::string restore = saved ? saved : "";
  unsetenv("KILN_DIST_PROGRESS");
  EXPECT_EQ(dist::detail::progress_mode_from_env(), dist::detail::ProgressMode::Backoff);
  setenv("KILN_DIST_PROGRESS", "spin", 1);
  EXPECT_EQ(dist::detail::progress_mode_from_env(), dist::detail::ProgressMode::Spin);
  setenv("KILN_DIST_PROGRESS", "busy", 1);
  try {
    dist::detail::progress_mode_from_env();
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("got 'busy'"), std::string::npos) << e.what();
  }
  if (restore.empty()) {
    unsetenv("KILN_DIST_PROGRESS");
  } else {
    setenv("KILN_DIST_PROGRESS", restore.c_str(), 1);
  }
}

}  // namespace
}  // namespace kiln
