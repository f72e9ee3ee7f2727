// dist::init / world / run_or_abort: MPI's lifetime in a kiln process.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>

#include "kiln/core/error.h"
#include "kiln/dist/dist.h"
#include "mpi_process_group.h"
#include "rank_status.h"

namespace kiln::dist {
namespace {

std::mutex g_mu;
std::shared_ptr<detail::MPIProcessGroup> g_world;
bool g_we_initialised = false;

void finalize_at_exit() {
  std::shared_ptr<detail::MPIProcessGroup> w;
  {
    std::lock_guard lock(g_mu);
    w = std::move(g_world);
  }
  // Subgroups first: their threads must stop before MPI_Finalize too.
  detail::shutdown_groups();
  if (w) w->shutdown();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && g_we_initialised) MPI_Finalize();
}

int world_rank_or_minus_one() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return -1;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// An exception nobody caught, on any thread: end the job rather than leave
// the other ranks waiting in their next collective.
void on_terminate() {
  std::string what = "std::terminate called without an active exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = std::string("uncaught exception: ") + ex.what();
    } catch (...) {
      what = "uncaught exception of a type not derived from std::exception";
    }
  }
  abort_job(what, 1);
}

}  // namespace

bool launched_by_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

void init() {
  std::lock_guard lock(g_mu);
  if (g_world) return;
  int already = 0;
  MPI_Initialized(&already);
  int provided = 0;
  if (!already) {
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    g_we_initialised = true;
  } else {
    MPI_Query_thread(&provided);
  }
  KILN_CHECK(provided >= MPI_THREAD_MULTIPLE, DistributedError,
             "dist::init: kiln's MPI backend needs MPI_THREAD_MULTIPLE (a communication thread and a watchdog call MPI "
             "beside the caller), but this MPI provides level ",
             provided, "; use Open MPI built with thread support (Debian's openmpi-bin is)");
  static bool registered = false;
  if (!registered) {
    std::atexit(finalize_at_exit);
    std::set_terminate(on_terminate);
    registered = true;
  }
  g_world = std::make_shared<detail::MPIProcessGroup>(MPI_COMM_WORLD);
  detail::open_rank_status(g_world->rank());
}

bool is_initialized() {
  std::lock_guard lock(g_mu);
  return g_world != nullptr;
}

ProcessGroupPtr world() {
  std::lock_guard lock(g_mu);
  KILN_CHECK(g_world, DistributedError, "dist::world(): call dist::init() first (MPI is not initialised)");
  return g_world;
}

int rank() { return world()->rank(); }
int world_size() { return world()->size(); }

int local_rank() {
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) return std::atoi(s);
  // Another launcher: the rank among the processes that share this machine's memory.
  static const int from_mpi = [] {
    if (world_rank_or_minus_one() < 0) return 0;
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int r = 0;
    MPI_Comm_rank(node, &r);
    MPI_Comm_free(&node);
    return r;
  }();
  return from_mpi;
}

void abort_job(const std::string& why, int code) {
  const int r = world_rank_or_minus_one();
  const std::string text =
      r >= 0 ? "kiln: rank " + std::to_string(r) + " failed: " + why + "\nkiln: aborting the job (MPI_Abort)\n"
             : "kiln: failed: " + why + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  detail::status_failed(why);
  if (r >= 0) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

int run_or_abort(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    abort_job(e.what(), 1);
  } catch (...) {
    abort_job("an exception of a type not derived from std::exception", 1);
  }
  return 0;
}

}  // namespace kiln::dist
