// kiln's exceptions and the checking macros (DESIGN.md §8).
//
// KILN_CHECK is for conditions the user can violate: its message must say what
// was expected, what was got, and where. KILN_ASSERT is for our own invariants;
// when it fires it is a kiln bug, and the message says so.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kiln {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class ShapeError : public Error {
 public:
  using Error::Error;
};
class DTypeError : public Error {
 public:
  using Error::Error;
};
class ValueError : public Error {
 public:
  using Error::Error;
};
class IndexError : public Error {
 public:
  using Error::Error;
};
class OutOfMemory : public Error {
 public:
  using Error::Error;
};
class FormatError : public Error {
 public:
  using Error::Error;
};
/// The operating system refused a file operation (open, read, write, rename); the message holds errno's text.
class IOError : public Error {
 public:
  using Error::Error;
};
class DistributedError : public Error {
 public:
  using Error::Error;
};
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string concat(const Args&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return {};
  } else {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
  }
}

[[noreturn]] void throw_internal(const std::source_location& loc, std::string_view cond, const std::string& msg);

}  // namespace detail
}  // namespace kiln

/// KILN_CHECK(cond, ErrorType, parts...): throws ErrorType(concat(parts...)) when !cond.
#define KILN_CHECK(cond, ErrorType, ...)                    \
  do {                                                      \
    if (!(cond)) [[unlikely]] {                             \
      throw ErrorType(::kiln::detail::concat(__VA_ARGS__)); \
    }                                                       \
  } while (0)

#define KILN_ASSERT(cond, ...)                                                                                     \
  do {                                                                                                             \
    if (!(cond)) [[unlikely]] {                                                                                    \
      ::kiln::detail::throw_internal(std::source_location::current(), #cond, ::kiln::detail::concat(__VA_ARGS__)); \
    }                                                                                                              \
  } while (0)
