// File reading shared by the data layer's readers (private to src/data).
//
// Every reader takes its path as hostile: only a regular file is read (a
// device such as /dev/zero or a FIFO could feed it forever, a directory not at
// all), and sizes come from fstat before anything is allocated.
#pragma once

#include <cstdint>
#include <string>

namespace kiln::data::detail {

/// An owned file descriptor, closed on destruction.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

/// Reads up to n bytes at offset; fewer only at the end of the file. IOError on a read error.
size_t pread_some(int fd, char* dst, size_t n, uint64_t offset, const std::string& path);

/// A regular file opened for reading, with its size.
struct OpenFile {
  Fd fd;
  uint64_t size = 0;
};

/// Opens `path`; IOError (prefixed by `who`) if it cannot be opened or is not a regular file.
OpenFile open_regular(const std::string& path, const char* who);

/// The whole of a regular file (text and image files, which are parsed from memory).
std::string read_whole_file(const std::string& path, const char* who);

}  // namespace kiln::data::detail
