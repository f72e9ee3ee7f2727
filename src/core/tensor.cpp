// The parts of Tensor that need no op: metadata accessors and element access.
#include "kiln/core/tensor.h"

#include "kiln/core/allocator.h"
#include "kiln/core/capture.h"

namespace kiln {

int64_t Tensor::size(int64_t d) const {
  KILN_CHECK(defined(), ValueError, "size(): called on an undefined tensor");
  KILN_CHECK(dim() > 0, IndexError, "size(", d, "): a 0-dim tensor has no dimensions");
  return sizes()[wrap_dim(d, dim(), "size")];
}

int64_t Tensor::stride(int64_t d) const {
  KILN_CHECK(defined(), ValueError, "stride(): called on an undefined tensor");
  KILN_CHECK(dim() > 0, IndexError, "stride(", d, "): a 0-dim tensor has no dimensions");
  return strides()[wrap_dim(d, dim(), "stride")];
}

void Tensor::check_dtype_for_access(DType requested, const char* what) const {
  KILN_CHECK(defined(), ValueError, what, "(): called on an undefined tensor");
  KILN_CHECK(requested == dtype(), DTypeError, what, "<", dtype_name(requested), ">(): the tensor's dtype is ",
             dtype_name(dtype()), "; use data_ptr<", dtype_name(dtype()), "> or convert with .to(",
             dtype_name(requested), ") first");
}

void Tensor::set_data(const Tensor& new_data) const {
  KILN_CHECK(defined(), ValueError, "set_data(): called on an undefined tensor");
  KILN_CHECK(new_data.defined(), ValueError,
             "set_data(): expected a defined tensor as the new data, got an undefined one");
  KILN_CHECK(new_data.device() == device(), ValueError, "set_data(): the new data must be on the same device");
  // Self-assignment would hand set_data views of the very metadata it overwrites.
  if (new_data.impl() == impl()) return;
  impl_->set_data(new_data.storage(), new_data.dtype(), new_data.sizes(), new_data.strides(),
                  new_data.storage_offset());
}

Scalar Tensor::item_scalar(std::source_location loc) const {
  // The value may steer host code, which a replay does not run.
  if (capture::recording()) {
    memory::note_call_site(loc.file_name(), loc.line());
    capture::graph_break("Tensor.item() reads a tensor's value on the host");
  }
  KILN_CHECK(defined(), ValueError, "item(): called on an undefined tensor");
  KILN_CHECK(numel() == 1, ValueError, "item(): expected a tensor with one element, got shape ", sizes(), " (", numel(),
             " elements)");
  return visit_dtype(dtype(), [&]<typename T>() -> Scalar { return Scalar(*static_cast<const T*>(data_ptr())); });
}

}  // namespace kiln
