// Checkpoints across processes, with the child program ckpt_child (see
// tests/train/ckpt_child/): 2N steps straight equal N steps, save, exit, and N
// more in a fresh process that resumes from the directory, bitwise (per-step
// losses as %a text, final parameters); and a child saving every step, killed
// with SIGKILL at random moments, always leaves a checkpoint that loads (with
// no fallback needed) and trains on, and never a temporary file in list().
#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "kiln/io/safetensors.h"
#include "kiln/train/checkpoint.h"
#include "train/ckpt_child/ckpt_rig.h"
#include "support/test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

// Every child runs with the same thread count: bitwise equality is promised per thread count.
constexpr const char* kThreads = "OMP_NUM_THREADS=2";

std::string child_command(const std::vector<std::string>& args) {
  std::string cmd = std::string(kThreads) + " " + test::shell_quote(KILN_CKPT_CHILD);
  for (const auto& a : args) {
    cmd += ' ';
    cmd += test::shell_quote(a);
  }
  return cmd;
}

// Runs the child; returns its "loss ..." lines. Fails the test if it fails.
std::vector<std::string> run_child(const std::vector<std::string>& args, std::string* all = nullptr) {
  std::string out;
  const int rc = test::run_command(child_command(args), out);
  EXPECT_EQ(rc, 0) << child_command(args) << ":\n" << out;
  std::vector<std::string> losses;
  std::istringstream is(out);
  for (std::string line; std::getline(is, line);)
    if (line.rfind("loss ", 0) == 0) losses.push_back(line);
  if (all) *all = out;
  return losses;
}

TEST(CheckpointProcess, ResumeInAFreshProcessIsBitwiseIdentical) {
  test::TempDir tmp;
  const int n = 7;  // 5 batches an epoch: the resume point is epoch 1, batch 2
  const std::string straight = tmp.file("straight.safetensors"), resumed = tmp.file("resumed.safetensors");
  const std::string dir = tmp.file("run");
  const std::vector<std::string> want = run_child({"straight", std::to_string(2 * n), straight});
  std::vector<std::string> got = run_child({"first", std::to_string(n), dir});
  ASSERT_EQ(got.size(), static_cast<size_t>(n));

  // The saved state is mid-epoch.
  const auto latest = train::CheckpointManager(dir).latest();
  ASSERT_TRUE(latest.has_value());
  const io::SafetensorsHeader h = io::read_safetensors_header(latest->string());
  EXPECT_EQ(h.metadata.at("loader.epoch"), "1");
  EXPECT_EQ(h.metadata.at("loader.position"), "2");
  EXPECT_EQ(h.metadata.at("step"), std::to_string(n));

  std::string out;
  const std::vector<std::string> rest = run_child({"resume", std::to_string(n), dir, resumed}, &out);
  EXPECT_NE(out.find("resumed 7\n"), std::string::npos) << out;
  got.insert(got.end(), rest.begin(), rest.end());
  ASSERT_EQ(want.size(), static_cast<size_t>(2 * n));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;

  const io::SafetensorsFile a = io::load_safetensors(straight), b = io::load_safetensors(resumed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first);
    EXPECT_TRUE(test::bitwise_equal(a.tensors[i].second, b.tensors[i].second)) << a.tensors[i].first;
  }
}

// fork + exec of `ckpt_child loop dir`, stdout to /dev/null; everything exec needs is built before fork.
pid_t spawn_loop(const std::string& dir) {
  const std::string exe = KILN_CKPT_CHILD;
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e)
    if (std::string(*e).rfind("OMP_NUM_THREADS=", 0) != 0) env_s.emplace_back(*e);
  env_s.emplace_back(kThreads);
  std::vector<char*> envp, argv;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string a0 = exe, a1 = "loop", a2 = dir;
  argv = {a0.data(), a1.data(), a2.data(), nullptr};
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, 1);
    ::execve(exe.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

TEST(CheckpointProcess, SigkillAtRandomMomentsAlwaysLeavesALoadableCheckpoint) {
  test::TempDir tmp;
  const std::string dir = tmp.file("run");
  run_child({"first", "1", dir});  // so that there is a checkpoint before the first kill
  const std::regex final_name(R"(ckpt-\d{8,}\.safetensors)");
  std::mt19937 rng(20261129);
  std::uniform_int_distribution<int> delay_ms(5, 250);
  int64_t last_step = 1;
  int mid_write = 0;
  for (int kill_no = 0; kill_no < 12; ++kill_no) {
    const pid_t pid = spawn_loop(dir);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "kill " << kill_no << ": the child ended by itself (status " << status << ") instead of being killed";

    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().find(".tmp.") != std::string::npos) ++mid_write;
    train::CheckpointManager m(dir);
    const std::vector<fs::path> listed = m.list();
    ASSERT_FALSE(listed.empty()) << "kill " << kill_no;
    for (const auto& p : listed)
      EXPECT_TRUE(std::regex_match(p.filename().string(), final_name)) << "kill " << kill_no << ": listed " << p;
    ASSERT_TRUE(m.latest().has_value()) << "kill " << kill_no;

    ckpt_test::Rig rig;
    testing::internal::CaptureStderr();
    const train::CheckpointInfo info = m.load_latest(rig.refs());
    // `latest` must name a complete, valid file after any kill: no fallback, nothing said.
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "") << "kill " << kill_no;
    EXPECT_GE(info.step, last_step) << "kill " << kill_no;
    last_step = info.step;
    rig.resume(info);
    const float loss = rig.train_step();
    EXPECT_TRUE(std::isfinite(loss)) << "kill " << kill_no;
    EXPECT_EQ(rig.step, info.step + 1);
  }
  std::printf("[ info ] 12 kills, reached step %lld, %d of them left a temporary file behind\n",
              static_cast<long long>(last_step), mid_write);
}

}  // namespace
}  // namespace kiln
