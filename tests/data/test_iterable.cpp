// IterableDataLoader over a stream: stream order and batching (drop_last),
// reset(epoch) per epoch, bitwise determinism across num_workers, resume by
// re-reading and skipping, exceptions with the running sample index,
// early-break shutdown, and the options a stream rejects.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/data/iterable.h"
#include "kiln/ops/elementwise.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

namespace {

/// Epoch e streams values 1000 e + 0 .. 1000 e + n-1: data = [v, v] + noise
/// from the per-sample generator, target = v.
class CountingStream : public IterableDataset<Example> {
 public:
  explicit CountingStream(int64_t n, int64_t throw_at = -1, int sleep_ms = 0)
      : n_(n), throw_at_(throw_at), sleep_ms_(sleep_ms) {}
  void reset(int64_t epoch) override {
    epoch_ = epoch;
    pos_ = 0;
    ++resets;
  }
  std::optional<Example> next() override {
    if (pos_ >= n_) return std::nullopt;
    if (pos_ == throw_at_) throw ValueError("bad stream record on purpose");
    if (sleep_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    const int64_t v = 1000 * epoch_ + pos_++;
    ++reads;
    Tensor noise = rand({2}, TensorOptions().dtype(kFloat32), &sample_generator());
    return Example{add(full({2}, static_cast<double>(v), TensorOptions().dtype(kFloat32)), noise),
                   scalar_tensor(v, TensorOptions().dtype(kInt64))};
  }
  std::atomic<int64_t> resets{0}, reads{0};

 private:
  int64_t n_, throw_at_, epoch_ = -1, pos_ = 0;
  int sleep_ms_;
};

using Loader = IterableDataLoader<>;

std::vector<Example> run_epoch(Loader& loader) {
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

std::vector<int64_t> iota(int64_t from, int64_t n) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}

}  // namespace

TEST(IterableDataLoader, StreamOrderBatchingAndDropLast) {
  for (int64_t workers : {0, 2}) {
    auto ds = std::make_shared<CountingStream>(23);
    Loader keep(ds, {.batch_size = 5, .num_workers = workers});
    auto e0 = run_epoch(keep);
    ASSERT_EQ(e0.size(), 5u) << workers;
    EXPECT_EQ(e0[0].data.shape_string(), "[5, 2]");
    EXPECT_EQ(e0[4].target.shape_string(), "[3]");  // the short last batch
    EXPECT_EQ(targets(e0), iota(0, 23));
    auto e1 = run_epoch(keep);  // reset(1): the stream's epoch-1 values
    EXPECT_EQ(targets(e1), iota(1000, 23));
    EXPECT_EQ(ds->resets.load(), 2);
    EXPECT_EQ(keep.state(), (StreamLoaderState{.epoch = 2, .samples = 0, .seed = keep.seed()}));

    Loader drop(std::make_shared<CountingStream>(23), {.batch_size = 5, .num_workers = workers, .drop_last = true});
    auto d = run_epoch(drop);
    ASSERT_EQ(d.size(), 4u);
    EXPECT_EQ(targets(d), iota(0, 20));

    Loader empty(std::make_shared<CountingStream>(0), {.batch_size = 5, .num_workers = workers});
    EXPECT_TRUE(run_epoch(empty).empty());
    EXPECT_EQ(empty.state().epoch, 1);
  }
}

TEST(IterableDataLoader, BitwiseIdenticalAcrossNumWorkers) {
  std::vector<std::vector<Example>> ref;
  for (int64_t workers : {0, 1, 2, 4}) {
    Loader loader(std::make_shared<CountingStream>(37),
                  {.batch_size = 8, .num_workers = workers, .prefetch_factor = 2, .seed = 77, .rank = 1});
    std::vector<std::vector<Example>> epochs = {run_epoch(loader), run_epoch(loader)};
    if (ref.empty()) {
      ref = epochs;
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
  // The noise is the per-sample generator's: the same for the same (seed, epoch,
  // rank, running index) and different for another seed.
  Loader other(std::make_shared<CountingStream>(37), {.batch_size = 8, .seed = 78, .rank = 1});
  auto o = run_epoch(other);
  EXPECT_TRUE(test::bitwise_equal(o[0].target, ref[0][0].target));
  EXPECT_FALSE(test::bitwise_equal(o[0].data, ref[0][0].data));
  Generator gen(sample_seed(77, 0, 1, 0));
  Tensor expect0 = rand({2}, TensorOptions().dtype(kFloat32), &gen);
  EXPECT_TRUE(test::bitwise_equal(add(full({2}, 0.0, TensorOptions().dtype(kFloat32)), expect0),
                                  ref[0][0].data.select(0, 0)));
}

TEST(IterableDataLoader, ResumeReReadsAndSkipsTheConsumedSamples) {
  auto ds = std::make_shared<CountingStream>(30);
  Loader full(ds, {.batch_size = 4, .num_workers = 2, .seed = 5});
  run_epoch(full);
  auto expected = run_epoch(full);  // epoch 1: 8 batches

  Loader first(std::make_shared<CountingStream>(30), {.batch_size = 4, .num_workers = 2, .seed = 5});
  run_epoch(first);
  StreamLoaderState saved;
  int64_t seen = 0;
  for (auto& b : first) {
    (void)b;
    if (++seen == 3) {
      saved = first.state();
      break;
    }
  }
  EXPECT_EQ(saved, (StreamLoaderState{.epoch = 1, .samples = 12, .seed = 5}));

  for (int64_t workers : {0, 3}) {
    auto rds = std::make_shared<CountingStream>(30);
    Loader resumed(rds, {.batch_size = 4, .num_workers = workers, .seed = 5});
    resumed.load_state(saved);
    auto rest = run_epoch(resumed);
    ASSERT_EQ(rest.size(), expected.size() - 3);
    for (size_t i = 0; i < rest.size(); ++i) {
      EXPECT_TRUE(test::bitwise_equal(rest[i].data, expected[i + 3].data)) << workers << " workers, " << i;
      EXPECT_TRUE(test::bitwise_equal(rest[i].target, expected[i + 3].target)) << i;
    }
    EXPECT_EQ(rds->resets.load(), 1);
    EXPECT_EQ(rds->reads.load(), 30) << "the 12 consumed samples are re-read and skipped";
    EXPECT_EQ(resumed.state(), (StreamLoaderState{.epoch = 2, .samples = 0, .seed = 5}));
  }

  Loader wrong(std::make_shared<CountingStream>(30), {.batch_size = 4, .seed = 5});
  EXPECT_THROW(wrong.load_state({.epoch = 0, .samples = 0, .seed = 6}), ValueError);
  wrong.load_state({.epoch = 0, .samples = 31, .seed = 5});
  try {
    run_epoch(wrong);
    FAIL() << "resuming past the stream's end should throw";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("past the end"), std::string::npos) << e.what();
  }
}

TEST(IterableDataLoader, ExceptionSurfacesWithTheSampleIndex) {
  for (int64_t workers : {0, 2}) {
    Loader loader(std::make_shared<CountingStream>(40, /*throw_at=*/17), {.batch_size = 4, .num_workers = workers});
    int64_t batches = 0;
    try {
      for (auto& b : loader) {
        (void)b;
        ++batches;
      }
      FAIL() << "no exception";
    } catch (const ValueError& e) {  // the stream's exception type is kept
      std::string msg = e.what();
      EXPECT_NE(msg.find("sample 17"), std::string::npos) << msg;
      EXPECT_NE(msg.find("bad stream record on purpose"), std::string::npos) << msg;
    }
    EXPECT_EQ(batches, 4) << "batches before the failing one are delivered";
    EXPECT_EQ(loader.state(), (StreamLoaderState{.epoch = 0, .samples = 16, .seed = loader.seed()}));
  }
  // A collate error names the samples of the batch.
  IterableDataLoader<Example, Example> bad(
      std::make_shared<CountingStream>(8),
      {.batch_size = 4, .num_workers = 1, .collate = [](std::vector<Example>&&) -> Example {
         throw ShapeError("collate failed on purpose");
       }});
  try {
    run_epoch(bad);
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("samples 0..3"), std::string::npos) << e.what();
  }
}

TEST(IterableDataLoader, EarlyBreakShutsDownInBoundedTime) {
  auto ds = std::make_shared<CountingStream>(10000, -1, /*sleep_ms=*/2);
  auto t0 = std::chrono::steady_clock::now();
  {
    Loader loader(ds, {.batch_size = 16, .num_workers = 2, .prefetch_factor = 2});
    int n = 0;
    for (auto& b : loader) {
      (void)b;
      if (++n == 3) break;
    }
    EXPECT_EQ(loader.state(), (StreamLoaderState{.epoch = 0, .samples = 48, .seed = loader.seed()}));
    n = 0;
    for (auto& b : loader) {  // a second, new epoch after the break
      EXPECT_EQ(static_cast<int64_t>(test::to_doubles(b.target)[0]), 1000 + 16 * n);
      if (++n == 2) break;
    }
    EXPECT_EQ(loader.state().epoch, 1);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0) << "the full epoch would take ~20 s";
  EXPECT_LT(ds->reads.load(), 1000) << "the producer stops at the bounded queue";
}

TEST(IterableDataLoader, OneEpochAtATimeAndRejectedOptions) {
  Loader loader(std::make_shared<CountingStream>(20), {.batch_size = 4, .num_workers = 2});
  {
    auto it = loader.begin();
    EXPECT_THROW(loader.begin(), ValueError);
    ++it;
    EXPECT_EQ(loader.state().samples, 8);
  }
  EXPECT_EQ(run_epoch(loader).size(), 5u);
  auto ds = std::make_shared<CountingStream>(4);
  EXPECT_THROW(Loader(ds, {.shuffle = true}), ValueError);
  EXPECT_THROW(Loader(ds, {.sampler = std::make_shared<SequentialSampler>(4)}), ValueError);
  EXPECT_THROW(Loader(ds, {.persistent_workers = true}), ValueError);
  EXPECT_THROW(Loader(ds, {.batch_size = 0}), ValueError);
  EXPECT_THROW(Loader(nullptr, {}), ValueError);
  EXPECT_THROW((IterableDataLoader<Example, Tensor>(ds, {.batch_size = 2})), ValueError);
}
