// The MPI backend's shared-memory all-reduce (src/dist/shm_allreduce.h): float32
// and bfloat16 Sum/Avg all-reduces and reduce-scatters go through it when
// every rank is on one node. Run on 2 and 4 ranks (ctest dist_2, dist_4).
// - exact inputs (small integers and halves) give the exact reduction, across
//   chunk boundaries and uneven slices;
// - every rank gets the same bits, and on 2 ranks the same bits as Open MPI's
//   own allreduce (a + b is commutative); on 4, within 4 float32 ulps of the
//   magnitudes summed (the ranks' order of summation may differ from MPI's);
// - a rank that arrives late leaves its peers sleeping, not polling;
// - reduce-scatter (ZeRO, FSDP) gives the all-reduce's bits for its shard;
// - KILN_DIST_SHM=0 keeps every all-reduce in MPI, and Max, Min and int64 stay there.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dist/mpi_process_group.h"
#include "dist/shm_allreduce.h"
#include "kiln/core/half.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/traffic.h"
#include "kiln/ops/factory.h"

using namespace kiln;
using dist::ReduceOp;
using dist::detail::ShmAllreduce;
using dist::detail::shm_counters;

namespace {

// Sizes: one chunk's slices of a few thousand floats, one chunk and a bit,
// and three chunks whose last one splits unevenly over the ranks.
const int64_t kSizes[] = {4096, static_cast<int64_t>(ShmAllreduce::kChunk) + 5,
                          2 * static_cast<int64_t>(ShmAllreduce::kChunk) + 4097};

float exact_value(int r, int64_t i) { return static_cast<float>(((r * 7 + i * 3) % 61) * 0.5 - 10); }

// A group of every rank made with KILN_DIST_SHM set to `shm` (and, when
// given, KILN_DIST_DEBUG to `debug`), the environment restored after.
dist::ProcessGroupPtr group_with(const char* shm, const std::string& name, const char* debug = nullptr) {
  std::vector<std::pair<const char*, const char*>> set = {{"KILN_DIST_SHM", shm}};
  if (debug) set.emplace_back("KILN_DIST_DEBUG", debug);
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;  // nullopt: was unset
  for (auto [k, v] : set) {
    const char* old = std::getenv(k);
    saved.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
    setenv(k, v, 1);
  }
  std::vector<int> all;
  for (int r = 0; r < dist::world_size(); ++r) all.push_back(r);
  auto g = dist::new_group(all, name);
  for (auto& [k, v] : saved) {
    if (v) {
      setenv(k.c_str(), v->c_str(), 1);
    } else {
      unsetenv(k.c_str());
    }
  }
  return g;
}

class ShmAllreduceMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "run under mpirun: ctest -R dist_";
    pg = group_with("1", "shm");
    // The segment is made by the first float sum; if it could not be, say why (a full /dev/shm, ...).
    Tensor warm = full({8}, 1.0);
    pg->allreduce(warm, ReduceOp::Sum)->wait();
    auto* mpi = dynamic_cast<dist::detail::MPIProcessGroup*>(pg.get());
    ASSERT_NE(mpi, nullptr);
    ASSERT_EQ(mpi->shm_status(), "") << "the shared-memory all-reduce is not in use";
  }
  dist::ProcessGroupPtr pg;
};

TEST_F(ShmAllreduceMpi, ExactSumsAndAveragesAcrossChunks) {
  const int P = pg->size(), rank = pg->rank();
  for (int64_t n : kSizes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      Tensor t = empty({n});
      for (int64_t i = 0; i < n; ++i) t.data_ptr<float>()[i] = exact_value(rank, i);
      const auto before = shm_counters();
      pg->allreduce(t, op)->wait();
      const auto after = shm_counters();
      EXPECT_EQ(after.calls - before.calls, 1) << "n " << n;
      EXPECT_EQ(after.chunks - before.chunks, (n + ShmAllreduce::kChunk - 1) / ShmAllreduce::kChunk);
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < P; ++r) want += exact_value(r, i);
        if (op == ReduceOp::Avg) want /= static_cast<float>(P);
        ASSERT_EQ(t.data_ptr<float>()[i], want) << "n " << n << " element " << i << " rank " << rank;
      }
    }
  }
}

