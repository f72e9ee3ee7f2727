// DataLoader: coverage per epoch, determinism across num_workers, in-order
// delivery, resume mid-epoch, worker exceptions with the sample index,
// early-break shutdown, stall accounting, custom collate.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/data/loader.h"
#include "kiln/ops/elementwise.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

namespace {

/// Sample i: data = [i, i] + noise from the per-sample generator, target = i.
class NoisyIndexDataset : public Dataset<Example> {
 public:
  explicit NoisyIndexDataset(int64_t n, int64_t throw_at = -1, int sleep_ms = 0)
      : n_(n), throw_at_(throw_at), sleep_ms_(sleep_ms) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    if (i == throw_at_) throw ValueError("bad sample on purpose");
    if (sleep_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    Tensor noise = rand({2}, TensorOptions().dtype(kFloat32), &sample_generator());
    return {add(full({2}, static_cast<double>(i), TensorOptions().dtype(kFloat32)), noise),
            scalar_tensor(i, TensorOptions().dtype(kInt64))};
  }

 private:
  int64_t n_, throw_at_;
  int sleep_ms_;
};

std::vector<Example> run_epoch(DataLoader<>& loader) {
  std::vector<Example> out;
  for (auto& b : loader) out.push_back(b);
  return out;
}

std::vector<int64_t> targets(const std::vector<Example>& batches) {
  std::vector<int64_t> out;
  for (auto& b : batches)
    for (double v : test::to_doubles(b.target)) out.push_back(static_cast<int64_t>(v));
  return out;
}

}  // namespace

TEST(DataLoader, EveryIndexOncePerEpochInOrderBatches) {
  auto ds = std::make_shared<NoisyIndexDataset>(103);
  for (int64_t workers : {0, 3}) {
    DataLoader<> loader(ds, {.batch_size = 10, .shuffle = true, .num_workers = workers, .seed = 9});
    EXPECT_EQ(loader.size(), 11);
    std::vector<int64_t> prev;
    for (int epoch = 0; epoch < 2; ++epoch) {
      auto batches = run_epoch(loader);
      ASSERT_EQ(batches.size(), 11u);
      EXPECT_EQ(batches.back().data.size(0), 3);
      auto t = targets(batches);
      std::vector<int64_t> sorted = t;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t i = 0; i < 103; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i) << "epoch " << epoch;
      EXPECT_NE(t, prev) << "each epoch reshuffles";
      prev = t;
    }
  }
  DataLoader<> seq(ds, {.batch_size = 10, .num_workers = 2, .drop_last = true});
  auto t = targets(run_epoch(seq));
  ASSERT_EQ(t.size(), 100u);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(t[static_cast<size_t>(i)], i) << "delivered out of order";
}

// Batches are data until the model computes on them, whichever thread made them.
TEST(DataLoader, BatchesAreChargedToData) {
  auto ds = std::make_shared<NoisyIndexDataset>(20);
  for (int64_t workers : {0, 2}) {
    DataLoader<> loader(ds, {.batch_size = 4, .num_workers = workers});
    for (auto& b : loader) {
      EXPECT_EQ(b.data.storage()->category(), MemoryCategory::Data) << "num_workers " << workers;
      EXPECT_EQ(b.target.storage()->category(), MemoryCategory::Data) << "num_workers " << workers;
    }
  }
  EXPECT_EQ(current_memory_category(), MemoryCategory::Activation) << "the guard must not outlive the fetch";
}

TEST(DataLoader, BitwiseIdenticalAcrossNumWorkers) {
  auto ds = std::make_shared<NoisyIndexDataset>(77);
  std::vector<std::vector<Example>> ref;
  for (int64_t workers : {0, 1, 2, 4}) {
    DataLoader<> loader(ds, {.batch_size = 8, .shuffle = true, .num_workers = workers, .prefetch_factor = 2,
                             .seed = 123});
    std::vector<std::vector<Example>> epochs = {run_epoch(loader), run_epoch(loader)};
    if (ref.empty()) {
      ref = epochs;
      EXPECT_FALSE(test::bitwise_equal(ref[0][0].data, ref[1][0].data));
      continue;
    }
    for (size_t e = 0; e < 2; ++e) {
      ASSERT_EQ(epochs[e].size(), ref[e].size());
      for (size_t b = 0; b < ref[e].size(); ++b) {
        EXPECT_TRUE(test::bitwise_equal(epochs[e][b].data, ref[e][b].data)) << workers << " workers, batch " << b;
        EXPECT_TRUE(test::bitwise_equal(epochs[e][b].target, ref[e][b].target));
      }
    }
  }
}

