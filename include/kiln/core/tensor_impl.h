// TensorImpl: what a Tensor handle points at — sizes, strides, offset, dtype,
// device, and the Storage (whose version counter every view shares).
//
// Autograd state (grad, grad_fn, hooks, a parameter's name) hangs off
// `autograd_meta`, declared here only as an abstract interface so that core
// never includes an autograd header (DESIGN.md §2).
#pragma once

#include <memory>
#include <string>

#include "kiln/core/dtype.h"
#include "kiln/core/shape.h"
#include "kiln/core/storage.h"

namespace kiln {

/// Implemented by the autograd layer; core only owns and destroys it.
struct AutogradMetaInterface {
  virtual ~AutogradMetaInterface() = default;
  /// A differentiable view requires grad whenever its base does, including
  /// when the base gained a history after the view was made (an in-place
  /// write through a sibling view), as torch's views do.
  virtual bool requires_grad_through_base() const = 0;
};

class TensorImpl final : public RefCounted {
 public:
  TensorImpl(Storage storage, DType dtype, IntArrayRef sizes, IntArrayRef strides, int64_t offset);

  IntArrayRef sizes() const { return sizes_; }
  IntArrayRef strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t numel() const { return numel_; }
  int64_t storage_offset() const { return offset_; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_->device(); }
  const Storage& storage() const { return storage_; }
  bool is_contiguous() const { return contiguous_; }

  /// Byte address of element 0 of this view.
  void* data() const { return static_cast<char*>(storage_->data()) + offset_ * element_size(dtype_); }

  /// Replaces the view metadata in place (used by in-place view ops such as
  /// squeeze_ and by as_strided_); recomputes numel and contiguity.
  void set_sizes_and_strides(IntArrayRef sizes, IntArrayRef strides, int64_t offset);
  /// Points this impl at other data (storage, dtype and view metadata) while
  /// keeping its identity, autograd meta and flags: how Module::to(dtype)
  /// converts a parameter that members, optimizers and hooks already hold.
  void set_data(Storage storage, DType dtype, IntArrayRef sizes, IntArrayRef strides, int64_t offset);

  bool requires_grad() const {
    return requires_grad_ || (autograd_meta_ && autograd_meta_->requires_grad_through_base());
  }
  void set_requires_grad_flag(bool r) { requires_grad_ = r; }

  AutogradMetaInterface* autograd_meta() const { return autograd_meta_.get(); }
  void set_autograd_meta(std::unique_ptr<AutogradMetaInterface> m) { autograd_meta_ = std::move(m); }

  /// Set under InferenceModeGuard: such tensors may not be saved for backward later.
  bool is_inference() const { return inference_; }
  void set_inference(bool v) { inference_ = v; }

 private:
  void refresh();

  Storage storage_;
  DimVector sizes_;
  DimVector strides_;
  int64_t offset_ = 0;
  int64_t numel_ = 0;
  DType dtype_;
  bool contiguous_ = true;
  bool requires_grad_ = false;
  bool inference_ = false;
  std::unique_ptr<AutogradMetaInterface> autograd_meta_;
};

}  // namespace kiln