TEST_F(ShmAllreduceMpi, BFloat16AveragesInFloatThenRounds) {
  const int P = pg->size(), rank = pg->rank();
  const int64_t n = static_cast<int64_t>(ShmAllreduce::kChunk) + 333;
  Tensor t = empty({n}, TensorOptions().dtype(DType::BFloat16));
  for (int64_t i = 0; i < n; ++i) t.data_ptr<BFloat16>()[i] = BFloat16(exact_value(rank, i));
  const auto before = shm_counters();
  pg->allreduce(t, ReduceOp::Avg)->wait();
  EXPECT_EQ(shm_counters().calls - before.calls, 1);
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int r = 0; r < P; ++r) sum += exact_value(r, i);
    ASSERT_EQ(static_cast<float>(t.data_ptr<BFloat16>()[i]), static_cast<float>(BFloat16(sum / P))) << i;
  }
}

// allreduce_compressed (DDP's compression hooks): float32 values travel as
// bfloat16 or float16 through shared memory, half the bytes, and arrive as
// round(sum over ranks of round(v_r) / P), one rounding in and one out. The
// values are multiples of 2^-12 below 4 in magnitude: float16 must round them
// (11 significant bits), and the sums of rounded values are exact in float32,
// so on 2 ranks MPI (KILN_DIST_SHM=0, 16-bit partial sums) gives the same
// bits too; on more, MPI rounds each partial sum to the wire type.
float compressible(int r, int64_t i) {
  uint32_t h = static_cast<uint32_t>(r) * 2654435761u ^ static_cast<uint32_t>(i) * 40503u;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return static_cast<float>(static_cast<int32_t>(h % 32768u) - 16384) / 4096.0f;
}

float round_to(DType wire, float x) {
  return wire == DType::BFloat16 ? static_cast<float>(BFloat16(x)) : static_cast<float>(Half(x));
}

TEST_F(ShmAllreduceMpi, CompressedAllreduceRoundsOnceInAndOnceOut) {
  const int P = pg->size(), rank = pg->rank();
  auto mpi = group_with("0", "no-shm-compressed");
  // Three chunks of 16-bit values (2 * kChunk per slot), the last uneven.
  const int64_t n = 4 * static_cast<int64_t>(ShmAllreduce::kChunk) + 4097;
  for (DType wire : {DType::BFloat16, DType::Float16}) {
    for (ReduceOp op : {ReduceOp::Avg, ReduceOp::Sum}) {
      Tensor t = empty({n}), u = empty({n});
      for (int64_t i = 0; i < n; ++i) t.data_ptr<float>()[i] = u.data_ptr<float>()[i] = compressible(rank, i);
      const auto before = shm_counters();
      const auto traffic_before = dist::traffic();
      pg->allreduce_compressed(t, wire, op)->wait();
      EXPECT_EQ(shm_counters().calls - before.calls, 1);
      EXPECT_EQ(shm_counters().chunks - before.chunks, 3) << "2 * kChunk 16-bit values per chunk";
      EXPECT_EQ(dist::traffic().bytes - traffic_before.bytes, 2 * n) << "two bytes a value";
      mpi->allreduce_compressed(u, wire, op)->wait();
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < P; ++r) sum += round_to(wire, compressible(r, i));
        const float want = round_to(wire, op == ReduceOp::Avg ? sum / static_cast<float>(P) : sum);
        ASSERT_EQ(t.data_ptr<float>()[i], want) << dtype_name(wire) << " element " << i << " rank " << rank;
        if (P == 2) {
          ASSERT_EQ(u.data_ptr<float>()[i], want) << dtype_name(wire) << " (MPI) element " << i << " rank " << rank;
        } else {
          // MPI rounds each partial sum to the wire type: within P roundings of the magnitudes summed.
          float mag = 0;
          for (int r = 0; r < P; ++r) mag += std::fabs(round_to(wire, compressible(r, i)));
          if (op == ReduceOp::Avg) mag /= static_cast<float>(P);
          const float unit = wire == DType::BFloat16 ? 0x1p-8f : 0x1p-11f;
          ASSERT_LE(std::fabs(u.data_ptr<float>()[i] - want), static_cast<float>(P) * unit * mag)
              << dtype_name(wire) << " (MPI) element " << i << " rank " << rank;
        }
      }
    }
  }
}