TEST(DataLoader, ResumeMidEpochYieldsTheRemainingBatches) {
  auto ds = std::make_shared<NoisyIndexDataset>(50);
  DataLoader<> full(ds, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 5});
  run_epoch(full);  // epoch 0
  auto expected = run_epoch(full);  // epoch 1

  DataLoader<> first(ds, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 5});
  run_epoch(first);
  LoaderState saved;
  int64_t seen = 0;
  for (auto& b : first) {
    (void)b;
    if (++seen == 5) {
      saved = first.state();
      break;
    }
  }
  EXPECT_EQ(saved, (LoaderState{.epoch = 1, .position = 5, .seed = 5}));

  DataLoader<> resumed(ds, {.batch_size = 4, .shuffle = true, .num_workers = 3, .seed = 5});
  resumed.load_state(saved);
  auto rest = run_epoch(resumed);
  ASSERT_EQ(rest.size(), expected.size() - 5);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_TRUE(test::bitwise_equal(rest[i].data, expected[i + 5].data)) << i;
    EXPECT_TRUE(test::bitwise_equal(rest[i].target, expected[i + 5].target)) << i;
  }
  EXPECT_EQ(resumed.state(), (LoaderState{.epoch = 2, .position = 0, .seed = 5}));
  EXPECT_THROW(resumed.load_state({.epoch = 0, .position = 0, .seed = 6}), ValueError);
}

// Issue 27: without options.seed the order follows manual_seed (torch draws
// its loader base seed from the global generator); an explicit seed ignores it.
TEST(DataLoader, DefaultSeedFollowsManualSeed) {
  auto ds = std::make_shared<NoisyIndexDataset>(40);
  auto order = [&](std::optional<uint64_t> global, std::optional<uint64_t> seed) {
    if (global) manual_seed(*global);
    DataLoader<> loader(ds, {.batch_size = 8, .shuffle = true, .seed = seed});
    return targets(run_epoch(loader));
  };
  const auto a0 = order(0, std::nullopt), a1 = order(1, std::nullopt), b0 = order(0, std::nullopt);
  EXPECT_NE(a0, a1) << "manual_seed(0) and manual_seed(1) gave the same shuffle";
  EXPECT_EQ(a0, b0) << "the same manual_seed gave different shuffles";
  EXPECT_EQ(order(0, 5), order(1, 5)) << "an explicit seed must not depend on the global generator";
  // Two loaders built one after the other draw different seeds, as torch's do.
  manual_seed(0);
  DataLoader<> x(ds, {.batch_size = 8, .shuffle = true}), y(ds, {.batch_size = 8, .shuffle = true});
  EXPECT_NE(x.seed(), y.seed());
}

