#pragma once
// Internal to src/dist: replacing this process with the mpirun command line,
// shared by exec_launch() (in this process) and run_launch() (in its child).
#include <string>
#include <vector>

namespace kiln::dist::detail {

/// Sets launch_environment() in this process (mpirun reads the run-as-root and
/// mapping settings from its own environment) and execvp's `argv`; returns
/// only when the exec failed (errno says why).
void exec_with_launch_environment(const std::vector<std::string>& argv);

}  // namespace kiln::dist::detail
