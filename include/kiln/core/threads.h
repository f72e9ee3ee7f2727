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

/// torch.set_flush_denormal: with `on`, floating-point arithmetic treats
/// subnormal inputs as 0 and writes 0 for subnormal results (x86's DAZ and
/// FTZ), on the calling thread and on the threads of kiln's parallel loops,
/// which oneDNN shares (torch sets only the calling thread). Off by default:
/// kiln keeps IEEE subnormals, whose arithmetic costs a microcode assist per
/// vector on x86 (Note [Flushing subnormals] in src/core/threads.cpp: AdamW
/// runs 21x slower on moments that decayed into them). Other threads (data
/// loaders, communication) keep their own mode. Returns whether this CPU
/// supports it (x86), as torch's does; on another CPU nothing changes.
bool set_flush_denormal(bool on);
/// Whether set_flush_denormal(true) is in effect.
bool flush_denormal();

namespace detail {
/// Brings the calling thread's floating-point mode to set_flush_denormal's,
/// when it changed since this thread last looked (parallel_for calls it in
/// each region's threads: a relaxed load when nothing changed).
void sync_flush_denormal();
}  // namespace detail

}  // namespace kiln
