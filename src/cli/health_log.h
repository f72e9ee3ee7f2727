#pragma once
// `kiln train`'s training-health lines: a train::HealthMonitor on the run's
// model, sampled every train.log_every steps, each record written to
// metrics.jsonl as {"kind":"health", ...} (what `kiln doctor` and the report read).
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "kiln/optim/optimizer.h"
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

/// How much of an optimizer's floating-point state (Adam's moments, momentum
/// buffers) is subnormal: nonzero and below the smallest normal number
/// (1.18e-38 in float32). Arithmetic on such values runs tens of times
/// slower on x86 unless subnormals are flushed (kiln::set_flush_denormal;
/// Note [Subnormal optimizer state] in health_log.cpp).
struct SubnormalState {
  struct Entry {
    std::string param, state;  // the parameter's name and the state's key ("exp_avg_sq")
    int64_t subnormal = 0, values = 0;
  };
  int64_t subnormal = 0, values = 0;
  std::vector<Entry> worst;  // the tensors with the most subnormal values, most first, at most 3
};
SubnormalState subnormal_state(const optim::Optimizer& optimizer);

class HealthLog {
 public:
  HealthLog(nn::Module& model, int64_t every) : monitor_(model, {.every = every}) {}
  /// Before forward of step `step` (1-based).
  void begin(int64_t step);
  /// After the optimizer step: the health line, when the step was sampled. The line's
  /// cost_ms is the monitor's own time on that step (its overhead). With an
  /// optimizer the line also says how much of its state is subnormal
  /// ("subnormal_state": subnormal, values, worst [{param, state, subnormal, values}]).
  void end(std::ostream& metrics, const optim::Optimizer* optimizer = nullptr);
  /// Whether step `step` (1-based) is sampled: its forward runs the monitor's hooks.
  bool sampled(int64_t step) const { return monitor_.sampled(step); }
  /// The check for an evaluation of the monitored model (train/eval_check.h).
  train::EvalCheck check_evaluation() { return monitor_.check_evaluation(); }

 private:
  train::HealthMonitor monitor_;
  double begin_ms_ = 0;
};

}  // namespace kiln::cli
