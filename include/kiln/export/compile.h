// kiln::compile: capture a step once, replay it without the eager overheads,
// and say why it could not (graph breaks, where the step is split instead) or
// had to capture again (recompiles).
//
//   auto step = kiln::compile([&] {
//     opt.zero_grad();
//     Tensor loss = F::cross_entropy(model(x), y);
//     loss.backward();
//     opt.step();
//     return loss;
//   }, {.modules = {&model}});
//   for (...) { Tensor loss = step()[0]; }
//
// The first call runs the function eagerly while the capture hook
// (kiln/core/capture.h) records every kernel it launches, with its pointers,
// and the host actions replay must repeat (the optimizer's step, zero_grad,
// AccumulateGrad setting .grad). Every tensor the step makes comes from a
// private memory pool, reused by lifetime inside the step: that is the
// static memory plan, and it keeps the recorded addresses valid. Later calls
// whose guards hold replay the record: no dispatch, no shape checks, no
// autograd graph, no tensor allocation (kernels' own scratch still comes from
// the cache) — torch.compile's mode="reduce-overhead" (CUDA graphs) on the
// CPU. Before the first replay, runs of consecutive elementwise kernels are
// fused into tiled loops whose dying intermediates never reach memory
// (docs/compile.md, "Fusion", says what is and is not fused).
//
// As with CUDA graphs, outputs are static: each call overwrites the tensors
// the previous call returned (clone one to keep it), and inputs are copied
// into buffers the compiled function owns. Tensors the function reads that
// are neither inputs nor parameters of `modules` are read at the addresses
// they had at capture: pass anything that changes between calls as an input.
//
// A function whose record has a graph break is not replayed: from its second
// call it runs again as written, with the kernels between breaks held and run
// as fused graphs when host code needs their results (a split call; its
// outputs are its own, not static).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/nn/module.h"

