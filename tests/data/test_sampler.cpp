// Datasets and samplers: TensorDataset/SyntheticDataset, sequential/random/batch
// samplers, DistributedSampler partitioning and its forgotten-set_epoch warning.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/data/dataset.h"
#include "kiln/data/sampler.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

TEST(DataDataset, TensorDatasetReturnsRows) {
  Tensor x = arange(12, TensorOptions().dtype(kFloat32)).reshape({4, 3});
  Tensor y = tensor<int64_t>({7, 8, 9, 10});
  TensorDataset ds(x, y);
  EXPECT_EQ(ds.size(), 4);
  Example e = ds.get(2);
  EXPECT_EQ(test::to_doubles(e.data), (std::vector<double>{6, 7, 8}));
  EXPECT_EQ(e.target.item<int64_t>(), 9);
  EXPECT_THROW(ds.get(4), IndexError);
  EXPECT_THROW(TensorDataset(x, tensor<int64_t>({1, 2})), ShapeError);
}

TEST(DataDataset, SyntheticIsAPureFunctionOfSeedAndIndex) {
  SyntheticDataset a({.size = 10, .sample_shape = {2, 3}, .num_classes = 4, .seed = 5});
  SyntheticDataset b({.size = 10, .sample_shape = {2, 3}, .num_classes = 4, .seed = 5});
  SyntheticDataset c({.size = 10, .sample_shape = {2, 3}, .num_classes = 4, .seed = 6});
  for (int64_t i : {0, 3, 9}) {
    EXPECT_TRUE(test::bitwise_equal(a.get(i).data, b.get(i).data));
    EXPECT_TRUE(test::bitwise_equal(a.get(i).target, b.get(i).target));
    EXPECT_FALSE(test::bitwise_equal(a.get(i).data, c.get(i).data));
    int64_t label = a.get(i).target.item<int64_t>();
    EXPECT_GE(label, 0);
    EXPECT_LT(label, 4);
  }
  EXPECT_FALSE(test::bitwise_equal(a.get(0).data, a.get(1).data));
  EXPECT_EQ(a.get(0).data.shape_string(), Tensor(zeros({2, 3})).shape_string());
}

TEST(DataSampler, SequentialAndRandom) {
  SequentialSampler seq(5);
  EXPECT_EQ(seq.indices(), (std::vector<int64_t>{0, 1, 2, 3, 4}));

  RandomSampler r1(100, Generator(42)), r2(100, Generator(42)), r3(100, Generator(43));
  auto p0 = r1.indices();
  EXPECT_EQ(p0, r2.indices());
  EXPECT_NE(p0, r3.indices());
  std::vector<int64_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, SequentialSampler(100).indices());
  EXPECT_EQ(r1.indices(), p0) << "same epoch, same order";
  r1.set_epoch(1);
  auto p1 = r1.indices();
  EXPECT_NE(p1, p0);
  r2.set_epoch(1);
  EXPECT_EQ(r2.indices(), p1) << "the order depends only on (seed, epoch)";
}

TEST(DataSampler, BatchSamplerDropLast) {
  auto s = std::make_shared<SequentialSampler>(10);
  BatchSampler keep(s, 4, false), drop(s, 4, true);
  EXPECT_EQ(keep.size(), 3);
  EXPECT_EQ(drop.size(), 2);
  auto kb = keep.batches();
  ASSERT_EQ(kb.size(), 3u);
  EXPECT_EQ(kb[2], (std::vector<int64_t>{8, 9}));
  auto db = drop.batches();
  ASSERT_EQ(db.size(), 2u);
  EXPECT_EQ(db[1], (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_THROW(BatchSampler(s, 0, false), ValueError);
}

TEST(DataSampler, DistributedPartitionsWithoutOverlap) {
  for (bool shuffle : {false, true}) {
    const int64_t n = 103, world = 4;
    std::vector<int64_t> counts(n, 0);
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(n, {.num_replicas = world, .rank = r, .shuffle = shuffle, .seed = 7, .drop_last = true});
      s.set_epoch(3);
      auto idx = s.indices();
      EXPECT_EQ(static_cast<int64_t>(idx.size()), n / world);
      for (int64_t i : idx) counts[static_cast<size_t>(i)]++;
    }
    int64_t seen = 0;
    for (int64_t c : counts) {
      EXPECT_LE(c, 1) << "an index went to two ranks";
      seen += c;
    }
    EXPECT_EQ(seen, (n / world) * world);
  }
}

TEST(DataSampler, DistributedPadsToEqualLengthsAndCoversAll) {
  const int64_t n = 10, world = 4;
  std::multiset<int64_t> all;
  for (int64_t r = 0; r < world; ++r) {
    DistributedSampler s(n, {.num_replicas = world, .rank = r, .shuffle = true, .seed = 1});
    EXPECT_EQ(s.size(), 3);
    auto idx = s.indices();
    EXPECT_EQ(idx.size(), 3u);
    all.insert(idx.begin(), idx.end());
  }
  EXPECT_EQ(all.size(), 12u);
  for (int64_t i = 0; i < n; ++i) EXPECT_GE(all.count(i), 1u) << i;
}

TEST(DataSampler, DistributedSetEpochChangesShuffleAndForgettingWarnsOnce) {
  DistributedSampler s(50, {.num_replicas = 2, .rank = 1, .shuffle = true, .seed = 3});
  s.set_epoch(0);
  auto e0 = s.indices();
  s.set_epoch(1);
  auto e1 = s.indices();
  EXPECT_NE(e0, e1);

  DistributedSampler f(50, {.num_replicas = 2, .rank = 1, .shuffle = true, .seed = 3});
  testing::internal::CaptureStderr();
  auto a = f.indices();
  std::string first = testing::internal::GetCapturedStderr();
  EXPECT_EQ(first, "") << "the first epoch needs no set_epoch";
  testing::internal::CaptureStderr();
  auto b = f.indices();
  auto c = f.indices();
  std::string later = testing::internal::GetCapturedStderr();
  EXPECT_EQ(a, b);
  EXPECT_EQ(b, c);
  EXPECT_NE(later.find("set_epoch"), std::string::npos) << later;
  EXPECT_EQ(later.find("kiln warning"), later.rfind("kiln warning")) << "warned more than once: " << later;
}
