// The view half of check_inplace and rebase_history (functions.cpp), kept
// beside the CopySlices node in view_history.cpp.
#pragma once

#include <initializer_list>

#include "kiln/autograd/autograd_meta.h"

namespace kiln::autograd::detail {

/// Raises the errors torch raises for an in-place op recorded on a view.
void check_view_inplace(const Tensor& self, const AutogradMeta& m, const char* op, CallSite site);

/// `fn` (the in-place op's node, no edges yet) becomes part of the base's new
/// history (CopySlices); the view's grad_fn is rebuilt from it.
void rebase_view_history(Tensor& self, AutogradMeta& m, const NodePtr& fn,
                         std::initializer_list<const Tensor*> other_inputs, CallSite site);

}  // namespace kiln::autograd::detail
