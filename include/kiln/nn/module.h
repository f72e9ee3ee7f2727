// nn::Module: the base class of layers and models, as torch.nn.Module.
//
// A module owns named parameters (trainable tensors, charged to
// MemoryCategory::Parameter), buffers (state such as BatchNorm's running
// statistics) and child modules held by std::shared_ptr. Names are dotted
// paths exactly as PyTorch's ("layers.0.weight"). Layers are plain classes
// (`class Linear : public Module`) that override forward(); operator() runs
// the forward pre/post hooks around it.
//
// Registered tensors live in stable slots: register_parameter/register_buffer
// return a reference that stays valid for the module's life, so layers keep
// `Tensor& weight` members that follow to(dtype) and load_state_dict; to(dtype)
// converts in place, so a Tensor member copied from register_parameter's result,
// an optimizer built before to() and tensor hooks keep following it too.
//
// Calling: model(x), or (*ptr)(x) through a pointer, runs the forward hooks
// around forward(); forward(x) itself is the bare computation and skips them,
// exactly as PyTorch's module.forward(x) (docs/decisions.md, "Calling a module").
// A two-input module overrides forward(x, other) and is called as (*ptr)(x, mask).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/io/safetensors.h"

namespace kiln::nn {

class Module;
using ModulePtr = std::shared_ptr<Module>;
using NamedTensors = io::NamedTensors;

/// What load_state_dict(strict = false) could not match, as torch's _IncompatibleKeys.
struct LoadStateDictResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};

class Module {
 public:
  /// Receives the module and its input; a defined return value replaces the input.
  using ForwardPreHook = std::function<Tensor(Module&, const Tensor& input)>;
  /// Receives module, input and output; a defined return value replaces the output.
  using ForwardHook = std::function<Tensor(Module&, const Tensor& input, const Tensor& output)>;
  /// What kiln::compile may assume of a forward hook. A replay repeats the
  /// tensor ops a step ran but none of its host code, so a hook that keeps
  /// host state (counts calls, appends to a list, logs) would silently stop
  /// doing so: by default a hook is a graph break while a step is captured
  /// (calls with those guards run split at it, so the hook runs on every call,
  /// and explain() names it).
  /// TensorOpsOnly declares that the hook only computes tensors from its
  /// arguments (a LoRA branch, a mask), which a replay repeats.
  enum class HookReplay { HostCode, TensorOpsOnly };

  /// `type_name` is what the printed summary shows ("Linear"); left empty, it
  /// is the class's own name (a `class Block : public Module` prints "Block").
  explicit Module(std::string type_name = {});
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  std::string type_name() const;

