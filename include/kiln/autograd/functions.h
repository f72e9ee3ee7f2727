// What ops need from autograd to record the graph, and the two built-in
// nodes: AccumulateGrad (a leaf's sink) and the error node for in-place ops.
//
// The pattern every differentiable op follows (forward and backward side by
// side, DESIGN.md §4):
//
//   Tensor Tensor::exp() const {
//     Tensor out = <forward kernel>;
//     if (autograd::compute_requires_grad({this})) {
//       auto node = make_intrusive<ExpBackward>();      // saves what it needs
//       node->result = SavedVariable(out, /*is_output=*/true);
//       autograd::set_history(out, node, {this});
//     }
//     return out;
//   }
#pragma once

#include <functional>
#include <initializer_list>
#include <source_location>

#include "kiln/autograd/autograd_meta.h"
#include "kiln/autograd/saved_variable.h"

namespace kiln::autograd {

/// The sink for a leaf's gradient: runs its tensor hooks, accumulates into
/// .grad (charged to MemoryCategory::Gradient), then runs its
/// post-accumulate-grad hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor leaf);
  ~AccumulateGrad() override;
  const char* name() const override { return "AccumulateGrad"; }
  TensorList apply(TensorList&& grads) override;
  const Tensor& leaf() const { return leaf_; }

 private:
  Tensor leaf_;
};

bool is_accumulate_grad(const Node& n);

/// True when grad mode is on and any defined input requires grad.
bool compute_requires_grad(std::initializer_list<const Tensor*> inputs);
bool compute_requires_grad(const TensorList& inputs);

/// Connects `node` to the inputs' gradient edges (in order) and makes it the
/// grad_fn of each output (output_nr in order). Records the forward call site.
void set_history(std::initializer_list<Tensor*> outputs, const NodePtr& node,
                 std::initializer_list<const Tensor*> inputs, CallSite site = {});
void set_history(Tensor& output, const NodePtr& node, std::initializer_list<const Tensor*> inputs, CallSite site = {});
void set_history(TensorList& outputs, const NodePtr& node, const TensorList& inputs, CallSite site = {});

/// For view ops: set_history, then marks `view` as a differentiable view of
/// base (mark_view), so that an in-place write into it rewrites the base's
/// history and a write through another alias rebuilds the view's.
void set_view_history(Tensor& view, const NodePtr& node, const Tensor& base, CallSite site = {},
                      ViewCreation creation = ViewCreation::kDefault);

/// Before an in-place op on `self` with `other_inputs` (the op's other tensor
/// operands): raises the PyTorch errors — a leaf that requires grad, a view
/// of one, a view torch will not rewrite (one of several outputs of split,
/// chunk or unbind; one made in no-grad mode) — naming the tensor, and
/// records the op and site on the storage so a later version-mismatch error
/// can say who modified the tensor. Nothing is written before it passes.
void check_inplace(const Tensor& self, const char* op, CallSite site = {},
                   std::initializer_list<const Tensor*> other_inputs = {});

/// After an in-place op recorded as `node` on `self`: `self` now has `node`
/// as grad_fn (its history is rewritten, as PyTorch does). When `self` is a
/// view, the base's history is rewritten instead (a CopySlices node wrapping
/// `node`, as torch's) and the view's grad_fn is rebuilt from it, so the
/// gradient reaches the base, the written values and earlier readers alike.
void rebase_history(Tensor& self, const NodePtr& node, std::initializer_list<const Tensor*> other_inputs,
                    CallSite site = {});

/// Names a tensor for messages ("fc.weight"); modules call it on registration.
void set_name(const Tensor& t, std::string name);

}  // namespace kiln::autograd
