// kiln::profiler — where every millisecond and byte of a step goes, as
// torch.profiler answers it: a Chrome trace (Perfetto, chrome://tracing), an
// op table grouped by name (key_averages), a per-step breakdown, and a memory
// timeline per category with its peak.
//
// The profiler listens on core's record hook (kiln/core/record.h): ops, the
// autograd engine, optimizers, the data loader, collectives and checkpoints
// open record scopes, the allocator reports allocations. It is compiled in
// always; with no Profiler recording, each of those sites costs one flag test.
//
//   profiler::Profiler prof({.schedule = profiler::Schedule{.wait = 1, .warmup = 1, .active = 3}});
//   prof.start();
//   for (...) { train_step(); prof.step(); }
//   prof.stop();
//   std::cout << prof.table();
//   prof.export_chrome_trace("trace.json");
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/core/record.h"

namespace kiln::profiler {

/// torch.profiler.schedule: skip `skip_first` steps, then cycles of `wait`
/// idle steps, `warmup` steps recorded and discarded, and `active` steps kept;
/// `repeat` cycles (0: until stopped). Without a schedule everything between
/// start() and stop() is kept.
struct Schedule {
  int64_t skip_first = 0;
  int64_t wait = 0;
  int64_t warmup = 0;
  int64_t active = 1;
  int64_t repeat = 1;
};

struct Options {
  bool use_schedule = false;
  Schedule schedule;
  bool record_shapes = true;   // input shapes and dtypes per op (group_by_input_shape needs them)
  bool profile_memory = true;  // allocation events, the memory timeline and its peak
  int rank = 0;                // the trace's process id (one process per rank)
  std::string process_name;    // "rank 0" when empty
  /// Called when an active window closes (after its last active step), as torch's on_trace_ready;
  /// also by stop() inside an active window, and without a schedule by stop() (not by the destructor).
  std::function<void(class Profiler&)> on_trace_ready;
};

/// One row of key_averages(): every event of one name (and shapes, when grouped by them).
struct OpStats {
  std::string name;
  std::string kind;          // record::kind_name of its events
  std::string input_shapes;  // "[[32, 784], [784, 256]]" when grouped by shapes, else ""
  int64_t calls = 0;
  int64_t self_ns = 0;  // total minus the time of scopes nested in it on the same thread
  int64_t total_ns = 0;
  double flops = 0;         // summed analytic FLOPs (products, convolutions)
  int64_t bytes = 0;        // summed payload bytes (collectives, data, checkpoints)
  int64_t alloc_bytes = 0;  // allocated while it was the innermost scope
  int64_t freed_bytes = 0;
  double gflops_per_s() const;  // flops / total time (0 when no FLOPs)
};

/// Where one step's wall time went. Categories do not overlap and sum to total_ms.
struct StepBreakdown {
  int64_t step = 0;
  double total_ms = 0;
  double data_ms = 0;  // waiting for the next batch
  double forward_ms = 0;
  double backward_ms = 0;
  double optimizer_ms = 0;
  double comm_exposed_ms = 0;  // collective waits on the training thread not hidden behind compute
  double other_ms = 0;
};

/// Live bytes per memory category over the recorded window.
struct MemoryTimeline {
  struct Point {
    int64_t time_ns = 0;  // since the profiler's start(), as the trace's timestamps
    std::array<int64_t, kNumMemoryCategories> live{};
    int64_t total = 0;
  };
  /// The live bytes when the window began, then one point per allocation or
  /// free, in time order. Empty when Options::profile_memory is off.
  std::vector<Point> points;
  std::array<int64_t, kNumMemoryCategories> peak{};  // highest live bytes per category in the window
  int64_t peak_total = 0;
  int64_t peak_time_ns = 0;
  /// The largest tensors live at the total peak, with the call sites that made them
  /// ("src/models/gpt.cpp:88 (Addmm)"), when memory history was recording.
  std::vector<std::string> live_at_peak;
};

class Profiler {
 public:
  explicit Profiler(Options options = {});
  ~Profiler();  // stops recording if still started
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void start();
  void stop();
  /// Marks a step boundary (torch's prof.step()): closes "ProfilerStep#N", advances the schedule.
  /// start(), step() and stop() belong on one thread: the step scope is on its scope stack.
  void step();
  /// True while events are being kept or warmed up (the schedule's warmup and active steps).
  bool recording() const;
  int64_t step_num() const;

  /// The kept events (the last completed active window with a schedule; everything otherwise).
  std::vector<OpStats> key_averages(bool group_by_input_shape = false) const;
  /// key_averages as a text table sorted by "self" (self time), "total", "calls" or "flops".
  std::string table(const std::string& sort_by = "self", size_t row_limit = 20,
                    bool group_by_input_shape = false) const;
  /// key_averages as JSON: {"rows": [{name, kind, input_shapes, calls, self_us, total_us, flops, gflops_per_s, ...}]}.
  std::string key_averages_json(bool group_by_input_shape = false) const;
  std::vector<StepBreakdown> step_breakdown() const;
  MemoryTimeline memory_timeline() const;
  /// Trace Event Format JSON: pid = rank, a track per thread, flow arrows from
  /// each forward op to the backward node it created, collectives on their own
  /// track, memory counters per category.
  void export_chrome_trace(const std::string& path) const;
  std::string chrome_trace_json() const;
  size_t num_events() const;
  /// Notes "now" as the moment a cross-rank barrier completed; merge_traces aligns ranks on it.
  void mark_clock_sync();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// A user range in the trace and the table (torch.profiler.record_function).
class Range {
 public:
  explicit Range(std::string name);
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  std::string name_;
  record::Scope scope_;
};

/// Merges per-rank traces (each written by export_chrome_trace with its own
/// rank) into one file, shifting each rank's clock so their clock-sync marks
/// coincide. Throws kiln::ValueError naming the file that is not a kiln trace.
void merge_traces(const std::vector<std::string>& inputs, const std::string& output);

}  // namespace kiln::profiler
