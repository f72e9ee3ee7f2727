// Which blocks of a private pool were freed, in order: kiln::compile asks
// after each recorded kernel, so that it knows when each intermediate of a
// captured step died (an elementwise result freed before anything else ran
// is one a fused loop need not write to memory at all).
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

}  // namespace kiln::memory
