// What the allocator tells memory history (memory_history.cpp) about each block.
// Private to core: the public side is kiln/core/memory_history.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kiln/core/allocator.h"

namespace kiln::memory::history {

/// Read on every allocation: a relaxed load when off, nothing more.
extern std::atomic<bool> g_recording;
/// Blocks in the table: frees look the block up only while some are.
extern std::atomic<int64_t> g_tracked;

/// `size` is the rounded size; `total_live` the allocator's live bytes after this block.
void on_alloc(void* p, size_t size, MemoryCategory category, int64_t total_live);
void on_free(void* p);
void on_recharge(void* p, MemoryCategory to);
/// The live-site table and advice that OutOfMemory appends (empty without history).
std::string oom_report(size_t top);

}  // namespace kiln::memory::history
