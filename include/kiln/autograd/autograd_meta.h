// Per-tensor autograd state, hung off TensorImpl (DESIGN.md §2): the
// gradient, the node that produced the tensor, hooks, and a display name
// (a module parameter's path) for error messages.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/autograd/node.h"

namespace kiln::autograd {

class AccumulateGrad;

struct AutogradMeta final : AutogradMetaInterface {
  Tensor grad;
  NodePtr grad_fn;  // null for leaves
  uint32_t output_nr = 0;
  /// The leaf's AccumulateGrad node while a graph refers to it. Not owning:
  /// the node owns the leaf (through a Tensor) and clears this when it dies,
  /// so leaf and graph do not keep each other alive.
  AccumulateGrad* grad_accumulator = nullptr;
  bool retains_grad = false;
  /// A differentiable view of another tensor, and the storage version its
  /// history is valid for (docs/autograd.md, "Views").
  bool is_view = false;
  uint32_t view_version = 0;
  std::string name;  // "layers.0.weight" once a module registers it

  struct Hook {
    uint64_t id;
    std::function<Tensor(const Tensor&)> fn;
  };
  struct PostAccumulateHook {
    uint64_t id;
    std::function<void(Tensor&)> fn;
  };
  std::vector<Hook> leaf_hooks;  // tensor hooks of a leaf run before accumulation
  std::vector<PostAccumulateHook> post_accumulate_hooks;
  uint64_t retain_grad_hook_id = 0;

  ~AutogradMeta() override;
};

/// The tensor's autograd meta, or null.
AutogradMeta* get_meta(const Tensor& t);
/// The tensor's autograd meta, created on first use.
AutogradMeta& materialize_meta(const Tensor& t);

/// The node gradients for `t` flow into: its grad_fn, or (for a leaf that
/// requires grad) its AccumulateGrad node, created on demand. Invalid edge
/// when t needs no gradient.
Edge gradient_edge(const Tensor& t);

/// A short description for messages: "parameter 'fc.weight' [4, 8] float32"
/// or "output 0 of MulBackward0 [4, 8] float32".
std::string describe(const Tensor& t);

/// Next id for hook handles (process-wide, monotonic).
uint64_t next_hook_id();

}  // namespace kiln::autograd
