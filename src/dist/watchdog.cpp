// The watchdog of an MPI process group. It times the collective the
// communication thread is running; past KILN_DIST_TIMEOUT it asks every peer,
// on its own communicator (usable while the stuck one is not), how far it has
// got, prints which ranks reached the collective and which did not, with this
// rank's last few operations, and aborts the job instead of hanging. Between
// checks it answers the same question from peers that time out.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <sstream>
#include <thread>
#include <vector>

#include "mpi_process_group.h"
#include "rank_status.h"

namespace kiln::dist::detail {
namespace {

constexpr int kTagQuery = 1;
constexpr int kTagAnswer = 2;
// How long a timed-out rank waits for its peers' answers before reporting without them.
constexpr double kAnswerWaitS = 5.0;

}  // namespace

void MPIProcessGroup::serve_queries() {
  for (;;) {
    if (query_req_ == MPI_REQUEST_NULL) {
      MPI_Irecv(&query_buf_, 1, MPI_INT, MPI_ANY_SOURCE, kTagQuery, watch_, &query_req_);
    }
    int flag = 0;
    MPI_Status st;
    MPI_Test(&query_req_, &flag, &st);
    if (!flag) return;
    Progress p;
    {
      std::lock_guard lock(state_mu_);
      p = progress_;
    }
    MPI_Send(&p, sizeof p, MPI_BYTE, st.MPI_SOURCE, kTagAnswer, watch_);
  }
}

void MPIProcessGroup::watchdog_loop() {
  using clock = std::chrono::steady_clock;
  while (!watch_stop_) {
    serve_queries();
    Signature stuck;
    double waited = 0;
    {
      std::lock_guard lock(state_mu_);
      if (progress_.in_flight) {
        waited = std::chrono::duration<double>(clock::now() - started_at_).count();
        stuck = progress_.current;
      }
    }
    if (timeout_s_ > 0 && waited > timeout_s_) report_timeout(stuck, waited);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (query_req_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&query_req_);
    MPI_Wait(&query_req_, MPI_STATUS_IGNORE);
  }
}

void MPIProcessGroup::report_timeout(const Signature& stuck, double seconds) {
  using clock = std::chrono::steady_clock;
  // Ask every peer for its progress; keep answering theirs meanwhile, since
  // they may be timing out too.
  std::vector<Progress> answers(static_cast<size_t>(size_));
  std::vector<MPI_Request> reqs;
  std::vector<int> peers;
  int query = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request rq;
    MPI_Irecv(&answers[static_cast<size_t>(r)], sizeof(Progress), MPI_BYTE, r, kTagAnswer, watch_, &rq);
    reqs.push_back(rq);
    peers.push_back(r);
    MPI_Request sq;
    MPI_Isend(&query, 1, MPI_INT, r, kTagQuery, watch_, &sq);
    MPI_Request_free(&sq);
  }
  std::vector<bool> answered(static_cast<size_t>(size_), false);
  const auto deadline = clock::now() + std::chrono::duration<double>(kAnswerWaitS);
  size_t pending = reqs.size();
  while (pending > 0 && clock::now() < deadline) {
    serve_queries();
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
      if (flag) {
        answered[static_cast<size_t>(peers[i])] = true;
        --pending;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  Progress mine;
  std::deque<Signature> history;
  {
    std::lock_guard lock(state_mu_);
    mine = progress_;
    history = history_;
  }
  std::ostringstream os;
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", seconds);
  // The world keeps its short headline; a subgroup says which group and which world rank.
  const std::string where = is_world_ ? "rank " + std::to_string(rank_) + " of " + std::to_string(size_)
                                      : "rank " + std::to_string(rank_) + " of " + name_ + ", world rank " +
                                            std::to_string(world_ranks_[static_cast<size_t>(rank_)]) + ",";
  os << "\nkiln dist watchdog: " << where << " waited " << secs << " s (KILN_DIST_TIMEOUT=" << timeout_s_ << ") in "
     << stuck.describe() << "\n";
  // A rank that started collective number coll_no may be in the same call
  // (then it is stuck inside it too) or in another one at that position (a
  // barrier where this rank does an allreduce): the mismatch is the bug.
  std::vector<int> reached, elsewhere, missing;
  std::vector<std::string> elsewhere_what;
  std::ostringstream table;
  table << "  rank | reached | last started / last completed (sequence numbers) | running\n";
  for (int r = 0; r < size_; ++r) {
    const Progress& p = r == rank_ ? mine : answers[static_cast<size_t>(r)];
    if (r != rank_ && !answered[static_cast<size_t>(r)]) {
      table << "  " << who(r) << " | ?   | no answer within " << kAnswerWaitS
            << " s (finished and in MPI_Finalize, or its process is stuck outside kiln)\n";
      missing.push_back(r);
      continue;
    }
    // Send/recv are counted apart from collectives (only some ranks take part),
    // so whether a rank reached this collective is judged by its collective count.
    const bool got_there = stuck.coll_no == 0 ? (r == rank_) : p.colls_started >= stuck.coll_no;
    const bool other_call =
        got_there && r != rank_ && p.in_flight && p.current.coll_no == stuck.coll_no && !p.current.same_call(stuck);
    const char* mark = !got_there ? "NO " : other_call ? "ELSEWHERE" : "yes";
    if (!got_there) {
      missing.push_back(r);
    } else if (other_call) {
      elsewhere.push_back(r);
      elsewhere_what.push_back(p.current.describe());
    } else {
      reached.push_back(r);
    }
    table << "  " << who(r) << " | " << mark << " | #" << p.started_seq << " / #" << p.completed_seq << " | "
          << (p.in_flight ? p.current.describe() : std::string("(idle)")) << "\n";
  }
  auto list = [this](const std::vector<int>& v) {
    std::string s;
    for (int r : v) s += (s.empty() ? "" : ", ") + who(r);
    return s.empty() ? std::string("none") : s;
  };
  if (stuck.coll_no != 0) {
    os << "ranks in this collective, number " << stuck.coll_no << " of " << (is_world_ ? "the group" : name_) << " (#"
       << stuck.seq << " on this rank, counting send/recv): " << list(reached) << "\n";
    if (!elsewhere.empty()) {
      os << "ranks in a DIFFERENT collective at the same position:";
      for (size_t i = 0; i < elsewhere.size(); ++i)
        os << (i ? ";" : "") << " rank " << who(elsewhere[i]) << " in " << elsewhere_what[i];
      os << "\n";
    }
    os << "ranks that had NOT reached it: " << list(missing) << "\n";
  }
  os << table.str() << "last operations of rank " << who(rank_) << (is_world_ ? "" : " in " + name_)
     << " (oldest first):\n";
  for (const auto& s : history) os << "    " << s.describe() << "\n";
  os << "aborting the job (MPI_Abort) so that it does not hang";
  if (!elsewhere.empty()) {
    os << "; every rank must issue the same collectives in the same order: look at the call sites above";
  } else if (!debug_) {
    os << "; set KILN_DIST_DEBUG=1 to check every collective's signature across ranks";
  } else {
    os << " (KILN_DIST_DEBUG is on and found no mismatch before this collective: a rank is stuck in its own "
          "code, or inside this collective)";
  }
  os << "\n";
  status_failed(std::string("the watchdog ended the job: waited ") + secs + " s in " + stuck.describe() +
                (is_world_ ? "" : " of " + name_));
  const std::string text = os.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

}  // namespace kiln::dist::detail
