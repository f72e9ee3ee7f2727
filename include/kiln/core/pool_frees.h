// Which blocks of a private pool were freed, in order: kiln::compile asks
// after each recorded kernel, so that it knows when each intermediate of a
// captured step died (an elementwise result freed before anything else ran
// is one a fused loop need not write to memory at all); and holding back
// blocks freed to the shared cache while kernels that use them wait.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "kiln/core/allocator.h"

namespace kiln::memory {

/// Starts (or stops) keeping the list of blocks returned to `pool`.
void log_pool_frees(PrivatePool& pool, bool on);
/// The blocks (address, rounded size) returned to `pool` since the last call.
std::vector<std::pair<void*, size_t>> take_pool_frees(PrivatePool& pool);

/// RAII: while it lives, blocks this thread frees to the shared cache are held
/// back — no allocation can take them — until release() or its end. A split
/// call of kiln::compile holds kernels that may still read or write a tensor
/// freed after they were held (a buffer made before the call and replaced in
/// it); its own tensors come from its private pool, which needs no holding.
class HoldFrees {
 public:
  HoldFrees();
  ~HoldFrees();
  HoldFrees(const HoldFrees&) = delete;
  HoldFrees& operator=(const HoldFrees&) = delete;
  /// Returns the blocks held so far to the shared cache.
  void release();

 private:
  std::vector<std::pair<void*, size_t>> held_;
  std::vector<std::pair<void*, size_t>>* prev_;
};

}  // namespace kiln::memory
