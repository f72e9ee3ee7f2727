// `kiln launch`'s mpirun command line.
#include "kiln/dist/launch.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kiln/core/error.h"
#include "launch_exec.h"

namespace kiln::dist {

std::vector<std::string> launch_environment() {
  return {
      // Containers run as root; Open MPI refuses to without both of these.
      "OMPI_ALLOW_RUN_AS_ROOT=1",
      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
      // More ranks than cores is legitimate for tests and small machines.
      "OMPI_MCA_rmaps_base_oversubscribe=1",
      // Without these, glibc returns Open MPI's large temporary buffers to the
      // kernel after each collective and allreduce runs ~30x slower (DESIGN.md §6).
      "GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold="
      "4294967296",
  };
}

std::vector<std::string> launch_command(int nprocs, const std::vector<std::string>& command,
                                        const LaunchOptions& options) {
  KILN_CHECK(nprocs >= 1, ValueError, "kiln launch: expected -n N with N >= 1, got ", nprocs);
  KILN_CHECK(!command.empty(), ValueError, "kiln launch: expected a command after --, got none");
  std::vector<std::string> argv{options.mpirun, "-np", std::to_string(nprocs)};
  if (!options.hostfile.empty()) {
    KILN_CHECK(::access(options.hostfile.c_str(), R_OK) == 0, IOError, "kiln launch: cannot read hostfile '",
               options.hostfile, "': ", std::strerror(errno));
    argv.insert(argv.end(), {"--hostfile", options.hostfile});
  }
  for (const auto& kv : launch_environment()) argv.insert(argv.end(), {"-x", kv});
  // kiln's own settings travel to remote ranks too when the launcher has them.
  // (Unless options.env sets them: one -x per name, so which value wins is clear.)
  for (const char* name :
       {"KILN_DIST_DEBUG", "KILN_DIST_TIMEOUT", "KILN_DIST_PROGRESS", "KILN_DIST_SHM", "OMP_NUM_THREADS"}) {
    bool overridden = false;
    for (const auto& kv : options.env) overridden = overridden || kv.rfind(std::string(name) + "=", 0) == 0;
    if (std::getenv(name) && !overridden) argv.insert(argv.end(), {"-x", name});
  }
  for (const auto& kv : options.env) {
    KILN_CHECK(kv.find('=') != std::string::npos && kv.front() != '=', ValueError,
               "kiln launch: expected NAME=VALUE in env, got '", kv, "'");
    argv.insert(argv.end(), {"-x", kv});
  }
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

void detail::exec_with_launch_environment(const std::vector<std::string>& argv) {
  for (const auto& kv : launch_environment()) {
    const auto eq = kv.find('=');
    ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
  }
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  ::execvp(cargv[0], cargv.data());
}

void exec_launch(int nprocs, const std::vector<std::string>& command, const LaunchOptions& options) {
  detail::exec_with_launch_environment(launch_command(nprocs, command, options));
  throw IOError("kiln launch: cannot run '" + options.mpirun + "': " + std::strerror(errno) +
                " (install Open MPI: scripts/setup.sh installs openmpi-bin)");
}

}  // namespace kiln::dist
