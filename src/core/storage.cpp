#include "kiln/core/storage.h"

#include <utility>

#include "kiln/core/error.h"

namespace kiln {

StorageImpl::StorageImpl(size_t nbytes, MemoryCategory category)
    : data_(memory::allocate(nbytes, category)), nbytes_(nbytes), category_(category), owned_(true) {}

StorageImpl::StorageImpl(void* data, size_t nbytes, std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), category_(MemoryCategory::Data), owned_(false), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (memory_freed_) return;
  if (owned_) {
    memory::deallocate(data_, nbytes_, category_);
  } else if (deleter_) {
    deleter_(data_);
  }
}

void StorageImpl::set_category(MemoryCategory c) {
  if (c == category_) return;
  if (owned_ && !memory_freed_) memory::recharge(data_, nbytes_, category_, c);
  category_ = c;
}

void StorageImpl::free_memory() {
  KILN_CHECK(owned_, ValueError,
             "Storage::free_memory(): only a storage that owns its bytes can release them (this one ",
             "wraps memory it was given)");
  if (memory_freed_) return;
  memory::deallocate(data_, nbytes_, category_);
  data_ = nullptr;
  memory_freed_ = true;
}

void StorageImpl::reallocate_memory() {
  if (!memory_freed_) return;
  data_ = memory::allocate(nbytes_, category_);
  memory_freed_ = false;
}

}  // namespace kiln
