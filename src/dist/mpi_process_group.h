#pragma once
// The MPI backend of ProcessGroup (internal to src/dist). Collectives are
// queued to one communication thread per group, which runs them in issue
// order on a duplicate of the group's communicator, so they progress while the
// caller computes. Profiles (kiln/core/record.h) see each collective as a
// Collective scope on that thread (its own track in a trace: "collectives:
// <group>"), and a caller blocked in Work::wait as a CollectiveWait scope. A watchdog thread times the running
// collective and answers peers' questions about this rank's progress on a second duplicate, which stays usable while
// the first is stuck.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kiln/dist/process_group.h"
#include "shm_allreduce.h"

namespace kiln::dist::detail {

enum class OpKind : int32_t {
  AllReduce,
  Broadcast,
  AllGather,
  ReduceScatter,
  Barrier,
  Send,
  Recv,
  AllGatherInto,
  ReduceScatterTensor,
  AllToAll,
  AllToAllSplit,
  AllReduceCompressed,
};

/// What a rank called: fixed-size so that ranks can exchange it with one
/// MPI_Allgather (debug mode) or one message (watchdog).
struct Signature {
  uint64_t seq = 0;      // per group, every operation
  uint64_t coll_no = 0;  // per group, collectives only (0 for send/recv): what ranks must agree on
  int32_t kind = 0;      // OpKind
  int32_t reduce = -1;   // ReduceOp, or -1
  int32_t dtype = -1;    // DType, or -1 (barrier)
  int32_t peer = -1;     // root, dst or src
  int64_t count = 0;     // elements per rank
  // A hash of what every rank must agree on beyond one shape: the per-rank
  // sizes of an uneven allgather (0 when there is none).
  uint64_t layout = 0;
  // The full shape (up to kShapeDims dimensions; the count covers the rest):
  // an allreduce of [3, 4] against [4, 3] moves the same bytes but is a bug.
  static constexpr int kShapeDims = 8;
  int32_t ndim = 0;
  int32_t pad = 0;
  int64_t shape[kShapeDims] = {};
  char site[176] = {};  // file:line of the call

  bool same_call(const Signature& o) const {
    if (!(coll_no == o.coll_no && kind == o.kind && reduce == o.reduce && dtype == o.dtype && peer == o.peer &&
          count == o.count && layout == o.layout && ndim == o.ndim)) {
      return false;
    }
    for (int d = 0; d < kShapeDims; ++d) {
      if (shape[d] != o.shape[d]) return false;
    }
    return true;
  }
  /// "#3 allreduce(sum) float32[32, 32] at file.cpp:42"
  std::string describe() const;
};

/// A rank's progress, as the watchdog reports it to a peer that asks.
struct Progress {
  uint64_t started_seq = 0, completed_seq = 0;
  uint64_t colls_started = 0, colls_completed = 0;
  int32_t in_flight = 0;
  int32_t pad = 0;
  Signature current;  // the running (or last started) operation
};

/// How the communication thread waits for a collective to complete
/// (KILN_DIST_PROGRESS, read when a group is made).
enum class ProgressMode {
  /// A nonblocking collective (MPI_Iallreduce, MPI_Ibcast) tested with
  /// back-off: spin about 20 µs, then sleep 5 µs doubling up to 100 µs between
  /// tests, so a rank waiting for its peer leaves the core to compute.
  Backoff,
  /// The blocking call, which Open MPI completes by busy-polling a core.
  Spin,
};
/// Throws DistributedError "dist: <what> failed: <MPI's message>" unless `rc` is MPI_SUCCESS.
void check_mpi(int rc, const char* what);

/// KILN_DIST_PROGRESS: "backoff" (the default, also when unset or empty) or "spin".
ProgressMode progress_mode_from_env();
/// Completes `req` by MPI_Test with back-off (ProgressMode::Backoff); `what` names the call in errors.
void wait_with_backoff(MPI_Request& req, const char* what);
/// Process-wide counts of the back-off path, for tests and figures.
struct ProgressCounters {
  int64_t completed = 0;  // requests completed by wait_with_backoff
  int64_t tests = 0;      // MPI_Test calls
  int64_t sleeps = 0;     // sleeps between tests
};
ProgressCounters progress_counters();

class MPIWork final : public Work {
 public:
  /// `wait_name` ("allreduce.wait") and `group` (the group's describe()) name
  /// the CollectiveWait scope of a wait() that blocks; both outlive the work's wait.
  MPIWork(uint64_t seq, const char* wait_name, const std::string* group)
      : seq_(seq), wait_name_(wait_name), group_(group) {}
  void wait() override;
  bool is_completed() override;
  uint64_t sequence() const override { return seq_; }
  void finish(std::exception_ptr err);

