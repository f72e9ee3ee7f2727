#include "kiln/data/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

std::string_view trim(std::string_view s) {
  auto ws = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

/// Maps `path` read-only; null for an empty file.
void* map_file(const std::string& path, const char* who, size_t& size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KILN_CHECK(fd >= 0, IOError, who, ": cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw IOError(std::string(who) + ": cannot stat '" + path + "': " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    // A device such as /dev/zero maps as endless data, a directory or pipe not at all.
    ::close(fd);
    throw IOError(std::string(who) + ": '" + path + "' is not a regular file (a directory, device or pipe)");
  }
  size = static_cast<size_t>(st.st_size);
  void* map = nullptr;
  if (size > 0) {
    map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw IOError(std::string(who) + ": cannot mmap '" + path + "': " + std::strerror(err));
    }
  }
  ::close(fd);
  return map;
}

int64_t num_windows(int64_t n, int64_t context, int64_t stride) {
  return n > context ? (n - context - 1) / stride + 1 : 0;
}

}  // namespace

CharCorpus::CharCorpus(CharCorpusOptions options) : options_(std::move(options)) {
  if (options_.stride == 0) options_.stride = options_.context;
  KILN_CHECK(options_.context >= 1, ValueError, "CharCorpus: expected context >= 1, got ", options_.context);
  KILN_CHECK(options_.stride >= 1, ValueError, "CharCorpus: expected stride >= 1 (or 0), got ", options_.stride);
  map_ = map_file(options_.path, "CharCorpus", map_size_);

  std::string_view all(static_cast<const char*>(map_), map_ ? map_size_ : 0);
  std::string_view body = all;
  if (options_.strip_gutenberg) {
    size_t s = body.find("*** START OF");
    if (s != std::string_view::npos) {
      size_t eol = body.find('\n', s);
      body.remove_prefix(eol == std::string_view::npos ? body.size() : eol + 1);
    }
    size_t e = body.find("*** END OF");
    if (e != std::string_view::npos) body = body.substr(0, e);
  }
  if (body.find("\r\n") != std::string_view::npos) {
    copy_.reserve(body.size());
    for (size_t i = 0; i < body.size(); ++i) {
      if (body[i] == '\r' && i + 1 < body.size() && body[i + 1] == '\n') continue;
      copy_.push_back(body[i]);
    }
    body = copy_;
  }
  text_ = trim(body);
  const int64_t n = static_cast<int64_t>(text_.size());
  num_windows_ = num_windows(n, options_.context, options_.stride);
}

CharCorpus::~CharCorpus() {
  if (map_) ::munmap(map_, map_size_);
}

Example CharCorpus::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < num_windows_, IndexError, "CharCorpus: index ", index, " out of range [0, ",
             num_windows_, ")");
  const int64_t ctx = options_.context;
  const auto* p = reinterpret_cast<const uint8_t*>(text_.data()) + index * options_.stride;
  Tensor x = empty({ctx}, TensorOptions().dtype(kInt64));
  Tensor y = empty({ctx}, TensorOptions().dtype(kInt64));
  int64_t* xd = x.data_ptr<int64_t>();
  int64_t* yd = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < ctx; ++i) {
    xd[i] = p[i];
    yd[i] = p[i + 1];
  }
  return {x, y};
}

TokenFile::TokenFile(TokenFileOptions options) : options_(std::move(options)) {
  if (options_.stride == 0) options_.stride = options_.context;
  KILN_CHECK(options_.bytes_per_token == 2 || options_.bytes_per_token == 4, ValueError,
             "TokenFile: expected bytes_per_token 2 (uint16) or 4 (uint32), got ", options_.bytes_per_token);
  KILN_CHECK(options_.context >= 1, ValueError, "TokenFile: expected context >= 1, got ", options_.context);
  KILN_CHECK(options_.stride >= 1, ValueError, "TokenFile: expected stride >= 1 (or 0), got ", options_.stride);
  map_ = map_file(options_.path, "TokenFile", map_size_);
  if (map_size_ % static_cast<size_t>(options_.bytes_per_token) != 0) {
    if (map_) ::munmap(map_, map_size_);
    throw FormatError("TokenFile: '" + options_.path + "' has " + std::to_string(map_size_) +
                      " bytes, not a multiple of " + std::to_string(options_.bytes_per_token) +
                      " bytes per token (truncated, or the wrong token width)");
  }
  num_tokens_ = static_cast<int64_t>(map_size_) / options_.bytes_per_token;
  num_windows_ = num_windows(num_tokens_, options_.context, options_.stride);
}

TokenFile::~TokenFile() {
  if (map_) ::munmap(map_, map_size_);
}

int64_t TokenFile::token(int64_t i) const {
  KILN_CHECK(i >= 0 && i < num_tokens_, IndexError, "TokenFile: token ", i, " out of range [0, ", num_tokens_, ")");
  const auto* p = static_cast<const uint8_t*>(map_) + i * options_.bytes_per_token;
  uint64_t v = 0;
  for (int64_t b = options_.bytes_per_token - 1; b >= 0; --b) v = (v << 8) | p[b];
  return static_cast<int64_t>(v);
}

Example TokenFile::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < num_windows_, IndexError, "TokenFile: index ", index, " out of range [0, ",
             num_windows_, ")");
  const int64_t ctx = options_.context, start = index * options_.stride;
  Tensor x = empty({ctx}, TensorOptions().dtype(kInt64));
  Tensor y = empty({ctx}, TensorOptions().dtype(kInt64));
  int64_t* xd = x.data_ptr<int64_t>();
  int64_t* yd = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < ctx; ++i) {
    xd[i] = token(start + i);
    yd[i] = token(start + i + 1);
  }
  return {x, y};
}

}  // namespace kiln::data