namespace kiln {

struct CompileOptions {
  /// Named in logs and explain().
  std::string name = "compiled";
  /// Modules whose parameters and buffers the function uses: guarded on their
  /// training mode, their tensors' identity (storage, shape, dtype) and their
  /// versions (a change made outside the compiled function recompiles).
  std::vector<nn::Module*> modules;
  /// Captures kept for different guard values (torch's cache_size_limit);
  /// past it the function runs eagerly and says so.
  int cache_size_limit = 8;
  /// A graph break throws kiln::ValueError naming it instead of splitting there.
  bool fullgraph = false;
  /// A function with graph breaks runs split at them: the kernels between two
  /// breaks run as one graph (fused as a replay's are) while the function's
  /// host code runs as usual (docs/compile.md, "Graph breaks"). false: such
  /// calls run eagerly.
  bool split = true;
  /// Runs consecutive elementwise kernels over one shape as one tiled loop,
  /// keeping intermediates that die inside it out of memory (results are
  /// bitwise those of the unfused kernels; docs/compile.md, "Fusion").
  bool fuse = true;
  /// Runs each ReLU that only a channels-last max pool reads inside the pool,
  /// on each maximum, and its backward inside the pool's backward
  /// (docs/compile.md, "Rewrites"): the values of the recorded kernels but
  /// for the sign of a zero where a window's maximum is 0.
  bool rewrite = true;
  /// Times every replayed event (CompileStats::replay_ms by kernel name,
  /// replay_events one by one; explain() lists both). KILN_COMPILE_PROFILE=1
  /// turns it on for every compiled function. Costs a clock read per event.
  bool profile = false;
};

/// One graph break: what could not be captured and the last line of user
/// code kiln saw before it.
struct GraphBreak {
  std::string reason;
  std::string site;  // "file:line", or "" when unknown
};

/// What happened so far (explain() formats it).
struct CompileStats {
  int64_t captures = 0;     // eager runs that recorded (first call, recompiles)
  int64_t replays = 0;      // calls served by a replay
  int64_t eager_calls = 0;  // calls run eagerly (the cache was full, or split = false)
  int64_t split_calls = 0;  // calls of a function with graph breaks, run split at them
  // The newest split call: graphs run between its breaks, their kernels, and fusion in them.
  int64_t split_graphs = 0;
  int64_t split_kernels = 0;
  int64_t split_fused_loops = 0;
  int64_t split_fused_kernels = 0;
  /// Its graphs in order, and what each ran before: the graph break, a host action
  /// ("Optimizer.step"), a kernel whose result the host reads, or "the return".
  struct SplitGraph {
    int64_t kernels = 0;
    int64_t fused_loops = 0;
    int64_t fused_kernels = 0;
    std::string before;
  };
  std::vector<SplitGraph> split_graph_list;
  int64_t recompiles = 0;                       // captures made because a guard failed
  double compile_seconds = 0;                   // time spent in captures (each includes one eager run)
  int64_t kernels = 0;                          // kernels in the newest capture
  int64_t host_actions = 0;                     // host actions in it
  std::map<std::string, int64_t> ops_in_graph;  // the newest capture's record, by kernel or action name
  int64_t pool_bytes = 0;                       // its private pool
  int64_t fused_loops = 0;                      // fused loops in it
  int64_t fused_kernels = 0;                    // the elementwise kernels they run
  int64_t unwritten_bytes = 0;                  // intermediates a replay keeps in cache instead of memory
  int64_t rewrites = 0;                         // graph rewrites applied to it (ReLU-pooling pairs)
  int64_t pool_weight_grad_rewrites = 0;        // max pool backwards read through by a conv weight gradient
  int64_t conv_pool_rewrites = 0;               // convolutions run inside the max pool after them
  int64_t rewrite_unwritten_bytes = 0;          // full-size tensors the rewrites no longer write, per call
  std::vector<GraphBreak> graph_breaks;
  std::vector<std::string> recompile_reasons;  // the failed guard of each recompile
  /// With CompileOptions::profile: milliseconds spent in replays per recorded
  /// kernel or host action name, summed over replays (explain() lists them).
  std::map<std::string, double> replay_ms;
  /// With CompileOptions::profile, the record replayed last, event by event: a
  /// kernel name such as "binary" says little, so each event also names the
  /// user line whose op recorded it and, in a backward, the autograd node that
  /// ran it (explain() lists the slowest).
  struct ReplayEvent {
    int64_t index = 0;   // position in the record
    std::string kernel;  // kernel or host action ("fused(binary, unary)" for a fused loop)
    std::string op;      // the public op ("linear"), or in a backward the autograd node ("LinearBackward0");
                         // a fused loop's lists its kernels' ("gelu, mul"); "" when none ran it
    bool backward = false;
    std::string site;      // "file:line" the op noted (a backward: its forward's), or "" when unknown
    int64_t elements = 0;  // an elementwise kernel's iteration space, else 0
    double ms = 0;         // summed over the replays of this record
  };
  std::vector<ReplayEvent> replay_events;
};

class CompiledFunction {
 public:
  using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  CompiledFunction(Fn fn, CompileOptions options);
  ~CompiledFunction();
  CompiledFunction(CompiledFunction&&) noexcept;
  CompiledFunction& operator=(CompiledFunction&&) noexcept;

  /// Runs the function: replays a capture whose guards hold, else captures.
  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs = {});

  const CompileStats& stats() const;
  /// torch._dynamo.explain's vocabulary: graphs, graph breaks with their
  /// reasons and sites, recompiles with the guard that failed, compile time.
  std::string explain() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Compiles `fn` (inputs → outputs).
CompiledFunction compile(CompiledFunction::Fn fn, CompileOptions options = {});
/// Compiles a step without inputs that returns one tensor (the loss).
CompiledFunction compile(std::function<Tensor()> step, CompileOptions options = {});

}  // namespace kiln
