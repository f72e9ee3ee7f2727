// The input iterator both loaders hand out for `for (auto& batch : loader)`:
// it holds the epoch's shared state and asks it for the next batch; the end
// iterator holds none. Epoch must offer `bool advance()` and `Batch& current()`.
#pragma once

#include <cstddef>
#include <memory>

namespace kiln::data::detail {

template <typename Epoch, typename Batch>
class EpochIterator {
 public:
  using value_type = Batch;
  using difference_type = std::ptrdiff_t;
  EpochIterator() = default;
  explicit EpochIterator(std::shared_ptr<Epoch> e) : epoch_(std::move(e)) {
    if (epoch_ && !epoch_->advance()) epoch_.reset();
  }
  Batch& operator*() const { return epoch_->current(); }
  Batch* operator->() const { return &epoch_->current(); }
  EpochIterator& operator++() {
    if (!epoch_->advance()) epoch_.reset();
    return *this;
  }
  bool operator==(const EpochIterator& o) const { return epoch_ == o.epoch_; }

 private:
  std::shared_ptr<Epoch> epoch_;
};

}  // namespace kiln::data::detail