// A drawn seed is replaced by the saved one on load_state, so a resumed run
// continues the saved order even when its global RNG was at another point.
TEST(DataLoader, ResumeWithADrawnSeedAdoptsTheSavedSeed) {
  auto ds = std::make_shared<NoisyIndexDataset>(40);
  manual_seed(11);
  DataLoader<> first(ds, {.batch_size = 4, .shuffle = true, .num_workers = 2});
  auto expected = run_epoch(first);
  DataLoader<> cut(ds, {.batch_size = 4, .shuffle = true, .seed = first.seed()});
  LoaderState saved;
  int64_t seen = 0;
  for (auto& b : cut) {
    (void)b;
    if (++seen == 3) {
      saved = cut.state();
      break;
    }
  }
  manual_seed(99);
  DataLoader<> resumed(ds, {.batch_size = 4, .shuffle = true});
  ASSERT_NE(resumed.seed(), saved.seed);
  resumed.load_state(saved);
  EXPECT_EQ(resumed.seed(), saved.seed);
  auto rest = run_epoch(resumed);
  ASSERT_EQ(rest.size(), expected.size() - 3);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_TRUE(test::bitwise_equal(rest[i].data, expected[i + 3].data)) << i;
    EXPECT_TRUE(test::bitwise_equal(rest[i].target, expected[i + 3].target)) << i;
  }
  // An explicit seed still has to match the saved one, and the error names both.
  DataLoader<> pinned(ds, {.batch_size = 4, .shuffle = true, .seed = saved.seed + 1});
  const std::string msg = test::error_message<ValueError>([&] { pinned.load_state(saved); });
  EXPECT_NE(msg.find("expected seed " + std::to_string(saved.seed + 1)), std::string::npos) << msg;
  EXPECT_NE(msg.find("got " + std::to_string(saved.seed)), std::string::npos) << msg;
}

// Issue 27: a loader moves between epochs (out of a factory, into a member),
// carrying its seed and position; not while an epoch's iterator is alive.
TEST(DataLoader, MovesBetweenEpochsButNotDuringOne) {
  auto ds = std::make_shared<NoisyIndexDataset>(24);
  DataLoader<> ref(ds, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 8});
  run_epoch(ref);
  const auto expected = run_epoch(ref);
  auto make = [&] { return DataLoader<>(ds, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 8}); };
  DataLoader<> first = make();
  run_epoch(first);
  DataLoader<> moved(std::move(first));
  EXPECT_EQ(moved.state(), (LoaderState{.epoch = 1, .position = 0, .seed = 8}));
  const auto got = run_epoch(moved);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(test::bitwise_equal(got[i].data, expected[i].data)) << i;
  {
    auto it = moved.begin();
    EXPECT_THROW(DataLoader<>(std::move(moved)), ValueError);
  }
  DataLoader<> assigned = make();
  assigned = std::move(moved);
  // Where the interrupted epoch left off: epoch 2, its first batch delivered.
  EXPECT_EQ(assigned.state(), (LoaderState{.epoch = 2, .position = 1, .seed = 8}));
}

TEST(DataLoader, WorkerExceptionSurfacesWithTheSampleIndex) {
  auto ds = std::make_shared<NoisyIndexDataset>(40, /*throw_at=*/17);
  for (int64_t workers : {0, 2}) {
    DataLoader<> loader(ds, {.batch_size = 4, .num_workers = workers});
    int64_t batches = 0;
    try {
      for (auto& b : loader) {
        (void)b;
        ++batches;
      }
      FAIL() << "no exception";
    } catch (const ValueError& e) {  // the dataset's exception type is kept
      std::string msg = e.what();
      EXPECT_NE(msg.find("sample 17"), std::string::npos) << msg;
      EXPECT_NE(msg.find("bad sample on purpose"), std::string::npos) << msg;
    }
    EXPECT_EQ(batches, 4) << "batches before the failing one are delivered";
    // The loader is usable after the failure (workers were stopped cleanly).
    DataLoader<> ok(std::make_shared<NoisyIndexDataset>(8), {.batch_size = 4, .num_workers = workers});
    EXPECT_EQ(run_epoch(ok).size(), 2u);
  }
}

TEST(DataLoader, EarlyBreakShutsDownInBoundedTime) {
  auto ds = std::make_shared<NoisyIndexDataset>(10000, -1, /*sleep_ms=*/2);
  auto t0 = std::chrono::steady_clock::now();
  {
    DataLoader<> loader(ds, {.batch_size = 16, .num_workers = 4, .prefetch_factor = 2});
    int n = 0;
    for (auto& b : loader) {
      (void)b;
      if (++n == 3) break;
    }
    EXPECT_EQ(loader.state().position, 3);
    n = 0;
    for (auto& b : loader) {  // a second, new epoch after the break
      (void)b;
      if (++n == 2) break;
    }
    EXPECT_EQ(loader.state().epoch, 1);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0) << "the full epoch would take ~20 s on 4 workers";
}

