// Process groups made by dist::new_group (issue 19): every collective on
// subgroups of the world against a reference computed here from every
// member's (deterministic) input, bitwise (inputs are small integers and
// halves, so sums are exact in any order); the handle non-members get; bad
// arguments; DDP on two subgroups at once. Run on 2 and 4 ranks (ctest dist_2,
// dist_4, dist_2_debug). Every case calls new_group on every rank in the same
// order, as the API requires.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "dist/ddp_nets.h"
#include "kiln/core/half.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"
#include "kiln/ops/factory.h"

using namespace kiln;
using dist::ReduceOp;

namespace {

constexpr int64_t kN = 13;
const DType kDTypes[] = {DType::Float32, DType::BFloat16, DType::Int64};

// World rank w's element i (salt: which block): distinct per rank, exact in bfloat16.
double value(DType dt, int w, int64_t i, int salt = 0) {
  const double v = ((w * 7 + i * 3 + salt * 5) % 61) * 0.5 - 10;
  return dt == DType::Int64 ? std::floor(v * 2) : v;
}

void set(Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::Float32) t.data_ptr<float>()[i] = static_cast<float>(v);
  if (t.dtype() == DType::BFloat16) t.data_ptr<BFloat16>()[i] = BFloat16(static_cast<float>(v));
  if (t.dtype() == DType::Int64) t.data_ptr<int64_t>()[i] = static_cast<int64_t>(v);
}

double at(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::Float32: return t.data_ptr<float>()[i];
    case DType::BFloat16: return static_cast<float>(t.data_ptr<BFloat16>()[i]);
    case DType::Int64: return static_cast<double>(t.data_ptr<int64_t>()[i]);
    default: return NAN;
  }
}

Tensor input(DType dt, int w, int64_t n = kN, int salt = 0) {
  Tensor t = empty({n}, TensorOptions().dtype(dt));
  for (int64_t i = 0; i < n; ++i) set(t, i, value(dt, w, i, salt));
  return t;
}

// The reduction over the members (world ranks) of value(dt, w, i, salt), rounded as the backend does.
double reduced(DType dt, ReduceOp op, const std::vector<int>& members, int64_t i, int salt = 0) {
  double acc = value(dt, members[0], i, salt);
  for (size_t k = 1; k < members.size(); ++k) {
    const double v = value(dt, members[k], i, salt);
    acc = op == ReduceOp::Max ? std::max(acc, v) : op == ReduceOp::Min ? std::min(acc, v) : acc + v;
  }
  if (op == ReduceOp::Avg) acc = static_cast<float>(acc) / static_cast<float>(members.size());
  if (dt == DType::Float32) return static_cast<float>(acc);
  if (dt == DType::BFloat16) return static_cast<float>(BFloat16(static_cast<float>(acc)));
  return acc;
}

