#pragma once
// EvalCheck: catches an evaluation that runs in training mode.
//
// NoGradGuard and InferenceModeGuard turn off gradient tracking; they do not
// switch modules to eval mode. A model evaluated without model.eval() runs its
// Dropout layers (the scores are noisy and lower), and its BatchNorm layers
// normalise with the evaluation batch's statistics and fold them into
// running_mean / running_var, so the evaluation changes the model it measures.
// PyTorch says nothing about it. Wrap the evaluation:
//
//   {
//     train::EvalCheck check(model);   // model.eval() belongs before this
//     NoGradGuard ng;
//     for (auto& b : test_loader) ... model(b.data) ...
//     if (auto r = check.finish()) log(r->message);
//   }
//
// Construction looks for modules that behave differently in training: Dropout
// with p > 0 and BatchNorm (and SyncBatchNorm). When the model is in eval mode
// it does nothing else. When some are in training mode it copies each such
// BatchNorm's running_mean and num_batches_tracked (a few floats per channel)
// and puts a forward hook on each of them, to count the forwards that ran in
// training mode. finish() says which modules ran that way and what they
// changed. A check destroyed without finish() prints its report to std::cerr
// as a warning (never from a destructor unwinding an exception).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/nn/module.h"

namespace kiln::train {

/// One module that ran in training mode during an evaluation.
struct TrainModeModule {
  std::string name;  // its path in the model ("features.1"); "(root)" for the model itself
  std::string type;  // "Dropout", "BatchNorm2d", ...
  int64_t forwards = 0;
  /// BatchNorm: num_batches_tracked before and after (both -1 without running statistics),
  /// and the largest absolute change of an element of running_mean.
  int64_t batches_before = -1, batches_after = -1;
  double running_mean_moved = 0;
  /// Dropout: its probability.
  double p = 0;
};

/// What finish() found: the modules and a message naming them, the change and the fix.
struct EvalModeReport {
  std::vector<TrainModeModule> modules;
  std::string message;
};

class EvalCheck {
 public:
  /// Snapshots `model`'s training-mode Dropout and BatchNorm modules (nothing when it is in eval mode).
  explicit EvalCheck(nn::Module& model);
  ~EvalCheck();
  EvalCheck(EvalCheck&&) noexcept;
  EvalCheck& operator=(EvalCheck&&) = delete;
  EvalCheck(const EvalCheck&) = delete;
  EvalCheck& operator=(const EvalCheck&) = delete;

  /// Ends the check (removes its hooks): the modules that ran a forward in training mode since
  /// construction, or nullopt when none did. Call it once.
  std::optional<EvalModeReport> finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kiln::train
