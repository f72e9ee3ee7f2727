// What OpenMP's idle threads do while they wait, as kiln set it up.
// See Note [OpenMP waiting under load] in src/core/threads.cpp.
#pragma once

#include <string>

namespace kiln {

/// How long an idle OpenMP thread spins before it sleeps, and who chose it:
/// e.g. "GOMP_SPINCOUNT=10000 (kiln's default)" or "OMP_WAIT_POLICY=active
/// (set by the user)".
std::string openmp_wait_policy();

}  // namespace kiln
