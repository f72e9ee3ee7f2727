// Each rank's status record for `kiln launch` (see rank_status.h), and the
// launcher's reading of them after a failed job.
#include "rank_status.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "kiln/dist/dist.h"

namespace kiln::dist::detail {
namespace {

constexpr char kMagic[8] = "KILNRS1";
RankStatusRecord* g_rec = nullptr;
std::atomic<int64_t> g_pending_step{-1};  // a step set before init(): kept for the record

constexpr int kFatal[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kStop[] = {SIGTERM, SIGINT};
struct sigaction g_old_fatal[5], g_old_stop[2];

std::string record_path(const std::string& dir, int rank) { return dir + "/rank-" + std::to_string(rank); }

void copy_text(char* dst, size_t cap, const std::string& s) {
  const size_t n = std::min(s.size(), cap - 1);
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV (segmentation fault)";
    case SIGBUS: return "SIGBUS (bus error)";
    case SIGFPE: return "SIGFPE (arithmetic exception)";
    case SIGILL: return "SIGILL (illegal instruction)";
    case SIGABRT: return "SIGABRT (abort)";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGKILL: return "SIGKILL";
    default: return "a signal";
  }
}

// Async-signal-safe text building for the crash line.
struct SafeLine {
  char buf[512];
  size_t n = 0;
  void add(const char* s) {
    while (*s && n + 1 < sizeof buf) buf[n++] = *s++;
  }
  void add(int64_t v) {
    char tmp[24];
    int k = 0;
    const bool neg = v < 0;
    uint64_t u = neg ? static_cast<uint64_t>(-(v + 1)) + 1 : static_cast<uint64_t>(v);
    do {
      tmp[k++] = static_cast<char>('0' + u % 10);
      u /= 10;
    } while (u && k < 23);
    if (neg) add("-");
    while (k > 0 && n + 1 < sizeof buf) buf[n++] = tmp[--k];
  }
};

extern "C" void on_fatal_signal(int sig) {
  status_signal(sig);
  if (g_rec) {
    SafeLine l;
    l.add("kiln: rank ");
    l.add(static_cast<int64_t>(g_rec->rank));
    l.add(" died of ");
    l.add(signal_name(sig));
    if (g_rec->step >= 0) {
      l.add(" at step ");
      l.add(g_rec->step);
    }
    l.add(g_rec->in_collective ? ", in " : g_rec->op[0] ? ", computing after " : ", before any collective");
    l.add(g_rec->op);
    l.add("\n");
    ssize_t w = ::write(2, l.buf, l.n);
    (void)w;
  }
  // Hand the signal to whoever had it before (the default: die, with a core if enabled).
  for (size_t i = 0; i < std::size(kFatal); ++i) {
    if (kFatal[i] == sig) ::sigaction(sig, &g_old_fatal[i], nullptr);
  }
  ::raise(sig);
}

extern "C" void on_stop_signal_record(int sig) {
  status_signal(sig);
  for (size_t i = 0; i < std::size(kStop); ++i) {
    if (kStop[i] == sig) ::sigaction(sig, &g_old_stop[i], nullptr);
  }
  ::raise(sig);
}

void on_process_exit(int code, void*) { status_exit(code); }

}  // namespace

void open_rank_status(int rank) {
  const char* dir = std::getenv("KILN_LAUNCH_STATUS_DIR");
  if (g_rec || !dir || !*dir) return;
  // A rank on another machine has no such directory: it simply keeps no record.
  const int fd = ::open(record_path(dir, rank).c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  void* p = MAP_FAILED;
  if (::ftruncate(fd, sizeof(RankStatusRecord)) == 0) {
    p = ::mmap(nullptr, sizeof(RankStatusRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (p == MAP_FAILED) return;
  auto* rec = static_cast<RankStatusRecord*>(p);
  std::memset(rec, 0, sizeof *rec);
  rec->rank = rank;
  rec->pid = static_cast<int32_t>(::getpid());
  rec->step = g_pending_step.load();
  rec->state = RankState::Running;
  std::memcpy(rec->magic, kMagic, sizeof kMagic);
  g_rec = rec;
  struct sigaction sa {};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_NODEFER | SA_RESETHAND;
  for (size_t i = 0; i < std::size(kFatal); ++i) ::sigaction(kFatal[i], &sa, &g_old_fatal[i]);
  // Only where nobody handles them yet: the CLI's graceful stop records for itself (dist::record_signal).
  struct sigaction stop {};
  stop.sa_handler = on_stop_signal_record;
  sigemptyset(&stop.sa_mask);
  for (size_t i = 0; i < std::size(kStop); ++i) {
    struct sigaction cur {};
    ::sigaction(kStop[i], nullptr, &cur);
    if (cur.sa_handler == SIG_DFL) ::sigaction(kStop[i], &stop, &g_old_stop[i]);
  }
  ::on_exit(on_process_exit, nullptr);
}

bool rank_status_enabled() { return g_rec != nullptr; }

void status_collective(const std::string& describe, bool running) {
  if (!g_rec) return;
  if (running) copy_text(g_rec->op, sizeof g_rec->op, describe);
  g_rec->in_collective = running ? 1 : 0;
}

void status_exit(int code) {
  if (!g_rec || g_rec->state != RankState::Running) return;
  g_rec->exit_code = code;
  g_rec->state = RankState::Exited;
}

void status_failed(const std::string& why) {
  if (!g_rec) return;
  copy_text(g_rec->why, sizeof g_rec->why, why);
  g_rec->state = RankState::Failed;
}

void status_signal(int sig) {
  if (!g_rec || g_rec->state != RankState::Running) return;
  g_rec->signal = sig;
  g_rec->state = (sig == SIGTERM || sig == SIGINT) ? RankState::Signalled : RankState::Crashed;
}

std::string describe_job_end(const std::string& dir, int nprocs, int mpirun_status) {
  struct Seen {
    int rank;
    bool have = false;
    bool alive = false;
    RankStatusRecord rec{};
  };
  std::vector<Seen> seen;
  for (int r = 0; r < nprocs; ++r) {
    Seen s{r};
    if (FILE* f = std::fopen(record_path(dir, r).c_str(), "rb")) {
      s.have = std::fread(&s.rec, sizeof s.rec, 1, f) == 1 && std::memcmp(s.rec.magic, kMagic, sizeof kMagic) == 0;
      std::fclose(f);
      s.rec.op[sizeof s.rec.op - 1] = s.rec.why[sizeof s.rec.why - 1] = '\0';
      s.alive = s.have && s.rec.pid > 0 && (::kill(s.rec.pid, 0) == 0 || errno == EPERM);
    }
    seen.push_back(s);
  }
  auto where = [](const RankStatusRecord& rec) {
    std::string w = rec.step >= 0 ? " at step " + std::to_string(rec.step) : std::string();
    if (rec.in_collective)
      w += ", in " + std::string(rec.op);
    else if (rec.op[0])
      w += ", computing after " + std::string(rec.op);
    else
      w += ", before its first collective";
    return w;
  };
  auto explicit_failure = [](const Seen& s) {
    return s.have && (s.rec.state == RankState::Crashed || s.rec.state == RankState::Failed ||
                      (s.rec.state == RankState::Exited && s.rec.exit_code != 0));
  };
  auto silent_death = [](const Seen& s) { return s.have && s.rec.state == RankState::Running && !s.alive; };
  bool any_explicit = false;
  for (const auto& s : seen) any_explicit = any_explicit || explicit_failure(s);
  // A rank that says why it failed is the cause; one that vanished is the
  // cause only when nobody said anything (mpirun SIGKILLs the rest after a failure).
  auto is_failure = [&](const Seen& s) { return any_explicit ? explicit_failure(s) : silent_death(s); };
  auto line = [&](const Seen& s) {
    std::ostringstream os;
    os << "rank " << s.rank;
    if (!s.have) {
      os << ": no status record (it stopped before dist::init, runs on another machine, or is not a kiln program)";
      return os.str();
    }
    os << " (pid " << s.rec.pid << ")";
    switch (s.rec.state) {
      case RankState::Running:
        if (s.alive)
          os << " is still running";
        else if (any_explicit)
          os << " was ended without a word (mpirun kills the other ranks when one fails)";
        else
          os << " died without a word — killed by SIGKILL, most likely the kernel's out-of-memory killer "
                "(see `dmesg`) or a kill -9 —";
        break;
      case RankState::Crashed: os << " died of " << signal_name(s.rec.signal); break;
      case RankState::Failed: os << " failed: " << s.rec.why << ";"; break;
      case RankState::Signalled:
        os << " was stopped by " << signal_name(s.rec.signal) << " (mpirun stops the others when a rank fails)";
        break;
      case RankState::Exited: os << " exited with code " << s.rec.exit_code; break;
    }
    os << where(s.rec);
    return os.str();
  };
  std::vector<const Seen*> failed, others;
  for (const auto& s : seen) (is_failure(s) ? failed : others).push_back(&s);
  std::ostringstream os;
  if (failed.empty()) {
    if (mpirun_status == 0) return "";
    os << "kiln launch: the job ended with status " << mpirun_status << "; no rank recorded a failure of its own:\n";
  } else {
    os << "kiln launch: the job failed because ";
    for (size_t i = 0; i < failed.size(); ++i) os << (i ? "; and " : "") << line(*failed[i]);
    os << ".\n";
    if (!others.empty()) os << "The other ranks:\n";
  }
  for (const Seen* s : others) os << "  " << line(*s) << "\n";
  return os.str();
}

}  // namespace kiln::dist::detail

namespace kiln::dist {

void set_step(int64_t step) {
  detail::g_pending_step.store(step, std::memory_order_relaxed);
  if (detail::g_rec) detail::g_rec->step = step;
}

void record_signal(int sig) noexcept { detail::status_signal(sig); }

}  // namespace kiln::dist
