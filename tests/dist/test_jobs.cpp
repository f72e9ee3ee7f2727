// Whole jobs that must fail loudly rather than hang: each case starts
// kiln_dist_child under mpirun (built with dist::launch_command), bounds the
// job's time with timeout(1), and checks the exit code and the report on
// stderr. Also the mpirun command line `kiln launch` runs. Run without mpirun
// (ctest dist_jobs).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/dist/launch.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

// Generous: jobs that work end in seconds; a hang would end here, with exit 137.
constexpr int kJobLimitS = 120;

int run_job(const std::string& mode, const std::vector<std::string>& env, std::string& out, int np = 2) {
  const auto argv = dist::launch_command(np, {KILN_DIST_CHILD, mode}, {.mpirun = KILN_MPIRUN, .env = env});
  std::string cmd = "env";
  auto add = [&](const std::string& word) {
    cmd += ' ';
    cmd += test::shell_quote(word);
  };
  for (const auto& kv : dist::launch_environment()) add(kv);
  for (const auto& w : {std::string("timeout"), std::string("-s"), std::string("KILL"), std::to_string(kJobLimitS)}) add(w);
  for (const auto& a : argv) add(a);
  return test::run_command(cmd, out);
}

bool has(const std::string& out, const std::string& s) { return out.find(s) != std::string::npos; }

TEST(DistJob, DebugModeRaisesASkippedCollectiveOnEveryRank) {
  std::string out;
  const int rc = run_job("skip-debug", {"KILN_DIST_DEBUG=1", "KILN_DIST_TIMEOUT=100"}, out);
  EXPECT_EQ(rc, 0) << out;  // the child returns 0 only when it caught the error
  for (const char* r : {"rank 0 raised: ", "rank 1 raised: "}) EXPECT_TRUE(has(out, r)) << r << "\n" << out;
  EXPECT_TRUE(has(out, "collective mismatch at collective number 3")) << out;
  EXPECT_TRUE(has(out, "   0 | #3 allreduce(sum) float32[1000] at tests/dist/child/dist_child.cpp:")) << out;
  EXPECT_TRUE(has(out, "   1 | #3 broadcast float32[10] root=0 at tests/dist/child/dist_child.cpp:")) << out;
  EXPECT_TRUE(has(out, "<-- differs from rank 0")) << out;
  EXPECT_FALSE(has(out, "no error raised")) << out;
}

// Debug mode compared element counts only: [3, 4] against [4, 3] passed.
TEST(DistJob, DebugModeComparesFullShapes) {
  std::string out;
  const int rc = run_job("transposed-debug", {"KILN_DIST_DEBUG=1", "KILN_DIST_TIMEOUT=100"}, out);
  EXPECT_EQ(rc, 0) << out;  // the child returns 0 only when it caught the error
  EXPECT_TRUE(has(out, "   0 | #3 allreduce(sum) float32[3, 4] at tests/dist/child/dist_child.cpp:")) << out;
  EXPECT_TRUE(has(out, "   1 | #3 allreduce(sum) float32[4, 3] at tests/dist/child/dist_child.cpp:")) << out;
  EXPECT_TRUE(has(out, "<-- differs from rank 0")) << out;
}

TEST(DistJob, WatchdogNamesTheCollectiveAndTheMissingRank) {
  std::string out;
  const int rc = run_job("skip-hang", {"KILN_DIST_TIMEOUT=3"}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln dist watchdog: rank 0 of 2 waited")) << out;
  EXPECT_TRUE(has(out, "(KILN_DIST_TIMEOUT=3) in #3 allreduce(sum) float32[1000] at tests/dist/child/dist_child.cpp:"))
      << out;
  EXPECT_TRUE(has(out, "ranks in this collective, number 3 of the group (#3 on this rank, counting send/recv): 0\n")) << out;
  EXPECT_TRUE(has(out, "ranks that had NOT reached it: 1\n")) << out;
  // Rank 1 answered on the watchdog's communicator: it had completed #2 and runs nothing.
  EXPECT_TRUE(has(out, "  1 | NO  | #2 / #2 | (idle)")) << out;
  EXPECT_TRUE(has(out, "last operations of rank 0 (oldest first):\n    #1 allreduce(sum) float32[16]")) << out;
  EXPECT_TRUE(has(out, "aborting the job (MPI_Abort)")) << out;
  EXPECT_TRUE(has(out, "set KILN_DIST_DEBUG=1 to check")) << out;
  EXPECT_FALSE(has(out, "finished, but the watchdog")) << out;
}

// The headline used to say "NOT reached it: none" here: rank 1 had started
// collective 3 too, only a barrier instead of the allreduce.
TEST(DistJob, WatchdogNamesARankInADifferentCollective) {
  std::string out;
  const int rc = run_job("barrier-vs-allreduce", {"KILN_DIST_TIMEOUT=3"}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "ranks in a DIFFERENT collective at the same position: rank 1 in #3 barrier at "
                       "tests/dist/child/dist_child.cpp:") ||
              has(out, "ranks in a DIFFERENT collective at the same position: rank 0 in #3 allreduce(sum) "
                       "float32[1000] at tests/dist/child/dist_child.cpp:"))
      << out;
  EXPECT_TRUE(has(out, "every rank must issue the same collectives in the same order")) << out;
  EXPECT_FALSE(has(out, "ranks that had NOT reached it: none\nranks")) << out;
}