std::string text(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

template <typename E, typename F>
void expect_error(F&& f, const std::string& want) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << want;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

// Rows a rank of group rank a sends to group rank b in the alltoall with splits:
// asymmetric (s(0, 1) = 2, s(1, 0) = 1) and sometimes 0.
int64_t rows(int a, int b) { return (a + 2 * b) % 3; }

// Every collective on `g`, run by its members only.
void check_collectives(const dist::ProcessGroupPtr& g) {
  const std::vector<int> m = g->ranks();
  const int gs = g->size(), gr = g->rank(), w = m[static_cast<size_t>(gr)];
  const std::string where = g->describe() + " on world rank " + std::to_string(w);
  for (DType dt : kDTypes) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " in " + where);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && dt == DType::Int64) continue;
      Tensor t = input(dt, w);
      g->allreduce(t, op)->wait();
      for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(t, i), reduced(dt, op, m, i)) << "allreduce op " << int(op);
    }
    for (int root = 0; root < gs; ++root) {
      Tensor t = input(dt, w);
      g->broadcast(t, root)->wait();
      for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(t, i), value(dt, m[root], i)) << "broadcast root " << root;
    }
    {  // allgather into a list, equal shards
      std::vector<Tensor> out;
      for (int r = 0; r < gs; ++r) out.push_back(zeros({kN}, TensorOptions().dtype(dt)));
      g->allgather(out, input(dt, w))->wait();
      for (int r = 0; r < gs; ++r) {
        for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(out[r], i), value(dt, m[r], i)) << "allgather from " << r;
      }
    }
    {  // uneven shards: group rank r contributes 2r + 1 elements
      std::vector<Tensor> out;
      for (int r = 0; r < gs; ++r) out.push_back(full({2 * r + 1}, -99.0, TensorOptions().dtype(dt)));
      g->allgather(out, input(dt, w, 2 * gr + 1))->wait();
      for (int r = 0; r < gs; ++r) {
        ASSERT_EQ(out[r].numel(), 2 * r + 1);
        for (int64_t i = 0; i < 2 * r + 1; ++i) ASSERT_EQ(at(out[r], i), value(dt, m[r], i)) << "uneven from " << r;
      }
    }
    {  // into one tensor, from a separate input and in place (the input a view of the output)
      Tensor out = zeros({gs, kN}, TensorOptions().dtype(dt));
      g->allgather_into_tensor(out, input(dt, w))->wait();
      Tensor out2 = zeros({gs * kN}, TensorOptions().dtype(dt));
      Tensor mine = out2.narrow(0, gr * kN, kN);
      for (int64_t i = 0; i < kN; ++i) set(mine, i, value(dt, w, i));
      g->allgather_into_tensor(out2, mine)->wait();
      for (int r = 0; r < gs; ++r) {
        for (int64_t i = 0; i < kN; ++i) {
          ASSERT_EQ(at(out, r * kN + i), value(dt, m[r], i)) << "allgather_into_tensor from " << r;
          ASSERT_EQ(at(out2, r * kN + i), value(dt, m[r], i)) << "in-place allgather_into_tensor from " << r;
        }
      }
    }
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      if (op == ReduceOp::Avg && dt == DType::Int64) continue;
      // Block j of the input is value(w, ., salt j): group rank gr ends with the reduction of salt gr.
      Tensor flat = empty({gs * kN}, TensorOptions().dtype(dt));
      std::vector<Tensor> list;
      for (int j = 0; j < gs; ++j) {
        list.push_back(input(dt, w, kN, j));
        for (int64_t i = 0; i < kN; ++i) set(flat, j * kN + i, value(dt, w, i, j));
      }
      Tensor out = zeros({kN}, TensorOptions().dtype(dt)), out2 = zeros({kN}, TensorOptions().dtype(dt));
      g->reduce_scatter_tensor(out, flat, op)->wait();
      g->reduce_scatter(out2, list, op)->wait();
      for (int64_t i = 0; i < kN; ++i) {
        ASSERT_EQ(at(out, i), reduced(dt, op, m, i, gr)) << "reduce_scatter_tensor op " << int(op);
        ASSERT_EQ(at(out2, i), reduced(dt, op, m, i, gr)) << "reduce_scatter op " << int(op);
      }
    }
    // alltoall: the element (row k of the block for group rank b, column c) encodes sender, receiver, row, column.
    // Unique for up to 4 ranks and 2 rows of 2, and exact in bfloat16.
    auto code = [](int from_w, int to, int64_t k, int64_t c) { return from_w * 16.0 + to * 4 + k * 2 + c - 40; };
    {  // equal splits: 2 rows of 2 per peer
      Tensor in = empty({2 * gs, 2}, TensorOptions().dtype(dt)), out = zeros({2 * gs, 2}, TensorOptions().dtype(dt));
      for (int b = 0; b < gs; ++b) {
        for (int64_t k = 0; k < 2; ++k) {
          for (int64_t c = 0; c < 2; ++c) set(in, (b * 2 + k) * 2 + c, code(w, b, k, c));
        }
      }
      g->alltoall(out, in)->wait();
      for (int a = 0; a < gs; ++a) {
        for (int64_t k = 0; k < 2; ++k) {
          for (int64_t c = 0; c < 2; ++c) ASSERT_EQ(at(out, (a * 2 + k) * 2 + c), code(m[a], gr, k, c)) << "from " << a;
        }
      }
    }
    {  // with split sizes
      std::vector<int64_t> in_splits, out_splits;
      int64_t in_rows = 0, out_rows = 0;
      for (int b = 0; b < gs; ++b) {
        in_splits.push_back(rows(gr, b));
        out_splits.push_back(rows(b, gr));
        in_rows += rows(gr, b);
        out_rows += rows(b, gr);
      }
      Tensor in = empty({in_rows, 2}, TensorOptions().dtype(dt)), out = full({out_rows, 2}, -99.0, TensorOptions().dtype(dt));
      int64_t row = 0;
      for (int b = 0; b < gs; ++b) {
        for (int64_t k = 0; k < rows(gr, b); ++k, ++row) {
          for (int64_t c = 0; c < 2; ++c) set(in, row * 2 + c, code(w, b, k, c));
        }
      }
      g->alltoall(out, in, out_splits, in_splits)->wait();
      row = 0;
      for (int a = 0; a < gs; ++a) {
        for (int64_t k = 0; k < rows(a, gr); ++k, ++row) {
          for (int64_t c = 0; c < 2; ++c) ASSERT_EQ(at(out, row * 2 + c), code(m[a], gr, k, c)) << "split from " << a;
        }
      }
    }
  }
  if (gs > 1) {  // a ring, tagged by the group's size; alternate so that not everyone sends first
    Tensor mine = input(DType::Int64, w), got = zeros({kN}, TensorOptions().dtype(DType::Int64));
    const int next = (gr + 1) % gs, prev = (gr + gs - 1) % gs;
    if (gr % 2 == 0) {
      g->send(mine, next, 30 + gs)->wait();
      g->recv(got, prev, 30 + gs)->wait();
    } else {
      g->recv(got, prev, 30 + gs)->wait();
      g->send(mine, next, 30 + gs)->wait();
    }
    for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(at(got, i), value(DType::Int64, m[prev], i)) << "ring in " << where;
  }
  g->barrier()->wait();
}

