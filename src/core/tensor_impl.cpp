#include "kiln/core/tensor_impl.h"

namespace kiln {

TensorImpl::TensorImpl(Storage storage, DType dtype, IntArrayRef sizes, IntArrayRef strides, int64_t offset)
    : storage_(std::move(storage)), sizes_(sizes), strides_(strides), offset_(offset), dtype_(dtype) {
  refresh();
}

void TensorImpl::set_sizes_and_strides(IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  sizes_ = sizes;
  strides_ = strides;
  offset_ = offset;
  refresh();
}

void TensorImpl::set_data(Storage storage, DType dtype, IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  storage_ = std::move(storage);
  dtype_ = dtype;
  set_sizes_and_strides(sizes, strides, offset);
}

void TensorImpl::refresh() {
  KILN_ASSERT(sizes_.size() == strides_.size(), "sizes ", sizes_, " vs strides ", strides_);
  numel_ = 1;
  for (int64_t s : sizes_) numel_ *= s;
  // Contiguous = row-major dense, ignoring strides of size-1 dims (as PyTorch).
  contiguous_ = true;
  if (numel_ == 0) return;
  int64_t expected = 1;
  for (size_t i = sizes_.size(); i-- > 0;) {
    if (sizes_[i] == 1) continue;
    if (strides_[i] != expected) {
      contiguous_ = false;
      return;
    }
    expected *= sizes_[i];
  }
}

}  // namespace kiln