// With debug mode on, the report does not advise turning it on.
TEST(DistJob, WatchdogDoesNotAdviseDebugModeWhenItIsOn) {
  std::string out;
  const int rc = run_job("skip-hang", {"KILN_DIST_TIMEOUT=3", "KILN_DIST_DEBUG=1"}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln dist watchdog: rank 0 of 2 waited")) << out;
  EXPECT_FALSE(has(out, "set KILN_DIST_DEBUG=1")) << out;
  EXPECT_TRUE(has(out, "KILN_DIST_DEBUG is on")) << out;
}

// The same in a subgroup of 4 ranks: the report names the group and shows
// group ranks with their world ranks.
TEST(DistJob, DebugModeNamesTheSubgroupOfAMismatch) {
  std::string out;
  const int rc = run_job("group-mismatch-debug", {"KILN_DIST_DEBUG=1", "KILN_DIST_TIMEOUT=100"}, out, 4);
  EXPECT_EQ(rc, 0) << out;  // members return 0 only when they caught the error
  for (const char* r : {"world rank 1 raised: ", "world rank 3 raised: "}) EXPECT_TRUE(has(out, r)) << r << "\n" << out;
  EXPECT_TRUE(has(out, "collective mismatch at collective number 3 of group [1, 3] (2 of 4 ranks) (KILN_DIST_DEBUG=1)"))
      << out;
  EXPECT_TRUE(has(out, "   0 (world 1) | #3 allreduce(sum) float32[1000] at tests/dist/child/dist_child.cpp:")) << out;
  EXPECT_TRUE(has(out, "   1 (world 3) | #3 broadcast float32[10] root=0 at tests/dist/child/dist_child.cpp:")) << out;
  EXPECT_FALSE(has(out, "no error raised")) << out;
}

TEST(DistJob, WatchdogNamesTheSubgroupAndItsMissingRank) {
  std::string out;
  const int rc = run_job("group-hang", {"KILN_DIST_TIMEOUT=3"}, out, 4);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln dist watchdog: rank 0 of group [1, 3] (2 of 4 ranks), world rank 1, waited")) << out;
  EXPECT_TRUE(has(out, "(KILN_DIST_TIMEOUT=3) in #3 allreduce(sum) float32[1000] at tests/dist/child/dist_child.cpp:"))
      << out;
  EXPECT_TRUE(has(out, "ranks in this collective, number 3 of group [1, 3] (2 of 4 ranks) (#3 on this rank, counting "
                       "send/recv): 0 (world 1)\n"))
      << out;
  EXPECT_TRUE(has(out, "ranks that had NOT reached it: 1 (world 3)\n")) << out;
  EXPECT_TRUE(has(out, "  1 (world 3) | NO  | #2 / #2 | (idle)")) << out;
  EXPECT_TRUE(has(out, "last operations of rank 0 (world 1) in group [1, 3] (2 of 4 ranks) (oldest first):\n"
                       "    #1 allreduce(sum) float32[16]"))
      << out;
  EXPECT_FALSE(has(out, "finished, but the watchdog")) << out;
}

// A DeviceMesh's groups carry their dimension's name into the report.
TEST(DistJob, WatchdogNamesTheMeshDimensionOfAStuckGroup) {
  std::string out;
  const int rc = run_job("mesh-hang", {"KILN_DIST_TIMEOUT=3"}, out, 4);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln dist watchdog: rank 0 of tp group [2, 3] (2 of 4 ranks), world rank 2, waited")) << out;
  EXPECT_TRUE(has(out, "ranks that had NOT reached it: 1 (world 3)\n")) << out;
  EXPECT_FALSE(has(out, "finished, but the watchdog")) << out;
}

TEST(DistJob, ARankThatThrowsEndsTheJob) {
  std::string out;
  const int rc = run_job("throw", {}, out);  // default timeout (300 s): the abort, not the watchdog, ends it
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln: rank 1 failed: deliberate failure on rank 1")) << out;
  EXPECT_FALSE(has(out, "watchdog")) << out;
}

TEST(DistJob, AnUncaughtExceptionEndsTheJob) {
  std::string out;
  const int rc = run_job("uncaught", {}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln: rank 1 failed: uncaught exception: deliberate failure on rank 1")) << out;
}

// `kiln launch` (dist::run_launch) names the rank that died, its step and
// collective, where mpirun alone says only that a process was killed.
TEST(DistJob, LaunchNamesARankKilledWithoutAWord) {
  const auto r = dist::run_launch(2, {KILN_DIST_CHILD, "sigkill"}, {.mpirun = KILN_MPIRUN});
  EXPECT_NE(r.exit_code, 0) << r.report;
  EXPECT_TRUE(has(r.report, "kiln launch: the job failed because rank 1 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "died without a word — killed by SIGKILL, most likely the kernel's out-of-memory "
                            "killer (see `dmesg`) or a kill -9 — at step 7, computing after #2 broadcast "
                            "float32[8] root=0 at tests/dist/child/dist_child.cpp:"))
      << r.report;
  EXPECT_TRUE(has(r.report, "The other ranks:\n  rank 0 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "at step 7, in #3 allreduce(sum) float32[1000]")) << r.report;
}

// A rank killed just before FSDP unit '1' all-gathers its parameters: the
// report names the dead rank and, for the rank left waiting, the unit and the
// collective it waited in.
TEST(DistJob, LaunchNamesTheFsdpUnitWhoseAllGatherARankNeverJoined) {
  const auto r = dist::run_launch(2, {KILN_DIST_CHILD, "fsdp-die"}, {.mpirun = KILN_MPIRUN});
  EXPECT_NE(r.exit_code, 0) << r.report;
  EXPECT_TRUE(has(r.report, "kiln launch: the job failed because rank 1 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "killed by SIGKILL")) << r.report;
  // Rank 0 waits in unit '1''s all-gather, which rank 1 never reached.
  EXPECT_TRUE(has(r.report, "The other ranks:\n  rank 0 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "at step 3, in #")) << r.report;
  EXPECT_TRUE(has(r.report, " allgather_into_tensor float32[36] at src/dist/fsdp.cpp:")) << r.report;
  EXPECT_TRUE(has(r.report, "(FSDP unit '1' over the world (2 ranks): parameter all-gather)")) << r.report;
}

// Issue 20: a pipeline stage that stalls is named by the watchdog of the stage
// waiting for it: stage, micro-batch and direction (1F1B, p = 2, M = 4: stage
// 1 stalls in micro-batch 2's forward, so stage 0 waits for micro-batch 2's
// gradients).
TEST(DistJob, WatchdogNamesTheStalledPipelineStage) {
  std::string out;
  const int rc = run_job("pipeline-stall", {"KILN_DIST_TIMEOUT=3"}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "kiln dist watchdog: rank 0 of group [0, 1] (2 of 2 ranks), world rank 0, waited")) << out;
  EXPECT_TRUE(has(out, " recv int64[12] from=1 at src/parallel/pipeline.cpp:")) << out;
  EXPECT_TRUE(has(out, "(pipeline stage 0, micro-batch 2, gradients backward (recv from stage 1))")) << out;
  EXPECT_FALSE(has(out, "should have stalled")) << out;
}

// A pipeline stage that dies: `kiln launch` names it, and the stage left
// waiting says for what (GPipe, p = 2, M = 4: stage 0 dies in micro-batch 2's
// forward, so stage 1 waits for its activations).
TEST(DistJob, LaunchNamesThePipelineStageThatNeverSent) {
  const auto r = dist::run_launch(2, {KILN_DIST_CHILD, "pipeline-die"}, {.mpirun = KILN_MPIRUN});
  EXPECT_NE(r.exit_code, 0) << r.report;
  EXPECT_TRUE(has(r.report, "kiln launch: the job failed because rank 0 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "killed by SIGKILL")) << r.report;
  EXPECT_TRUE(has(r.report, "  rank 1 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "at step 3, in #")) << r.report;
  EXPECT_TRUE(has(r.report, " recv int64[12] from=0 at src/parallel/pipeline.cpp:")) << r.report;
  EXPECT_TRUE(has(r.report, "(pipeline stage 1, micro-batch 2, activations forward (recv from stage 0))")) << r.report;
}

TEST(DistJob, LaunchNamesARankThatCrashed) {
  testing::internal::CaptureStderr();
  const auto r = dist::run_launch(2, {KILN_DIST_CHILD, "sigsegv"}, {.mpirun = KILN_MPIRUN});
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(r.exit_code, 0) << r.report;
  EXPECT_TRUE(has(r.report, "kiln launch: the job failed because rank 1 (pid ")) << r.report;
  EXPECT_TRUE(has(r.report, "died of SIGSEGV (segmentation fault) at step 7, computing after #2 broadcast")) << r.report;
  // The rank says so itself, too, on its way out.
  EXPECT_TRUE(has(err, "kiln: rank 1 died of SIGSEGV (segmentation fault) at step 7, computing after #2 broadcast"))
      << err;
}

TEST(DistJob, LaunchOfAJobThatSucceedsReportsNothing) {
  const auto r = dist::run_launch(2, {KILN_DIST_CHILD, "bw", "1", "2"}, {.mpirun = KILN_MPIRUN});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.report, "");
}

TEST(DistJob, DebugModeMustBeOnForEveryRankOrNone) {
  std::string out;
  const int rc = run_job("debug-on-rank-0", {}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "KILN_DIST_DEBUG must be set alike on every rank, but some ranks have it on and some off"))
      << out;
}

TEST(DistJob, SharedMemoryAllreduceMustBeAlikeOnEveryRank) {
  std::string out;
  const int rc = run_job("shm-off-on-rank-0", {}, out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 137) << "the job hung until timeout(1) killed it:\n" << out;
  EXPECT_TRUE(has(out, "KILN_DIST_SHM must be set alike on every rank")) << out;
}

TEST(DistLaunch, BuildsTheMpirunCommandLine) {
  const auto argv = dist::launch_command(4, {"kiln", "train", "cfg.toml"}, {.env = {"FOO=bar baz"}});
  std::vector<std::string> want{"mpirun", "-np", "4",
                                "-x", "OMPI_ALLOW_RUN_AS_ROOT=1",
                                "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                "-x", "OMPI_MCA_rmaps_base_oversubscribe=1",
                                "-x", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4294967296:"
                                      "glibc.malloc.trim_threshold=4294967296"};
  // ctest sets OMP_NUM_THREADS and KILN_DIST_TIMEOUT: they are forwarded by name.
  for (const char* name :
       {"KILN_DIST_DEBUG", "KILN_DIST_TIMEOUT", "KILN_DIST_PROGRESS", "KILN_DIST_SHM", "OMP_NUM_THREADS"}) {
    if (std::getenv(name)) want.insert(want.end(), {"-x", name});
  }
  want.insert(want.end(), {"-x", "FOO=bar baz", "kiln", "train", "cfg.toml"});
  EXPECT_EQ(argv, want);
}

TEST(DistLaunch, HostfileAndBadArguments) {
  test::TempDir dir;
  const auto hosts = dir.file("hosts");
  std::ofstream(hosts) << "node1 slots=2\nnode2 slots=2\n";
  const auto argv = dist::launch_command(4, {"kiln"}, {.hostfile = hosts, .mpirun = "/opt/ompi/bin/mpirun"});
  ASSERT_GE(argv.size(), 6u);
  EXPECT_EQ(argv[0], "/opt/ompi/bin/mpirun");
  EXPECT_EQ(argv[3], "--hostfile");
  EXPECT_EQ(argv[4], hosts);
  EXPECT_EQ(argv.back(), "kiln");
  try {
    dist::launch_command(2, {"kiln"}, {.hostfile = dir.file("missing")});
    FAIL() << "expected an IOError";
  } catch (const IOError& e) {
    EXPECT_TRUE(has(e.what(), "cannot read hostfile '" + dir.file("missing") + "'")) << e.what();
  }
  // A variable given in env is not also forwarded from the launcher's environment.
  ::setenv("KILN_DIST_TIMEOUT", "120", 1);
  const auto own = dist::launch_command(2, {"kiln"}, {.env = {"KILN_DIST_TIMEOUT=3"}});
  EXPECT_EQ(std::count(own.begin(), own.end(), "KILN_DIST_TIMEOUT"), 0);
  EXPECT_EQ(std::count(own.begin(), own.end(), "KILN_DIST_TIMEOUT=3"), 1);
  EXPECT_THROW(dist::launch_command(0, {"kiln"}), ValueError);
  EXPECT_THROW(dist::launch_command(2, {}), ValueError);
  EXPECT_THROW(dist::launch_command(2, {"kiln"}, {.env = {"NOEQUALS"}}), ValueError);
}

// What `kiln launch -n 2 -- kiln_dist_child bw 1 2` does: exec mpirun with the
// environment set by exec_launch itself (the test's own run-as-root variables
// are removed first), in a forked child whose time this test bounds.
TEST(DistLaunch, ExecLaunchRunsAJob) {
  test::TempDir dir;
  const auto log = dir.file("out.txt");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    for (const char* v : {"OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_MCA_rmaps_base_oversubscribe"}) {
      ::unsetenv(v);
    }
    try {
      dist::exec_launch(2, {KILN_DIST_CHILD, "bw", "1", "2"}, {.mpirun = KILN_MPIRUN});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "exec_launch threw: %s\n", e.what());
    }
    std::_Exit(99);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kJobLimitS);
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  const std::string out = test::read_file(log);
  ASSERT_NE(done, 0) << "the launched job hung:\n" << out;
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_TRUE(has(out, "allreduce float32 1.0 MB, 2 ranks: ")) << out;
}

}  // namespace
