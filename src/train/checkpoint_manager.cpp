// CheckpointManager (see include/kiln/train/checkpoint.h): a directory of
// ckpt-<step>.safetensors files and a `latest` pointer. The pointer is only
// rewritten after the checkpoint it names has been renamed into place and the
// directory synced, so a crash at any moment leaves `latest` naming a complete
// file (or the previous one); temporary files never carry a final name.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/io/atomic_file.h"
#include "kiln/io/safetensors.h"
#include "kiln/train/checkpoint.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "ckpt-";
constexpr const char* kSuffix = ".safetensors";
constexpr const char* kPointer = "latest";

// The step of a final checkpoint name "ckpt-<8 or more digits>.safetensors"; nullopt otherwise.
std::optional<int64_t> step_of(const std::string& name) {
  const size_t np = std::strlen(kPrefix), ns = std::strlen(kSuffix);
  if (name.size() < np + 8 + ns || name.compare(0, np, kPrefix) != 0 ||
      name.compare(name.size() - ns, ns, kSuffix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(np, name.size() - np - ns);
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoll(digits);
}

std::string file_name(int64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%s%08lld%s", kPrefix, static_cast<long long>(step), kSuffix);
  return buf;
}

// The file name `latest` holds, if it holds a well-formed checkpoint name; why not otherwise.
std::optional<std::string> read_pointer(const fs::path& dir, std::string& why) {
  const fs::path p = dir / kPointer;
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    why = detail::concat("'", p.string(), "' does not exist");
    return std::nullopt;
  }
  std::string text(256, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  if (!step_of(text)) {
    why = detail::concat("'", p.string(), "' does not name a checkpoint file (expected ckpt-<step>.safetensors)");
    return std::nullopt;
  }
  return text;
}

// Cheap check: the file exists and its header is a kiln checkpoint's.
bool header_ok(const fs::path& p) {
  try {
    return io::read_safetensors_header(p.string()).metadata.count("kiln.checkpoint") > 0;
  } catch (const Error&) {
    return false;
  }
}

// "<final name>.tmp.<pid>" or "latest.tmp.<pid>": the pid, else nullopt.
std::optional<pid_t> temp_owner(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  if (at == std::string::npos) return std::nullopt;
  const std::string base = name.substr(0, at), pid = name.substr(at + 5);
  if (base != kPointer && !step_of(base)) return std::nullopt;
  if (pid.empty() || pid.size() > 9 ||
      !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return static_cast<pid_t>(std::stol(pid));
}

}  // namespace

CheckpointManager::CheckpointManager(fs::path dir, CheckpointManagerOptions opts) : dir_(std::move(dir)), opts_(opts) {
  KILN_CHECK(opts_.keep_last >= 1, ValueError, "CheckpointManager: expected keep_last >= 1, got ", opts_.keep_last);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  KILN_CHECK(!ec && fs::is_directory(dir_), IOError, "CheckpointManager: cannot create directory '", dir_.string(),
             "': ", ec ? ec.message() : "a file of that name exists");
}

std::vector<fs::path> CheckpointManager::list() const {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code rec;
    if (auto step = step_of(name); step && e.is_regular_file(rec)) found.emplace_back(*step, e.path());
  }
  KILN_CHECK(!ec, IOError, "CheckpointManager: cannot list '", dir_.string(), "': ", ec.message());
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

fs::path CheckpointManager::save(const CheckpointRefs& refs, const CheckpointInfo& info) {
  KILN_CHECK(info.step >= 0, ValueError, "CheckpointManager::save: expected a step >= 0, got ", info.step);
  const std::string name = file_name(info.step);
  const fs::path path = dir_ / name;
  save_checkpoint(path.string(), refs, info);
  io::write_file_atomically(dir_ / kPointer, name + "\n");

  // Prune: the newest keep_last by step, and whatever `latest` names, stay.
  std::vector<fs::path> all = list();
  const size_t keep = static_cast<size_t>(opts_.keep_last);
  for (size_t i = 0; i + keep < all.size(); ++i) {
    if (all[i].filename() == name) continue;
    std::error_code ec;
    fs::remove(all[i], ec);  // a file someone else removed first is no failure
  }
  // Temporary files of writers that died (killed mid-write). A live writer's are left alone;
  // ours are stale since our own writes have all completed (one writer per directory).
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const auto owner = temp_owner(e.path().filename().string());
    if (!owner) continue;
    if (*owner == ::getpid() || (::kill(*owner, 0) != 0 && errno == ESRCH)) {
      std::error_code rec;
      fs::remove(e.path(), rec);
    }
  }
  return path;
}

std::optional<fs::path> CheckpointManager::latest() const {
  std::string why;
  if (auto name = read_pointer(dir_, why); name && header_ok(dir_ / *name)) return dir_ / *name;
  const std::vector<fs::path> all = list();
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (header_ok(*it)) return *it;
  return std::nullopt;
}

CheckpointInfo CheckpointManager::load_latest(const CheckpointRefs& refs) {
  std::string why;
  const std::optional<std::string> pointed = read_pointer(dir_, why);
  std::vector<fs::path> order;
  if (pointed) order.push_back(dir_ / *pointed);
  const std::vector<fs::path> all = list();
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (!pointed || it->filename() != *pointed) order.push_back(*it);

  std::vector<std::string> failures;
  if (!pointed) failures.push_back(why);
  for (const fs::path& p : order) {
    try {
      CheckpointInfo info = load_checkpoint(p.string(), refs);
      if (!failures.empty()) {
        const std::string what = pointed ? detail::concat("'", (dir_ / *pointed).string(), "' (named by 'latest')")
                                         : std::string("the 'latest' pointer");
        std::cerr << "kiln: CheckpointManager: " << what << " is not usable (" << failures.front() << "); loaded '"
                  << p.string() << "' instead\n";
      }
      return info;
    } catch (const FormatError& e) {
      failures.push_back(e.what());
    } catch (const IOError& e) {
      failures.push_back(e.what());
    }
  }
  std::string msg;
  for (const auto& f : failures) msg += "\n  " + f;
  throw IOError(detail::concat("CheckpointManager::load_latest: no checkpoint in '", dir_.string(),
                               "' could be loaded (expected a 'latest' pointer or ckpt-<step>.safetensors files; ",
                               order.size(), " tried)", msg));
}

}  // namespace kiln::train
