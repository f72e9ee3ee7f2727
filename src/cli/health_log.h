#pragma once
// `kiln train`'s training-health lines: a train::HealthMonitor on the run's
// model, sampled every train.log_every steps, each record written to
// metrics.jsonl as {"kind":"health", ...} (what `kiln doctor` and the report read).
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>

#include "kiln/train/health.h"

namespace kiln::cli {

/// A record as its metrics.jsonl line: step, grad_norm, modules (name, type, grad_norm,
/// weight_norm, update_ratio), no_grad (names, at most 20) and no_grad_count, frozen,
/// trainable, dead (name, type, fraction, units), blocks (name, act_rms, grad_rms), and
/// input (mean, std) when the model's input is floating point.
nlohmann::json health_json(const train::HealthRecord& record);

/// Ends `check`; when the evaluation ran in training mode, writes its report as a
/// {"kind":"warning","what":"eval_train_mode"} line (message, and per module name, type,
/// forwards, num_batches_tracked before/after, running_mean_moved, p) and returns true.
bool log_eval_check(train::EvalCheck& check, int64_t step, std::ostream& metrics);

class HealthLog {
 public:
  HealthLog(nn::Module& model, int64_t every) : monitor_(model, {.every = every}) {}
  /// Before forward of step `step` (1-based).
  void begin(int64_t step);
  /// After the optimizer step: the health line, when the step was sampled. The line's
  /// cost_ms is the monitor's own time on that step (its overhead).
  void end(std::ostream& metrics);
  /// Whether step `step` (1-based) is sampled: its forward runs the monitor's hooks.
  bool sampled(int64_t step) const { return monitor_.sampled(step); }
  /// The check for an evaluation of the monitored model (train/eval_check.h).
  train::EvalCheck check_evaluation() { return monitor_.check_evaluation(); }

 private:
  train::HealthMonitor monitor_;
  double begin_ms_ = 0;
};

}  // namespace kiln::cli
