// Optimizers (DESIGN.md §5): the Optimizer base with param groups and
// per-parameter state keyed by parameter name, and SGD, Adam, AdamW, RMSprop
// with torch 1.13's update rules. Each step runs one fused pass per parameter
// over its contiguous float/double data (src/optim/kernels.h).
//
//   optim::AdamW opt(model.named_parameters(), {.lr = 1e-3, .weight_decay = 0.1});
//   opt.zero_grad(); loss.backward(); opt.step();
//
// Parameters are named tensors (what Module::named_parameters() returns), so
// plain leaf tensors work too: {{"w", w}, {"b", b}}; or the module itself:
// optim::AdamW opt(model, {...}). As torch, an optimizer over no parameters is
// refused ("optimizer got an empty parameter list").
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/nn/module.h"

namespace kiln::optim {

using NamedParams = std::vector<std::pair<std::string, Tensor>>;
/// Hyperparameters by torch's names ("lr", "momentum", "betas0", "betas1", "amsgrad" as 0/1, ...).
using HyperParams = std::map<std::string, double>;

/// One param group: named parameters and its hyperparameters. When added to an
/// optimizer, keys missing from `options` take the optimizer's defaults.
struct ParamGroup {
  NamedParams params;
  HyperParams options;

  double lr() const { return options.at("lr"); }
  void set_lr(double lr) { options["lr"] = lr; }
};

/// Per-parameter state: named tensors (momentum_buffer, exp_avg, ...) and the step count.
struct ParamState {
  std::map<std::string, Tensor> tensors;
  int64_t step = 0;
};

/// What state_dict() returns: every group's parameter names and hyperparameters,
/// and the state of each parameter that has any, by parameter name.
struct OptimizerStateDict {
  struct Group {
    std::vector<std::string> param_names;
    HyperParams options;
  };
  std::vector<Group> param_groups;
  std::map<std::string, ParamState> state;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  /// Movable (into a member, a container, out of a factory). Schedulers keep a
  /// reference to the optimizer they were built with: build them after the move.
  Optimizer(Optimizer&&) = default;
  Optimizer& operator=(Optimizer&&) = default;

  /// Adds a group; its options override the defaults. Throws ValueError for an
  /// invalid hyperparameter, a parameter name already in the optimizer, a
  /// non-leaf or non-float32/float64 parameter.
  void add_param_group(ParamGroup group);

  /// Clears every parameter's .grad: undefined (set_to_none) or zeroed.
  void zero_grad(bool set_to_none = true);

  /// One update of every parameter with a gradient (under NoGradGuard).
  void step();

  /// Deep copies of the state tensors and the hyperparameters.
  OptimizerStateDict state_dict() const;
  /// Validates group count, parameter names and state tensor shapes/dtypes and
  /// throws one ValueError listing every mismatch; otherwise copies everything in.
  void load_state_dict(const OptimizerStateDict& sd);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  const std::map<std::string, ParamState>& state() const { return state_; }
  const HyperParams& defaults() const { return defaults_; }
  /// How many times step() has run (schedulers use it for their ordering warning).
  int64_t step_count() const { return step_count_; }

 protected:
  Optimizer(HyperParams defaults, std::string name) : defaults_(std::move(defaults)), name_(std::move(name)) {}
  /// Throws ValueError when no group holds a parameter (torch: "optimizer got an empty parameter list").
  void require_parameters() const;
  /// model.named_parameters(), or a ValueError naming the modules of `model` when it has none.
  static NamedParams module_parameters(const nn::Module& model, const std::string& optimizer);
  /// Throws ValueError when a hyperparameter of a group is out of range.
  virtual void validate(const HyperParams& hp) const = 0;
  /// Updates one parameter (contiguous `p` and `g` of one dtype) with its state.
  virtual void update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) = 0;
  void init_groups(NamedParams params);

  HyperParams defaults_;
  std::string name_;
  std::vector<ParamGroup> groups_;
  std::map<std::string, ParamState> state_;
  int64_t step_count_ = 0;
};

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};
/// torch.optim.SGD (1.13 update order): d = g + wd*p; buf = d (first step) or
/// momentum*buf + (1-dampening)*d; d = nesterov ? d + momentum*buf : buf; p -= lr*d.
class SGD : public Optimizer {
 public:
  SGD(NamedParams params, SGDOptions options = {});
  SGD(std::vector<ParamGroup> groups, SGDOptions options = {});
  /// Over every parameter of `model` (one group); names its modules when it has none.
  SGD(const nn::Module& model, SGDOptions options = {});

 protected:
  void validate(const HyperParams& hp) const override;
  void update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) override;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool amsgrad = false;
};
/// torch.optim.Adam: weight_decay is L2 (added to the gradient).
class Adam : public Optimizer {
 public:
  Adam(NamedParams params, AdamOptions options = {});
  Adam(std::vector<ParamGroup> groups, AdamOptions options = {});
  /// Over every parameter of `model` (one group); names its modules when it has none.
  Adam(const nn::Module& model, AdamOptions options = {});

 protected:
  Adam(HyperParams defaults, std::string name) : Optimizer(std::move(defaults), std::move(name)) {}
  void validate(const HyperParams& hp) const override;
  void update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) override;
  bool decoupled_ = false;  // AdamW
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
};
/// torch.optim.AdamW: decoupled decay p *= 1 - lr*weight_decay, then Adam's step.
class AdamW : public Adam {
 public:
  AdamW(NamedParams params, AdamWOptions options = {});
  AdamW(std::vector<ParamGroup> groups, AdamWOptions options = {});
  /// Over every parameter of `model` (one group); names its modules when it has none.
  AdamW(const nn::Module& model, AdamWOptions options = {});
};

struct RMSpropOptions {
  double lr = 1e-2;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool centered = false;
};
/// torch.optim.RMSprop.
class RMSprop : public Optimizer {
 public:
  RMSprop(NamedParams params, RMSpropOptions options = {});
  RMSprop(std::vector<ParamGroup> groups, RMSpropOptions options = {});
  /// Over every parameter of `model` (one group); names its modules when it has none.
  RMSprop(const nn::Module& model, RMSpropOptions options = {});

 protected:
  void validate(const HyperParams& hp) const override;
  void update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) override;
};

/// Writes a state_dict to a safetensors file (atomically): state tensors as
/// "state.<param>.<key>", step counts and group hyperparameters in the metadata
/// (17 significant digits, so doubles round-trip exactly).
void save_optimizer_state(const OptimizerStateDict& sd, const std::string& path);
/// Reads what save_optimizer_state wrote; FormatError when the metadata is not kiln's optimizer format.
OptimizerStateDict load_optimizer_state(const std::string& path);

/// The usual grouping: parameters with dim >= 2 (weights of Linear/Conv/Embedding)
/// get `weight_decay`, the rest (biases, norm weights) get 0. Returns {decay, no_decay}.
std::vector<ParamGroup> split_decay(const NamedParams& params, double weight_decay);

}  // namespace kiln::optim
