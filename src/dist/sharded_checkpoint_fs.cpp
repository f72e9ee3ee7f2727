// The directory side of a sharded checkpoint save (sharded_checkpoint_fs.h).
#include "sharded_checkpoint_fs.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc >= 2.28, _GNU_SOURCE)
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "kiln/core/error.h"
#include "kiln/io/atomic_file.h"
#include "sharded_checkpoint_format.h"

namespace kiln::dist::shard_format {

namespace fs = std::filesystem;
using detail::concat;

namespace {

std::string sys_error(int err) { return std::strerror(err); }

// What in `d` is not ours, for the message that refuses to delete it ("" if all is).
std::string foreign_entries(const fs::path& d) {
  std::string out;
  int shown = 0;
  for (const auto& e : fs::directory_iterator(d)) {
    const std::string name = e.path().filename().string();
    if (is_ours(name) && e.is_regular_file()) continue;
    if (shown++ < 5) out += concat(out.empty() ? "" : ", ", "'", name, "'");
  }
  if (shown > 5) out += concat(" and ", shown - 5, " more");
  return out;
}

}  // namespace

fs::path partial_path(const fs::path& dir) { return fs::path(dir.string() + ".partial"); }

bool is_ours(const std::string& name) {
  if (name == kIndexName) return true;
  if (name.rfind(std::string(kIndexName) + ".tmp.", 0) == 0) return true;
  const std::string suffix = ".safetensors";
  const size_t tmp = name.find(suffix + ".tmp.");
  const size_t end = tmp != std::string::npos ? tmp : name.size() - std::min(name.size(), suffix.size());
  return name.rfind("shard-", 0) == 0 && name.find("-of-") != std::string::npos &&
         name.compare(end, suffix.size(), suffix) == 0;
}

void prepare_partial(const fs::path& dir, const fs::path& partial) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    KILN_CHECK(fs::is_directory(dir, ec), ValueError, "refusing to replace '", dir.string(),
               "': it is not a directory (expected a sharded checkpoint or nothing)");
    const std::string foreign = foreign_entries(dir);
    const bool empty = fs::is_empty(dir, ec);
    KILN_CHECK(foreign.empty() && (empty || fs::exists(dir / kIndexName, ec)), ValueError, "refusing to replace '",
               dir.string(), "': expected a sharded checkpoint or an empty directory, got one holding ",
               foreign.empty() ? "shard files but no index.json" : foreign);
  }
  if (fs::exists(partial, ec)) {  // a crashed save's: never read, safe to drop
    KILN_CHECK(fs::is_directory(partial, ec), ValueError, "refusing to delete '", partial.string(),
               "' (left by an earlier save?): it is not a directory");
    const std::string foreign = foreign_entries(partial);
    KILN_CHECK(foreign.empty(), ValueError, "refusing to delete '", partial.string(),
               "' (left by an earlier save?): it holds files a save does not write: ", foreign);
    fs::remove_all(partial, ec);
    KILN_CHECK(!ec, IOError, "cannot remove the leftover '", partial.string(), "': ", ec.message());
  }
  fs::create_directories(partial, ec);
  KILN_CHECK(!ec, IOError, "cannot create '", partial.string(), "': ", ec.message());
}

void remove_ours(const fs::path& d) noexcept {
  std::error_code ec;
  for (auto it = fs::directory_iterator(d, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (is_ours(it->path().filename().string())) fs::remove(it->path(), ec);
  }
  fs::remove(d, ec);  // fails, harmlessly, if anything else is left
}

void sync_directory(const fs::path& d) { io::sync_directory(d); }

void write_file_synced(const fs::path& path, const std::string& text) { io::write_file_atomically(path, text); }

void replace_directory(const fs::path& partial, const fs::path& dir) {
  const fs::path parent = dir.parent_path();
  std::error_code ec;
  // rename() replaces an empty directory atomically, and takes a free name.
  if (!fs::exists(dir, ec) || fs::is_empty(dir, ec)) {
    KILN_CHECK(::rename(partial.c_str(), dir.c_str()) == 0, IOError, "cannot rename '", partial.string(), "' to '",
               dir.string(), "': ", sys_error(errno));
    sync_directory(parent);
    return;
  }
  if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    sync_directory(parent);
    remove_ours(partial);  // the old checkpoint, now under the partial name
    return;
  }
  const int err = errno;
  KILN_CHECK(err == EINVAL || err == ENOSYS || err == ENOTSUP, IOError, "cannot exchange '", partial.string(),
             "' with '", dir.string(), "': ", sys_error(err));
  const fs::path old(dir.string() + ".old");
  remove_ours(old);
  KILN_CHECK(::rename(dir.c_str(), old.c_str()) == 0, IOError, "cannot rename '", dir.string(), "' to '", old.string(),
             "': ", sys_error(errno));
  KILN_CHECK(::rename(partial.c_str(), dir.c_str()) == 0, IOError, "cannot rename '", partial.string(), "' to '",
             dir.string(), "': ", sys_error(errno), " (the previous checkpoint is at '", old.string(), "')");
  sync_directory(parent);
  remove_ours(old);
}

}  // namespace kiln::dist::shard_format
