#pragma once
// The process-wide MPI setup (DESIGN.md §6): init() reads the launch that
// mpirun (or `kiln launch`) made, world() is the group of every process, and
// run_or_abort() turns one rank's exception into the end of the whole job, so
// that the other ranks are not left waiting in a collective forever.
//
// Environment read by the MPI backend:
//   KILN_DIST_DEBUG=1      cross-check every collective's signature across ranks
//                          before running it; a mismatch raises on every rank.
//   KILN_DIST_TIMEOUT=S    seconds a collective may take before the watchdog
//                          reports who is stuck where and aborts (default 300;
//                          0 turns the watchdog off).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"

namespace kiln::dist {

/// Initialises MPI (thread level MPI_THREAD_MULTIPLE: a communication thread
/// and a watchdog thread call MPI beside the caller) and the world group.
/// Idempotent; MPI is finalised at exit. A process started without mpirun
/// becomes a world of one.
void init();
bool is_initialized();
/// The group of all processes; init() must have run.
ProcessGroupPtr world();

/// A group of some of the world's ranks (torch.distributed.new_group): an MPI
/// communicator split, usable wherever the world is (DDP included). Every
/// process of the world must call it, with the same ranks, in the same order
/// relative to its other new_group calls; the ranks are sorted, so group rank
/// i is the i-th smallest world rank. A process not in `ranks` gets a handle
/// whose is_member() is false and whose collectives throw. Duplicate or
/// out-of-range ranks, and ranks that differ between processes, throw on every
/// process. `name` says what the group is for, so that errors and the watchdog
/// name it: "tp" gives "tp group [0, 1] (2 of 4 ranks)" (DeviceMesh names its
/// groups by their dimension); without one, "group [0, 1] (2 of 4 ranks)".
ProcessGroupPtr new_group(std::vector<int> ranks, const std::string& name = "");

/// This process's rank and the number of processes, from the world group.
int rank();
int world_size();
/// The rank among the processes on this machine: OMPI_COMM_WORLD_LOCAL_RANK
/// under Open MPI; otherwise computed once with MPI_Comm_split_type (a
/// collective: the first call must come from every rank); 0 without MPI.
int local_rank();
/// True when this process was started by mpirun (Open MPI's environment is set).
bool launched_by_mpi();

/// Runs fn; if it throws, prints "kiln: rank R failed: <what>" on stderr and
/// aborts the whole job (MPI_Abort with exit code 1). Returns 0 otherwise, so
/// that main() can `return dist::run_or_abort(...)`.
int run_or_abort(const std::function<void()>& fn);

/// The training step this rank is at, for the report `kiln launch` prints when
/// a rank dies (which rank, at which step, in which collective). A plain store:
/// call it every step.
void set_step(int64_t step);
/// Records that this rank got `sig` (SIGTERM/SIGINT) for that report; for a
/// program that installs its own stop handler. Async-signal-safe.
void record_signal(int sig) noexcept;

/// Prints `why` prefixed with this rank on stderr and aborts every process of
/// the job with `code`. Without MPI initialised it exits the process.
[[noreturn]] void abort_job(const std::string& why, int code = 1);

}  // namespace kiln::dist
