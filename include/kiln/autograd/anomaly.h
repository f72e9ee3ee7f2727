// Anomaly mode (DESIGN.md §3): every forward output recorded in the graph
// and every gradient a backward node returns is checked for NaN/Inf; the
// first op that produced one is reported with its name, call site and the
// min/max/NaN count of its inputs. Turn it on with AnomalyModeGuard or the
// environment variable KILN_DETECT_ANOMALY=1. It costs a pass over every
// output, so it is a debugging tool, off by default.
//
// Expected overflow: float16 training with a loss scaler overflows on purpose
// now and then (the scaler skips the step and halves the scale). While an
// ExpectedOverflowScope is open on a thread (amp::GradScaler opens one from
// scale() to update()), a backward node that returns a float16 gradient with
// NaN/Inf from finite incoming gradients does not throw: the first such event
// of the iteration is kept as an OverflowRecord that the scaler reads when it
// skips the step. Everything else (forward outputs, float32/bfloat16
// gradients, float16 without a scaler) still throws.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kiln/autograd/node.h"

namespace kiln::autograd {

bool anomaly_mode_enabled();
void set_anomaly_mode_enabled(bool enabled);

class AnomalyModeGuard {
 public:
  explicit AnomalyModeGuard(bool enabled = true) : prev_(anomaly_mode_enabled()) { set_anomaly_mode_enabled(enabled); }
  ~AnomalyModeGuard() { set_anomaly_mode_enabled(prev_); }
  AnomalyModeGuard(const AnomalyModeGuard&) = delete;
  AnomalyModeGuard& operator=(const AnomalyModeGuard&) = delete;

 private:
  bool prev_;
};

/// Thrown when anomaly mode finds a NaN or Inf.
class AnomalyError : public ValueError {
 public:
  using ValueError::ValueError;
};

/// "min -1.5, max 3, 2 NaN, 0 Inf of 12 elements" for a floating tensor.
std::string tensor_stats(const Tensor& t);
/// Number of NaN and Inf elements (0 for non-floating tensors).
void count_nonfinite(const Tensor& t, int64_t& nan_count, int64_t& inf_count);

/// Where a float16 backward first overflowed while overflow was expected.
struct OverflowRecord {
  std::string node;        // "MmBackward0"
  CallSite site;           // the forward call that built the node
  size_t input_index = 0;  // the gradient for the node's input k overflowed
  std::string shape;       // of that gradient, "[16, 64]"
  int64_t nan = 0, inf = 0;
  std::string incoming;  // stats of the finite gradients that came in
  /// The node that produced that input in the forward (the overflowed
  /// gradient is its output's): what a reader wants when `node` is autocast's
  /// cast (ToCopyBackward0, whose call site is inside kiln). Empty for a leaf.
  std::string input_node;
  CallSite input_site;
  /// "ToCopyBackward0 (forward at src/ops/autocast.cpp:73) returned 0 NaN and
  /// 12 Inf in the float16 gradient for its input 0 [128, 4], the gradient of
  /// the output of MmBackward0 (forward at tests/x.cpp:42), from finite
  /// incoming gradients (...)"
  std::string str() const;
};

/// Thread-local and nestable (a depth count): while one is open on this
/// thread, overflow in float16 backward is recorded instead of thrown.
bool overflow_expected();
void begin_expected_overflow();
void end_expected_overflow();

class ExpectedOverflowScope {
 public:
  ExpectedOverflowScope() { begin_expected_overflow(); }
  ~ExpectedOverflowScope() { end_expected_overflow(); }
  ExpectedOverflowScope(const ExpectedOverflowScope&) = delete;
  ExpectedOverflowScope& operator=(const ExpectedOverflowScope&) = delete;
};

/// The first overflow recorded on this thread since the last take/clear
/// (only anomaly mode records), and clears it.
std::optional<OverflowRecord> take_overflow_record();
void clear_overflow_record();

/// Forward check (called from set_history when anomaly mode is on).
void check_forward_outputs(const Node& node, const Tensor* const* outputs, size_t n_out,
                           const std::vector<Tensor>& inputs);
/// Backward check (called by the engine when anomaly mode is on).
void check_backward_outputs(const Node& node, const TensorList& grads_in, const TensorList& grads_out);

}  // namespace kiln::autograd
