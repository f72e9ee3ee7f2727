#pragma once
// Process groups: the collectives data-parallel training needs (DESIGN.md §6).
// Callers (DDP, the CLI, user code) see only this interface; the MPI backend
// lives behind it so that NCCL or Gloo can be added without touching them.
//
// Every collective is asynchronous and returns a Work handle; the synchronous
// form is `pg.allreduce(t)->wait()`. Collectives run in the order they were
// issued on each rank and carry a sequence number and a signature (op, dtype,
// element count, call site) so that a rank that calls something else, or
// nothing, is diagnosed rather than left hanging.
//
// A group is the world (dist::world()) or a subset of it made by
// dist::new_group(ranks). Every rank argument of a group's methods (root, dst,
// src) and rank() itself are ranks within that group, 0 .. size() - 1, as in
// torch.distributed's ProcessGroup objects; ranks() maps them to world ranks.
#include <cstdint>
#include <functional>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::dist {

enum class ReduceOp { Sum, Avg, Max, Min };

/// A pending collective. wait() rethrows the collective's error (mismatch,
/// timeout, a peer's failure) on the calling thread.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
  /// The collective's sequence number on this rank (1-based, per group).
  virtual uint64_t sequence() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

/// torch's fut.then(...): a Work that waits for `inner` and then runs `step`
/// once, on the thread that waits (e.g. to divide a sum or copy a result
/// into place). A null `inner` stands for a collective already done.
WorkPtr then(WorkPtr inner, std::function<void()> step);

/// A set of ranks that run collectives together. Tensors must be contiguous
/// float32, bfloat16 or int64 and stay alive and unmodified until wait().
class ProcessGroup {
 public:
  using Loc = std::source_location;
  virtual ~ProcessGroup() = default;
  /// This process's rank in the group; -1 on a process that is not a member.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  /// False for the handle new_group() gives the processes it leaves out: its
  /// collectives throw (torch instead returns None from them silently).
  virtual bool is_member() const { return true; }
  /// The world rank of each group rank, in group-rank order (the world: 0 .. size-1).
  virtual std::vector<int> ranks() const;
  /// How messages name the group: "the world (4 ranks)", "group [0, 2] (2 of 4 ranks)".
  virtual std::string describe() const;

  /// In place: every rank ends with the reduction of all ranks' `t`.
  virtual WorkPtr allreduce(Tensor& t, ReduceOp op = ReduceOp::Sum, Loc loc = Loc::current()) = 0;
  /// In place, float32 `t` sent as `wire` (bfloat16 or float16) to move half
  /// the bytes: each rank's values are rounded to `wire`, summed in float32,
  /// divided by size() for Avg, rounded to `wire` once and widened back into
  /// `t`. DDP's compression hooks run on it (torch's bf16_compress_hook and
  /// fp16_compress_hook; docs/ddp.md). The default runs a float32 allreduce
  /// between the roundings, with the same result.
  virtual WorkPtr allreduce_compressed(Tensor& t, DType wire, ReduceOp op = ReduceOp::Avg, Loc loc = Loc::current());
  /// In place: every rank ends with `root`'s `t`.
  virtual WorkPtr broadcast(Tensor& t, int root = 0, Loc loc = Loc::current()) = 0;
  /// out[r] receives rank r's `in`; out has size() tensors of in's dtype.
  /// They may differ in size (uneven shards, as FSDP's last one): out[r] has
  /// rank r's element count, which every rank must know; out[rank()] has in's.
  virtual WorkPtr allgather(std::vector<Tensor>& out, const Tensor& in, Loc loc = Loc::current()) = 0;
  /// torch's all_gather_into_tensor: `out` (size() x in.numel() elements, any
  /// shape) receives rank r's `in` at element offset r x in.numel(). `in` may
  /// be the view of `out` at this rank's offset (gathered in place).
  virtual WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in, Loc loc = Loc::current()) = 0;
  /// `out` receives the reduction over ranks of in[rank()]; in has size() tensors shaped like `out`.
  virtual WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& in, ReduceOp op = ReduceOp::Sum,
                                 Loc loc = Loc::current()) = 0;
  /// torch's reduce_scatter_tensor: `in` (size() x out.numel() elements) is
  /// cut into size() equal shards in element order; `out` receives the
  /// reduction over ranks of shard rank().
  virtual WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum,
                                        Loc loc = Loc::current()) = 0;
  /// torch's all_to_all_single: `in` is cut along dim 0 into size() blocks,
  /// block j going to rank j; `out` receives rank j's block for this rank as
  /// block j. Without split sizes dim 0 of both divides evenly by size();
  /// with them, in_splits[j] rows go to rank j and out_splits[j] rows come
  /// from rank j (rank j's in_splits[this rank] must equal out_splits[j]:
  /// KILN_DIST_DEBUG=1 checks it). Both empty or both given.
  virtual WorkPtr alltoall(Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits = {},
                           const std::vector<int64_t>& in_splits = {}, Loc loc = Loc::current()) = 0;
  virtual WorkPtr barrier(Loc loc = Loc::current()) = 0;
  /// Point to point, matched by (peer, tag) within the group; not collectives,
  /// so the debug cross-check leaves them out.
  virtual WorkPtr send(const Tensor& t, int dst, int tag = 0, Loc loc = Loc::current()) = 0;
  virtual WorkPtr recv(Tensor& t, int src, int tag = 0, Loc loc = Loc::current()) = 0;

 protected:
  /// allreduce_compressed's arguments: float32 `t`, a 16-bit float `wire`, Sum or Avg.
  static void check_compressed(const Tensor& t, DType wire, ReduceOp op);
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

/// While one lives, the collectives this thread issues carry `label` next to
/// their call site, so that a mismatch, a timeout or a dead rank is reported as
/// "... at fsdp.cpp:210 (FSDP unit 'blocks.1': forward all-gather)" rather
/// than by a line of library code alone. The innermost label wins.
class CollectiveLabel {
 public:
  explicit CollectiveLabel(std::string label);
  ~CollectiveLabel();
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;
  /// This thread's label; empty when none is set.
  static const std::string& current();

 private:
  std::string previous_;
};

}  // namespace kiln::dist
