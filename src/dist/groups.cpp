// dist::new_group: groups of some of the world's ranks, each an MPI
// communicator split from the world with its own communication thread and
// watchdog (mpi_process_group.h), and the handle the ranks left out get.
#include <mpi.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/half.h"
#include "kiln/dist/dist.h"
#include "mpi_process_group.h"

namespace kiln::dist {

std::vector<int> ProcessGroup::ranks() const {
  std::vector<int> r(static_cast<size_t>(size()));
  for (int i = 0; i < size(); ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

std::string ProcessGroup::describe() const {
  return backend() + " group of " + std::to_string(size()) + (size() == 1 ? " rank" : " ranks");
}

void ProcessGroup::check_compressed(const Tensor& t, DType wire, ReduceOp op) {
  KILN_CHECK(t.defined() && t.dtype() == DType::Float32, DTypeError,
             "dist::allreduce_compressed: expected a float32 tensor (the values to compress), got ",
             t.defined() ? dtype_name(t.dtype()) : "an undefined tensor");
  KILN_CHECK(wire == DType::BFloat16 || wire == DType::Float16, DTypeError,
             "dist::allreduce_compressed: the wire type must be bfloat16 or float16, got ", dtype_name(wire));
  KILN_CHECK(op == ReduceOp::Sum || op == ReduceOp::Avg, ValueError,
             "dist::allreduce_compressed: expected ReduceOp::Sum or ReduceOp::Avg (a compressed sum), got Max or Min");
}

namespace {
thread_local std::string t_collective_label;

// Rounds every value of float32 `t` to `wire` and back.
void round_through(Tensor& t, DType wire) {
  auto* p = static_cast<float*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = wire == DType::BFloat16 ? static_cast<float>(BFloat16(p[i])) : static_cast<float>(Half(p[i]));
}

// A collective whose result needs one more step on the caller's thread when it is waited.
class ThenWork final : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> then) : inner_(std::move(inner)), then_(std::move(then)) {}
  void wait() override {
    if (inner_) inner_->wait();
    if (then_) std::exchange(then_, nullptr)();
  }
  bool is_completed() override { return !then_ && (!inner_ || inner_->is_completed()); }
  uint64_t sequence() const override { return inner_ ? inner_->sequence() : 0; }

 private:
  WorkPtr inner_;
  std::function<void()> then_;
};
}  // namespace

WorkPtr then(WorkPtr inner, std::function<void()> step) {
  return std::make_shared<ThenWork>(std::move(inner), std::move(step));
}

WorkPtr ProcessGroup::allreduce_compressed(Tensor& t, DType wire, ReduceOp op, Loc loc) {
  check_compressed(t, wire, op);
  KILN_CHECK(t.is_contiguous(), ValueError, "dist::allreduce_compressed: expected a contiguous tensor, got shape ",
             t.shape_string());
  round_through(t, wire);
  Tensor keep = t;
  const int by = size();
  return then(allreduce(t, ReduceOp::Sum, loc), [keep, wire, op, by]() mutable {
    if (op == ReduceOp::Avg) {
      auto* p = static_cast<float*>(keep.data_ptr());
      for (int64_t i = 0; i < keep.numel(); ++i) p[i] /= static_cast<float>(by);
    }
    round_through(keep, wire);
  });
}

CollectiveLabel::CollectiveLabel(std::string label) : previous_(std::move(t_collective_label)) {
  t_collective_label = std::move(label);
}
CollectiveLabel::~CollectiveLabel() { t_collective_label = std::move(previous_); }
const std::string& CollectiveLabel::current() { return t_collective_label; }

namespace detail {
namespace {

std::string list_ranks(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// What new_group gives a process it leaves out, as torch's
// GroupMember.NON_GROUP_MEMBER; torch's collectives then return None and do
// nothing, which hides a caller that forgot to test membership. Here every
// collective throws, naming the group and this process's world rank.
class NonMemberGroup final : public ProcessGroup {
 public:
  NonMemberGroup(std::vector<int> ranks, int world_rank, int world_size, const std::string& name)
      : ranks_(std::move(ranks)), world_rank_(world_rank) {
    name_ = (name.empty() ? "" : name + " ") + "group " + list_ranks(ranks_) + " (" + std::to_string(ranks_.size()) +
            " of " + std::to_string(world_size) + " ranks)";
  }
  int rank() const override { return -1; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  std::string backend() const override { return "mpi"; }
  bool is_member() const override { return false; }
  std::vector<int> ranks() const override { return ranks_; }
  std::string describe() const override { return name_; }

  WorkPtr allreduce(Tensor&, ReduceOp, Loc loc) override { refuse("allreduce", loc); }
  WorkPtr broadcast(Tensor&, int, Loc loc) override { refuse("broadcast", loc); }
  WorkPtr allgather(std::vector<Tensor>&, const Tensor&, Loc loc) override { refuse("allgather", loc); }
  WorkPtr allgather_into_tensor(Tensor&, const Tensor&, Loc loc) override { refuse("allgather_into_tensor", loc); }
  WorkPtr reduce_scatter(Tensor&, const std::vector<Tensor>&, ReduceOp, Loc loc) override {
    refuse("reduce_scatter", loc);
  }
  WorkPtr reduce_scatter_tensor(Tensor&, const Tensor&, ReduceOp, Loc loc) override {
    refuse("reduce_scatter_tensor", loc);
  }
  WorkPtr alltoall(Tensor&, const Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&, Loc loc) override {
    refuse("alltoall", loc);
  }
  WorkPtr barrier(Loc loc) override { refuse("barrier", loc); }
  WorkPtr send(const Tensor&, int, int, Loc loc) override { refuse("send", loc); }
  WorkPtr recv(Tensor&, int, int, Loc loc) override { refuse("recv", loc); }

 private:
  [[noreturn]] void refuse(const char* op, const Loc& loc) const {
    std::string file = loc.file_name();
    if (const auto at = file.rfind('/'); at != std::string::npos) file = file.substr(at + 1);
    throw DistributedError("dist::" + std::string(op) + " at " + file + ":" + std::to_string(loc.line()) +
                           ": world rank " + std::to_string(world_rank_) + " is not a member of " + name_ +
                           "; only its members may use it (test group->is_member() first)");
  }
  std::vector<int> ranks_;
  int world_rank_;
  std::string name_;
};

std::mutex g_groups_mu;
std::vector<std::weak_ptr<MPIProcessGroup>> g_groups;

}  // namespace

void register_group(const std::shared_ptr<MPIProcessGroup>& g) {
  std::lock_guard lock(g_groups_mu);
  std::erase_if(g_groups, [](const auto& w) { return w.expired(); });
  g_groups.push_back(g);
}

void shutdown_groups() {
  std::vector<std::shared_ptr<MPIProcessGroup>> live;
  {
    std::lock_guard lock(g_groups_mu);
    for (auto& w : g_groups) {
      if (auto g = w.lock()) live.push_back(std::move(g));
    }
    g_groups.clear();
  }
  for (auto& g : live) g->shutdown();
}

}  // namespace detail

ProcessGroupPtr new_group(std::vector<int> ranks, const std::string& name) {
  auto world_group = world();  // throws before init()
  const int n = world_group->size(), me = world_group->rank();
  std::sort(ranks.begin(), ranks.end());
  // Argument errors are the same on every process that passed the same list,
  // so each can throw before the collective below.
  KILN_CHECK(!ranks.empty(), ValueError, "dist::new_group: expected at least one rank, got an empty list");
  for (size_t i = 0; i < ranks.size(); ++i) {
    KILN_CHECK(ranks[i] >= 0 && ranks[i] < n, ValueError, "dist::new_group: rank ", ranks[i],
               " is not a rank of the world, which has ranks 0 .. ", n - 1);
    KILN_CHECK(i == 0 || ranks[i] != ranks[i - 1], ValueError, "dist::new_group: rank ", ranks[i],
               " is listed twice in ", detail::list_ranks(ranks));
  }
  // Every process must pass the same list, or the split would make groups
  // that some members do not know they are in. Exchange the lists (they are
  // at most the world's size) on the world communicator.
  std::vector<int> mine(static_cast<size_t>(n), -1);
  std::copy(ranks.begin(), ranks.end(), mine.begin());
  std::vector<int> all(static_cast<size_t>(n) * static_cast<size_t>(n));
  int rc = MPI_Allgather(mine.data(), n, MPI_INT, all.data(), n, MPI_INT, MPI_COMM_WORLD);
  KILN_CHECK(rc == MPI_SUCCESS, DistributedError, "dist::new_group: MPI_Allgather failed (code ", rc, ")");
  std::ostringstream differ;
  for (int r = 0; r < n; ++r) {
    if (!std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r) * n)) {
      std::vector<int> theirs;
      for (int i = 0; i < n && all[static_cast<size_t>(r * n + i)] >= 0; ++i) {
        theirs.push_back(all[static_cast<size_t>(r * n + i)]);
      }
      differ << "\n  world rank " << r << " asked for " << detail::list_ranks(theirs);
    }
  }
  KILN_CHECK(differ.str().empty(), DistributedError,
             "dist::new_group: the processes asked for different groups: world rank ", me, " asked for ",
             detail::list_ranks(ranks), ", but", differ.str(),
             "\nevery process of the world must call new_group with the same ranks, in the same order of calls");
  const bool member = std::binary_search(ranks.begin(), ranks.end(), me);
  MPI_Comm comm = MPI_COMM_NULL;
  rc = MPI_Comm_split(MPI_COMM_WORLD, member ? 0 : MPI_UNDEFINED, me, &comm);
  KILN_CHECK(rc == MPI_SUCCESS, DistributedError, "dist::new_group: MPI_Comm_split failed (code ", rc, ")");
  if (!member) return std::make_shared<detail::NonMemberGroup>(ranks, me, n, name);
  // The group keeps duplicates of the split; this one is only their template.
  std::shared_ptr<detail::MPIProcessGroup> g;
  try {
    g = std::make_shared<detail::MPIProcessGroup>(comm, ranks, name);
  } catch (...) {
    MPI_Comm_free(&comm);
    throw;
  }
  MPI_Comm_free(&comm);
  detail::register_group(g);
  return g;
}

}  // namespace kiln::dist