class Groups : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's Groups cases run under mpirun: ctest -R dist_";
    n = dist::world_size();
    me = dist::rank();
  }
  int n = 1, me = 0;
};

TEST_F(Groups, NewGroupSortsItsRanksAndNamesThem) {
  EXPECT_EQ(dist::world()->describe(), "the world (" + std::to_string(n) + " ranks)");
  std::vector<int> all;
  for (int r = n - 1; r >= 0; --r) all.push_back(r);
  auto g = dist::new_group(all);
  EXPECT_TRUE(g->is_member());
  EXPECT_EQ(g->rank(), me);
  EXPECT_EQ(g->size(), n);
  EXPECT_EQ(g->backend(), "mpi");
  std::sort(all.begin(), all.end());
  EXPECT_EQ(g->ranks(), all);
  EXPECT_EQ(g->describe(), "group " + text(all) + " (" + std::to_string(n) + " of " + std::to_string(n) + " ranks)");
  // The odd ranks, given out of order: group rank i is the i-th smallest.
  std::vector<int> odd;
  for (int r = n - 1; r >= 0; --r) {
    if (r % 2) odd.push_back(r);
  }
  auto h = dist::new_group(odd);
  std::sort(odd.begin(), odd.end());
  EXPECT_EQ(h->ranks(), odd);
  EXPECT_EQ(h->size(), static_cast<int>(odd.size()));
  EXPECT_EQ(h->describe(), "group " + text(odd) + " (" + std::to_string(odd.size()) + " of " + std::to_string(n) + " ranks)");
  EXPECT_EQ(h->is_member(), me % 2 == 1);
  EXPECT_EQ(h->rank(), me % 2 ? me / 2 : -1);
}

TEST_F(Groups, EveryCollectiveOnSubgroups) {
  // Groups made in the same order everywhere; a rank runs the ones it is in.
  std::vector<std::vector<int>> lists;
  if (n == 2) lists = {{0, 1}, {1}};
  if (n >= 4) lists = {{1, 3}, {0, 2, 3}, {0, 1, 2, 3}};
  for (const auto& l : lists) {
    auto g = dist::new_group(l);
    if (g->is_member()) check_collectives(g);
  }
  // Disjoint pairs at once: [0, 1] and [2, 3] run their collectives concurrently, beside the world.
  if (n >= 4) {
    auto a = dist::new_group({0, 1}), b = dist::new_group({2, 3});
    auto mine = me < 2 ? a : b;
    if (me < 4) {
      ASSERT_TRUE(mine->is_member());
      check_collectives(mine);
    }
  }
  Tensor t = full({3}, 1.0);
  dist::world()->allreduce(t)->wait();
  EXPECT_EQ(t.data_ptr<float>()[0], static_cast<float>(n));
}

TEST_F(Groups, NonMembersGetAHandleThatRefusesUse) {
  auto g = dist::new_group({0});
  ASSERT_EQ(g->is_member(), me == 0);
  const std::string name = "group [0] (1 of " + std::to_string(n) + " ranks)";
  EXPECT_EQ(g->describe(), name);
  EXPECT_EQ(g->size(), 1);
  EXPECT_EQ(g->ranks(), std::vector<int>{0});
  Tensor t = full({4}, 2.0);
  if (me == 0) {
    EXPECT_EQ(g->rank(), 0);
    g->allreduce(t)->wait();  // a group of one: the identity
    EXPECT_EQ(t.data_ptr<float>()[3], 2.0f);
    return;
  }
  EXPECT_EQ(g->rank(), -1);
  const std::string want = "world rank " + std::to_string(me) + " is not a member of " + name;
  expect_error<DistributedError>([&] { g->allreduce(t); }, "dist::allreduce at test_groups.cpp:");
  expect_error<DistributedError>([&] { g->allreduce(t); }, want + "; only its members may use it");
  expect_error<DistributedError>([&] { g->barrier(); }, want);
  expect_error<DistributedError>([&] { g->send(t, 0); }, want);
  expect_error<DistributedError>([&] { g->alltoall(t, t); }, want);
  expect_error<DistributedError>(
      [&] { dist::DistributedDataParallel ddp(test::make_net(1), g, {}); },
      "DistributedDataParallel: this process is not a member of " + name);
}

