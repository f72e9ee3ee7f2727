// Forced into every translation unit of the fuzz build (clang 14, -include):
// libstdc++ 12 declares std::source_location only when the compiler has
// __builtin_source_location, which clang gained in version 15. This stand-in
// offers the same members from the older __builtin_FILE/LINE/... intrinsics,
// so kiln compiles unchanged; a newer clang skips it and uses the real one.
#pragma once

#if defined(__clang__) && !__has_builtin(__builtin_source_location)
#include <cstdint>

namespace std {
struct source_location {
  static constexpr source_location current(const char* file = __builtin_FILE(),
                                           const char* function = __builtin_FUNCTION(),
                                           uint_least32_t line = __builtin_LINE(),
                                           uint_least32_t column = __builtin_COLUMN()) noexcept {
    source_location l;
    l.file_ = file;
    l.function_ = function;
    l.line_ = line;
    l.column_ = column;
    return l;
  }
  constexpr source_location() noexcept = default;
  constexpr uint_least32_t line() const noexcept { return line_; }
  constexpr uint_least32_t column() const noexcept { return column_; }
  constexpr const char* file_name() const noexcept { return file_; }
  constexpr const char* function_name() const noexcept { return function_; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  uint_least32_t line_ = 0;
  uint_least32_t column_ = 0;
};
}  // namespace std
#endif
