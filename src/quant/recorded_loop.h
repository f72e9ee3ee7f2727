// Internal to quant: host loops over tensor memory in a training step (QAT's
// fake quantize, NF4's dequantize, a pruning mask), made replayable by
// kiln::compile (kiln/core/capture.h), as the ops layer's host_write.h does.
#pragma once

#include "kiln/core/capture.h"

namespace kiln::quant::detail {

/// Runs `loop` now and, while a capture records, records it for replay under
/// `name` (a literal), like a kernel: `loop` must capture by value what it
/// needs, with the raw data pointers of the tensors it reads and writes.
template <typename F>
void recorded_loop(const char* name, F&& loop) {
  const capture::KernelScope cap(name);
  if (cap.recording()) cap.record(capture::Replay(loop));
  loop();
}

}  // namespace kiln::quant::detail
