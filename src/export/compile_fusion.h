// Internal to kiln::compile: the record of a captured step and the fusion
// pass that runs over it before the first replay (docs/compile.md, "Fusion").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"

namespace kiln::compile_detail {

/// An elementwise kernel's loop and how to run it over part of that loop.
struct LoopRecord {
  capture::Loop loop;
  capture::LoopRun run;
};

/// A kernel's operands and how to run it on other buffers (graph rewrites).
struct OperandsRecord {
  capture::Operands ops;
  capture::OperandsRun run;
};

/// What ran an event, for the per-event profile (CompileStats::replay_events,
/// kiln/core/capture_ops.h): the public op ("linear") and the user line it
/// noted, or in a backward the autograd node and its forward's line; a fused
/// loop lists its kernels' ops (distinct, in order) and keeps the first line.
struct EventOrigin {
  std::string op;
  const char* file = nullptr;  // null: no line known
  uint32_t line = 0;
  bool backward = false;
};

/// One recorded event of a captured step.
struct Recorded {
  const char* name;
  bool host;
  capture::Replay fn;
  std::shared_ptr<const LoopRecord> loop;            // set for elementwise kernels
  std::shared_ptr<const capture::Reduction> reduce;  // set for reductions of a whole array to one value
  std::string fused_name;                            // "fused(binary, unary)" once fusion made it; else empty
  // Private-pool blocks (address, bytes) freed after the previous event and before this one.
  std::vector<std::pair<void*, size_t>> freed_before;
  std::shared_ptr<const OperandsRecord> operands;  // set for kernels that described their operands
  std::optional<double> scalar;                    // an elementwise kernel's scalar parameter, when it noted one
  EventOrigin origin;
};

struct FusionReport {
  int64_t groups = 0;              // fused loops made
  int64_t kernels = 0;             // elementwise kernels they replaced
  int64_t unwritten_bytes = 0;     // per call: intermediates kept in a tile-sized scratch instead of memory
  std::vector<std::string> lines;  // one per fused loop, for the log
};

/// Replaces runs of consecutive elementwise kernels over the same iteration
/// space, whose operands are either the same elements or disjoint, by one
/// loop over tiles of that space; a reduction of a run's result to one value
/// that follows the run joins it, reducing each tile as it is made. `freed_at_end`: blocks freed after the last
/// event. Results are bitwise those of the kernels run one after another.
FusionReport fuse_elementwise(std::vector<Recorded>& ops, const std::vector<std::pair<void*, size_t>>& freed_at_end);

}  // namespace kiln::compile_detail
