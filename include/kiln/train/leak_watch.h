#pragma once
// LeakWatch: notices memory that grows step after step, and says who holds it.
//
// A training loop's live memory between steps is flat once warm-up is over
// (parameters, gradients, optimizer state, the loader's batches in flight).
// When a category keeps growing — the classic case is `total += loss`, which
// keeps every step's autograd graph and its saved activations alive — the
// watch warns once, naming:
//   - the growth per step and the category;
//   - the call sites whose live tensors grow, with bytes per step (memory
//     history, kiln/core/memory_history.h);
//   - when old autograd graphs are what is kept, the line whose output keeps
//     them (the root of the kept graph: for `total += loss`, that line).
// Graphs kept after backward has freed their saved tensors grow only in
// nodes; the watch counts those too (the census) and warns the same way.
// Call step() once per training step, after the optimizer step. `kiln train`
// runs one; library users create their own. It turns on memory history and
// the graph census (kiln/autograd/graph_census.h) for its lifetime.
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kiln/autograd/graph_census.h"
#include "kiln/core/allocator.h"

namespace kiln::train {

struct LeakWatchOptions {
  /// Steps not judged at the start (optimizer state and caches appear there).
  int64_t warmup_steps = 3;
  /// A category must grow at each of this many consecutive steps.
  int64_t window = 5;
  /// ... by at least this much per step on average.
  int64_t min_growth_bytes = 1024;
  /// Also write the warning to stderr (as "kiln warning: ...").
  bool print = true;
  /// Batches the input pipeline may hold by design: the one in use, those being
  /// built and the prefetch queue. While a queue fills, data memory grows by up to
  /// a batch per step for as many steps, which is no leak: the data category must
  /// grow at more consecutive steps than this (and at least `window`).
  int64_t data_in_flight = 0;
};

/// What the watch found, once.
struct LeakReport {
  int64_t step = 0;  // the step (count of step() calls) at which it warned
  /// False when tensor bytes are flat but autograd nodes pile up: backward freed
  /// the kept graphs' saved tensors, so only their nodes grow (host memory).
  bool bytes_grow = true;
  MemoryCategory category = MemoryCategory::Activation;
  int64_t growth_per_step = 0;  // bytes, or nodes when !bytes_grow
  int64_t live_bytes = 0;
  /// Call sites whose live bytes grew over the window: label and bytes per step, largest first.
  std::vector<std::pair<std::string, int64_t>> growing_sites;
  /// The kept autograd graph, when old graphs are alive.
  std::optional<autograd::KeptGraph> graph;
  std::string message;
};

class LeakWatch {
 public:
  explicit LeakWatch(LeakWatchOptions options = {});
  ~LeakWatch();
  LeakWatch(const LeakWatch&) = delete;
  LeakWatch& operator=(const LeakWatch&) = delete;

  /// Once per training step. Returns the report the one time the watch warns, else nullptr.
  const LeakReport* step();
  const std::optional<LeakReport>& report() const { return report_; }
  int64_t steps() const { return steps_; }

 private:
  struct Sample {
    std::array<int64_t, kNumMemoryCategories> live{};
    std::map<std::string, int64_t> sites;  // label + category -> live bytes
    uint64_t mark = 0;                     // autograd sequence number at the end of the step
    int64_t nodes = 0;                     // live nodes in the census
  };
  Sample sample() const;
  /// `category` < 0: the census grew, not tensor bytes.
  LeakReport explain(int category, const Sample& first, const Sample& last, int64_t window) const;
  int64_t window_of(int category) const;

  LeakWatchOptions options_;
  bool owns_history_ = false;
  autograd::GraphCensusGuard census_;
  std::deque<Sample> samples_;
  int64_t steps_ = 0;
  std::optional<LeakReport> report_;
};

}  // namespace kiln::train
