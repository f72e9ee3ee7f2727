// The data loaders' profiling scopes (kiln/core/record.h): the consumer's wait
// for each batch (DataWait) and each batch's production (DataLoad, with the
// batch's bytes) on the loader's named worker threads, or inline without workers.
#include <gtest/gtest.h>

#include <optional>
#include <set>

#include "kiln/data/iterable.h"
#include "kiln/data/loader.h"
#include "kiln/ops/factory.h"
#include "support/record_collector.h"

using namespace kiln;
using namespace kiln::data;

namespace {

class Squares : public Dataset<Example> {
 public:
  int64_t size() const override { return 12; }
  Example get(int64_t i) const override {
    return {full({3}, static_cast<double>(i * i), TensorOptions().dtype(kFloat32)),
            scalar_tensor(i, TensorOptions().dtype(kInt64))};
  }
};

class Counter : public IterableDataset<Example> {
 public:
  void reset(int64_t) override { next_ = 0; }
  std::optional<Example> next() override {
    if (next_ == 10) return std::nullopt;
    const double v = static_cast<double>(next_++);
    return Example{full({2}, v, TensorOptions().dtype(kFloat32)), scalar_tensor(0, TensorOptions().dtype(kInt64))};
  }

 private:
  int64_t next_ = 0;
};

// A batch of 4: data [4, 3] float32, target [4] int64.
constexpr int64_t kBatchBytes = 4 * 3 * 4 + 4 * 8;

}  // namespace

TEST(LoaderRecord, WorkersProduceNamedDataLoadsWhileTheLoopWaits) {
  auto ds = std::make_shared<Squares>();
  test::RecordCollector rec;
  const uint32_t me = record::thread_index();
  int64_t batches = 0;
  {
    DataLoader<> loader(ds, {.batch_size = 4, .num_workers = 2});
    for (auto& b : loader) batches += b.data.size(0) > 0 ? 1 : 0;
  }
  ASSERT_EQ(batches, 3);
  const auto waits = rec.events(record::Kind::DataWait, "DataLoader.next");
  ASSERT_EQ(waits.size(), 3u) << "one wait per batch the loop took";
  for (const auto& w : waits) {
    EXPECT_EQ(w.thread, me) << "the wait is the consumer's";
    EXPECT_LE(w.start_ns, w.end_ns);
  }
  const auto loads = rec.events(record::Kind::DataLoad, "DataLoader.batch");
  ASSERT_EQ(loads.size(), 3u);
  std::set<std::string> names;
  for (const auto& l : loads) {
    EXPECT_NE(l.thread, me) << "with workers a batch is made on a worker thread";
    EXPECT_EQ(l.bytes, kBatchBytes);
    names.insert(l.thread_name);
  }
  for (const std::string& n : names)
    EXPECT_TRUE(n == "loader worker 0" || n == "loader worker 1") << "worker track named '" << n << "'";
}

TEST(LoaderRecord, WithoutWorkersTheLoadIsInsideTheWait) {
  auto ds = std::make_shared<Squares>();
  test::RecordCollector rec;
  DataLoader<> loader(ds, {.batch_size = 4, .num_workers = 0});
  for (auto& b : loader) (void)b;
  const auto waits = rec.events(record::Kind::DataWait);
  const auto loads = rec.events(record::Kind::DataLoad);
  ASSERT_EQ(waits.size(), 3u);
  ASSERT_EQ(loads.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(loads[i].parent, waits[i].id) << "batch " << i << " is made while the loop waits for it";
    EXPECT_EQ(loads[i].bytes, kBatchBytes);
    EXPECT_GE(loads[i].start_ns, waits[i].start_ns);
    EXPECT_LE(loads[i].end_ns, waits[i].end_ns);
  }
}

TEST(LoaderRecord, IterableLoaderRecordsItsProducer) {
  auto ds = std::make_shared<Counter>();
  test::RecordCollector rec;
  {
    IterableDataLoader<> loader(ds, {.batch_size = 4, .num_workers = 1});
    for (auto& b : loader) (void)b;
  }
  const auto loads = rec.events(record::Kind::DataLoad);
  ASSERT_GE(loads.size(), 3u);  // 4 + 4 + 2 samples (the end of the stream may add an empty production)
  EXPECT_EQ(loads[0].thread_name, "loader worker 0");
  EXPECT_EQ(loads[0].bytes, 4 * 2 * 4 + 4 * 8);
  EXPECT_EQ(rec.events(record::Kind::DataWait).size(), 4u) << "three batches and the end of the stream";
}

TEST(LoaderRecord, NothingIsRecordedWhileRecordingIsOff) {
  auto ds = std::make_shared<Squares>();
  std::vector<test::RecordedEvent> none;
  {
    test::RecordCollector rec;
    record::set_enabled(false);
    DataLoader<> loader(ds, {.batch_size = 4, .num_workers = 2});
    for (auto& b : loader) (void)b;
    none = rec.events(record::Kind::DataWait);
    EXPECT_TRUE(rec.events(record::Kind::DataLoad).empty());
  }
  EXPECT_TRUE(none.empty());
}
