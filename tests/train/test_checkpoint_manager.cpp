// CheckpointManager: file naming, the `latest` pointer, pruning to keep_last
// (never what `latest` names), falling back past a damaged pointer or file to
// the newest good checkpoint (and saying so), removing a dead writer's
// temporary files, and a clear error when nothing loads.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"
#include "kiln/train/checkpoint.h"
#include "support/test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using train::CheckpointManager;

struct Rig {
  std::shared_ptr<nn::Linear> model;
  std::unique_ptr<optim::SGD> opt;
  train::CheckpointRefs refs() { return {.model = model.get(), .optimizer = opt.get(), .scheduler = nullptr}; }
};

Rig make_rig(uint64_t seed) {
  manual_seed(seed);
  Rig r;
  r.model = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 4, .out_features = 3});
  r.opt = std::make_unique<optim::SGD>(r.model->named_parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  return r;
}

// Saves checkpoints for `steps`, each with distinct weights (the weight filled with the step).
void save_steps(CheckpointManager& m, Rig& r, std::initializer_list<int64_t> steps) {
  for (int64_t s : steps) {
    r.model->weight.detach().fill_(static_cast<double>(s));
    m.save(r.refs(), {.step = s, .loader = std::nullopt, .config = "step " + std::to_string(s)});
  }
}

std::vector<std::string> names(const std::vector<fs::path>& ps) {
  std::vector<std::string> out;
  for (const auto& p : ps) out.push_back(p.filename().string());
  return out;
}

std::string pointer(const fs::path& dir) { return test::read_file((dir / "latest").string()); }

void flip_byte_in_data(const fs::path& p) {
  const io::SafetensorsHeader h = io::read_safetensors_header(p.string());
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  const auto at = static_cast<std::streamoff>(h.data_start + h.data_size / 2);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x01);
  f.seekp(at);
  f.write(&c, 1);
}

float weight0(const Rig& r) { return r.model->weight.detach().contiguous().data_ptr<float>()[0]; }

TEST(CheckpointManager, SaveNamesByStepPointsLatestAndKeepsTheLastK) {
  test::TempDir tmp;
  const fs::path dir = tmp.path() / "run";  // created by the manager
  CheckpointManager m(dir, {.keep_last = 3});
  Rig r = make_rig(1);
  EXPECT_FALSE(m.latest().has_value());
  EXPECT_TRUE(m.list().empty());
  const fs::path p = m.save(r.refs(), {.step = 7, .loader = std::nullopt, .config = ""});
  EXPECT_EQ(p, dir / "ckpt-00000007.safetensors");
  EXPECT_EQ(pointer(dir), "ckpt-00000007.safetensors\n");
  save_steps(m, r, {8, 9, 10, 123456789});
  EXPECT_EQ(names(m.list()), (std::vector<std::string>{"ckpt-00000009.safetensors", "ckpt-00000010.safetensors",
                                                         "ckpt-123456789.safetensors"}));
  EXPECT_EQ(m.latest(), dir / "ckpt-123456789.safetensors");
  EXPECT_EQ(pointer(dir), "ckpt-123456789.safetensors\n");
  EXPECT_FALSE(fs::exists(dir / "ckpt-00000007.safetensors"));
}

TEST(CheckpointManager, LoadLatestRestoresTheNewestState) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path(), {.keep_last = 2});
  Rig r = make_rig(1);
  save_steps(m, r, {1, 2, 3});
  Rig fresh = make_rig(2);
  testing::internal::CaptureStderr();
  const train::CheckpointInfo info = CheckpointManager(tmp.path()).load_latest(fresh.refs());
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");  // nothing to say when `latest` is good
  EXPECT_EQ(info.step, 3);
  EXPECT_EQ(info.config, "step 3");
  EXPECT_EQ(weight0(fresh), 3.0f);
}

TEST(CheckpointManager, PruningNeverDeletesWhatLatestNames) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path(), {.keep_last = 2});
  Rig r = make_rig(1);
  save_steps(m, r, {10, 11, 12});
  save_steps(m, r, {2});  // an older step saved last (a run restarted from an early checkpoint)
  EXPECT_EQ(names(m.list()), (std::vector<std::string>{"ckpt-00000002.safetensors", "ckpt-00000011.safetensors",
                                                         "ckpt-00000012.safetensors"}));
  EXPECT_EQ(m.latest(), tmp.path() / "ckpt-00000002.safetensors");
  Rig fresh = make_rig(2);
  EXPECT_EQ(m.load_latest(fresh.refs()).step, 2);
}

TEST(CheckpointManager, CorruptedLatestFileFallsBackToTheNewestGoodOneAndSaysSo) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path(), {.keep_last = 3});
  Rig r = make_rig(1);
  save_steps(m, r, {1, 2, 3});
  flip_byte_in_data(tmp.path() / "ckpt-00000003.safetensors");
  // The header is intact, so latest() (headers only) still names it; load_latest verifies the checksum.
  EXPECT_EQ(m.latest(), tmp.path() / "ckpt-00000003.safetensors");
  Rig fresh = make_rig(2);
  testing::internal::CaptureStderr();
  const train::CheckpointInfo info = m.load_latest(fresh.refs());
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(info.step, 2);
  EXPECT_EQ(weight0(fresh), 2.0f);
  EXPECT_NE(err.find("ckpt-00000003.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find("ckpt-00000002.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find("checksum"), std::string::npos) << err;
}

