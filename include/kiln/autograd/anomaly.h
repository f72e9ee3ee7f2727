// Anomaly mode (DESIGN.md §3): every forward output recorded in the graph
// and every gradient a backward node returns is checked for NaN/Inf; the
// first op that produced one is reported with its name, call site and the
// min/max/NaN count of its inputs. Turn it on with AnomalyModeGuard or the
// environment variable KILN_DETECT_ANOMALY=1. It costs a pass over every
// output, so it is a debugging tool, off by default.
#pragma once

#include <string>
#include <vector>

#include "kiln/autograd/node.h"

namespace kiln::autograd {

bool anomaly_mode_enabled();
void set_anomaly_mode_enabled(bool enabled);

class AnomalyModeGuard {
 public:
  explicit AnomalyModeGuard(bool enabled = true) : prev_(anomaly_mode_enabled()) {
    set_anomaly_mode_enabled(enabled);
  }
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

/// Forward check (called from set_history when anomaly mode is on).
void check_forward_outputs(const Node& node, const Tensor* const* outputs, size_t n_out,
                           const std::vector<Tensor>& inputs);
/// Backward check (called by the engine when anomaly mode is on).
void check_backward_outputs(const Node& node, const TensorList& grads_in, const TensorList& grads_out);

}  // namespace kiln::autograd
