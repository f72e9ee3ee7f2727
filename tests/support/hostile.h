#pragma once
// The contract every reader's hostile-input tests check (DESIGN.md §7): the
// documented error, naming the file, no tensor left alive, and no more memory
// at once than the file's size can justify (the allocator's peak statistics).
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"

namespace kiln::test {

/// Runs f, expecting ErrorT whose message names `path` and holds each of `parts`;
/// also checks no tensor outlives the call and the peak stays within `budget` bytes.
template <typename ErrorT = FormatError, typename F>
void expect_error(F&& f, const std::string& path, std::initializer_list<std::string> parts, int64_t budget = 4096) {
  const int64_t live = memory::stats().live_bytes;
  memory::reset_peak_stats();
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << (parts.size() ? *parts.begin() : "") << "' for " << path;
  } catch (const ErrorT& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "the message should name the file: " << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
  EXPECT_EQ(memory::stats().live_bytes, live) << "a failed read left tensors alive";
  EXPECT_LE(memory::stats().peak_bytes - live, budget) << "allocated more than the file justifies";
}

}  // namespace kiln::test
