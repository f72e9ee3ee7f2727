// Helpers of the profiler tests: busy-waiting a known time inside a scope,
// and reading a trace back.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kiln/core/record.h"
#include "kiln/profiler/profiler.h"

namespace kiln::test {

/// Busy-waits at least `ns` on record's clock (a sleep would let the scheduler add noise, not less).
inline void spin(int64_t ns) {
  const int64_t end = record::now_ns() + ns;
  while (record::now_ns() < end) {
  }
}

/// A scope of `kind` named `name` that lasts at least `ns` of its own.
inline void timed_scope(record::Kind kind, const char* name, int64_t ns) {
  record::Scope s(kind, name);
  spin(ns);
}

inline const profiler::OpStats* find_row(const std::vector<profiler::OpStats>& rows, const std::string& name,
                                         const std::string& shapes = "") {
  for (const auto& r : rows) {
    if (r.name == name && r.input_shapes == shapes) return &r;
  }
  return nullptr;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

}  // namespace kiln::test
