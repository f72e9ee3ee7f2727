// Every collective of the MPI process group on float32, bfloat16 and int64,
// against the same reduction computed in this process from every rank's
// (deterministic) input; run on 2 and 4 ranks (ctest dist_2, dist_4).
// Inputs are small integers and halves, so float sums are exact in any order.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kiln/ops/factory.h"
#include "kiln/core/half.h"
#include "kiln/dist/dist.h"

using namespace kiln;
using dist::ReduceOp;

namespace {

constexpr int64_t kN = 37;  // odd, so no reduction splits evenly by accident

// Rank r's element i: distinct per rank, exact in bfloat16 (|v| <= 32, step 1/2).
double value(DType dt, int r, int64_t i, int salt = 0) {
  const double v = ((r * 7 + i * 3 + salt * 5) % 61) * 0.5 - 10;
  return dt == DType::Int64 ? std::floor(v * 2) : v;
}

Tensor input(DType dt, int r, int salt = 0) {
  Tensor t = empty({kN}, TensorOptions().dtype(dt));
  for (int64_t i = 0; i < kN; ++i) {
    const double v = value(dt, r, i, salt);
    if (dt == DType::Float32) t.data_ptr<float>()[i] = static_cast<float>(v);
    if (dt == DType::BFloat16) t.data_ptr<BFloat16>()[i] = BFloat16(static_cast<float>(v));
    if (dt == DType::Int64) t.data_ptr<int64_t>()[i] = static_cast<int64_t>(v);
  }
  return t;
}

double at(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::Float32: return t.data_ptr<float>()[i];
    case DType::BFloat16: return static_cast<float>(t.data_ptr<BFloat16>()[i]);
    case DType::Int64: return static_cast<double>(t.data_ptr<int64_t>()[i]);
    default: return NAN;
  }
}

// The reduction over all ranks of value(dt, r, i, salt), rounded to dt as the backend does.
double reduced(DType dt, ReduceOp op, int size, int64_t i, int salt = 0) {
  double acc = value(dt, 0, i, salt);
  for (int r = 1; r < size; ++r) {
    const double v = value(dt, r, i, salt);
    acc = op == ReduceOp::Max ? std::max(acc, v) : op == ReduceOp::Min ? std::min(acc, v) : acc + v;
  }
  if (op == ReduceOp::Avg) acc = static_cast<float>(acc) / static_cast<float>(size);
  if (dt == DType::Float32) return static_cast<float>(acc);
  if (dt == DType::BFloat16) return static_cast<float>(BFloat16(static_cast<float>(acc)));
  return acc;
}

class Dist : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's collective cases run under mpirun: ctest -R dist_";
    pg = dist::world();
  }
  dist::ProcessGroupPtr pg;
};

const DType kDTypes[] = {DType::Float32, DType::BFloat16, DType::Int64};

TEST_F(Dist, WorldMatchesTheLaunch) {
  EXPECT_EQ(pg->rank(), dist::rank());
  EXPECT_EQ(pg->size(), dist::world_size());
  EXPECT_EQ(pg->backend(), "mpi");
  EXPECT_EQ(std::to_string(pg->size()), std::getenv("OMPI_COMM_WORLD_SIZE"));
  EXPECT_GE(dist::local_rank(), 0);
  EXPECT_LT(dist::local_rank(), pg->size());
  dist::init();  // idempotent: the same group
  EXPECT_EQ(dist::world().get(), pg.get());
}

TEST_F(Dist, AllreduceEveryOpAndDtype) {
  for (DType dt : kDTypes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && dt == DType::Int64) continue;  // rejected: see AvgOnInt64IsRejected
      Tensor t = input(dt, pg->rank());
      pg->allreduce(t, op)->wait();
      for (int64_t i = 0; i < kN; ++i) {
        ASSERT_EQ(at(t, i), reduced(dt, op, pg->size(), i))
            << dtype_name(dt) << " op " << static_cast<int>(op) << " element " << i << " on rank " << pg->rank();
      }
    }
  }
}

TEST_F(Dist, AvgOnInt64IsRejected) {
  Tensor t = input(DType::Int64, pg->rank());
  try {
    pg->allreduce(t, ReduceOp::Avg);
    FAIL() << "expected a DTypeError";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("ReduceOp::Avg needs a float32 or bfloat16 tensor, got int64"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Dist, BroadcastFromEveryRoot) {
  for (DType dt : kDTypes) {
    for (int root = 0; root < pg->size(); ++root) {
      Tensor t = input(dt, pg->rank());
      pg->broadcast(t, root)->wait();
      for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(t, i), value(dt, root, i)) << dtype_name(dt) << " root " << root;
    }
  }
}

TEST_F(Dist, AllgatherCollectsEveryRank) {
  for (DType dt : kDTypes) {
    std::vector<Tensor> out;
    for (int r = 0; r < pg->size(); ++r) out.push_back(zeros({kN}, TensorOptions().dtype(dt)));
    Tensor in = input(dt, pg->rank());
    pg->allgather(out, in)->wait();
    for (int r = 0; r < pg->size(); ++r) {
      for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(out[r], i), value(dt, r, i)) << dtype_name(dt) << " from " << r;
    }
  }
}

