// Internal to the ops layer: host code that writes tensor memory, made
// replayable by kiln::compile (kiln/core/capture.h).
//
// A compiled step replays the kernels it recorded and nothing else, so a loop
// over data_ptr<T>() in an op (arange's values, index_put's writes, the
// running statistics of batch norm) must be recorded like a kernel: it runs
// as `write`, a closure that captures by value everything host-side it needs
// and the raw data pointers of the tensors it touches (replay reuses those
// addresses: they stay reserved in the capture's private pool). The scope
// also keeps the kernels `write` calls from being recorded a second time.
//
// `write` is copied into the record only while recording: capture a large
// host vector by move (or build a copy only then) to keep eager calls cheap.
#pragma once

#include <utility>

#include "kiln/core/capture.h"

namespace kiln::ops {

/// Runs `write` now and, while a capture records, records it for replay under
/// `name` (a literal).
template <typename F>
void host_write(const char* name, F&& write) {
  const capture::KernelScope cap(name);
  if (cap.recording()) cap.record(capture::Replay(write));
  std::forward<F>(write)();
}

}  // namespace kiln::ops
