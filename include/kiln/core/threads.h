// Intra-op parallelism settings. kiln uses one OpenMP runtime for its own
// loops and for oneDNN (DESIGN.md §4), so one setting governs all.
#pragma once

#include <cstdint>

namespace kiln {

/// Threads used by parallel kernels. Defaults to OMP_NUM_THREADS if set, else
/// the number of cores.
int get_num_threads();
void set_num_threads(int n);

/// Elements below which a loop stays on one thread: forking costs more than
/// the work for small tensors.
inline constexpr int64_t kGrainSize = 32768;

}  // namespace kiln
