#pragma once
// Helpers for the CLI tests: run the built `kiln` executable, write small
// configs, read metrics.jsonl.
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/test_util.h"

namespace kiln::test {

struct CliResult {
  int rc = -1;
  std::string output;  // stdout and stderr, interleaved
};

inline CliResult kiln_cli(const std::string& args) {
  CliResult r;
  r.rc = run_command(std::string("OMP_NUM_THREADS=2 ") + KILN_CLI_BINARY + " " + args, r.output);
  return r;
}

// Multi-rank jobs end in about a second; a hang ends at this bound with exit 137.
inline constexpr int kJobLimitS = 60;
inline const std::string kRankEnv = "OMP_NUM_THREADS=1 KILN_DIST_TIMEOUT=20 ";

/// `kiln launch -n N -- kiln ARGS`, bounded.
inline CliResult launch(int n, const std::string& args) {
  CliResult r;
  r.rc = run_command(kRankEnv + "timeout -s KILL " + std::to_string(kJobLimitS) + " " + KILN_CLI_BINARY +
                         " launch -n " + std::to_string(n) + " -- kiln " + args,
                     r.output);
  return r;
}
inline CliResult launch2(const std::string& args) { return launch(2, args); }

// ---- the processes of a job (`kiln launch` runs mpirun as its child, whose children are the ranks) ----

/// Pids of the processes whose parent is `parent`.
inline std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close = text.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(text.c_str() + close + 1, " %c %d", &state, &ppid) == 2 && ppid == parent)
      out.push_back(static_cast<pid_t>(std::stoi(name)));
  }
  return out;
}

/// Every process below `pid` (`kiln launch` runs mpirun as its child, whose children are the ranks).
inline std::vector<pid_t> descendants_of(pid_t pid) {
  std::vector<pid_t> out, todo{pid};
  while (!todo.empty()) {
    const pid_t p = todo.back();
    todo.pop_back();
    for (pid_t c : children_of(p)) {
      out.push_back(c);
      todo.push_back(c);
    }
  }
  return out;
}

/// The rank `rank` below the launcher (by OMPI_COMM_WORLD_RANK in its environment); -1 if not found.
inline pid_t rank_pid(pid_t launcher, int rank) {
  const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (pid_t c : descendants_of(launcher)) {
    std::ifstream env("/proc/" + std::to_string(c) + "/environ", std::ios::binary);
    for (std::string kv; std::getline(env, kv, '\0');)
      if (kv == want) return c;
  }
  return -1;
}


inline void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

/// A tiny classifier run: an MLP on 8x8 synthetic images, a few dozen steps.
inline std::string tiny_mlp_config(const std::string& extra_train = "") {
  return R"(name = "tiny"
seed = 3

[model]
type = "mlp"
hidden = [32]

[data]
dataset = "synthetic"
image_size = 8
train_size = 256
eval_size = 64
batch_size = 16
num_workers = 2

[optim]
name = "adamw"
lr = 3e-3
weight_decay = 0.1

[schedule]
type = "cosine"
warmup_steps = 4

[train]
steps = 40
eval_every = 10
ckpt_every = 20
log_every = 1
)" + extra_train;
}

/// tiny_mlp_config() with a tiny "cnn" or "resnet" in place of the MLP: the image
/// runs the quantization, pruning and int8 export tests train.
inline std::string tiny_image_config(const std::string& model) {
  std::string c = tiny_mlp_config();
  const std::string mlp = "type = \"mlp\"\nhidden = [32]\n";
  c.replace(c.find(mlp), mlp.size(),
            model == "cnn" ? "type = \"cnn\"\nchannels1 = 4\nchannels2 = 8\nfc_hidden = 16\n"
                           : "type = \"resnet\"\nstem_channels = 4\nwidths = [4, 8]\nblocks = [1, 1]\n");
  return c;
}

/// English-ish text for the character-level GPT (a few KB, repeated phrases so it learns quickly).
inline std::string tiny_text() {
  std::string t;
  const char* lines[] = {"Call me Ishmael. Some years ago, never mind how long precisely, ",
                         "having little or no money in my purse, and nothing particular to interest me on shore, ",
                         "I thought I would sail about a little and see the watery part of the world.\n"};
  for (int i = 0; i < 40; ++i)
    for (const char* l : lines) t += l;
  return t;
}

/// A tiny GPT (one layer, dropout on, so the resumed generator state matters) on `text_path`.
inline std::string tiny_gpt_config(const std::string& text_path) {
  return R"(name = "tiny_gpt"
seed = 1

[model]
type = "gpt"
n_layer = 1
n_head = 2
n_embd = 32
dropout = 0.1

[data]
dataset = "text"
path = ")" + text_path + R"("
context = 32
val_fraction = 0.1
batch_size = 16
eval_batch_size = 16
num_workers = 1

[optim]
name = "adamw"
lr = 3e-3
grad_clip = 1.0

[schedule]
type = "cosine"
warmup_steps = 3

[train]
steps = 30
eval_every = 10
ckpt_every = 100
log_every = 1
)";
}

inline std::vector<nlohmann::json> metrics_lines(const std::filesystem::path& run_dir, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == kind) out.push_back(j);
  }
  return out;
}

/// The loss of every train line of a run, in order.
inline std::vector<double> train_losses(const std::filesystem::path& run_dir) {
  std::vector<double> out;
  for (const auto& j : metrics_lines(run_dir, "train")) out.push_back(j["loss"].get<double>());
  return out;
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

/// `kiln launch -n N -- kiln ARGS` started in the background (stdout and
/// stderr to `log`), for tests that act on its ranks mid-run. The destructor
/// kills whatever is left of it.
class BackgroundLaunch {
 public:
  BackgroundLaunch(int n, const std::string& args, std::string log) : log_(std::move(log)) {
    // exec: the shell becomes the launcher, so the pid below is kiln launch's.
    const std::string cmd = kRankEnv + "exec " + KILN_CLI_BINARY + " launch -n " + std::to_string(n) + " -- kiln " + args;
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~BackgroundLaunch() {
    if (pid_ > 0 && !ended_) kill_all();
  }
  BackgroundLaunch(const BackgroundLaunch&) = delete;
  BackgroundLaunch& operator=(const BackgroundLaunch&) = delete;

  bool started() const { return pid_ > 0; }
  /// Waits (up to 30 s) until `metrics` holds at least `lines` lines; whether it does.
  bool wait_for_lines(const std::filesystem::path& metrics, int lines) const {
    for (int i = 0; i < 3000; ++i) {
      std::ifstream in(metrics);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (count_lines(text) >= lines) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  /// The pid of rank `rank` below the launcher, or -1.
  pid_t rank(int r) const { return rank_pid(pid_, r); }
  /// Waits up to kJobLimitS for the job to end; false (and the job killed) if it did not.
  bool wait(int* status) {
    for (int i = 0; i < kJobLimitS * 100 && !ended_; ++i) {
      ended_ = ::waitpid(pid_, status, WNOHANG) == pid_;
      if (!ended_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return ended_;
  }
  std::string log() const { return read_file(log_); }

 private:
  void kill_all() {
    for (pid_t d : descendants_of(pid_)) ::kill(d, SIGKILL);
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    ended_ = true;
  }
  std::string log_;
  pid_t pid_ = -1;
  bool ended_ = false;
};

}  // namespace kiln::test