TEST(DataLoader, OneEpochAtATime) {
  DataLoader<> loader(std::make_shared<NoisyIndexDataset>(20), {.batch_size = 4, .num_workers = 2});
  {
    auto it = loader.begin();
    EXPECT_THROW(loader.begin(), ValueError);
    ++it;
    EXPECT_EQ(loader.state().position, 2);
  }
  EXPECT_EQ(run_epoch(loader).size(), 5u);  // the next epoch, in full
  EXPECT_EQ(loader.state(), (LoaderState{.epoch = 2, .position = 0, .seed = loader.seed()}));
}

TEST(DataLoader, PersistentWorkersGiveTheSameBatches) {
  auto ds = std::make_shared<NoisyIndexDataset>(30);
  DataLoader<> a(ds, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 1, .persistent_workers = true});
  DataLoader<> b(ds, {.batch_size = 4, .shuffle = true, .num_workers = 0, .seed = 1});
  for (int e = 0; e < 3; ++e) {
    auto x = run_epoch(a), y = run_epoch(b);
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(test::bitwise_equal(x[i].data, y[i].data));
  }
}

TEST(DataLoader, SlowTransformStallFractionIsMeasured) {
  auto ds = std::make_shared<NoisyIndexDataset>(40, -1, /*sleep_ms=*/5);
  DataLoader<> loader(ds, {.batch_size = 4, .num_workers = 0});
  for (auto& b : loader) {
    (void)b;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a fast "training step"
  }
  LoaderStats s = loader.stats();
  EXPECT_EQ(s.batches, 10);
  EXPECT_EQ(s.batch_wait_s.size(), 10u);
  EXPECT_GT(s.wait_s, 0.15);  // 40 samples x 5 ms
  EXPECT_GT(s.wait_fraction, 0.5);
  EXPECT_LE(s.wait_fraction, 1.0);
  EXPECT_GT(s.batches_per_s, 0.0);
  EXPECT_NEAR(s.batches_per_s, s.batches / s.wall_s, 1e-9);
}

TEST(DataLoader, CustomCollateAndDistributedSampler) {
  struct Seq {
    std::vector<int64_t> tokens;
  };
  class Seqs : public Dataset<Seq> {
   public:
    int64_t size() const override { return 9; }
    Seq get(int64_t i) const override { return {std::vector<int64_t>(static_cast<size_t>(i % 4 + 1), i)}; }
  };
  // Variable-length sequences padded with -1 to the longest in the batch.
  auto pad = [](std::vector<Seq>&& xs) {
    size_t len = 0;
    for (auto& x : xs) len = std::max(len, x.tokens.size());
    std::vector<int64_t> flat;
    for (auto& x : xs) {
      flat.insert(flat.end(), x.tokens.begin(), x.tokens.end());
      flat.insert(flat.end(), len - x.tokens.size(), -1);
    }
    return tensor(flat, {static_cast<int64_t>(xs.size()), static_cast<int64_t>(len)});
  };
  std::vector<int64_t> firsts;
  for (int64_t rank = 0; rank < 2; ++rank) {
    auto sampler = std::make_shared<DistributedSampler>(
        9, DistributedSamplerOptions{.num_replicas = 2, .rank = rank, .shuffle = false});
    DataLoader<Seq, Tensor> loader(std::make_shared<Seqs>(), {.batch_size = 2, .sampler = sampler,
                                                              .num_workers = 1, .collate = pad});
    std::vector<Tensor> got;
    for (auto& b : loader) got.push_back(b);
    ASSERT_EQ(got.size(), 3u);  // 5 samples per rank (padded)
    EXPECT_EQ(test::to_doubles(got[0]).size(), rank == 0 ? 2u * 3u : 2u * 4u);
    for (auto& g : got) firsts.push_back(static_cast<int64_t>(test::to_doubles(g)[0]));
  }
  EXPECT_EQ(firsts, (std::vector<int64_t>{0, 4, 8, 1, 5, 0}));
  EXPECT_THROW((DataLoader<Seq, Tensor>(std::make_shared<Seqs>(), {.batch_size = 2})), ValueError);
}
