#pragma once
// HealthMonitor: the numbers that say whether a run is learning well, for the
// failures that raise no error (the run "works" but learns badly).
//
// On a sampled step (every `every` steps) it records, per module that owns
// parameters: the gradient norm, the weight norm and the update-to-weight
// ratio ||Δw|| / ||w|| of that step's optimizer update (healthy runs sit near
// 1e-3); the parameters that require a gradient but got none (a `detach`, an
// unused branch, an empty parameter group); per ReLU/GELU module the fraction
// of its units dead on the whole batch (ReLU: input <= 0, GELU: input < -3,
// where its slope is below 1%); per block the RMS of its output and of the
// gradient flowing into that output (vanishing or exploding by depth).
//
// Between sampled steps it does nothing: no hook is registered, nothing is
// copied, so fused kernels that hooks would turn off keep running. On a sampled
// step it reads tensors in place and allocates no tensor (memory peaks are the
// run's own); it keeps at most 4096 elements of each parameter to measure the
// update against. A loop calls
//   begin_step(step)   before forward (step = the step being taken, 1-based)
//   end_step()         after optimizer.step(); the step's record on a sampled step
// The weights do not change between forward and the optimizer step, so the
// copy the update is measured against is taken in begin_step; the gradients
// are read in end_step (after any clipping and, under a GradScaler, unscaled).
// `kiln train` runs one and writes each record as a {"kind":"health"} line.
// check_evaluation() guards an evaluation against a model left in training mode.
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/nn/module.h"
#include "kiln/train/eval_check.h"

namespace kiln::train {

struct HealthOptions {
  /// Sample every this many steps (>= 1).
  int64_t every = 50;
  /// Record dead-unit fractions and block scales (forward hooks on sampled steps only).
  bool activations = true;
};

/// One module that owns parameters directly ("layers.0", "blocks.1.attn.qkv").
struct ModuleHealth {
  std::string name;
  std::string type;        // its type name ("Linear")
  double grad_norm = 0;    // L2 over its parameters' gradients (those that have one)
  double weight_norm = 0;  // L2 over its parameters before the update
  /// ||Δw|| / ||w|| of this step's update (0 when ||w|| is 0); exact for parameters of at
  /// most 4096 elements, estimated from 4096 evenly spaced elements of a larger one.
  double update_ratio = 0;
};

/// A ReLU or GELU module's dead units on a sampled batch.
struct ActivationHealth {
  std::string name;
  std::string type;          // "ReLU" or "GELU"
  double dead_fraction = 0;  // units (features; channels for 4-D inputs) inactive for every sample
  int64_t units = 0;
};

/// A block's output scale: the top-level children of the model, containers (Sequential,
/// ModuleList) opened into their children.
struct BlockScale {
  std::string name;
  double activation_rms = 0;  // RMS of the block's output
  double grad_rms = -1;       // RMS of the gradient of that output; -1 when none flowed to it
};

struct HealthRecord {
  int64_t step = 0;
  double grad_norm = 0;  // over every parameter that has a gradient
  std::vector<ModuleHealth> modules;
  /// Parameters that require a gradient but have none after backward.
  std::vector<std::string> no_grad;
  /// Parameters that do not require a gradient (frozen).
  int64_t frozen = 0;
  int64_t trainable = 0;
  std::vector<ActivationHealth> activations;
  std::vector<BlockScale> blocks;
  /// Mean and standard deviation of the model's input on the sampled batch (NaN when the
  /// input is not floating point, e.g. token ids): far from 0 and 1, the first layer sees
  /// inputs it was not initialised for (a missing or wrong normalisation).
  double input_mean = std::numeric_limits<double>::quiet_NaN();
  double input_std = std::numeric_limits<double>::quiet_NaN();
};

class HealthMonitor {
 public:
  explicit HealthMonitor(nn::Module& model, HealthOptions options = {});
  ~HealthMonitor();
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;

  /// Before forward of step `step` (1-based): on a sampled step, copies the weights and
  /// sets the activation hooks.
  void begin_step(int64_t step);
  /// After the optimizer step (gradients still in place): the sampled step's record, or
  /// nullopt on other steps.
  std::optional<HealthRecord> end_step();
  /// An evaluation of the monitored model is about to run: the check that says, at its
  /// finish(), whether it ran in training mode (train/eval_check.h). Evaluations are not
  /// sampled: each one is checked, and one in eval mode costs a walk over the modules.
  EvalCheck check_evaluation() { return EvalCheck(model_); }
  /// Whether `step` is sampled.
  bool sampled(int64_t step) const { return step % options_.every == 0; }

 private:
  struct Group {
    std::string name, type;
    std::vector<Tensor> params;  // trainable parameters it owns directly
    std::vector<std::string> param_names;
    // Taken by begin_step() on a sampled step: each parameter's elements at an even stride
    // (all of a small one) and the squared norm of the weights before the update.
    std::vector<std::vector<float>> before;
    double weight_sq = 0;
  };
  struct Probe;  // hook state shared with the hooks' closures
  void remove_hooks();

  nn::Module& model_;
  HealthOptions options_;
  std::vector<Group> groups_;
  std::vector<std::pair<std::string, nn::Module*>> activation_modules_, blocks_;
  std::shared_ptr<Probe> probe_;
  std::vector<HookHandle> hooks_;
  std::optional<HealthRecord> pending_;  // the sampled step in progress
  int64_t frozen_ = 0, trainable_ = 0;
};

/// L2 norm of a floating-point tensor, accumulated in double (any dtype, any strides).
double l2_norm(const Tensor& t);

}  // namespace kiln::train
