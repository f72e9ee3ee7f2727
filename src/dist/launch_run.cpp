// `kiln launch`: runs mpirun as a child, and when the job fails, says which
// rank died first, at which step and in which collective, from the records the
// ranks keep in a directory of the launcher's (rank_status.h). mpirun alone
// says only that "a process" ended, and nothing when a rank was SIGKILLed.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kiln/core/error.h"
#include "kiln/dist/launch.h"
#include "launch_exec.h"
#include "rank_status.h"

namespace kiln::dist {
namespace {

volatile sig_atomic_t g_child = 0;

// A SIGTERM for the launcher (a scheduler ending the job) is passed on to
// mpirun, which passes it to every rank. Ctrl-C reaches mpirun directly (same
// process group), so the launcher only has to survive it.
extern "C" void forward_to_child(int sig) {
  if (g_child > 0) ::kill(static_cast<pid_t>(g_child), sig);
}

}  // namespace

LaunchResult run_launch(int nprocs, const std::vector<std::string>& command, const LaunchOptions& options) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "kiln-launch-XXXXXX").string();
  KILN_CHECK(::mkdtemp(tmpl.data()) != nullptr, IOError, "kiln launch: cannot create a status directory from '", tmpl,
             "': ", std::strerror(errno));
  const std::string dir = tmpl;
  LaunchOptions opts = options;
  opts.env.push_back("KILN_LAUNCH_STATUS_DIR=" + dir);
  const auto argv = launch_command(nprocs, command, opts);

  const pid_t pid = ::fork();
  if (pid < 0) {
    std::filesystem::remove_all(dir);
    throw IOError(std::string("kiln launch: fork failed: ") + std::strerror(errno));
  }
  if (pid == 0) {
    detail::exec_with_launch_environment(argv);
    const std::string msg = "kiln launch: cannot run '" + options.mpirun + "': " + std::strerror(errno) +
                            " (install Open MPI: scripts/setup.sh installs openmpi-bin)\n";
    ssize_t w = ::write(2, msg.data(), msg.size());
    (void)w;
    ::_exit(127);
  }
  g_child = pid;
  struct sigaction fwd {
  }, ign{}, old_term{}, old_int{};
  fwd.sa_handler = forward_to_child;
  sigemptyset(&fwd.sa_mask);
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  ::sigaction(SIGTERM, &fwd, &old_term);
  ::sigaction(SIGINT, &ign, &old_int);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGINT, &old_int, nullptr);
  g_child = 0;

  LaunchResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (result.exit_code == 127 && WIFEXITED(status)) {
    std::filesystem::remove_all(dir);
    throw IOError("kiln launch: cannot run '" + options.mpirun +
                  "' (install Open MPI: scripts/setup.sh installs "
                  "openmpi-bin)");
  }
  result.report = detail::describe_job_end(dir, nprocs, result.exit_code);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return result;
}

}  // namespace kiln::dist