TEST(CheckpointManager, TruncatedLatestFileFallsBack) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path());
  Rig r = make_rig(1);
  save_steps(m, r, {4, 5});
  fs::resize_file(tmp.path() / "ckpt-00000005.safetensors", 100);
  EXPECT_EQ(m.latest(), tmp.path() / "ckpt-00000004.safetensors");
  Rig fresh = make_rig(2);
  testing::internal::CaptureStderr();
  EXPECT_EQ(m.load_latest(fresh.refs()).step, 4);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("ckpt-00000005.safetensors"), std::string::npos) << err;
}

TEST(CheckpointManager, MissingOrGarbledPointerFallsBackToTheNewestFile) {
  for (const char* content : std::initializer_list<const char*>{"", "garbage\n", "../ckpt-00000001.safetensors\n", "ckpt-00000099.safetensors\n", nullptr}) {
    test::TempDir tmp;
    CheckpointManager m(tmp.path());
    Rig r = make_rig(1);
    save_steps(m, r, {1, 2});
    if (content)
      std::ofstream(tmp.path() / "latest", std::ios::binary | std::ios::trunc) << content;
    else
      fs::remove(tmp.path() / "latest");
    const std::string label = content ? content : "(removed)";
    EXPECT_EQ(m.latest(), tmp.path() / "ckpt-00000002.safetensors") << label;
    Rig fresh = make_rig(2);
    testing::internal::CaptureStderr();
    EXPECT_EQ(m.load_latest(fresh.refs()).step, 2) << label;
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("latest"), std::string::npos) << label << ": " << err;
    EXPECT_NE(err.find("ckpt-00000002.safetensors"), std::string::npos) << label << ": " << err;
  }
}

TEST(CheckpointManager, NothingToLoadIsAClearIOError) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path());
  Rig r = make_rig(1);
  try {
    m.load_latest(r.refs());
    FAIL() << "expected IOError";
  } catch (const IOError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(tmp.path().string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("no checkpoint"), std::string::npos) << msg;
  }
  // Every file damaged: the error lists each.
  save_steps(m, r, {1, 2});
  flip_byte_in_data(tmp.path() / "ckpt-00000001.safetensors");
  flip_byte_in_data(tmp.path() / "ckpt-00000002.safetensors");
  try {
    m.load_latest(r.refs());
    FAIL() << "expected IOError";
  } catch (const IOError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("ckpt-00000001.safetensors: checksum"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ckpt-00000002.safetensors: checksum"), std::string::npos) << msg;
  }
}

TEST(CheckpointManager, AMismatchedModelIsReportedNotSkipped) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path());
  Rig r = make_rig(1);
  save_steps(m, r, {1, 2});
  auto other = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 5, .out_features = 3});
  testing::internal::CaptureStderr();
  EXPECT_THROW(m.load_latest({.model = other.get(), .optimizer = nullptr, .scheduler = nullptr}), ValueError);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(CheckpointManager, SaveRemovesADeadWritersTemporaryFilesButNotALiveOnes) {
  test::TempDir tmp;
  CheckpointManager m(tmp.path());
  Rig r = make_rig(1);
  save_steps(m, r, {1});
  const std::string dead = std::to_string(dead_pid()), live = std::to_string(::getppid());
  const std::vector<std::string> stale = {"ckpt-00000002.safetensors.tmp." + dead, "latest.tmp." + dead};
  const std::vector<std::string> kept = {"ckpt-00000003.safetensors.tmp." + live, "notes.tmp." + dead};
  for (const auto& n : stale) std::ofstream(tmp.path() / n) << "partial";
  for (const auto& n : kept) std::ofstream(tmp.path() / n) << "partial";
  EXPECT_EQ(names(m.list()), std::vector<std::string>{"ckpt-00000001.safetensors"});  // never a temp file
  save_steps(m, r, {4});
  for (const auto& n : stale) EXPECT_FALSE(fs::exists(tmp.path() / n)) << n;
  for (const auto& n : kept) EXPECT_TRUE(fs::exists(tmp.path() / n)) << n;
  EXPECT_EQ(names(m.list()), (std::vector<std::string>{"ckpt-00000001.safetensors", "ckpt-00000004.safetensors"}));
}

TEST(CheckpointManager, RejectsBadOptionsAndSteps) {
  test::TempDir tmp;
  EXPECT_THROW(CheckpointManager(tmp.path(), {.keep_last = 0}), ValueError);
  std::ofstream(tmp.path() / "afile") << "x";
  EXPECT_THROW(CheckpointManager(tmp.path() / "afile"), IOError);
  CheckpointManager m(tmp.path());
  Rig r = make_rig(1);
  EXPECT_THROW(m.save(r.refs(), {.step = -1, .loader = std::nullopt, .config = ""}), ValueError);
}

}  // namespace
}  // namespace kiln
