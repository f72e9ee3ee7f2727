#pragma once
// A float32 (or 16-bit) sum/average all-reduce (and the float32 reduce-scatter
// that shares its segment) through shared memory, for the MPI backend when
// every rank of a group runs on one machine (internal to src/dist).
//
// Why: Open MPI moves a large allreduce between processes of one node at
// about 3 GB/s here (13 MB of gpt gradients take 5–6 ms, whatever algorithm
// coll/tuned picks), while one core copies memory at 50–60 GB/s. DDP on this
// machine has no spare core to hide that time behind, so the all-reduce's own
// cost is what weak scaling loses. The ranks map one segment, copy their
// chunk in, each reduces a 1/P slice of it (ranks in order: every rank gets
// the same bits) and copies the others' slices out: about five passes over
// the data per rank instead of Open MPI's pipeline of fragments.
//
// Synchronisation is by generation counters in the segment, waited on with a
// short spin, then asleep in the kernel until the peer publishes (a futex on
// the shared counter), or only a spin in ProgressMode::Spin. Sleeping until
// woken matters on a machine with no spare core: timed sleeps wake up again
// and again while a peer is far behind, and each wake-up preempts a training
// thread (measured: DDP with 2 MiB buckets lost 4 ms of backward to them). The segment
// is a POSIX shared-memory object unlinked as soon as every rank has mapped
// it, with its pages reserved up front (posix_fallocate), so a full /dev/shm
// makes the group fall back to MPI rather than fault later.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kiln/core/dtype.h"

namespace kiln::dist::detail {

class ShmAllreduce {
 public:
  /// Collective over `comm` (every rank must call it at the same point): maps
  /// a segment shared by all ranks of `comm`, or returns null with `why_not`
  /// set when they are not all on one node or the segment cannot be made
  /// (then every rank returns null: the ranks agree before returning).
  static std::unique_ptr<ShmAllreduce> create(MPI_Comm comm, std::string* why_not);
  /// `why_not` when the ranks are on several nodes (not a failure).
  static constexpr const char* kNotOneNode = "the ranks are not all on one node";
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  /// In place over `n` floats at `data`: the sum over ranks, divided by the
  /// rank count when `average` (as `x /= P`, the MPI path's division). Every
  /// rank must call it with the same `n` and `average`. `spin`: wait by
  /// busy-polling only (ProgressMode::Spin).
  void run(float* data, size_t n, bool average, bool spin);

  /// The same over `n` bfloat16 or float16 values (their bits at `data`):
  /// they travel as 16 bits, each slice is summed in float32 in rank order,
  /// divided and rounded once, so the result has the bits of widening, the
  /// float32 all-reduce and one rounding, with half its bytes moved.
  void run16(uint16_t* data, size_t n, DType dtype, bool average, bool spin);

  /// `n` float32 values sent as `wire` (bfloat16 or float16): each rank's
  /// values are rounded to `wire` as they enter the segment, summed in float32,
  /// divided, rounded to `wire` once and widened back into `data` (DDP's
  /// compression hooks, Note [Compressed gradients] in ddp.cpp).
  void run_compressed(float* data, size_t n, DType wire, bool average, bool spin);

  /// `send` holds one shard of `count` floats per rank; `out` gets this
  /// rank's shard summed over ranks in rank order (the all-reduce's order, so
  /// a reduce-scatter and an all-reduce of the same data agree bit for bit),
  /// divided by the rank count when `average`.
  void reduce_scatter(const float* send, float* out, size_t count, bool average, bool spin);

  /// Floats per rank and chunk: larger all-reduces go through in chunks.
  /// 256 KiB per slot: measured here (2 ranks, 1–16 MiB), 64–128 Ki floats ran
  /// 2.5–3× faster than 256 Ki, whose slots no longer cross cores through cache.
  static constexpr size_t kChunk = size_t{64} * 1024;

  struct Flag;  // a rank's generation counter, one cache line in the segment

 private:
  ShmAllreduce(int rank, int size, void* base, size_t bytes);
  float* slot(int set, int rank) const;
  /// The next chunk's generation; its set of slots (generation & 1) may be
  /// filled once every rank has read that set's previous chunk.
  uint64_t next_chunk(bool spin);
  /// run's steps for values of type T in `data`, travelling as W.
  template <typename W, typename T>
  void run_as(T* data, size_t n, bool average, bool spin);

  int rank_, size_;
  void* base_;
  size_t bytes_;
  // Per rank, in the segment: chunk copied in, slice reduced, others' slices read.
  Flag* arrived_;
  Flag* reduced_;
  Flag* read_;
  float* slots_;
  uint64_t gen_ = 0;  // chunks run so far; every rank counts the same
};

/// Process-wide counts of the shared-memory path, for tests and figures.
struct ShmCounters {
  int64_t calls = 0;   // all-reduces run through shared memory
  int64_t chunks = 0;  // chunks of at most kChunk floats
  int64_t sleeps = 0;  // times a rank went to sleep waiting for a peer
};
ShmCounters shm_counters();

}  // namespace kiln::dist::detail
