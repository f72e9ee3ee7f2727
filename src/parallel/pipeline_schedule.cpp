// The order of each stage's forwards and backwards under GPipe and 1F1B, and
// the bubble model.
//
// Note [Pipeline schedules]
// With p stages and M micro-batches, F(m) and B(m) on stage s can run once
// F(m) ran on stage s-1 (its activations arrived) and, for B(m), once B(m) ran
// on stage s+1 (the gradient of its output arrived). Counting each op as one
// slot, the first stage's first backward cannot start before slot 2p-1 and the
// last forward of the last stage not before M+p-1: every schedule that keeps
// the micro-batches in order needs 2(M+p-1) slots for 2M slots of work per
// stage, a bubble of (p-1)/(M+p-1).
//
// GPipe: F(0..M-1), then B(0..M-1). Every stage holds the activations of all
// M micro-batches when its backwards start.
//
// 1F1B (PipeDream-Flush, Megatron's default): stage s runs w = min(p-1-s, M)
// forwards (warm-up), then alternates F(w+i), B(i) (steady state), then the
// remaining backwards (cool-down). The bubble is the same; what changes is
// memory: stage s holds at most w+1 = p-s micro-batches' activations, not M.
#include <algorithm>

#include "kiln/core/error.h"
#include "kiln/parallel/pipeline.h"

namespace kiln::parallel {

const char* schedule_name(Schedule s) { return s == Schedule::GPipe ? "GPipe" : "1F1B"; }

std::vector<PipelineOp> schedule_ops(Schedule schedule, int stage, int num_stages, int64_t micro_batches) {
  KILN_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, ValueError,
             "parallel::schedule_ops: expected 0 <= stage < num_stages, got stage ", stage, " of ", num_stages);
  KILN_CHECK(micro_batches >= 1, ValueError, "parallel::schedule_ops: expected at least one micro-batch, got ",
             micro_batches);
  std::vector<PipelineOp> ops;
  ops.reserve(static_cast<size_t>(2 * micro_batches));
  if (schedule == Schedule::GPipe) {
    for (int64_t m = 0; m < micro_batches; ++m) ops.push_back({true, m});
    for (int64_t m = 0; m < micro_batches; ++m) ops.push_back({false, m});
    return ops;
  }
  const int64_t warm = std::min<int64_t>(num_stages - 1 - stage, micro_batches);
  for (int64_t m = 0; m < warm; ++m) ops.push_back({true, m});
  for (int64_t i = 0; i + warm < micro_batches; ++i) {
    ops.push_back({true, warm + i});
    ops.push_back({false, i});
  }
  for (int64_t m = micro_batches - warm; m < micro_batches; ++m) ops.push_back({false, m});
  return ops;
}

double model_bubble(int num_stages, int64_t micro_batches) {
  return static_cast<double>(num_stages - 1) / static_cast<double>(micro_batches + num_stages - 1);
}

}  // namespace kiln::parallel
