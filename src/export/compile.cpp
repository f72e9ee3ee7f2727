// kiln::compile (include/kiln/export/compile.h): captures, guards, replays.
//
// A capture is an eager run with a capture::Recorder installed and the
// entry's private pool as the thread's allocator: what it records is a flat
// list of closures (kernels with their pointers, host actions) that replay
// runs in order. The guards say when that list computes what the function
// would: the same input shapes and dtypes, grad mode, autocast, the modules'
// training flags, and the same parameter tensors (a record that found an
// autocast or packed copy of one made before its capture, and holds it as it
// is, is also dropped when that tensor changes outside the function).
// Before the first replay, runs of elementwise kernels are fused
// (compile_fusion.h).
#include "kiln/export/compile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "compile_fusion.h"
#include "compile_rewrite.h"
#include "compile_split.h"
#include "kiln/core/allocator.h"
#include "kiln/core/autocast.h"
#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"
#include "kiln/core/capture_ops.h"
#include "kiln/core/error.h"
#include "kiln/core/format.h"
#include "kiln/core/guards.h"
#include "kiln/core/pool_frees.h"
#include "kiln/core/threads.h"

namespace kiln {

namespace {

bool log_enabled() {
  static const bool on = [] {
    const char* s = std::getenv("KILN_COMPILE_LOG");
    return s && *s && std::strcmp(s, "0") != 0;
  }();
  return on;
}

bool profile_enabled() {
  static const bool on = [] {
    const char* s = std::getenv("KILN_COMPILE_PROFILE");
    return s && *s && std::strcmp(s, "0") != 0;
  }();
  return on;
}

std::string sizes_str(IntArrayRef s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

struct InputKey {
  DimVector sizes;
  DType dtype = DType::Float32;
};

struct TensorGuard {
  std::string name;  // "fc1.weight"
  Tensor tensor;     // the tensor captured (identity)
  uint32_t version = 0;
  const Tensor* slot = nullptr;  // the module's slot that held it
  const void* data = nullptr;    // and its data then
};

/// "" when every tensor still has the version it had when the compiled function last returned.
std::string check_versions(const std::vector<TensorGuard>& last) {
  for (const TensorGuard& tg : last) {
    if (tg.tensor.version() != tg.version) {
      std::ostringstream why;
      why << "'" << tg.name << "' was modified outside the compiled function (version " << tg.tensor.version()
          << ", expected " << tg.version << ")";
      return why.str();
    }
  }
  return {};
}

struct ModuleGuard {
  std::string label;  // "modules[0] (MLP)"
  nn::Module* module = nullptr;
  std::vector<nn::Module*> all;  // itself and its submodules, at capture
  std::vector<uint8_t> training;
};

/// Everything a replay assumes about the world.
struct Guards {
  std::vector<InputKey> inputs;
  int threads = 1;  // oneDNN picks layouts and packs weights per thread count
  bool grad_mode = true;
  bool inference_mode = false;
  bool autocast = false;
  DType autocast_dtype = DType::BFloat16;
  std::vector<ModuleGuard> modules;
  std::vector<TensorGuard> tensors;  // parameters and buffers of the modules
  // Parameters whose .grad at the call's start is what the step's backward accumulates into
  // (no zero_grad inside resets it first): None, or the data of the tensor it adds into.
  struct GradGuard {
    size_t tensor;     // index into `tensors`
    const void* data;  // nullptr: None
  };
  std::vector<GradGuard> grads;
  uint64_t structure_epoch = 0;  // nn::Module::structure_epoch() when the above were last enumerated
};

const char* on_off(bool b) { return b ? "enabled" : "disabled"; }

Guards current_guards(const std::vector<Tensor>& inputs, const CompileOptions& opts) {
  Guards g;
  for (const Tensor& t : inputs) g.inputs.push_back({DimVector(t.sizes()), t.dtype()});
  g.threads = get_num_threads();
  g.structure_epoch = nn::Module::structure_epoch();
  g.grad_mode = grad_mode_enabled();
  g.inference_mode = inference_mode_enabled();
  g.autocast = autocast_enabled();
  if (g.autocast) g.autocast_dtype = autocast_dtype();
  for (size_t i = 0; i < opts.modules.size(); ++i) {
    nn::Module* m = opts.modules[i];
    ModuleGuard mg;
    mg.label = "modules[" + std::to_string(i) + "] (" + m->type_name() + ")";
    mg.module = m;
    mg.all = m->modules();
    for (nn::Module* sub : mg.all) mg.training.push_back(sub->is_training() ? 1 : 0);
    g.modules.push_back(std::move(mg));
    for (auto& [n, slot] : m->named_tensor_slots())
      g.tensors.push_back({n, *slot, slot->version(), slot, slot->data_ptr()});
  }
  return g;
}

/// Why `g` does not hold now, or "" when it does.
// Called on every call: nothing is formatted unless a guard fails.
std::string check_guards(Guards& g, const std::vector<Tensor>& inputs) {
  if (inputs.size() != g.inputs.size())
    return "the number of inputs: " + std::to_string(inputs.size()) + ", captured with " +
           std::to_string(g.inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    const InputKey& k = g.inputs[i];
    if (t.dtype() != k.dtype)
      return "input " + std::to_string(i) + ": dtype " + std::string(dtype_name(t.dtype())) + ", captured with " +
             std::string(dtype_name(k.dtype));
    if (t.sizes() != IntArrayRef(k.sizes))
      return "input " + std::to_string(i) + ": sizes " + sizes_str(t.sizes()) + ", captured with " + sizes_str(k.sizes);
  }
  if (get_num_threads() != g.threads)
    return "threads: " + std::to_string(get_num_threads()) + ", captured with " + std::to_string(g.threads);
  if (grad_mode_enabled() != g.grad_mode)
    return std::string("grad mode: ") + on_off(grad_mode_enabled()) + ", captured " + on_off(g.grad_mode);
  if (inference_mode_enabled() != g.inference_mode)
    return std::string("inference mode: ") + on_off(inference_mode_enabled()) + ", captured " +
           on_off(g.inference_mode);
  const bool ac = autocast_enabled();
  if (ac != g.autocast || (ac && autocast_dtype() != g.autocast_dtype)) {
    auto desc = [](bool on, DType d) { return on ? "autocast to " + std::string(dtype_name(d)) : std::string("off"); };
    return "autocast: " + desc(ac, ac ? autocast_dtype() : g.autocast_dtype) + ", captured " +
           desc(g.autocast, g.autocast_dtype);
  }
  // No module anywhere registered a slot or child since the guards were enumerated: the
  // cached module and slot pointers still describe the modules, and checking them is cheap.
  const uint64_t epoch = nn::Module::structure_epoch();
  if (epoch != g.structure_epoch) {
    size_t k = 0;
    for (const ModuleGuard& mg : g.modules) {
      if (mg.module->modules() != mg.all) return mg.label + ": its submodules changed";
      for (auto& [n, slot] : mg.module->named_tensor_slots()) {
        if (k >= g.tensors.size() || g.tensors[k].name != n) return mg.label + ": its parameters and buffers changed";
        g.tensors[k++].slot = slot;
      }
    }
    if (k != g.tensors.size()) return "the modules' parameters and buffers changed";
    g.structure_epoch = epoch;
  }
  for (const ModuleGuard& mg : g.modules) {
    for (size_t j = 0; j < mg.all.size(); ++j) {
      const nn::Module* m = mg.all[j];
      if ((m->is_training() ? 1 : 0) != mg.training[j]) {
        std::ostringstream why;
        why << mg.label << ": " << (j ? "submodule " + std::to_string(j) + " (" + m->type_name() + ")" : "the module")
            << " is in " << (m->is_training() ? "training" : "eval") << " mode, captured in "
            << (mg.training[j] ? "training" : "eval") << " mode";
        return why.str();
      }
    }
  }
  // A replaced parameter (another tensor in the slot, or new data under it).
  for (const TensorGuard& tg : g.tensors) {
    if (tg.slot->impl() != tg.tensor.impl() || tg.slot->data_ptr() != tg.data)
      return "'" + tg.name + "' is another tensor than at capture";
  }
  // Gradient accumulation: a record that set .grad must not run over one that holds a
  // gradient, and one that adds into a .grad must find that tensor there.
  for (const Guards::GradGuard& gg : g.grads) {
    const Tensor& grad = g.tensors[gg.tensor].tensor.grad();
    const void* now = grad.defined() ? grad.data_ptr() : nullptr;
    if (now == gg.data) continue;
    const std::string name = "'" + g.tensors[gg.tensor].name + "'.grad";
    if (!gg.data) return name + " holds a gradient, captured None (the step accumulates into it)";
    if (!now) return name + " is None, captured holding a gradient the step adds to";
    return name + " is another tensor than the one the step added to at capture";
  }
  return {};
}

struct alignas(16) Bytes16 {
  unsigned char bytes[16];
};

using compile_detail::EventOrigin;
using compile_detail::Recorded;

class StepRecorder : public capture::Recorder, public capture::LoopSink, public capture::OpSink {
 public:
  // The pool keeps a list of the blocks freed into it until finish().
  explicit StepRecorder(memory::PrivatePool& pool) : pool_(pool) { memory::log_pool_frees(pool_, true); }

  void kernel(const char* name, capture::Replay replay) override { add(name, false, std::move(replay)); }
  void host_action(const char* name, capture::Replay replay) override { add(name, true, std::move(replay)); }
  // Right after kernel(): the loop of the kernel just recorded.
  void loop(const capture::Loop& l, capture::LoopRun run) override {
    if (!ops.empty() && !ops.back().host)
      ops.back().loop =
          std::make_shared<const compile_detail::LoopRecord>(compile_detail::LoopRecord{l, std::move(run)});
  }
  // Right after kernel(): how the reduction just recorded cuts its input.
  void reduction(capture::Reduction r) override {
    if (!ops.empty() && !ops.back().host) ops.back().reduce = std::make_shared<const capture::Reduction>(std::move(r));
  }
  // Right after kernel(): the operands of the kernel just recorded, for the rewrites.
  void operands(const capture::Operands& o, capture::OperandsRun run) override {
    if (!ops.empty() && !ops.back().host)
      ops.back().operands =
          std::make_shared<const compile_detail::OperandsRecord>(compile_detail::OperandsRecord{o, std::move(run)});
  }
  void scalar(double v) override {
    if (!ops.empty() && !ops.back().host) ops.back().scalar = v;
  }
  void watched(uint32_t id, const void* data, const char* role) override {
    watch_index[id] = watches.size();
    watches.push_back({id, data, role, ops.size(), {}});
  }
  void watched_access(uint32_t id) override {
    const auto it = watch_index.find(id);
    if (it != watch_index.end()) watches[it->second].accesses.push_back(ops.size());
  }
  /// At the end of the capture: the blocks freed after the last event.
  std::vector<std::pair<void*, size_t>> finish() {
    auto frees = take_frees();
    memory::log_pool_frees(pool_, false);
    return frees;
  }
  void backward_ran() override { ran_backward = true; }
  // Each forward event recorded inside a public op is charged to the outermost one, and to
  // the line that op noted (kiln/core/capture_ops.h); events of a backward keep the engine's
  // pinned site: the node and its forward's line.
  void op_enter(std::string_view name) override {
    if (op_depth_++ == 0) {
      op_first_ = ops.size();
      op_name_ = name;
    }
  }
  void op_exit() override {
    if (--op_depth_ != 0) return;
    const memory::AllocSite now = memory::current_alloc_site();
    const bool noted = take_note();
    for (size_t i = op_first_; i < ops.size(); ++i) {
      EventOrigin& o = ops[i].origin;
      if (o.backward) continue;
      o.op = std::string(op_name_);
      o.file = noted ? now.file : nullptr;
      o.line = noted ? now.line : 0;
    }
  }
  // A leaf's first accumulation depends on the call's starting state unless a zero_grad of
  // the step reset it first.
  void grad_before_accumulation(const Tensor& leaf, const Tensor& grad) override {
    if (seen.insert(leaf.impl()).second) first_grads.push_back({leaf, grad});
  }
  void grad_reset(const Tensor& leaf) override { seen.insert(leaf.impl()); }
  void reused_derivation(const char* what, const Tensor& source) override {
    reused.push_back({what, source, source.version()});
  }
  void graph_break(const std::string& what) override {
    const memory::AllocSite s = memory::current_alloc_site();
    GraphBreak b{what, {}};
    if (s.file) b.site = std::string(s.file) + ":" + std::to_string(s.line);
    breaks.push_back(std::move(b));
  }
  const void* keep(const void* p, int n) override {
    Bytes16& b = kept.emplace_back();
    std::memcpy(b.bytes, p, static_cast<size_t>(n < 16 ? n : 16));
    return b.bytes;
  }
  std::vector<Recorded> ops;
  std::vector<GraphBreak> breaks;
  bool ran_backward = false;
  struct Reused {
    const char* what;
    Tensor source;
    uint32_t version;  // when the capture used the copy
  };
  std::vector<Reused> reused;
  std::unordered_set<const void*> seen;                // leaves reset or accumulated into so far
  std::vector<std::pair<Tensor, Tensor>> first_grads;  // (leaf, its .grad there) when accumulated before a reset
  std::deque<Bytes16> kept;                            // deque: the addresses handed out stay put
  std::vector<compile_detail::WatchRecord> watches;    // storages watched for the rewrites
  std::unordered_map<uint32_t, size_t> watch_index;

 private:
  void add(const char* name, bool host, capture::Replay replay) {
    ops.push_back({name, host, std::move(replay), nullptr, nullptr, {}, take_frees(), nullptr, std::nullopt, origin()});
  }
  std::vector<std::pair<void*, size_t>> take_frees() { return memory::take_pool_frees(pool_); }
  // Whether a line was noted since the last call.
  bool take_note() {
    const uint64_t n = capture::site_notes();
    const bool changed = n != notes_seen_;
    notes_seen_ = n;
    return changed;
  }
  // An event's origin as it is recorded: in a backward, the node the engine pinned; inside a
  // public op, nothing yet (op_exit says); outside one (a host action such as Optimizer.step),
  // the line noted since the last op, if any.
  EventOrigin origin() {
    const memory::AllocSite s = memory::current_alloc_site();
    EventOrigin o;
    if (s.backward) {
      o.backward = true;
      if (s.op) o.op = s.op;
      o.file = s.file;
      o.line = s.line;
    } else if (op_depth_ == 0 && take_note()) {
      o.file = s.file;
      o.line = s.line;
    }
    return o;
  }
  memory::PrivatePool& pool_;
  int op_depth_ = 0;
  size_t op_first_ = 0;
  std::string_view op_name_;
  uint64_t notes_seen_ = capture::site_notes();
};

}  // namespace

struct CompiledFunction::Impl {
  struct Entry {
    Guards guards;
    std::unique_ptr<memory::PrivatePool> pool;  // with a break: the pool the split calls allocate from
    std::vector<Tensor> static_inputs;
    std::vector<Tensor> outputs;
    std::vector<Recorded> ops;
    std::deque<Bytes16> kept;  // scalar operands the ops read
    bool broken = false;       // a graph break: calls with these guards run split at their breaks
    int64_t breaks = 0;
    bool split_logged = false;  // KILN_COMPILE_LOG said how its first split call ran
    // What the record found derived before its capture and holds as it is ("a packed weight of
    // 'fc1.weight'"), or "": the record is dropped when a guarded tensor changes outside.
    std::string reuses;
    // Set when the step itself changed the source of such a copy: the next call recaptures.
    std::string stale;
    uint64_t serial = 0;  // which capture made it (the per-event profile follows the record replayed)
  };

