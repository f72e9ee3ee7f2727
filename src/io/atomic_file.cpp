// Atomic small-file writes. See include/kiln/io/atomic_file.h.
#include "kiln/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "kiln/core/error.h"

namespace kiln::io {

void sync_directory(const std::filesystem::path& dir) {
  const std::filesystem::path d = dir.empty() ? std::filesystem::path(".") : dir;
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // some systems cannot open directories; the renames are done
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  KILN_CHECK(rc == 0 || err == EINVAL || err == EROFS, IOError, "syncing directory '", d.string(),
             "' failed: ", std::strerror(err));
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  const std::string tmp = path.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd >= 0, IOError, "cannot create '", tmp, "': ", std::strerror(errno));
  std::string failure;
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0 && failure.empty()) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      failure = std::string("writing it failed: ") + std::strerror(errno);
    } else {
      p += w;
      left -= static_cast<size_t>(w);
    }
  }
  if (failure.empty() && ::fsync(fd) != 0) failure = std::string("fsync failed: ") + std::strerror(errno);
  if (::close(fd) != 0 && failure.empty()) failure = std::string("closing it failed: ") + std::strerror(errno);
  if (failure.empty() && ::rename(tmp.c_str(), path.c_str()) != 0)
    failure = "renaming it to '" + path.string() + "' failed: " + std::strerror(errno);
  if (!failure.empty()) {
    ::unlink(tmp.c_str());
    throw IOError("'" + tmp + "': " + failure);
  }
  sync_directory(path.parent_path());
}

}  // namespace kiln::io
