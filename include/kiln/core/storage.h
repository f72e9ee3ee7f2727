// Storage: the bytes behind one or more tensors, plus the version counter.
//
// Note [Version counter lives on Storage]
// Every view of a tensor shares its Storage, and so shares one version
// counter: an in-place op through any view bumps it, and autograd compares the
// version it saved with the current one before using a saved tensor
// (DESIGN.md §2-§3). Keeping the counter on Storage rather than in a separate
// heap object saves an allocation per op output. `detach()` shares storage and
// so shares the counter, as in PyTorch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "kiln/core/allocator.h"
#include "kiln/core/intrusive_ptr.h"

namespace kiln {

namespace capture::detail {
void note_watched_access(uint32_t id);
}  // namespace capture::detail

enum class DeviceType : uint8_t { CPU };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = -1;
  bool operator==(const Device&) const = default;
  bool is_cpu() const { return type == DeviceType::CPU; }
};
inline constexpr Device kCPU{};

class StorageImpl final : public RefCounted {
 public:
  /// Owning: bytes from the caching allocator, charged to `category`.
  StorageImpl(size_t nbytes, MemoryCategory category);
  /// Non-owning (from_blob): `deleter`, if set, runs when the last tensor goes.
  StorageImpl(void* data, size_t nbytes, std::function<void(void*)> deleter);
  ~StorageImpl() override;

  void* data() const {
    if (watch_ != 0) [[unlikely]]
      capture::detail::note_watched_access(watch_);
    return data_;
  }
  size_t nbytes() const { return nbytes_; }
  MemoryCategory category() const { return category_; }
  bool owns_memory() const { return owned_; }
  Device device() const { return kCPU; }

  uint32_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  /// The last in-place writer (op name and call site, when known), kept so
  /// that autograd's version-mismatch error can say who modified a tensor.
  struct WriteInfo {
    const char* op = nullptr;
    const char* file = nullptr;
    uint32_t line = 0;
  };
  void record_write(const char* op, const char* file, uint32_t line) { last_write_ = {op, file, line}; }
  WriteInfo last_write() const { return last_write_; }

  /// Re-charges this storage to another category (e.g. a tensor registered as a
  /// parameter after it was created as an activation).
  void set_category(MemoryCategory c);

  /// Frees the bytes of an owning storage while the storage itself (identity,
  /// size, version counter, every view of it) lives on; reallocate_memory() brings
  /// back nbytes() uninitialised bytes. This is how FSDP frees a unit's
  /// gathered parameters after its forward and regathers them for backward:
  /// the tensors autograd saved view this storage, so they see the regathered
  /// values and their saved versions still match (torch: storage().resize_(0)
  /// and resize_(n)). While released, data() is null: nothing may read it.
  /// (Not named release(): that is RefCounted's reference drop.)
  void free_memory();
  /// kiln::compile's rewrites (capture::watch): while set, every data() call
  /// reports this id to the capture recording on the calling thread, so the
  /// capture knows every op that took the address of these bytes.
  uint32_t watch_id() const { return watch_; }
  void set_watch_id(uint32_t id) { watch_ = id; }
  void reallocate_memory();
  bool memory_freed() const { return memory_freed_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  MemoryCategory category_ = MemoryCategory::Activation;
  bool owned_ = true;
  bool memory_freed_ = false;
  std::atomic<uint32_t> version_{0};
  uint32_t watch_ = 0;  // in the padding after version_: no larger
  WriteInfo last_write_;
  std::function<void(void*)> deleter_;
};

using Storage = IntrusivePtr<StorageImpl>;

}  // namespace kiln
