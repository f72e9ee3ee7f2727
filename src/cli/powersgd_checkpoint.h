// `kiln train`'s checkpoint object "powersgd": the state of dist.comm_hook =
// "powersgd" (Note [PowerSGD in checkpoints] in powersgd_checkpoint.cpp).
#pragma once

#include <string>

#include "kiln/dist/ddp.h"
#include "kiln/io/stateful.h"

namespace kiln::cli {

/// PowerSGD's state in a run's checkpoint: its step count and generator, each
/// compressed gradient's Q (the same on every rank) and every rank's error
/// feedback, gathered to the rank that writes the file. A resume hands each
/// rank its own share back, so the resumed run computes the uninterrupted
/// run's gradients.
class PowerSgdCheckpoint final : public io::Stateful {
 public:
  /// `ddp` is the run's wrapper under PowerSGD, or null: a run resumed without
  /// PowerSGD from a checkpoint that holds its state, which then goes unused
  /// for the reason `unused_because` gives.
  PowerSgdCheckpoint(dist::DistributedDataParallel* ddp, dist::ProcessGroupPtr group, std::string unused_because = "");

  /// Whether the run uses PowerSGD (its checkpoints then hold the object).
  bool active() const { return ddp_ != nullptr; }
  /// A collective over the run's ranks (every rank calls it before rank 0
  /// saves): the state now, with every rank's errors, kept on rank 0 only.
  void gather();
  /// Lets go of what gather() kept (every rank's errors), once saved.
  void release() { gathered_ = {}; }

  io::ObjectState state_dict() const override { return gathered_; }
  void load_state_dict(const io::ObjectState& state) override;
  /// Saved at one world size, the errors are a [world, n, m] stack: the object checks them itself (apply).
  bool loads_any_saved_state() const override { return true; }

  /// After a resume has loaded the checkpoint on every rank: this rank's share
  /// of the loaded state into the wrapper. Returns what happened, for rank 0 to
  /// print (empty only when neither the run nor the checkpoint has PowerSGD).
  std::string apply();

 private:
  dist::DistributedDataParallel* ddp_;
  dist::ProcessGroupPtr group_;
  std::string unused_because_;
  io::ObjectState gathered_, loaded_;
  bool has_loaded_ = false;
};

}  // namespace kiln::cli