  Fn fn;
  CompileOptions opts;
  CompileStats stats;
  std::vector<std::unique_ptr<Entry>> cache;  // newest first
  bool warned_full = false;
  uint64_t captures_made = 0;
  uint64_t profiled_serial = 0;  // the entry stats.replay_events describes (0: none)
  // The guarded tensors at the versions the last call left them (every entry shares them).
  std::vector<TensorGuard> last_versions;

  void note_versions() {
    if (last_versions.empty() && !cache.empty()) last_versions = cache.front()->guards.tensors;
    for (TensorGuard& tg : last_versions) tg.version = tg.tensor.version();
  }

  void log(const std::string& line) const {
    if (log_enabled()) std::cerr << "[kiln.compile] '" << opts.name << "': " << line << "\n";
  }

  std::vector<Tensor> run_eager(const std::vector<Tensor>& inputs) {
    ++stats.eager_calls;
    return fn(inputs);
  }

  /// A call of a function with graph breaks: it runs again, and what it launches runs as
  /// graphs split at its breaks (Deferrer). Outputs are the function's own, not static.
  std::vector<Tensor> run_split(Entry& e, const std::vector<Tensor>& inputs) {
    if (!e.pool) e.pool = std::make_unique<memory::PrivatePool>();
    compile_detail::Deferrer d(*e.pool, opts.fuse);
    std::vector<Tensor> outs;
    {
      const capture::RecorderGuard guard(&d, e.pool.get());
      const capture::LoopSinkGuard loops(&d);
      try {
        outs = fn(inputs);
      } catch (...) {
        // As eagerly, the kernels launched before the error have run when it reaches the caller.
        try {
          d.sync("an exception");
        } catch (...) {  // the first error is the one to report
        }
        throw;
      }
      d.sync("the return");
    }
    ++stats.split_calls;
    stats.split_graphs = static_cast<int64_t>(d.graphs_run.size());
    stats.split_kernels = stats.split_fused_loops = stats.split_fused_kernels = 0;
    for (const CompileStats::SplitGraph& g : d.graphs_run) {
      stats.split_kernels += g.kernels;
      stats.split_fused_loops += g.fused_loops;
      stats.split_fused_kernels += g.fused_kernels;
    }
    stats.split_graph_list = std::move(d.graphs_run);
    if (!e.split_logged) {
      e.split_logged = true;
      log("split at " + std::to_string(e.breaks) + (e.breaks == 1 ? " graph break: " : " graph breaks: ") +
          std::to_string(stats.split_kernels) + " kernels held and run as " + std::to_string(stats.split_graphs) +
          " graphs (" + std::to_string(stats.split_fused_kernels) + " elementwise kernels as " +
          std::to_string(stats.split_fused_loops) + " fused loops)");
    }
    return outs;
  }

