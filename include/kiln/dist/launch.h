#pragma once
// Builds the mpirun command line that `kiln launch -n N -- cmd ...` runs, so a
// user never types MPI flags: the run-as-root and oversubscription variables,
// and the malloc tunables Open MPI needs on these machines (without them its
// fresh temporary buffers make allreduce about 30x slower; DESIGN.md §6), are
// set in mpirun's environment and forwarded to every rank with -x.
#include <string>
#include <vector>

namespace kiln::dist {

struct LaunchOptions {
  /// An Open MPI hostfile ("host slots=N" lines) for a multi-machine job;
  /// empty runs every rank on this machine.
  std::string hostfile{};
  /// The launcher to run; `mpirun` from PATH by default.
  std::string mpirun = "mpirun";
  /// More environment for every rank, as NAME=VALUE (forwarded with -x).
  std::vector<std::string> env{};
};

/// The environment kiln's jobs run with, as NAME=VALUE pairs.
std::vector<std::string> launch_environment();

/// argv for running `command` on `nprocs` ranks: mpirun -np N [--hostfile F]
/// -x NAME=VALUE... command...
std::vector<std::string> launch_command(int nprocs, const std::vector<std::string>& command,
                                        const LaunchOptions& options = {});

/// How a job run by run_launch() ended: mpirun's exit code (128 + signal when
/// it was killed) and, when the job failed, which rank died first, at which
/// step (dist::set_step) and in which collective, and where the others were.
struct LaunchResult {
  int exit_code = 0;
  std::string report;  // empty when the job succeeded
};

/// Runs launch_command() as a child and waits for it (what `kiln launch` does).
/// Every rank keeps a small status record in a temporary directory of the
/// launcher's (KILN_LAUNCH_STATUS_DIR), so that a rank killed without a word
/// (SIGKILL, the out-of-memory killer) is still named afterwards. SIGTERM to the
/// launcher is passed on to mpirun; SIGINT (Ctrl-C) reaches mpirun directly.
LaunchResult run_launch(int nprocs, const std::vector<std::string>& command, const LaunchOptions& options = {});

/// Runs launch_command() with execvp, replacing this process; returns only by
/// throwing (the launcher could not be started). No failure report: see run_launch().
[[noreturn]] void exec_launch(int nprocs, const std::vector<std::string>& command, const LaunchOptions& options = {});

}  // namespace kiln::dist
