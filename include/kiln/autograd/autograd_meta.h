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

/// How a view was made, for the in-place writes torch refuses on it.
enum class ViewCreation : uint8_t {
  kDefault,
  kMultipleOutput,  // one of several views returned by one op (split, chunk, unbind)
  kNoGradMode,      // made with grad mode off from a base that requires grad
};

struct AutogradMeta final : AutogradMetaInterface {
  Tensor grad;
  NodePtr grad_fn;  // null for leaves
  uint32_t output_nr = 0;
  /// The leaf's AccumulateGrad node while a graph refers to it. Not owning:
  /// the node owns the leaf (through a Tensor) and clears this when it dies,
  /// so leaf and graph do not keep each other alive.
  AccumulateGrad* grad_accumulator = nullptr;
  bool retains_grad = false;
  /// A differentiable view of `view_base` (docs/autograd.md, "Views"): the root tensor whose
  /// storage it looks into (never a view; undefined for a no-grad view of a base needing no grad), how the
  /// view was made, and the storage version its grad_fn is valid for. After
  /// any in-place write into the storage the view's grad_fn is rebuilt from
  /// the base's history (refresh_view), so a write through the base, a
  /// sibling view or a detach() alias is seen as torch sees it.
  bool is_view = false;
  ViewCreation view_creation = ViewCreation::kDefault;
  uint32_t view_version = 0;
  Tensor view_base;
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
  bool requires_grad_through_base() const override {
    return is_view && view_creation != ViewCreation::kNoGradMode && view_base.requires_grad();
  }
};

/// The tensor's autograd meta, or null.
AutogradMeta* get_meta(const Tensor& t);
/// The tensor's autograd meta, created on first use.
AutogradMeta& materialize_meta(const Tensor& t);

/// Marks `view` (just made from `base` by a view op) as a differentiable view
/// of base's root. Its grad_fn, if any, is set by the caller.
void mark_view(const Tensor& view, const Tensor& base, ViewCreation creation);

/// Rebuilds a stale view's grad_fn from its base's current history (an
/// AsStridedBackward0 node, as torch's), when the storage was written since
/// the view's history was recorded. Raises for views torch refuses to
/// rebuild (one of several outputs of split/chunk/unbind).
void refresh_view(const Tensor& t);

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
