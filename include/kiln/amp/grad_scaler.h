// amp::GradScaler: torch.cuda.amp.GradScaler's dynamic loss scaling for
// float16 training, with telemetry that explains skipped steps.
//
// float16's smallest normal is 6e-5, so small gradients flush to zero. The
// scaler multiplies the loss by a large factor before backward, divides the
// gradients by it before the optimizer step, skips the step when a gradient
// overflowed (inf/NaN), and adapts the factor: halve it after an overflow,
// double it after growth_interval clean steps. The per-step protocol is torch's:
//
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);                 // optional: clipping sees true gradients
//   optim::clip_grad_norm_(params, 1.0);
//   scaler.step(opt);                     // unscales if not yet done; skips on inf/NaN
//   scaler.update();
//
// Telemetry: stats() and metrics() give the scale, the skipped-step count and
// the first parameter whose gradient was non-finite (and, with anomaly mode,
// the backward op where float16 first overflowed); messages() (also printed
// to stderr unless turned off) explain repeated skips, name that parameter,
// flag a collapsing scale as a likely real divergence, and note once that a
// scaler is unnecessary beside bfloat16 autocast.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kiln/autograd/anomaly.h"
#include "kiln/core/tensor.h"
#include "kiln/io/stateful.h"
#include "kiln/optim/optimizer.h"

namespace kiln::amp {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  /// A disabled scaler is a pass-through (scale returns the loss, step just steps).
  bool enabled = true;
  /// Consecutive skipped steps before the "repeated skips" message.
  int64_t warn_after_skips = 3;
  /// A scale below this after skips means the gradients are non-finite even
  /// barely scaled: reported as a likely real divergence, not overflow.
  double collapse_threshold = 1.0;
  /// Also write messages to stderr (they are always kept in messages()).
  bool print_messages = true;
};

struct GradScalerStats {
  double scale = 0;
  int64_t steps = 0;              // update() calls that followed a step
  int64_t skipped_steps = 0;      // of which the optimizer step was skipped
  int64_t consecutive_skips = 0;  // the current streak
  bool last_step_skipped = false;
  /// First parameter (in param-group order) whose gradient was non-finite at
  /// the most recent skipped step, with its NaN/Inf counts; empty when none.
  std::string first_nonfinite_param;
  int64_t first_nonfinite_nan = 0;
  int64_t first_nonfinite_inf = 0;
  /// With anomaly mode on: where the backward of the most recent skipped step
  /// first produced a non-finite float16 gradient from finite ones (the op's
  /// node, its forward call site, the gradient's shape and counts). Empty
  /// without anomaly mode, or when the non-finite values did not come from a
  /// float16 backward (they came from the forward, float32 ops, or the data).
  std::optional<autograd::OverflowRecord> first_overflow;
};

/// A Stateful object, so a checkpoint carries it:
///   train::save_checkpoint(path, {.model = &model, .optimizer = &opt, .objects = {{"scaler", &scaler}}}, info);
class GradScaler : public io::Stateful {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// loss * scale (a float32 0-dim factor, so a float32 loss stays float32).
  /// Also opens, on this thread until update(), the autograd "overflow is
  /// expected" scope: anomaly mode then records float16 overflow in backward
  /// for this scaler's skip message instead of throwing (autograd/anomaly.h).
  Tensor scale(const Tensor& loss);
  /// Divides every gradient of `opt` by the scale in place and records whether
  /// any is inf/NaN. At most once per optimizer between update() calls, and not
  /// after step() (ValueError). float16 gradients are rejected, as torch.
  void unscale_(optim::Optimizer& opt);
  /// Unscales if unscale_ was not called, then runs opt.step() unless a
  /// gradient was non-finite. Returns whether the optimizer stepped. Once per
  /// optimizer between update() calls (ValueError otherwise).
  bool step(optim::Optimizer& opt);
  /// Backs off (any optimizer found inf/NaN) or counts towards growth, and
  /// starts a new iteration. `new_scale` sets the scale directly instead.
  void update(std::optional<double> new_scale = std::nullopt);

  double get_scale() const { return enabled_ ? scale_ : 1.0; }
  int64_t get_growth_tracker() const { return growth_tracker_; }
  double get_growth_factor() const { return options_.growth_factor; }
  double get_backoff_factor() const { return options_.backoff_factor; }
  int64_t get_growth_interval() const { return options_.growth_interval; }
  bool is_enabled() const { return enabled_; }

  /// Tensors: 0-dim "scale" (float32) and "_growth_tracker" (int64); values:
  /// growth_factor, backoff_factor (double), growth_interval, and the telemetry
  /// counters steps and skipped_steps (int64). Keys follow torch's state_dict.
  /// Empty for a disabled scaler, as torch.
  io::ObjectState state_dict() const override;
  /// Validates keys, kinds, dtypes and values (ValueError naming the key) before
  /// changing anything. An empty state (from a disabled scaler) is an error, as torch.
  void load_state_dict(const io::ObjectState& state) override;

  GradScalerStats stats() const;
  /// The per-step numbers for metrics.jsonl: amp_scale, amp_skipped_steps,
  /// amp_step_skipped (0/1), amp_consecutive_skips.
  std::map<std::string, double> metrics() const;
  /// Every message the scaler emitted, oldest first.
  const std::vector<std::string>& messages() const { return messages_; }

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    bool checked = false;  // an inf check ran (unscale_)
    bool found_inf = false;
  };

  void emit(std::string message);
  void note_streak();
  void close_iteration();

  // The open ExpectedOverflowScope of this scaler's iteration. A copy of the
  // scaler does not inherit it (only the scaler that opened it closes it).
  struct OverflowScope {
    bool open = false;
    OverflowScope() = default;
    OverflowScope(const OverflowScope&) {}
    OverflowScope& operator=(const OverflowScope&) { return *this; }
    ~OverflowScope() { close(); }
    void close() {
      if (open) autograd::end_expected_overflow();
      open = false;
    }
  };

  GradScalerOptions options_;
  bool enabled_;
  float scale_;  // float32, as torch's _scale tensor: the trajectory rounds alike
  int64_t growth_tracker_ = 0;
  std::map<const optim::Optimizer*, PerOptimizer> per_optimizer_;
  GradScalerStats stats_;
  std::string pending_param_;  // first non-finite gradient of this iteration
  int64_t pending_nan_ = 0, pending_inf_ = 0;
  std::optional<autograd::OverflowRecord> pending_overflow_;  // anomaly mode's record of this iteration
  OverflowScope overflow_scope_;
  bool warned_streak_ = false;
  bool warned_collapse_ = false;
  bool warned_bf16_ = false;
  std::vector<std::string> messages_;
};

}  // namespace kiln::amp
