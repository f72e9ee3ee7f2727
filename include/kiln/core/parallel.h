// parallel_for: the one way kiln splits a loop across its threads. Kernels,
// and the few loops above them that run without a kernel (the optimizers'
// fused updates), call it, so that every parallel region honours
// set_num_threads and splits work alike.
#pragma once

#include <cstdint>
#include <type_traits>

namespace kiln {

/// Runs fn(begin, end) over [0, n) split into contiguous ranges, one per
/// thread, in parallel when n >= grain. The split depends only on n, grain
/// and the thread count, so results are deterministic. Inside a parallel
/// region it runs serially. Exceptions from fn propagate.
void parallel_for(int64_t n, int64_t grain, void (*fn)(int64_t, int64_t, void*), void* ctx);

/// parallel_for calls so far in this process that ran on more than one
/// thread. A benchmark reads it around its steps: at two or more threads
/// every such region costs a fork and a join, a price per op that no kernel
/// speed removes (docs/benchmarks.md, "Parallel regions").
int64_t parallel_regions();

template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  using Fn = std::remove_reference_t<F>;
  auto tramp = [](int64_t b, int64_t e, void* c) { (*static_cast<Fn*>(c))(b, e); };
  parallel_for(n, grain, tramp, const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace kiln
