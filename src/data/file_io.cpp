#include "file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kiln/core/error.h"

namespace kiln::data::detail {

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

size_t pread_some(int fd, char* dst, size_t n, uint64_t offset, const std::string& path) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, dst + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw IOError(
          kiln::detail::concat("'", path, "': read failed at offset ", offset + got, ": ", std::strerror(errno)));
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

OpenFile open_regular(const std::string& path, const char* who) {
  OpenFile f{Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), 0};
  KILN_CHECK(f.fd.get() >= 0, IOError, who, ": cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  KILN_CHECK(::fstat(f.fd.get(), &st) == 0, IOError, who, ": cannot stat '", path, "': ", std::strerror(errno));
  KILN_CHECK(S_ISREG(st.st_mode), IOError, who, ": '", path,
             "': expected a regular file (not a directory, device or pipe)");
  f.size = static_cast<uint64_t>(st.st_size);
  return f;
}

std::string read_whole_file(const std::string& path, const char* who) {
  OpenFile f = open_regular(path, who);
  std::string out(static_cast<size_t>(f.size), '\0');
  // A file that shrank since fstat reads short; one that grew is read to its old size.
  out.resize(pread_some(f.fd.get(), out.data(), out.size(), 0, path));
  return out;
}

}  // namespace kiln::data::detail
