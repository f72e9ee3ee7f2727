#include "kiln/autograd/saved_variable.h"

#include <sstream>

#include "kiln/autograd/autograd_meta.h"

namespace kiln::autograd {

namespace {

Tensor alias_of(const Tensor& t) {
  return Tensor(make_intrusive<TensorImpl>(t.storage(), t.dtype(), t.sizes(), t.strides(), t.storage_offset()));
}

}  // namespace

SavedVariable::SavedVariable(const Tensor& t, bool is_output, uint32_t output_nr) {
  if (!t.defined()) return;
  // As torch: any inference tensor, whether it requires grad or not (a weight made under
  // InferenceModeGuard and multiplied by a tensor that requires grad is saved by MulBackward0).
  KILN_CHECK(!t.impl()->is_inference(), ValueError, "inference tensors cannot be saved for backward: this tensor (",
             describe(t),
             ") was created under InferenceModeGuard; clone() it outside inference mode to get a normal "
             "tensor, or run the whole computation under NoGradGuard instead");
  defined_ = true;
  is_output_ = is_output;
  // An output is saved before set_history makes it require grad; it will.
  requires_grad_ = is_output || t.requires_grad();
  saved_version_ = t.version();
  if (is_output) {
    data_ = alias_of(t);
    output_nr_ = output_nr;
  } else {
    data_ = t;
  }
}

void SavedVariable::reset() {
  data_ = Tensor();
  released_ = true;
}

Tensor SavedVariable::unpack(const Node* owner) const {
  if (!defined_) return {};
  KILN_CHECK(!released_, ValueError, "backward through ", owner ? owner->name() : "a node",
             " a second time: its saved tensors were freed after the first backward. Pass retain_graph=true "
             "to the first backward() if you need to backward through the same graph again");
  const uint32_t now = data_.version();
  if (now != saved_version_) {
    std::ostringstream os;
    const auto w = data_.storage()->last_write();
    os << "a tensor saved for backward was modified in place before backward ran.\n"
       << "  tensor:      "
       << (is_output_ ? std::string("output ") + std::to_string(output_nr_) + " of " + (owner ? owner->name() : "?") +
                            " " + shape_str(data_.sizes()) + " " + std::string(dtype_name(data_.dtype()))
                      : describe(data_))
       << "\n  saved by:    " << (owner ? owner->name() : "?");
    if (owner && owner->site().known()) os << " (forward at " << owner->site().str() << ")";
    os << "\n  modified by: " << (w.op ? w.op : "an in-place op");
    if (w.file) os << " at " << CallSite{w.file, w.line}.str();
    os << "\n  versions:    saved at version " << saved_version_ << ", now at version " << now
       << "\nhint: the backward of " << (owner ? owner->name() : "this op")
       << " needs the value it saw in forward; use the out-of-place op (e.g. x = x.add(y) instead of "
          "x.add_(y)) or clone() the tensor before modifying it";
    throw ValueError(os.str());
  }
  if (!is_output_) return data_;
  Tensor t = alias_of(data_);
  if (requires_grad_ && owner) {
    AutogradMeta& m = materialize_meta(t);
    m.grad_fn = NodePtr(const_cast<Node*>(owner));
    m.output_nr = output_nr_;
    t.impl()->set_requires_grad_flag(true);
  }
  return t;
}

}  // namespace kiln::autograd
