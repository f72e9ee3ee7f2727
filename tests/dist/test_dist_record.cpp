// What profiles see of the MPI process group and DDP (kiln/core/record.h):
// each collective as a Collective scope on the group's communication thread
// (bytes, group, call site), a caller blocked in Work::wait as a
// CollectiveWait scope, and DDP's bucket allreduces inside backward. Run on 2
// and 4 ranks (ctest dist_2, dist_4).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "dist/ddp_nets.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"
#include "support/record_collector.h"

namespace kiln {
namespace {

class DistRecord : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's DistRecord cases run under mpirun: ctest -R dist_";
    pg = dist::world();
  }
  dist::ProcessGroupPtr pg;
};

TEST_F(DistRecord, CollectivesRunOnTheCommThreadAndBlockedWaitsAreRecorded) {
  Tensor t = ones({256});
  test::RecordCollector rec;
  // Rank 0 arrives first and waits for the others, which come 50 ms later.
  if (pg->rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  pg->allreduce(t)->wait();
  const auto colls = rec.events(record::Kind::Collective, "allreduce");
  ASSERT_EQ(colls.size(), 1u);
  EXPECT_EQ(colls[0].bytes, 256 * 4);
  EXPECT_NE(colls[0].thread, record::thread_index()) << "the transfer runs on the communication thread";
  EXPECT_EQ(colls[0].thread_name, "collectives: " + pg->describe());
  EXPECT_NE(colls[0].detail.find(pg->describe()), std::string::npos) << colls[0].detail;
  EXPECT_NE(colls[0].detail.find("test_dist_record.cpp:"), std::string::npos) << colls[0].detail;
  const auto waits = rec.events(record::Kind::CollectiveWait, "allreduce.wait");
  if (pg->rank() == 0) {
    ASSERT_EQ(waits.size(), 1u) << "rank 0 was blocked in wait()";
    EXPECT_EQ(waits[0].thread, record::thread_index());
    EXPECT_EQ(waits[0].detail, pg->describe());
    EXPECT_GE(waits[0].end_ns - waits[0].start_ns, 20'000'000) << "it waited for the late ranks";
    EXPECT_LE(waits[0].start_ns, colls[0].end_ns);
    EXPECT_GE(waits[0].end_ns, colls[0].end_ns);
  }
  EXPECT_FLOAT_EQ(t.data_ptr<float>()[0], static_cast<float>(pg->size()));
}

TEST_F(DistRecord, DDPBucketAllreducesLieInsideBackward) {
  auto net = test::make_net(1);
  dist::DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = 1024.0 / (1024 * 1024), .find_unused_parameters = true});
  ASSERT_GT(ddp.buckets().size(), 2u);
  test::RecordCollector rec;
  Tensor loss = test::mse(ddp(ones({4, 6})), zeros({4, 3}));
  int64_t bwd_start = 0, bwd_end = 0;
  {
    record::Scope backward(record::Kind::User, "backward");
    bwd_start = record::now_ns();
    loss.backward();
    bwd_end = record::now_ns();
  }
  int64_t bucket_bytes = 0;
  for (const auto& b : ddp.buckets()) bucket_bytes += b.bytes;
  int buckets = 0;
  int64_t bytes = 0;
  for (const auto& e : rec.events(record::Kind::Collective, "allreduce")) {
    if (e.detail.find("DDP gradient bucket") == std::string::npos) continue;
    ++buckets;
    bytes += e.bytes;
    EXPECT_GE(e.start_ns, bwd_start) << e.detail;
    EXPECT_LE(e.end_ns, bwd_end) << e.detail << ": DDP waits for its allreduces before backward returns";
  }
  EXPECT_EQ(buckets, static_cast<int>(ddp.buckets().size()));
  EXPECT_EQ(bytes, bucket_bytes);
}

}  // namespace
}  // namespace kiln
