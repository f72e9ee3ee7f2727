#pragma once
// Per-rank step-time skew of a data-parallel run (`kiln train` on several
// ranks, and the gallery's rank_skew scenario). The ranks of a synchronous job
// all take as long per step as the slowest one: the others wait for it inside
// a collective. So each rank's wall time per step says nothing; what tells the
// straggler apart is the time it did NOT spend waiting in that collective (its
// own work: data, forward, backward). Each log window every rank measures
//   step_ms  wall time per step
//   wait_ms  time blocked in the collective that absorbs the skew (the loop's
//            agreement allreduce after forward, where a fast rank waits for a
//            slow one's data and forward)
//   data_ms  time waiting for the data loader
// and window() allgathers them (float32: collectives carry no float64) into
// {"step_ms": [...], "busy_ms": [...], "wait_ms": [...], "data_ms": [...]},
// one entry per rank, busy_ms = step_ms - wait_ms. rank 0 writes it as the
// train line's "ranks" field; `kiln doctor` reads it (finding rank_skew).
#include <nlohmann/json.hpp>

#include "kiln/dist/process_group.h"

namespace kiln::cli {

class StepSkew {
 public:
  explicit StepSkew(dist::ProcessGroupPtr group) : group_(std::move(group)) {}
  /// Time this rank spent blocked in the skew-absorbing collective during the current step.
  void waited(double seconds) { wait_s_ += seconds; }
  /// A collective every rank calls at the same step: the window's per-rank figures (every
  /// rank gets them), then a new window. `steps` and the times are this rank's for the window.
  nlohmann::json window(int64_t steps, double window_s, double data_wait_s);

 private:
  dist::ProcessGroupPtr group_;
  double wait_s_ = 0;
};

}  // namespace kiln::cli
