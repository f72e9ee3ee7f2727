// Internal to kiln::compile: graph rewrites over a captured step's record,
// which run before fusion (docs/compile.md, "Rewrites"). A rewrite replaces
// kernels by others that compute the same values with less memory traffic,
// where the record shows that nothing else reads what it stops writing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "compile_fusion.h"

namespace kiln::compile_detail {

/// A storage the capture watched (capture::watch): what it was, the event
/// count when it was watched, and the event count at each later access of its
/// bytes (an op takes the address just before it records its kernels).
struct WatchRecord {
  uint32_t id = 0;
  const void* data = nullptr;
  std::string role;
  size_t at = 0;
  std::vector<size_t> accesses;
};

struct RewriteReport {
  int64_t relu_pools = 0;          // ReLU → max pool pairs run as one pool that applies the ReLU
  int64_t pool_weight_grads = 0;   // max pool backwards read through by the weight gradient after them
  int64_t conv_pools = 0;          // convolutions run inside the max pool after them
  int64_t unwritten_bytes = 0;     // per call: the full-size ReLU outputs and gradients no longer written
  std::vector<std::string> lines;  // one per rewrite, for the log
  // Where each event of the record went: map[i] is the event's new index, or
  // kDropped; empty when no event moved.
  static constexpr size_t kDropped = static_cast<size_t>(-1);
  std::vector<size_t> map;
};

/// The watches as the record stands after a rewrite that moved its events
/// (`map`, RewriteReport::map): positions renumbered, accesses by dropped
/// events removed.
std::vector<WatchRecord> remap_watches(const std::vector<WatchRecord>& watches, const std::vector<size_t>& map,
                                       size_t old_events);

/// Runs each ReLU whose output only a channels-last max pool reads as part of
/// the pool, which applies it to each maximum and marks the windows whose
/// gradient the ReLU's backward would mask; the pool's backward then writes
/// what the ReLU's backward would, which is dropped (Note [ReLU-pooling
/// rewrite]). Values are those of the kernels as recorded, but for the sign of
/// a zero (a pooled window whose maximum is a zero preceded by negatives: +0 as
/// recorded, the zero's own sign rewritten). `freed_at_end`: blocks freed after
/// the last event.
RewriteReport rewrite_relu_pooling(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                                   std::vector<std::pair<void*, size_t>>& freed_at_end);

/// Runs a convolution that the direct forward takes and the max pool that
/// alone reads its output as one kernel that pools each band of output rows
/// as it computes them (Note [Convolution inside the pool]). Same bits. Run
/// after rewrite_relu_pooling, with the watches remapped to its result.
RewriteReport rewrite_conv_pools(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                                 std::vector<std::pair<void*, size_t>>& freed_at_end);

/// Runs a channels-last max pool's backward and the weight gradient of the
/// convolution before the pool, which reads the full-size gradient the pool's
/// backward writes and nothing else reads, as one kernel that reads the
/// pool's output gradient and workspace instead (Note [Pool backward into the
/// weight gradient]). Same bits. Run after rewrite_relu_pooling, with the
/// watches remapped to its result.
RewriteReport rewrite_pool_weight_grads(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                                        std::vector<std::pair<void*, size_t>>& freed_at_end);

}  // namespace kiln::compile_detail