TEST_F(Groups, BadRankListsThrowOnEveryProcess) {
  expect_error<ValueError>([] { dist::new_group({}); }, "expected at least one rank, got an empty list");
  expect_error<ValueError>([] { dist::new_group({0, 0}); }, "rank 0 is listed twice in [0, 0]");
  expect_error<ValueError>([&] { dist::new_group({0, n}); },
                           "rank " + std::to_string(n) + " is not a rank of the world, which has ranks 0 .. " +
                               std::to_string(n - 1));
  // Rank 0 asks for another group than the others: every process raises, none splits.
  const std::vector<int> mine = me == 0 ? std::vector<int>{0} : std::vector<int>{0, 1};
  expect_error<DistributedError>([&] { dist::new_group(mine); }, "the processes asked for different groups");
  expect_error<DistributedError>([&] { dist::new_group(mine); },
                                 me == 0 ? "world rank 1 asked for [0, 1]" : "world rank 0 asked for [0]");
  auto g = dist::new_group({0, 1});  // still in step
  if (g->is_member()) g->barrier()->wait();
}

TEST_F(Groups, BadShapesNameTheGroup) {
  auto g = dist::new_group({0, 1});
  if (!g->is_member()) return;
  const std::string name = "group [0, 1] (2 of " + std::to_string(n) + " ranks)";
  Tensor in = zeros({3});
  Tensor out5 = zeros({5});
  expect_error<ShapeError>([&] { g->allgather_into_tensor(out5, in); },
                           "expected an output of 2 x 3 = 6 elements (2 ranks in " + name + " x the input [3]), got [5]");
  expect_error<ShapeError>([&] { g->reduce_scatter_tensor(in, out5); },
                           "expected an input of 2 x 3 = 6 elements (2 ranks in " + name + " x the output [3]), got [5]");
  Tensor i64 = zeros({6}, TensorOptions().dtype(DType::Int64));
  expect_error<DTypeError>([&] { g->allgather_into_tensor(i64, in); }, "the output is int64, the input float32");
  std::vector<Tensor> uneven{zeros({2}), zeros({4})};
  expect_error<ShapeError>([&] { g->allgather(uneven, zeros({7})); },
                           "output " + std::to_string(g->rank()) + " (this rank's) must have the input's 7 elements");
  std::vector<Tensor> three{zeros({3}), zeros({3}), zeros({3})};
  expect_error<ShapeError>([&] { g->allgather(three, in); }, "expected 2 output tensors (one per rank of " + name);
  Tensor rows3 = zeros({3, 2});
  expect_error<ShapeError>([&] { g->alltoall(rows3, rows3); }, "divisible by the 2 ranks of " + name);
  expect_error<ShapeError>([&] { g->alltoall(rows3, rows3, {1, 1, 1}, {1, 2}); },
                           "out_splits must have 2 entries (one per rank of " + name + "), got 3");
  expect_error<ShapeError>([&] { g->alltoall(rows3, rows3, {1, 2}, {2, 2}); },
                           "in_splits add up to 4 rows, but dim 0 of the input is 3");
  expect_error<ValueError>([&] { g->alltoall(rows3, rows3, {1, 2}, {}); }, "give both split lists or neither");
  Tensor cols = zeros({2, 3});
  expect_error<ShapeError>([&] { g->alltoall(cols, zeros({2, 2})); }, "must have the same dimensions after dim 0");
  expect_error<ValueError>([&] { g->broadcast(in, 2); }, "root must be a rank of " + name + ", in [0, 2), got 2");
  expect_error<ValueError>([&] { g->send(in, g->rank()); }, "dst must be another rank of " + name);
  Tensor six = zeros({6});
  Tensor wrong_view = six.narrow(0, 3 * (1 - g->rank()), 3);  // the other rank's shard
  expect_error<ValueError>([&] { g->allgather_into_tensor(six, wrong_view); },
                           "the input overlaps the output other than as this rank's shard");
  Tensor shard = six.narrow(0, 0, 3);
  expect_error<ValueError>([&] { g->reduce_scatter_tensor(shard, six); }, "the output overlaps the input");
  g->barrier()->wait();  // argument errors throw before anything is queued: the group is still usable
}

