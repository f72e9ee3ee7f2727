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
#include <cstdint>
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

/// A set of ranks that run collectives together. Tensors must be contiguous
/// float32, bfloat16 or int64 and stay alive and unmodified until wait().
class ProcessGroup {
 public:
  using Loc = std::source_location;
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;

  /// In place: every rank ends with the reduction of all ranks' `t`.
  virtual WorkPtr allreduce(Tensor& t, ReduceOp op = ReduceOp::Sum, Loc loc = Loc::current()) = 0;
  /// In place: every rank ends with `root`'s `t`.
  virtual WorkPtr broadcast(Tensor& t, int root = 0, Loc loc = Loc::current()) = 0;
  /// out[r] receives rank r's `in`; out has size() tensors shaped like `in`.
  virtual WorkPtr allgather(std::vector<Tensor>& out, const Tensor& in, Loc loc = Loc::current()) = 0;
  /// `out` receives the reduction over ranks of in[rank()]; in has size() tensors shaped like `out`.
  virtual WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& in, ReduceOp op = ReduceOp::Sum,
                                 Loc loc = Loc::current()) = 0;
  virtual WorkPtr barrier(Loc loc = Loc::current()) = 0;
  virtual WorkPtr send(const Tensor& t, int dst, int tag = 0, Loc loc = Loc::current()) = 0;
  virtual WorkPtr recv(Tensor& t, int src, int tag = 0, Loc loc = Loc::current()) = 0;
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

}  // namespace kiln::dist
