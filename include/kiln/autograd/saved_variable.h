// A tensor saved for backward, with the version it had when saved.
//
// Unpacking checks the version against the storage's current one; a
// mismatch means an in-place op changed data the backward formula needs,
// and the error names the saving node, the tensor, the op that modified it,
// both call sites and both versions (DESIGN.md §3), so the user need not
// rerun under anomaly mode.
#pragma once

#include <cstdint>

#include "kiln/autograd/node.h"

namespace kiln::autograd {

class SavedVariable {
 public:
  SavedVariable() = default;
  /// `is_output`: the tensor is an output of the node saving it. The saved
  /// copy then drops its grad_fn (which would be the node itself, a cycle)
  /// and unpack() restores it, so double backward still sees the history.
  /// For an output, `output_nr` says which output of the owner it is.
  SavedVariable(const Tensor& t, bool is_output, uint32_t output_nr = 0);

  /// The saved tensor; throws when it was modified in place since saving or
  /// was released after a backward without retain_graph.
  Tensor unpack(const Node* owner) const;
  bool defined() const { return defined_; }
  void reset();

 private:
  // Not an output: the tensor itself (same handle, so its name and history
  // stay reachable). An output: a detached alias sharing its storage.
  Tensor data_;
  uint32_t output_nr_ = 0;
  uint32_t saved_version_ = 0;
  bool is_output_ = false;
  bool requires_grad_ = false;
  bool defined_ = false;
  bool released_ = false;
};

}  // namespace kiln::autograd