  // ---- registration ----
  /// Adds (or replaces) a parameter. An undefined tensor registers an absent
  /// parameter (as torch's register_parameter(name, None)); it is skipped by
  /// parameters() and state_dict(). The storage is charged to Parameter.
  Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  /// Adds a buffer; non-persistent buffers are left out of state_dict().
  Tensor& register_buffer(const std::string& name, Tensor t, bool persistent = true);
  /// Adds a child module under `name`; returns it.
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    register_module_impl(name, m);
    return m;
  }

  // ---- traversal (recursive unless recurse = false; shared tensors and modules once) ----
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<ModulePtr> children() const;
  std::vector<std::pair<std::string, ModulePtr>> named_children() const;
  /// This module and every descendant, pre-order. `self` is returned by the
  /// non-owning pointer form; use named_modules for names.
  std::vector<Module*> modules();
  /// Every parameter and buffer slot, recursively (parameters first): the
  /// tensor each holds is what the module computes with, and a slot's address
  /// stays valid while its module lives. kiln::compile watches them.
  std::vector<std::pair<std::string, const Tensor*>> named_tensor_slots() const;
  /// Bumped by every register_parameter, register_buffer and register_module
  /// in the process: unchanged means no module gained or swapped a slot or child.
  static uint64_t structure_epoch();
  std::vector<std::pair<std::string, Module*>> named_modules(const std::string& prefix = "");
  /// fn(m) on every descendant, then on this module (torch's order).
  Module& apply(const std::function<void(Module&)>& fn);

  // ---- modes and state ----
  /// Sets training mode on this module and all descendants.
  virtual Module& train(bool on = true);
  Module& eval() { return train(false); }
  bool is_training() const { return training_; }
  /// Clears (set_to_none) or zeroes the gradient of every parameter.
  void zero_grad(bool set_to_none = true);
  /// Casts floating-point parameters and buffers to `dtype` (others unchanged), as torch's to(dtype);
  /// tied parameters stay tied.
  Module& to(DType dtype);
  /// Parameters and persistent buffers, in registration order, recursively (detached aliases).
  /// As torch, a tensor registered in several modules (tied weights) appears under each
  /// name (parameters() lists it once); load_state_dict expects every such name.
  NamedTensors state_dict() const;
  /// Copies `dict` into the parameters and buffers. Every problem (missing and
  /// unexpected keys when strict; shape and dtype mismatches always) is
  /// reported in one ValueError before anything is changed.
  LoadStateDictResult load_state_dict(const NamedTensors& dict, bool strict = true);
  /// Total elements of parameters (only those requiring grad when trainable_only).
  int64_t num_parameters(bool trainable_only = false) const;

  // ---- forward ----
  /// The computation; the base class raises (ModuleList, ModuleDict have none).
  /// Call the module instead (model(x), (*ptr)(x)) to run its forward hooks:
  /// as PyTorch's module.forward(x), a direct forward(x) skips them.
  virtual Tensor forward(const Tensor& input);
  /// The computation of a two-input module (forward(x, mask)): override this
  /// one and call the module as (*ptr)(x, mask). The base class raises.
  virtual Tensor forward(const Tensor& input, const Tensor& other);
  /// Runs pre-hooks, forward(), then post-hooks.
  Tensor operator()(const Tensor& input);
  /// The same for forward(input, other); hooks see (and pre-hooks may replace) the first input.
  Tensor operator()(const Tensor& input, const Tensor& other);
  HookHandle register_forward_pre_hook(ForwardPreHook hook, HookReplay replay = HookReplay::HostCode);
  HookHandle register_forward_hook(ForwardHook hook, HookReplay replay = HookReplay::HostCode);
  /// True when a forward pre- or post-hook is registered on this module (a
  /// parent that fuses this module's work with another's must then call it).
  bool has_forward_hooks() const { return !hooks_->pre.empty() || !hooks_->post.empty(); }

  // ---- printing ----
  /// The text inside the parentheses of this module's line ("in_features=4, ...").
  virtual std::string extra_repr() const { return {}; }
  /// PyTorch-like nested repr.
  std::string to_string() const;
  /// A table: each parameter's dotted name, shape and element count, then totals.
  std::string summary() const;

 protected:
  /// The registered children in order (name, module), without a copy.
  const std::vector<std::pair<std::string, ModulePtr>>& child_entries() const { return children_; }

  bool training_ = true;

 private:
  struct Slot {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  void register_module_impl(const std::string& name, ModulePtr m);
  Slot* find_slot(std::vector<std::unique_ptr<Slot>>& slots, const std::string& name);
  void collect(const std::string& prefix, bool recurse, bool want_buffers, bool persistent_only,
               std::vector<std::pair<std::string, Tensor*>>& out, std::vector<const TensorImpl*>& seen) const;
  void repr_into(std::string& out, int indent) const;
  Tensor call_with_hooks(const Tensor& input, const Tensor* other);
  void hook_break() const;  // a graph break when a capture records (HookReplay)
  void check_registered_in(Module& root, const Module& caller);

  std::string type_name_;
  std::vector<std::unique_ptr<Slot>> params_;
  std::vector<std::unique_ptr<Slot>> buffers_;
  std::vector<std::pair<std::string, ModulePtr>> children_;
  template <typename H>
  struct Hook {
    H fn;
    HookReplay replay;
  };
  struct Hooks {
    int64_t next_id = 0;
    std::map<int64_t, Hook<ForwardPreHook>> pre;
    std::map<int64_t, Hook<ForwardHook>> post;
  };
  std::shared_ptr<Hooks> hooks_ = std::make_shared<Hooks>();
  // The outermost module this one was last found registered under when called
  // inside another module's call, and whether its "not registered" warning was given.
  const Module* checked_root_ = nullptr;
  bool warned_unregistered_ = false;
};

std::ostream& operator<<(std::ostream& os, const Module& m);

}  // namespace kiln::nn