// float16's range is float16's: a value above 65504 becomes inf on the way in,
// as in torch's fp16_compress_hook, and a NaN stays a NaN; bfloat16 keeps
// float32's range. Wrong arguments are refused before anything is sent.
TEST_F(ShmAllreduceMpi, CompressedAllreduceKeepsTheWireTypesRange) {
  const int rank = pg->rank();
  Tensor t = full({4}, 1.0), b = full({4}, 1.0);
  if (rank == 0) {
    t.data_ptr<float>()[0] = b.data_ptr<float>()[0] = 70000.0f;
    t.data_ptr<float>()[1] = b.data_ptr<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  }
  pg->allreduce_compressed(t, DType::Float16, ReduceOp::Avg)->wait();
  pg->allreduce_compressed(b, DType::BFloat16, ReduceOp::Avg)->wait();
  EXPECT_TRUE(std::isinf(t.data_ptr<float>()[0]));
  EXPECT_TRUE(std::isnan(t.data_ptr<float>()[1]));
  EXPECT_EQ(t.data_ptr<float>()[2], 1.0f);
  EXPECT_TRUE(std::isfinite(b.data_ptr<float>()[0]));
  EXPECT_TRUE(std::isnan(b.data_ptr<float>()[1]));

  Tensor half = full({4}, 1.0, TensorOptions().dtype(DType::BFloat16));
  EXPECT_THROW(pg->allreduce_compressed(half, DType::BFloat16), DTypeError);
  EXPECT_THROW(pg->allreduce_compressed(t, DType::Float32), DTypeError);
  EXPECT_THROW(pg->allreduce_compressed(t, DType::BFloat16, ReduceOp::Max), ValueError);
}

TEST_F(ShmAllreduceMpi, EveryRankGetsTheSameBitsAsMpi) {
  const int P = pg->size(), rank = pg->rank();
  auto mpi = group_with("0", "no-shm");
  const int64_t n = 2 * static_cast<int64_t>(ShmAllreduce::kChunk) + 4097;
  std::mt19937 gen(1234 + rank);
  std::normal_distribution<float> dist_(0.f, 1.f);
  Tensor a = empty({n});
  for (int64_t i = 0; i < n; ++i) a.data_ptr<float>()[i] = dist_(gen);
  Tensor b = a.clone();
  // Every input's magnitude, summed over ranks: the scale of a reordered sum's error.
  Tensor mag = a.abs();
  const auto before = shm_counters();
  pg->allreduce(a, ReduceOp::Avg)->wait();
  mpi->allreduce(b, ReduceOp::Avg)->wait();
  mpi->allreduce(mag, ReduceOp::Sum)->wait();
  EXPECT_EQ(shm_counters().calls - before.calls, 1) << "the KILN_DIST_SHM=0 group stays in MPI";
  EXPECT_EQ(dynamic_cast<dist::detail::MPIProcessGroup*>(mpi.get())->shm_status(), "off (KILN_DIST_SHM=0)");
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  if (P == 2) {
    EXPECT_EQ(std::memcmp(pa, pb, static_cast<size_t>(n) * sizeof(float)), 0) << "(x0 + x1) / 2 on both paths";
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float tol = 4 * std::numeric_limits<float>::epsilon() * mag.data_ptr<float>()[i] / P;
      ASSERT_NEAR(pa[i], pb[i], tol) << i;
    }
  }
  // The same bits on every rank: gather rank 0's result and compare.
  Tensor from0 = a.clone();
  mpi->broadcast(from0, 0)->wait();
  EXPECT_EQ(std::memcmp(from0.data_ptr<float>(), pa, static_cast<size_t>(n) * sizeof(float)), 0) << "rank " << rank;
}

TEST_F(ShmAllreduceMpi, ManyInFlightKeepTheirOrder) {
  // Issued back to back, run in issue order on the communication thread: the
  // slots alternate between chunk after chunk of different all-reduces.
  const int P = pg->size(), rank = pg->rank();
  std::vector<Tensor> ts;
  std::vector<dist::WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    ts.push_back(full({static_cast<int64_t>(ShmAllreduce::kChunk) / 2 + 4096 * k}, static_cast<double>(rank + k)));
    works.push_back(pg->allreduce(ts.back(), ReduceOp::Sum));
  }
  for (auto& w : works) w->wait();
  for (int k = 0; k < 6; ++k) {
    const float want = static_cast<float>(P * (P - 1) / 2 + P * k);
    const float* p = ts[static_cast<size_t>(k)].data_ptr<float>();
    for (int64_t i = 0; i < ts[static_cast<size_t>(k)].numel(); ++i) ASSERT_EQ(p[i], want) << k << " " << i;
  }
}