  std::vector<Tensor> replay(Entry& e, const std::vector<Tensor>& inputs) {
    {
      const NoGradGuard no_grad;
      for (size_t i = 0; i < inputs.size(); ++i)
        if (inputs[i].data_ptr() != e.static_inputs[i].data_ptr()) e.static_inputs[i].copy_(inputs[i]);
    }
    if (opts.profile || profile_enabled()) {
      if (profiled_serial != e.serial) start_event_profile(e);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        const Recorded& r = e.ops[i];
        const auto t0 = std::chrono::steady_clock::now();
        r.fn();
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        stats.replay_ms[r.fused_name.empty() ? std::string(r.name) : r.fused_name] += ms;
        stats.replay_events[i].ms += ms;
      }
    } else {
      for (const Recorded& r : e.ops) r.fn();
    }
    ++stats.replays;
    return e.outputs;
  }

  // The per-event profile restarts with each record replayed (a recompile's, another entry's).
  void start_event_profile(const Entry& e) {
    profiled_serial = e.serial;
    stats.replay_events.clear();
    for (size_t i = 0; i < e.ops.size(); ++i) {
      const Recorded& r = e.ops[i];
      CompileStats::ReplayEvent& ev = stats.replay_events.emplace_back();
      ev.index = static_cast<int64_t>(i);
      ev.kernel = r.fused_name.empty() ? std::string(r.name) : r.fused_name;
      ev.op = r.origin.op;
      ev.backward = r.origin.backward;
      if (r.origin.file) ev.site = std::string(r.origin.file) + ":" + std::to_string(r.origin.line);
      if (r.loop) ev.elements = r.loop->loop.numel();
    }
  }

