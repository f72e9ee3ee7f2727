#pragma once
// Internal to src/dist: what each rank of a `kiln launch` job was doing, kept
// where the launcher can read it after the rank is gone.
//
// A rank that dies by SIGKILL (the kernel's out-of-memory killer, a user's
// kill -9) cannot say anything, and mpirun then only reports that "a process"
// ended. So `kiln launch` gives every rank a directory (KILN_LAUNCH_STATUS_DIR);
// each rank maps a small fixed-size record there (MAP_SHARED, so the record
// survives the process) and keeps its step, its running or last collective and
// its end in it. Writes are plain stores into the mapping: no system call on
// the training path. When mpirun exits non-zero the launcher reads the records
// and names the rank that died first, its step and its collective.
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::dist::detail {

enum class RankState : int32_t {
  Running = 0,
  Exited = 1,     // returned from main / exit(): exit_code is valid
  Crashed = 2,    // a fatal signal (SIGSEGV, SIGABRT, ...) it caught and recorded
  Signalled = 3,  // SIGTERM / SIGINT: asked to stop (by mpirun after another rank failed, or the user)
  Failed = 4,     // abort_job: an exception; `why` holds its message
};

struct RankStatusRecord {
  char magic[8];  // "KILNRS1"
  int32_t rank;
  int32_t pid;
  int64_t step;  // -1 until the program reports one (dist::set_step)
  RankState state;
  int32_t signal;
  int32_t exit_code;
  int32_t in_collective;  // 1 while a collective runs; `op` is then the running one, else the last
  char op[232];
  char why[256];
};

/// Maps this rank's record when KILN_LAUNCH_STATUS_DIR is set (dist::init);
/// installs the fatal-signal handlers that record and report a crash.
void open_rank_status(int rank);
bool rank_status_enabled();
void status_collective(const std::string& describe, bool running);
void status_exit(int code);
void status_failed(const std::string& why);
/// Async-signal-safe.
void status_signal(int sig);

/// The launcher's side: reads every record of `dir` and describes how the job
/// ended, the first failing rank first. `alive(pid)` tells a live process.
std::string describe_job_end(const std::string& dir, int nprocs, int mpirun_status);

}  // namespace kiln::dist::detail
