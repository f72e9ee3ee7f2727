#include "kiln/core/storage.h"

#include <utility>

namespace kiln {

StorageImpl::StorageImpl(size_t nbytes, MemoryCategory category)
    : data_(memory::allocate(nbytes, category)), nbytes_(nbytes), category_(category), owned_(true) {}

StorageImpl::StorageImpl(void* data, size_t nbytes, std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), category_(MemoryCategory::Data), owned_(false), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (owned_) {
    memory::deallocate(data_, nbytes_, category_);
  } else if (deleter_) {
    deleter_(data_);
  }
}

void StorageImpl::set_category(MemoryCategory c) {
  if (c == category_) return;
  if (owned_) memory::recharge(data_, nbytes_, category_, c);
  category_ = c;
}

}  // namespace kiln