  /// Guards each parameter whose .grad the backward accumulated into with no zero_grad of
  /// the step before: the record then depends on its state when the call begins (it sets
  /// .grad when that is None, and adds into that very tensor otherwise).
  static void guard_accumulated_grads(Entry& e, const StepRecorder& rec, const std::vector<Tensor>& at_start) {
    std::unordered_map<const void*, size_t> index;
    for (size_t i = 0; i < e.guards.tensors.size(); ++i) index.emplace(e.guards.tensors[i].tensor.impl(), i);
    for (const auto& [leaf, before] : rec.first_grads) {
      const auto it = index.find(leaf.impl());
      if (it == index.end()) continue;
      const Tensor& start = at_start[it->second];
      const bool same =
          start.defined() == before.defined() && (!start.defined() || start.data_ptr() == before.data_ptr());
      if (same) e.guards.grads.push_back({it->second, before.defined() ? before.data_ptr() : nullptr});
    }
  }

  std::vector<Tensor> capture(const std::vector<Tensor>& inputs, const std::string& reason) {
    auto e = std::make_unique<Entry>();
    e->serial = ++captures_made;
    for (size_t i = 0; i < inputs.size(); ++i)
      KILN_CHECK(!inputs[i].requires_grad(), ValueError, "compile '", opts.name, "': input ", i,
                 " requires grad; a compiled step takes data as inputs and computes gradients of parameters inside");
    e->guards = current_guards(inputs, opts);
    {
      const NoGradGuard no_grad;
      for (const Tensor& t : inputs) e->static_inputs.push_back(t.clone());
    }
    std::vector<Tensor> grads_at_start;
    for (const TensorGuard& tg : e->guards.tensors) grads_at_start.push_back(tg.tensor.grad());
    e->pool = std::make_unique<memory::PrivatePool>();
    StepRecorder rec(*e->pool);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Tensor> outs;
    const uint64_t unattributed = capture::unattributed_watched_accesses();
    {
      const capture::RecorderGuard guard(&rec, e->pool.get());
      const capture::LoopSinkGuard loops(&rec);
      const capture::OpSinkGuard op_sites(&rec);
      outs = fn(e->static_inputs);
    }
    // A watched storage's bytes reached on another thread: who read them is unknown.
    const bool watches_complete = capture::unattributed_watched_accesses() == unattributed;
    std::vector<std::pair<void*, size_t>> freed_at_end = rec.finish();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats.compile_seconds += secs;
    ++stats.captures;
    if (!reason.empty()) {
      ++stats.recompiles;
      stats.recompile_reasons.push_back(reason);
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      // A step that ran backward inside returns its loss with history, which replay need not
      // keep; an output with history and no backward is for a backward outside, which replay
      // cannot feed.
      if (outs[i].defined() && outs[i].requires_grad() && !rec.ran_backward)
        rec.breaks.push_back({"output " + std::to_string(i) +
                                  " requires grad and the function ran no backward: a replay builds no autograd "
                                  "graph, so compile the whole step (forward, backward, optimizer) or run it under "
                                  "NoGradGuard",
                              {}});
    }
    for (const Tensor& t : outs) e->outputs.push_back(t.defined() ? t.detach() : t);
    stats.kernels = 0;
    stats.host_actions = 0;
    stats.ops_in_graph.clear();
    for (const Recorded& r : rec.ops) {
      ++(r.host ? stats.host_actions : stats.kernels);
      ++stats.ops_in_graph[r.name];
    }
    if (!rec.breaks.empty()) {
      for (const GraphBreak& b : rec.breaks) {
        log("graph break: " + b.reason + (b.site.empty() ? "" : " (at " + b.site + ")"));
        stats.graph_breaks.push_back(b);
      }
      KILN_CHECK(!opts.fullgraph, ValueError, "compile '", opts.name,
                 "' (fullgraph): graph break: ", rec.breaks.front().reason,
                 rec.breaks.front().site.empty() ? "" : " at ", rec.breaks.front().site);
      e->broken = true;
      e->breaks = static_cast<int64_t>(rec.breaks.size());
      e->pool.reset();
      e->static_inputs.clear();
      e->outputs.clear();
    } else {
      guard_accumulated_grads(*e, rec, grads_at_start);
      for (const StepRecorder::Reused& r : rec.reused) {
        std::string what = r.what;
        for (const TensorGuard& tg : e->guards.tensors)
          if (tg.tensor.data_ptr() == r.source.data_ptr() && tg.tensor.numel() == r.source.numel()) {
            what += " of '" + tg.name + "'";
            break;
          }
        if (e->reuses.empty()) e->reuses = what;
        if (e->stale.empty() && r.source.version() != r.version)
          e->stale = what + " was made before the capture, and the step itself changes its source";
      }
      e->ops = std::move(rec.ops);
      e->kept = std::move(rec.kept);
      stats.pool_bytes = e->pool->reserved_bytes();
      stats.fused_loops = stats.fused_kernels = stats.unwritten_bytes = 0;
      stats.rewrites = stats.rewrite_unwritten_bytes = stats.pool_weight_grad_rewrites = stats.conv_pool_rewrites = 0;
      if (opts.rewrite && watches_complete) {
        const size_t recorded = e->ops.size();
        const compile_detail::RewriteReport rr =
            compile_detail::rewrite_relu_pooling(e->ops, rec.watches, freed_at_end);
        stats.rewrites = rr.relu_pools;
        stats.rewrite_unwritten_bytes = rr.unwritten_bytes;
        for (const std::string& line : rr.lines) log(line);
        std::vector<compile_detail::WatchRecord> watches = compile_detail::remap_watches(rec.watches, rr.map, recorded);
        const size_t after_relu = e->ops.size();
        const compile_detail::RewriteReport cp = compile_detail::rewrite_conv_pools(e->ops, watches, freed_at_end);
        stats.conv_pool_rewrites = cp.conv_pools;
        stats.rewrite_unwritten_bytes += cp.unwritten_bytes;
        for (const std::string& line : cp.lines) log(line);
        watches = compile_detail::remap_watches(watches, cp.map, after_relu);
        const compile_detail::RewriteReport pw =
            compile_detail::rewrite_pool_weight_grads(e->ops, watches, freed_at_end);
        stats.pool_weight_grad_rewrites = pw.pool_weight_grads;
        stats.rewrite_unwritten_bytes += pw.unwritten_bytes;
        for (const std::string& line : pw.lines) log(line);
      }
      if (opts.fuse) {
        const compile_detail::FusionReport fr = compile_detail::fuse_elementwise(e->ops, freed_at_end);
        stats.fused_loops = fr.groups;
        stats.fused_kernels = fr.kernels;
        stats.unwritten_bytes = fr.unwritten_bytes;
        for (const std::string& line : fr.lines) log("fused: " + line);
      }
      // The record needs nothing more about memory.
      for (Recorded& r : e->ops) std::vector<std::pair<void*, size_t>>().swap(r.freed_before);
    }
    std::ostringstream os;
    os << (reason.empty() ? "captured" : "recompiled (" + reason + ")") << ": " << stats.kernels << " kernels, "
       << stats.host_actions << " host actions, " << format_bytes(stats.pool_bytes) << " private pool, "
       << static_cast<int64_t>(secs * 1e6) << " us";
    log(os.str());
    cache.insert(cache.begin(), std::move(e));
    return outs;
  }

