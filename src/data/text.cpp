#include "kiln/data/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kiln/core/error.h"
#include "kiln/core/factory.h"

namespace kiln::data {

namespace {

std::string_view trim(std::string_view s) {
  auto ws = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

CharCorpus::CharCorpus(CharCorpusOptions options) : options_(std::move(options)) {
  if (options_.stride == 0) options_.stride = options_.context;
  KILN_CHECK(options_.context >= 1, ValueError, "CharCorpus: expected context >= 1, got ", options_.context);
  KILN_CHECK(options_.stride >= 1, ValueError, "CharCorpus: expected stride >= 1 (or 0), got ", options_.stride);
  const std::string& path = options_.path;
  int fd = ::open(path.c_str(), O_RDONLY);
  KILN_CHECK(fd >= 0, IOError, "CharCorpus: cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw IOError("CharCorpus: cannot stat '" + path + "': " + std::strerror(err));
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ > 0) {
    map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      int err = errno;
      map_ = nullptr;
      ::close(fd);
      throw IOError("CharCorpus: cannot mmap '" + path + "': " + std::strerror(err));
    }
  }
  ::close(fd);

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
  num_windows_ = n > options_.context ? (n - options_.context - 1) / options_.stride + 1 : 0;
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

}  // namespace kiln::data
