// Shared by the micro-benchmarks: runs a benchmark body at a given kiln
// thread count (the benchmarks take it as an argument) and restores the
// previous count afterwards, so one benchmark's setting never leaks into the next.
#pragma once

#include "kiln/core/threads.h"

namespace kiln_micro {

class ThreadScope {
 public:
  explicit ThreadScope(int n) : prev_(kiln::get_num_threads()) { kiln::set_num_threads(n); }
  ~ThreadScope() { kiln::set_num_threads(prev_); }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  int prev_;
};

}  // namespace kiln_micro