 private:
  uint64_t seq_;
  const char* wait_name_;
  const std::string* group_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr err_;
};

class MPIProcessGroup final : public ProcessGroup {
 public:
  /// Duplicates `comm` (twice: collectives, watchdog) and starts both threads.
  /// `world_ranks`: the world rank of each member, for messages; empty for the world.
  /// `name`: what new_group's caller said the group is for ("tp"), put before "group [...]".
  explicit MPIProcessGroup(MPI_Comm comm, std::vector<int> world_ranks = {}, const std::string& name = "");
  ~MPIProcessGroup() override;
  /// Stops the threads and frees the communicators; must run before MPI_Finalize.
  void shutdown();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  std::vector<int> ranks() const override { return world_ranks_; }
  std::string describe() const override { return name_; }
  ProgressMode progress_mode() const { return progress_mode_; }
  /// Why the shared-memory all-reduce is not in use: "" while it is, or before
  /// the first float sum made it; "off (KILN_DIST_SHM=0)"; or what failed.
  /// Read it after a collective has completed (it is set on the communication thread).
  std::string shm_status() const;

  WorkPtr allreduce(Tensor& t, ReduceOp op, Loc loc) override;
  WorkPtr allreduce_compressed(Tensor& t, DType wire, ReduceOp op, Loc loc) override;
  WorkPtr broadcast(Tensor& t, int root, Loc loc) override;
  WorkPtr allgather(std::vector<Tensor>& out, const Tensor& in, Loc loc) override;
  WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in, Loc loc) override;
  WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& in, ReduceOp op, Loc loc) override;
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op, Loc loc) override;
  WorkPtr alltoall(Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                   const std::vector<int64_t>& in_splits, Loc loc) override;
  WorkPtr barrier(Loc loc) override;
  WorkPtr send(const Tensor& t, int dst, int tag, Loc loc) override;
  WorkPtr recv(Tensor& t, int src, int tag, Loc loc) override;

 private:
  struct Task {
    Signature sig;
    std::function<void()> run;
    std::shared_ptr<MPIWork> work;
  };
  WorkPtr enqueue(Signature sig, std::function<void()> run);
  /// `t`: the tensor whose dtype and shape the ranks must agree on (null for a barrier).
  Signature make_signature(OpKind kind, int reduce, int peer, const Tensor* t, const Loc& loc);
  /// The reduce-scatter both forms share: `send` holds size() shards of
  /// out.numel() elements each (float32 when `out` is bfloat16).
  void reduce_scatter_block(const Tensor& out, const void* send, ReduceOp op);
  /// Rank r as messages show it: "r" in the world, "r (world w)" in a subgroup.
  std::string who(int r) const;
  void comm_loop();
  void check_signatures(const Signature& mine);
  void watchdog_loop();
  void serve_queries();
  [[noreturn]] void report_timeout(const Signature& stuck, double seconds);

  int rank_ = 0, size_ = 1;
  bool is_world_ = true;
  std::vector<int> world_ranks_;
  std::string name_;                // describe()
  MPI_Comm comm_ = MPI_COMM_NULL;   // collectives, send/recv and debug signature exchange
  MPI_Comm watch_ = MPI_COMM_NULL;  // watchdog queries and answers
  bool debug_ = false;
  double timeout_s_ = 300;
  ProgressMode progress_mode_ = ProgressMode::Backoff;
  // The shared-memory all-reduce (KILN_DIST_SHM, on unless "0"): made by the
  // group's first float sum, on the communication thread.
  bool shm_enabled_ = true;
  bool shm_tried_ = false;  // then shm_, or null and shm_why_ says why
  std::unique_ptr<ShmAllreduce> shm_;
  std::string shm_why_;
  /// On the communication thread: the shared-memory segment if a float sum of
  /// `n` elements (an all-reduce, or a reduce-scatter's input) should use it.
  ShmAllreduce* shm_for(size_t n);

  // Issue side (caller threads).
  std::mutex issue_mu_;
  uint64_t next_seq_ = 0, next_coll_ = 0;

  // The queue to the communication thread.
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<Task> queue_;
  bool stop_ = false;

  // Progress, written by the communication thread, read by the watchdog.
  mutable std::mutex state_mu_;
  Progress progress_;
  std::chrono::steady_clock::time_point started_at_;
  std::deque<Signature> history_;  // the last few started operations, newest last
  std::string poisoned_;           // set after a failed collective: later ones fail at once

  std::atomic<bool> watch_stop_{false};
  MPI_Request query_req_ = MPI_REQUEST_NULL;
  int query_buf_ = 0;
  std::thread comm_thread_, watch_thread_;
  bool shut_down_ = false;
};

/// Keeps every group new_group() made so that the exit handler can stop its
/// threads and free its communicators before MPI_Finalize (groups still
/// referenced then; a group destroyed earlier shuts itself down).
void register_group(const std::shared_ptr<MPIProcessGroup>& g);
void shutdown_groups();

}  // namespace kiln::dist::detail
