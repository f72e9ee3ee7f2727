// Memory history: who holds the bytes, by the call site that created them.
//
// The allocator's category counters (allocator.h) say *what kind* of memory
// is live. With history recorded, every live block also remembers where it
// was made — the call site in user code of the op that allocated it, the op,
// and the shape and dtype of the tensor it was made for — so an OutOfMemory
// message, memory::snapshot() (as torch.cuda.memory._snapshot) and a leak
// warning can name the lines that hold the memory. Recording costs a hash-map
// update per allocation and free, so it is off by default, as
// torch.cuda.memory._record_memory_history; `kiln train`, LeakWatch and
// KILN_MEMORY_HISTORY=1 turn it on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/core/dtype.h"
#include "kiln/core/shape.h"

namespace kiln::memory {

/// Starts (or stops) recording where each allocation was made. Blocks already
/// live when recording starts are counted under an unknown site.
void record_history(bool enabled = true);
bool recording_history();

/// Live bytes held by the tensors one call site made, in one category.
struct SiteUsage {
  std::string site;  // "src/models/gpt.cpp:88", or "<unknown>"
  std::string op;    // "Addmm", "backward of MmBackward0", or "" when not known
  MemoryCategory category = MemoryCategory::Activation;
  int64_t bytes = 0;
  int64_t tensors = 0;
  DimVector largest_shape;  // of its largest live tensor (empty when not known)
  DType largest_dtype = kFloat32;
  int64_t largest_bytes = 0;
  /// "src/models/gpt.cpp:88 (Addmm)": the key LeakWatch compares across steps.
  std::string label() const;
};

/// One live tensor's storage.
struct TensorUsage {
  std::string site;
  std::string op;
  MemoryCategory category = MemoryCategory::Activation;
  int64_t bytes = 0;
  DimVector shape;  // as created (empty when not known, e.g. workspace)
  DType dtype = kFloat32;
  bool has_shape = false;
};

/// What is live now (or was at the peak), by category and, with history, by call site.
struct Snapshot {
  Stats stats;
  bool history = false;              // false: only `stats` is filled
  std::vector<SiteUsage> sites;      // largest first
  std::vector<TensorUsage> tensors;  // the largest live tensors, largest first (not kept for peaks)
  int64_t total_bytes = 0;           // live bytes the site table covers
};

/// Now: the `top_sites` largest sites and `top_tensors` largest tensors.
Snapshot snapshot(size_t top_sites = 20, size_t top_tensors = 20);
/// At the highest total live bytes since history started (or since
/// reset_peak_snapshot): the site table of that moment. `stats` are the current ones.
Snapshot peak_snapshot(size_t top = 20);
void reset_peak_snapshot();

/// The snapshot as JSON: {"history", "categories": {name: {"live","peak","tensors"}},
/// "sites": [...], "tensors": [...], "total_bytes", "cached_bytes", "reserved_bytes", "limit_bytes"}.
std::string snapshot_json(const Snapshot& s);
/// A plain-text table of the largest call sites (what OutOfMemory prints).
std::string format_sites(const Snapshot& s, size_t top = 10);
/// Which lever would free the most, given the live or peak bytes by category:
/// a smaller batch, activation checkpointing, bf16, sharding states, ...
std::string memory_advice(const Stats& s, bool use_peaks);

namespace detail {
/// Called by the tensor factory right after allocating a fresh storage.
void annotate(const void* data, IntArrayRef sizes, DType dtype);
/// Called when autograd records the op that produced a tensor: its storage
/// takes the op's name and call site, unless an op already claimed it.
void claim(const void* data, const char* file, uint32_t line, const char* op);
}  // namespace detail

}  // namespace kiln::memory