  std::vector<Tensor> call(const std::vector<Tensor>& inputs) {
    // A compiled function called inside another capture is part of that one.
    if (capture::detail::t_recorder) return fn(inputs);
    std::vector<Tensor> out = dispatch(inputs);
    note_versions();
    return out;
  }

  std::vector<Tensor> dispatch(const std::vector<Tensor>& inputs) {
    std::string first_failure;
    // A replay reads parameters where they are, so a change made outside (a load_state_dict,
    // an optimizer step in another compiled function) is simply read by the next replay;
    // only records that hold a copy derived from the old values are dropped.
    if (std::string why = check_versions(last_versions); !why.empty()) {
      const size_t before = cache.size();
      std::erase_if(cache, [](const std::unique_ptr<Entry>& e) { return !e->reuses.empty(); });
      if (cache.size() != before) {
        log(why + ": " + std::to_string(before - cache.size()) +
            " record(s) holding a copy made before their capture dropped");
        first_failure = why;
      }
    }
    for (size_t i = 0; i < cache.size(); ++i) {
      Entry& e = *cache[i];
      std::string why = check_guards(e.guards, inputs);
      if (why.empty() && !e.stale.empty()) {
        std::string stale = e.stale;
        cache.erase(cache.begin() + static_cast<std::ptrdiff_t>(i));
        return capture(inputs, stale);
      }
      if (why.empty()) {
        if (i)
          std::rotate(cache.begin(), cache.begin() + static_cast<std::ptrdiff_t>(i),
                      cache.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        if (e.broken) return opts.split ? run_split(e, inputs) : run_eager(inputs);
        return replay(e, inputs);
      }
      if (first_failure.empty()) first_failure = std::move(why);
    }
    if (static_cast<int>(cache.size()) >= opts.cache_size_limit) {
      if (!warned_full) {
        warned_full = true;
        log("cache_size_limit (" + std::to_string(opts.cache_size_limit) + ") reached; running eagerly (" +
            first_failure + ")");
      }
      return run_eager(inputs);
    }
    return capture(inputs, first_failure);
  }
};

CompiledFunction::CompiledFunction(Fn fn, CompileOptions options) : impl_(std::make_unique<Impl>()) {
  KILN_CHECK(fn != nullptr, ValueError, "compile: expected a function, got an empty one");
  KILN_CHECK(options.cache_size_limit >= 1, ValueError, "compile: cache_size_limit must be at least 1, got ",
             options.cache_size_limit);
  for (size_t i = 0; i < options.modules.size(); ++i)
    KILN_CHECK(options.modules[i] != nullptr, ValueError, "compile: options.modules[", i,
               "]: expected a module, got null");
  impl_->fn = std::move(fn);
  impl_->opts = std::move(options);
}

CompiledFunction::~CompiledFunction() = default;
CompiledFunction::CompiledFunction(CompiledFunction&&) noexcept = default;
CompiledFunction& CompiledFunction::operator=(CompiledFunction&&) noexcept = default;

std::vector<Tensor> CompiledFunction::operator()(const std::vector<Tensor>& inputs) { return impl_->call(inputs); }

const CompileStats& CompiledFunction::stats() const { return impl_->stats; }

std::string CompiledFunction::explain() const {
  const CompileStats& s = impl_->stats;
  int64_t graphs = 0;
  // A function split at n breaks is n + 1 graphs, as torch counts them.
  for (const auto& e : impl_->cache) graphs += e->broken ? (impl_->opts.split ? e->breaks + 1 : 0) : 1;
  std::ostringstream os;
  os << "compiled '" << impl_->opts.name << "': " << graphs << (graphs == 1 ? " graph" : " graphs") << ", "
     << s.graph_breaks.size() << (s.graph_breaks.size() == 1 ? " graph break" : " graph breaks") << ", " << s.recompiles
     << (s.recompiles == 1 ? " recompile" : " recompiles") << "\n";
  os << "  calls: " << s.replays << " replayed, ";
  if (s.split_calls > 0) os << s.split_calls << " split at graph breaks, ";
  os << s.eager_calls << " eager, " << s.captures << " captured ("
     << static_cast<int64_t>(s.compile_seconds * 1e3 + 0.5) << " ms compiling)\n";
  os << "  newest graph: " << s.kernels << " kernels, " << s.host_actions << " host actions, private pool "
     << format_bytes(s.pool_bytes) << "\n";
  if (s.fused_loops > 0) {
    os << "  fusion: " << s.fused_kernels << " elementwise kernels run as " << s.fused_loops
       << (s.fused_loops == 1 ? " fused loop" : " fused loops");
    if (s.unwritten_bytes > 0)
      os << ", " << format_bytes(s.unwritten_bytes) << " of intermediates not written per call";
    os << "\n";
  }
  if (s.rewrites > 0 || s.pool_weight_grad_rewrites > 0 || s.conv_pool_rewrites > 0) {
    os << "  rewrites: ";
    if (s.conv_pool_rewrites > 0)
      os << s.conv_pool_rewrites << " conv2d -> max_pool2d " << (s.conv_pool_rewrites == 1 ? "pair" : "pairs")
         << " run as one, ";
    if (s.rewrites > 0)
      os << s.rewrites << " relu -> max_pool2d " << (s.rewrites == 1 ? "pair" : "pairs")
         << " run as max_pool2d(relu), ";
    if (s.pool_weight_grad_rewrites > 0)
      os << s.pool_weight_grad_rewrites << " max_pool2d backward" << (s.pool_weight_grad_rewrites == 1 ? "" : "s")
         << " read through by the conv2d weight gradient after it, ";
    os << format_bytes(s.rewrite_unwritten_bytes) << " of full-size activations and gradients not written per call\n";
  }
  if (!s.ops_in_graph.empty()) {
    os << "   ";
    for (const auto& [name, n] : s.ops_in_graph) os << " " << name << " x" << n;
    os << "\n";
  }
  if (s.split_calls > 0) {
    os << "  newest split call: " << s.split_kernels << " kernels run as " << s.split_graphs
       << (s.split_graphs == 1 ? " graph" : " graphs");
    if (s.split_fused_loops > 0)
      os << " (" << s.split_fused_kernels << " elementwise kernels as " << s.split_fused_loops
         << (s.split_fused_loops == 1 ? " fused loop)" : " fused loops)");
    os << "\n";
    // What ended each graph: a break, a host action, a kernel whose result the host reads.
    const size_t shown = std::min<size_t>(s.split_graph_list.size(), 12);
    for (size_t i = 0; i < shown; ++i) {
      const CompileStats::SplitGraph& g = s.split_graph_list[i];
      os << "    graph " << i + 1 << ": " << g.kernels << (g.kernels == 1 ? " kernel" : " kernels");
      if (g.fused_loops > 0) os << " (" << g.fused_kernels << " as " << g.fused_loops << " fused)";
      os << ", then " << g.before << "\n";
    }
    if (shown < s.split_graph_list.size()) os << "    ... " << s.split_graph_list.size() - shown << " more\n";
  }
  if (!s.graph_breaks.empty()) {
    if (impl_->opts.split)
      os << "Graph breaks (calls with these guards run split there: the kernels between breaks run as graphs, the "
            "function's host code runs on every call; to replay the rest without it, end one compiled function "
            "before the line and start another after it):\n";
    else
      os << "Graph breaks (split = false: calls with these guards run eagerly; to compile the rest, end one "
            "compiled function before the line and start another after it):\n";
    for (size_t i = 0; i < s.graph_breaks.size(); ++i) {
      os << "  " << i + 1 << ". " << s.graph_breaks[i].reason << "\n";
      if (!s.graph_breaks[i].site.empty()) os << "     at " << s.graph_breaks[i].site << "\n";
    }
  }
  if (!s.replay_ms.empty()) {
    std::vector<std::pair<double, std::string>> rows;
    double total = 0;
    for (const auto& [name, ms] : s.replay_ms) {
      rows.emplace_back(ms, name);
      total += ms;
    }
    std::sort(rows.rbegin(), rows.rend());
    os << "Replay time by kernel (KILN_COMPILE_PROFILE):\n";
    double products = 0;
    for (const auto& [ms, name] : rows) {
      char line[160];
      std::snprintf(line, sizeof(line), "  %-32s %10.3f ms  %5.1f%%\n", name.c_str(), ms,
                    total > 0 ? 100 * ms / total : 0);
      os << line;
      if (name.rfind("matmul", 0) == 0 || name.rfind("conv2d", 0) == 0) products += ms;
    }
    // Replay and fusion leave the products' kernels as they are, so what they could still save is
    // bounded by the rest: the first question when compiling did not help.
    if (total > 0) {
      char line[256];
      std::snprintf(line, sizeof(line),
                    "  products (matmul*, conv2d*) %.1f%% of the replay; the other %.1f%% bounds what further "
                    "fusion could save\n",
                    100 * products / total, 100 * (total - products) / total);
      os << line;
    }
  }
  if (!s.replay_events.empty()) {
    std::vector<const CompileStats::ReplayEvent*> rows;
    double total = 0;
    for (const CompileStats::ReplayEvent& ev : s.replay_events) {
      rows.push_back(&ev);
      total += ev.ms;
    }
    constexpr size_t kShown = 12;
    const size_t shown = std::min(kShown, rows.size());
    std::partial_sort(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(shown), rows.end(),
                      [](const auto* a, const auto* b) { return a->ms > b->ms; });
    os << "Slowest events of the record replayed last (KILN_COMPILE_PROFILE): the op and user line of each\n";
    for (size_t i = 0; i < shown; ++i) {
      const CompileStats::ReplayEvent& ev = *rows[i];
      std::string what = "#" + std::to_string(ev.index) + " " + ev.kernel;
      if (ev.elements) what += " (" + std::to_string(ev.elements) + " elements)";
      std::string who;
      if (ev.backward) {
        who = ev.site.empty() ? (ev.op.empty() ? "" : ev.op + " ") + "(backward)"
                              : (ev.op.empty() ? "backward" : ev.op) + ", backward of " + ev.site;
      } else {
        who = ev.op;
        if (!ev.site.empty()) who += (ev.op.empty() ? "at " : " at ") + ev.site;
      }
      char line[256];
      std::snprintf(line, sizeof(line), "  %-44s %10.3f ms  %5.1f%%", what.c_str(), ev.ms,
                    total > 0 ? 100 * ev.ms / total : 0);
      os << line << (who.empty() ? "" : "  ") << who << "\n";
    }
  }
  if (!s.recompile_reasons.empty()) {
    os << "Recompiles (the guard that failed):\n";
    for (size_t i = 0; i < s.recompile_reasons.size(); ++i)
      os << "  " << i + 1 << ". " << s.recompile_reasons[i] << "\n";
  }
  return os.str();
}

CompiledFunction compile(CompiledFunction::Fn fn, CompileOptions options) {
  return CompiledFunction(std::move(fn), std::move(options));
}

CompiledFunction compile(std::function<Tensor()> step, CompileOptions options) {
  KILN_CHECK(step != nullptr, ValueError, "compile: expected a function, got an empty one");
  return CompiledFunction([s = std::move(step)](const std::vector<Tensor>&) { return std::vector<Tensor>{s()}; },
                          std::move(options));
}

}  // namespace kiln