// KILN_DIST_DEBUG=1 (ctest dist_2_debug) checks that split sizes pair up: the
// wrong ones raise on every rank instead of truncating or hanging.
TEST_F(Groups, DebugModeCatchesAlltoallSplitsThatDisagree) {
  const char* d = std::getenv("KILN_DIST_DEBUG");
  if (!d || std::string(d) == "0" || std::string(d).empty()) GTEST_SKIP() << "needs KILN_DIST_DEBUG=1";
  auto g = dist::new_group({0, 1});  // its own group: a failed collective spoils the group it ran on
  if (!g->is_member()) return;
  // Group rank 1 expects 2 rows from rank 0, which sends it 1.
  const std::vector<int64_t> out_splits = g->rank() == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 0};
  Tensor in = zeros({2, 2}), out = zeros({2, 2});
  auto work = g->alltoall(out, in, out_splits, {1, 1});
  const std::string name = "group [0, 1] (2 of " + std::to_string(n) + " ranks)";
  expect_error<DistributedError>([&] { work->wait(); }, "alltoall split sizes disagree in " + name);
  if (g->rank() == 1) {
    expect_error<DistributedError>([&] { work->wait(); }, "from rank 0 (world 0): it sends 1 rows, out_splits expects 2");
  }
}

// A rank may send no rows at all and still receive some.
TEST_F(Groups, AlltoallFromARankThatSendsNothing) {
  auto g = dist::new_group({0, 1});
  if (!g->is_member()) return;
  // Group rank 0 sends nothing; rank 1 sends one row of 3 to each rank (itself included).
  const bool zero = g->rank() == 0;
  Tensor in = zero ? zeros({0, 3}) : full({2, 3}, 7.0);
  Tensor out = full({1, 3}, -1.0);
  const std::vector<int64_t> in_splits = zero ? std::vector<int64_t>{0, 0} : std::vector<int64_t>{1, 1};
  g->alltoall(out, in, {0, 1}, in_splits)->wait();
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(out.data_ptr<float>()[i], 7.0f);
}

// Uneven allgather sizes that the ranks disagree on (same total, so the count
// alone would pass): the debug check compares every rank's list of sizes.
TEST_F(Groups, DebugModeCatchesUnevenSizesThatDisagree) {
  const char* d = std::getenv("KILN_DIST_DEBUG");
  if (!d || std::string(d) == "0" || std::string(d).empty()) GTEST_SKIP() << "needs KILN_DIST_DEBUG=1";
  auto g = dist::new_group({0, 1});
  if (!g->is_member()) return;
  std::vector<Tensor> out = g->rank() == 0 ? std::vector<Tensor>{zeros({1}), zeros({3})}
                                           : std::vector<Tensor>{zeros({2}), zeros({2})};
  auto work = g->allgather(out, zeros({g->rank() == 0 ? 1 : 2}));
  expect_error<DistributedError>([&] { work->wait(); }, "collective mismatch at collective number 1 of group [0, 1]");
  expect_error<DistributedError>([&] { work->wait(); }, "allgather float32[4] uneven at tests/dist/test_groups.cpp:");
}

// DDP on a subgroup matches one process on the group's whole batch; at 4 ranks
// two DDPs, on [0, 2] and [1, 3], train different models at once.
TEST_F(Groups, DDPOnSubgroups) {
  const int half = n / 2;
  std::vector<dist::ProcessGroupPtr> groups;
  for (int k = 0; k < half; ++k) groups.push_back(dist::new_group({k, k + half}));
  if (me >= 2 * half) return;
  const int k = me % half;
  auto g = groups[static_cast<size_t>(k)];
  ASSERT_TRUE(g->is_member());
  const int64_t B = 2, K = 3;
  auto batches = test::make_batches(2 * B, K, 60 + k);
  auto ref = test::make_net(20 + k);
  ref->use_extra = false;
  test::train_reference(*ref, batches);
  auto net = test::make_net(g->rank() == 0 ? 20 + k : 90 + me);  // the broadcast at construction fixes the others
  net->use_extra = false;
  test::train_rank(net, g, batches, B, {.bucket_cap_mb = 1024.0 / (1024 * 1024), .find_unused_parameters = true});
  test::expect_same_parameters(*net, *ref, "world rank " + std::to_string(me) + " in " + g->describe());
}

}  // namespace
