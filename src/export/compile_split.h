// Internal to kiln::compile: running a function whose record has graph breaks
// split at them (docs/compile.md, "Graph breaks").
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "compile_fusion.h"
#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"
#include "kiln/core/pool_frees.h"
#include "kiln/export/compile.h"

namespace kiln::compile_detail {

/// The recorder a split call runs the function under. It holds the kernels
/// that can wait instead of running them, and runs what it holds — fused as a
/// replay's kernels are — when host code needs results: a graph break, a host
/// action, a kernel that cannot wait (capture.h sends each of these a sync())
/// and the function's return (the caller's sync("the return")). Each such run is one graph;
/// the function's own host code runs as written. The tensors the function makes
/// come from `pool`, whose frees tell fusion which intermediates die in a graph;
/// blocks freed to the shared cache wait until the kernels held so far have run.
class Deferrer : public capture::Recorder, public capture::LoopSink {
 public:
  Deferrer(memory::PrivatePool& pool, bool fuse);
  ~Deferrer() override;
  Deferrer(const Deferrer&) = delete;
  Deferrer& operator=(const Deferrer&) = delete;

  void kernel(const char* name, capture::Replay replay) override;
  void host_action(const char*, capture::Replay) override {}  // not sent to a deferring recorder
  void loop(const capture::Loop& l, capture::LoopRun run) override;
  void reduction(capture::Reduction r) override;
  void graph_break(const std::string& what) override;
  const void* keep(const void* p, int n) override;
  void sync(const char* before) override;

  /// The runs of held kernels so far, and what came after each.
  std::vector<CompileStats::SplitGraph> graphs_run;

 private:
  void run(std::string before);  // with something held
  struct alignas(16) Bytes16 {
    unsigned char bytes[16];
  };
  std::vector<std::pair<void*, size_t>> take_frees();

  // First, so that it ends last: what the held closures free as they go is held too.
  memory::HoldFrees hold_;
  memory::PrivatePool& pool_;
  bool fuse_;
  std::vector<Recorded> held_;
  // Kept for the whole call: an op may take a scalar's stable copy before a sync and hand it
  // to a kernel after. A deque: the addresses handed out stay put.
  std::deque<Bytes16> kept_;
};

}  // namespace kiln::compile_detail
