#pragma once
// How much this process has handed to communication: for the per-step
// "communicated bytes" of `kiln train` and of the parallelism figures
// (docs/parallel.md). A payload count, not wire bytes: an allreduce of N bytes
// counts N (a ring moves 2(n-1)/n N per rank on the wire, docs/distributed.md),
// a send or a recv its tensor's bytes, an allgather or reduce-scatter this
// rank's input.
#include <cstdint>

namespace kiln::dist {

struct Traffic {
  int64_t ops = 0;    // collectives and point-to-point operations issued
  int64_t bytes = 0;  // their payload, as above
};

/// The process's totals since it started, over every process group. Thread-safe.
Traffic traffic();

}  // namespace kiln::dist