TEST_F(Dist, ReduceScatterGivesEachRankItsShard) {
  for (DType dt : kDTypes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      if (op == ReduceOp::Avg && dt == DType::Int64) continue;
      // in[j] on rank r is input(dt, r, salt = j): rank r ends with the reduction of salt r.
      std::vector<Tensor> in;
      for (int j = 0; j < pg->size(); ++j) in.push_back(input(dt, pg->rank(), j));
      Tensor out = zeros({kN}, TensorOptions().dtype(dt));
      pg->reduce_scatter(out, in, op)->wait();
      for (int64_t i = 0; i < kN; ++i) {
        ASSERT_EQ(at(out, i), reduced(dt, op, pg->size(), i, pg->rank())) << dtype_name(dt) << " element " << i;
      }
    }
  }
}

TEST_F(Dist, SendRecvAroundARingInIssueOrder) {
  const int n = pg->size(), r = pg->rank();
  Tensor mine = input(DType::Float32, r);
  Tensor got = zeros({kN});
  // Operations run one at a time in issue order, so alternate to avoid both sides sending first.
  if (r % 2 == 0) {
    auto s = pg->send(mine, (r + 1) % n, 7);
    auto q = pg->recv(got, (r + n - 1) % n, 7);
    s->wait();
    q->wait();
  } else {
    auto q = pg->recv(got, (r + n - 1) % n, 7);
    auto s = pg->send(mine, (r + 1) % n, 7);
    q->wait();
    s->wait();
  }
  for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(got, i), value(DType::Float32, (r + n - 1) % n, i));
}

TEST_F(Dist, WaitRethrowsAFailedReceive) {
  // Rank 1 expects more elements than rank 0 sends: the error surfaces in wait().
  if (pg->rank() == 0) pg->send(zeros({3}), 1, 9)->wait();
  if (pg->rank() == 1) {
    Tensor big = zeros({5});
    auto w = pg->recv(big, 0, 9);
    try {
      w->wait();
      FAIL() << "expected a ShapeError";
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find("expected 5 elements from rank 0, got 3"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(w->is_completed());
  }
  pg->barrier()->wait();  // a failed send/recv does not spoil later collectives
}

TEST_F(Dist, BadArgumentsThrowOnTheCallingThread) {
  Tensor m = zeros({3, 4});
  Tensor nc = m.transpose(0, 1);
  EXPECT_THROW(pg->allreduce(nc), ValueError);
  Tensor f64 = zeros({3}, TensorOptions().dtype(DType::Float64));
  EXPECT_THROW(pg->allreduce(f64), DTypeError);
  Tensor t = zeros({3});
  EXPECT_THROW(pg->broadcast(t, pg->size()), ValueError);
  std::vector<Tensor> too_few{zeros({3})};
  if (pg->size() > 1) {
    EXPECT_THROW(pg->allgather(too_few, t), ShapeError);
  }
}

TEST_F(Dist, SequenceNumbersIncreaseInIssueOrder) {
  Tensor t = input(DType::Float32, pg->rank());
  auto a = pg->allreduce(t);
  auto b = pg->barrier();
  auto c = pg->broadcast(t, 0);
  EXPECT_EQ(b->sequence(), a->sequence() + 1);
  EXPECT_EQ(c->sequence(), b->sequence() + 1);
  c->wait();  // in order: the earlier ones are done too
  EXPECT_TRUE(a->is_completed());
  EXPECT_TRUE(b->is_completed());
}

// The allreduce is issued, then this thread computes without touching MPI; the
// communication thread completes it meanwhile. Ordering only, no speed bound:
// a fixed amount of compute (about a second), and the work must be seen
// complete before its last chunk. A barrier first, so that every rank issues
// the allreduce at about the same time.
TEST_F(Dist, AsyncAllreduceCompletesWhileTheCallerComputes) {
  using clock = std::chrono::steady_clock;
  Tensor t = full({1 << 20}, static_cast<double>(pg->rank() + 1));  // 4 MB
  std::vector<float> work(1 << 18, 1.0f);
  pg->barrier()->wait();
  const auto issued = clock::now();
  auto w = pg->allreduce(t);
  constexpr int kChunks = 1000;  // about a second on a busy core; completion is typically seen by chunk 100
  int seen_at = -1;
  clock::time_point seen_time;
  volatile float sink = 0;
  for (int c = 0; c < kChunks; ++c) {
    for (auto& x : work) x = std::sqrt(x * 1.0001f + 0.5f);  // compute only: no MPI call on this thread
    sink = sink + work[static_cast<size_t>(c) % work.size()];
    if (seen_at < 0 && w->is_completed()) {
      seen_at = c;
      seen_time = clock::now();
    }
  }
  const auto compute_end = clock::now();
  ASSERT_GE(seen_at, 0) << "the allreduce did not complete during " << kChunks << " chunks of compute";
  EXPECT_LT(seen_at, kChunks - 1);
  EXPECT_LT(seen_time, compute_end);
  EXPECT_GT(seen_time, issued);
  std::fprintf(stderr, "rank %d: allreduce seen complete after %.1f ms, at compute chunk %d; compute ran %.1f ms\n",
               pg->rank(), std::chrono::duration<double, std::milli>(seen_time - issued).count(), seen_at,
               std::chrono::duration<double, std::milli>(compute_end - issued).count());
  w->wait();
  const float want = static_cast<float>(pg->size() * (pg->size() + 1) / 2);
  EXPECT_EQ(t.data_ptr<float>()[0], want);
  EXPECT_EQ(t.data_ptr<float>()[(1 << 20) - 1], want);
}

}  // namespace