TEST_F(ShmAllreduceMpi, ALateRankLeavesItsPeersSleeping) {
  const int P = pg->size(), rank = pg->rank();
  // Without KILN_DIST_DEBUG's signature check, whose blocking allgather would do the waiting.
  pg = group_with("1", "shm-no-debug", "0");
  Tensor warm = full({4096}, 1.0);
  pg->allreduce(warm, ReduceOp::Sum)->wait();  // the new group's segment is made on first use
  const auto before = shm_counters();
  if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
  Tensor t = full({8192}, static_cast<double>(rank));
  pg->allreduce(t, ReduceOp::Sum)->wait();
  EXPECT_EQ(t.data_ptr<float>()[8191], P * (P - 1) / 2.0f);
  if (rank != 0) {
    const int64_t slept = shm_counters().sleeps - before.sleeps;
    EXPECT_GT(slept, 0) << "an early rank sleeps while it waits";
    // Asleep until the late rank publishes (each sleep bounded at 10 ms), not
    // woken by a timer: timed sleeps of at most 100 µs would make hundreds.
    EXPECT_LT(slept, 40) << "an early rank is woken by its peer, not every 100 µs";
  }
}

TEST_F(ShmAllreduceMpi, EverySizeOfFloatSumGoesThroughItOtherOpsStayInMpi) {
  const int P = pg->size(), rank = pg->rank();
  const auto before = shm_counters();
  Tensor one = full({1}, static_cast<double>(rank));
  pg->allreduce(one, ReduceOp::Sum)->wait();
  Tensor small = full({5}, static_cast<double>(rank));
  pg->allreduce(small, ReduceOp::Avg)->wait();
  EXPECT_EQ(shm_counters().calls - before.calls, 2) << "one rank order for every float sum, whatever its size";
  Tensor mx = full({10000}, static_cast<double>(rank));
  pg->allreduce(mx, ReduceOp::Max)->wait();
  Tensor ints = full({10000}, static_cast<double>(rank), TensorOptions().dtype(DType::Int64));
  pg->allreduce(ints, ReduceOp::Sum)->wait();
  EXPECT_EQ(shm_counters().calls - before.calls, 2) << "Max and int64 stay in MPI";
  EXPECT_EQ(one.data_ptr<float>()[0], P * (P - 1) / 2.0f);
  EXPECT_EQ(small.data_ptr<float>()[4], P * (P - 1) / 2.0f / P);
  EXPECT_EQ(mx.data_ptr<float>()[9999], static_cast<float>(P - 1));
  EXPECT_EQ(ints.data_ptr<int64_t>()[9999], P * (P - 1) / 2);
}

// ZeRO and FSDP reduce-scatter the gradients DDP all-reduces: both through
// shared memory, in rank order, so a shard equals the all-reduce's bits.
TEST_F(ShmAllreduceMpi, ReduceScatterEqualsTheAllreducesShardBitForBit) {
  const int P = pg->size(), rank = pg->rank();
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    for (int64_t shard : {int64_t{3}, static_cast<int64_t>(ShmAllreduce::kChunk) / P + 17}) {
      std::mt19937 gen(99 + rank);
      std::normal_distribution<float> nd(0.f, 1.f);
      Tensor full_t = empty({P * shard});
      for (int64_t i = 0; i < full_t.numel(); ++i) full_t.data_ptr<float>()[i] = nd(gen);
      full_t = full_t.to(dt);
      Tensor all = full_t.clone();
      Tensor mine = empty({shard}, TensorOptions().dtype(dt));
      const auto before = shm_counters();
      pg->reduce_scatter_tensor(mine, full_t, ReduceOp::Avg)->wait();
      pg->allreduce(all, ReduceOp::Avg)->wait();
      EXPECT_EQ(shm_counters().calls - before.calls, 2);
      Tensor want = all.narrow(0, rank * shard, shard).contiguous();
      EXPECT_EQ(std::memcmp(mine.data_ptr(), want.data_ptr(), static_cast<size_t>(mine.nbytes())), 0)
          << dtype_name(dt) << " shard " << shard << " rank " << rank;
    }
  }
  // Exact inputs: the exact sum, across chunks.
  const int64_t shard = static_cast<int64_t>(ShmAllreduce::kChunk) + 9;
  Tensor in = empty({P * shard});
  for (int64_t i = 0; i < in.numel(); ++i) in.data_ptr<float>()[i] = exact_value(rank, i);
  Tensor out = empty({shard});
  pg->reduce_scatter_tensor(out, in, ReduceOp::Sum)->wait();
  for (int64_t i = 0; i < shard; ++i) {
    float want = 0;
    for (int r = 0; r < P; ++r) want += exact_value(r, rank * shard + i);
    ASSERT_EQ(out.data_ptr<float>()[i], want) << i;
  }
}

}  // namespace
