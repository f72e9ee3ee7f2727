// The backward engine. See include/kiln/autograd/engine.h.
#include "kiln/autograd/engine.h"
#include "kiln/autograd/grad_math.h"

#include "kiln/core/autocast.h"

#include <algorithm>
#include <optional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "kiln/autograd/anomaly.h"
#include "kiln/autograd/autograd_meta.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/autocast.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/core/record.h"

namespace kiln::autograd {

namespace {

// Seeds the graph: its next edges are the roots' gradient edges.
class GraphRoot final : public Node {
 public:
  GraphRoot(std::vector<Edge> edges, TensorList grads) : grads_(std::move(grads)) {
    for (auto& e : edges) add_next_edge(std::move(e));
  }
  const char* name() const override { return "GraphRoot"; }
  TensorList apply(TensorList&&) override { return grads_; }

 private:
  TensorList grads_;
};

// Sums the gradient of a broadcast input back to the input's shape.
Tensor sum_to_shape(const Tensor& g, IntArrayRef shape) {
  if (g.sizes() == shape) return g;
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  DimVector dims;
  for (int64_t d = 0; d < g.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.sizes()[d] != 1)) dims.push_back(d);
  }
  Tensor r = dims.empty() ? g : grad_math().sum(g, dims.ref(), /*keepdim=*/true);
  return lead > 0 || !dims.empty() ? grad_math().view(r, shape) : r;
}

bool broadcastable_to(IntArrayRef from, IntArrayRef to) {
  if (from.size() < to.size()) return false;
  const size_t lead = from.size() - to.size();
  for (size_t i = 0; i < to.size(); ++i) {
    if (to[i] != 1 && from[lead + i] != to[i]) return false;
  }
  return true;
}

Tensor validate_grad(const Node& node, size_t i, const Tensor& g, const InputMeta& meta) {
  if (!g.defined()) return g;
  Tensor out = g;
  if (g.sizes() != meta.shape.ref()) {
    KILN_CHECK(broadcastable_to(g.sizes(), meta.shape), ShapeError, "autograd: ", node.name(),
               " returned a gradient of shape ", g.sizes(), " for output ", i, " of shape ", meta.shape, " (",
               node.site().known() ? "forward at " + node.site().str() : std::string("forward site unknown"),
               "); the shapes must match or the gradient must broadcast to the output");
    out = sum_to_shape(g, meta.shape);
  }
  if (out.dtype() != meta.dtype) {
    KILN_CHECK(out.is_floating_point() && is_floating_point(meta.dtype), DTypeError, "autograd: ", node.name(),
               " returned a gradient of dtype ", dtype_name(out.dtype()), " for an input of dtype ",
               dtype_name(meta.dtype));
    out = grad_math().to(out, meta.dtype);
  }
  return out;
}

void accumulate_into(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? grad_math().add(slot, g) : g;
}

// Whether t's elements fill a block of memory once each, in any order of
// dimensions (row-major, channels-last, a transpose's): strides that, sorted,
// are each the next one's times its size, ending in 1. Size-1 dimensions are
// free to have any stride.
bool dense_non_overlapping(const Tensor& t) {
  DimVector order;  // the dimensions that step, innermost (smallest stride) first
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) order.push_back(d);
  std::sort(order.data(), order.data() + order.size(), [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t expected = 1;
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t d = order.data()[i];
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// A node's input buffer receiving a second gradient: summed in place when the
// buffer is the only reference to its tensor (torch's InputBuffer::accumulate),
// so a tensor used twice (a residual connection) costs no fresh tensor per sum.
// Not under create_graph, where the sum must be recorded; never into a tensor
// another output, hook or saved variable can see (use counts), a view, or a
// broadcast (each gradient is reduced to the input's shape before it gets here).
// The buffer may be laid out in any dense order, as long as the incoming
// gradient has the same strides: a channels-last network's residual gradients
// (resnet's) are summed in place too, element by element as the fresh sum was.
void accumulate_into_buffer(Tensor& slot, const Tensor& g, bool create_graph) {
  if (!g.defined()) return;
  const bool in_place = !create_graph && slot.defined() && slot.use_count() == 1 && slot.storage().use_count() == 1 &&
                        slot.storage()->owns_memory() && !slot.requires_grad() && !g.requires_grad() &&
                        slot.dtype() == g.dtype() && slot.sizes() == g.sizes() &&
                        (slot.is_contiguous() || (slot.strides() == g.strides() && dense_non_overlapping(slot))) &&
                        !slot.is_alias_of(g);
  if (in_place) {
    const NoGradGuard no_grad;
    grad_math().add_(slot, g);
  } else {
    accumulate_into(slot, g);
  }
}

struct NodeTask {
  Node* node;
  bool operator<(const NodeTask& o) const { return node->sequence_nr() < o.node->sequence_nr(); }
};

class GraphTask {
 public:
  GraphTask(bool keep_graph, bool create_graph) : keep_graph_(keep_graph), create_graph_(create_graph) {}

  // Capture mode (autograd::grad): gradients arriving at these (node, input) slots are returned.
  void add_capture(Node* node, uint32_t input_nr, size_t out_index) {
    captures_[node].push_back({input_nr, out_index});
  }

  // grad_to_boundary: captured nodes are the edge of the graph, not run or passed.
  void set_boundary_mode() { boundary_mode_ = true; }

  TensorList run(GraphRoot& root, size_t num_captures) {
    // Backward formulas run in the dtypes the forward recorded, as in PyTorch: an
    // autocast region around backward() must not recast the gradients' products.
    // A disabled region rather than a suspension, so that a node that reruns a
    // forward (checkpointing) can re-enter the autocast state that forward saw; the
    // cache of the enclosing region, if any, stays.
    const AutocastGuard no_autocast(false);
    root_ = &root;
    captured_.resize(num_captures);
    count_dependencies(root);
    if (!captures_.empty() && !boundary_mode_) compute_needed(root);
    std::priority_queue<NodeTask> ready;
    process(root, TensorList{}, ready);
    while (!ready.empty()) {
      Node* n = ready.top().node;
      ready.pop();
      auto it = buffers_.find(n);
      TensorList grads = it != buffers_.end() ? std::move(it->second) : TensorList(n->num_inputs());
      if (it != buffers_.end()) buffers_.erase(it);
      process(*n, std::move(grads), ready);
    }
    return std::move(captured_);
  }

 private:
  struct Capture {
    uint32_t input_nr;
    size_t out_index;
  };

  void count_dependencies(Node& root) {
    std::vector<Node*> stack{&root};
    std::unordered_set<Node*> seen{&root};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (boundary_mode_ && captures_.count(n)) continue;
      for (const Edge& e : n->next_edges()) {
        if (!e.is_valid()) continue;
        Node* next = e.function.get();
        ++deps_[next];
        if (seen.insert(next).second) stack.push_back(next);
      }
    }
  }

  // A node is needed when a captured slot is reachable from it (inclusive).
  void compute_needed(Node& root) {
    // Iterative post-order DFS.
    std::vector<std::pair<Node*, size_t>> stack{{&root, 0}};
    std::unordered_set<Node*> visited{&root};
    while (!stack.empty()) {
      auto& [n, i] = stack.back();
      const auto& edges = n->next_edges();
      if (i < edges.size()) {
        Node* next = edges[i++].function.get();
        if (next && visited.insert(next).second) stack.push_back({next, 0});
        continue;
      }
      bool need = captures_.count(n) > 0;
      for (const Edge& e : edges) {
        if (e.is_valid() && needed_.count(e.function.get())) need = true;
      }
      if (need) needed_.insert(n);
      stack.pop_back();
    }
  }

  void process(Node& n, TensorList grads, std::priority_queue<NodeTask>& ready) {
    const bool capture_mode = !captures_.empty() && !boundary_mode_;
    if (n.num_inputs() > 0) {
      for (size_t i = 0; i < grads.size() && i < n.num_inputs(); ++i) {
        grads[i] = validate_grad(n, i, grads[i], n.input_metadata()[i]);
      }
    }
    if (boundary_mode_) {
      // The enclosing pass runs this node (and its hooks) with what arrives here.
      auto it = captures_.find(&n);
      if (it != captures_.end()) {
        for (const Capture& c : it->second) {
          if (c.input_nr < grads.size()) accumulate_into(captured_[c.out_index], grads[c.input_nr]);
        }
        return;
      }
      KILN_CHECK(!is_accumulate_grad(n), ValueError,
                 "autograd: a recomputed segment reached a leaf's AccumulateGrad that is not on its boundary");
    }
    n.run_pre_hooks(grads);
    if (capture_mode) {
      auto it = captures_.find(&n);
      if (it != captures_.end()) {
        for (const Capture& c : it->second) {
          if (c.input_nr < grads.size()) accumulate_into(captured_[c.out_index], grads[c.input_nr]);
        }
      }
    }
    TensorList outputs;
    const bool run_node = !capture_mode || (needed_.count(&n) && !is_accumulate_grad(n));
    if (run_node) {
      // One Backward event per node run (torch's "autograd::engine::evaluate_function:
      // MmBackward0"), carrying the sequence number of the forward op that made the
      // node. The root only hands the seeds on, and a leaf's AccumulateGrad was made by
      // no op (torch gives it no sequence number either).
      std::optional<record::Scope> rs;
      if (record::active() && &n != root_) {
        rs.emplace(record::Kind::Backward, n.name());
        if (!is_accumulate_grad(n)) rs->set_seq(static_cast<int64_t>(n.sequence_nr()));
      }
      GradModeGuard mode(create_graph_);
      const bool anomaly = anomaly_mode_enabled();
      TensorList grads_in = anomaly ? grads : TensorList{};
      // What backward allocates is charged to the node's forward call site (Note [Call sites of allocations]).
      memory::AllocSiteGuard site({.file = n.site().file, .line = n.site().line, .op = n.name(), .backward = true});
      outputs = n.apply(std::move(grads));
      if (anomaly) check_backward_outputs(n, grads_in, outputs);
      if (!keep_graph_) n.release_variables();
      KILN_CHECK(outputs.size() == n.next_edges().size(), ValueError, "autograd: ", n.name(), " returned ",
                 outputs.size(), " gradients but has ", n.next_edges().size(), " inputs");
    }
    const auto& edges = n.next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.is_valid()) continue;
      Node* next = e.function.get();
      if (run_node && i < outputs.size() && outputs[i].defined()) {
        TensorList& buf = buffers_[next];
        if (buf.size() < next->num_inputs()) buf.resize(next->num_inputs());
        if (e.input_nr >= buf.size()) buf.resize(e.input_nr + 1);
        // Reduce a broadcast gradient to the input's shape before summing it with
        // the others: [3,1] + [3,5] would broadcast first and count the [3,1]
        // part five times (x * exp(x.sum(-1, true)) under create_graph reaches
        // ExpBackward with both shapes: its saved output and mul's other operand).
        Tensor g = outputs[i];
        if (e.input_nr < next->num_inputs()) {
          GradModeGuard mode(create_graph_);
          g = validate_grad(*next, e.input_nr, g, next->input_metadata()[e.input_nr]);
        }
        accumulate_into_buffer(buf[e.input_nr], g, create_graph_);
      }
      if (--deps_[next] == 0) ready.push({next});
    }
  }

  struct GradModeGuard {
    explicit GradModeGuard(bool enabled) : prev(grad_mode_enabled()) { set_grad_mode_enabled(enabled); }
    ~GradModeGuard() { set_grad_mode_enabled(prev); }
    bool prev;
  };

  bool keep_graph_;
  bool create_graph_;
  bool boundary_mode_ = false;
  const Node* root_ = nullptr;  // the GraphRoot of this run (not recorded)
  std::unordered_map<Node*, int64_t> deps_;
  std::unordered_map<Node*, TensorList> buffers_;
  std::unordered_map<Node*, std::vector<Capture>> captures_;
  std::unordered_set<Node*> needed_;
  TensorList captured_;
};

TensorList make_root_grads(const TensorList& tensors, const TensorList& grad_tensors, const char* api) {
  KILN_CHECK(grad_tensors.empty() || grad_tensors.size() == tensors.size(), ValueError, api, ": got ", tensors.size(),
             " tensors but ", grad_tensors.size(), " gradients");
  TensorList grads;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    KILN_CHECK(t.defined(), ValueError, api, ": tensor ", i, " is undefined");
    KILN_CHECK(t.requires_grad(), ValueError, api, ": tensor ", i, " (shape ", t.sizes(),
               ") does not require grad and has no grad_fn; did you compute it under NoGradGuard, or forget "
               "requires_grad_() on the leaves?");
    if (i < grad_tensors.size() && grad_tensors[i].defined()) {
      const Tensor& g = grad_tensors[i];
      KILN_CHECK(g.sizes() == t.sizes(), ShapeError, api, ": gradient ", i, " has shape ", g.sizes(),
                 " but its tensor has shape ", t.sizes());
      grads.push_back(g);
    } else {
      KILN_CHECK(t.numel() == 1, ValueError, api,
                 ": grad can be implicitly created only for scalar outputs; "
                 "tensor ",
                 i, " has shape ", t.sizes(),
                 " — pass a gradient of that shape, or reduce it "
                 "(e.g. loss.sum() or loss.mean()) first");
      grads.push_back(grad_math().ones_like(t));
    }
  }
  return grads;
}

// The callbacks of the backward pass running on this thread (null outside one);
// a hook may start a nested backward, which gets its own list.
thread_local std::vector<std::function<void()>>* t_callbacks = nullptr;

// Runs `task` with a fresh callback list, then the callbacks it queued.
template <typename F>
auto with_callbacks(F&& task) {
  std::vector<std::function<void()>> callbacks;
  auto* prev = t_callbacks;
  t_callbacks = &callbacks;
  struct Restore {
    std::vector<std::function<void()>>*& slot;
    std::vector<std::function<void()>>* prev;
    ~Restore() { slot = prev; }
  } restore{t_callbacks, prev};
  auto result = task();
  // Index loop: a callback may queue another.
  for (size_t i = 0; i < callbacks.size(); ++i) {
    auto fn = std::move(callbacks[i]);
    fn();
  }
  return result;
}

}  // namespace

void queue_callback(std::function<void()> fn) {
  KILN_CHECK(t_callbacks != nullptr, ValueError,
             "queue_callback: no backward pass is running on this thread; "
             "callbacks can only be queued from inside backward (e.g. from a gradient hook)");
  t_callbacks->push_back(std::move(fn));
}

void backward(const TensorList& tensors, const TensorList& grad_tensors, bool retain_graph, bool create_graph) {
  capture::note_backward();
  TensorList grads = make_root_grads(tensors, grad_tensors, "backward");
  std::vector<Edge> edges;
  for (const Tensor& t : tensors) edges.push_back(gradient_edge(t));
  GraphRoot root(std::move(edges), std::move(grads));
  root.retain();  // lives on the stack; keep intrusive counts from deleting it
  GraphTask task(retain_graph || create_graph, create_graph);
  with_callbacks([&] { return task.run(root, 0); });
}

TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs,
                std::optional<bool> retain_graph, bool create_graph, bool allow_unused) {
  capture::note_backward();
  TensorList grads = make_root_grads(outputs, grad_outputs, "grad");
  std::vector<Edge> edges;
  for (const Tensor& t : outputs) edges.push_back(gradient_edge(t));
  GraphRoot root(std::move(edges), std::move(grads));
  root.retain();
  GraphTask task(retain_graph.value_or(create_graph), create_graph);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    KILN_CHECK(in.defined() && in.requires_grad(), ValueError, "grad: input ", i,
               " does not require grad; only tensors that require grad can be differentiated against");
    Edge e = gradient_edge(in);
    task.add_capture(e.function.get(), e.input_nr, i);
  }
  TensorList result = with_callbacks([&] { return task.run(root, inputs.size()); });
  for (size_t i = 0; i < result.size(); ++i) {
    KILN_CHECK(allow_unused || result[i].defined(), ValueError, "grad: input ", i, " (", describe(inputs[i]),
               ") is not reachable from the outputs (it was not used to compute them); pass allow_unused=true "
               "if that is expected");
  }
  return result;
}

TensorList grad_to_boundary(const TensorList& outputs, const TensorList& grad_outputs,
                            const std::vector<Edge>& boundary, bool create_graph) {
  KILN_CHECK(outputs.size() == grad_outputs.size(), ValueError, "grad_to_boundary: got ", outputs.size(),
             " outputs but ", grad_outputs.size(), " gradients");
  std::vector<Edge> edges;
  TensorList grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined() || !outputs[i].requires_grad() || !grad_outputs[i].defined()) continue;
    KILN_CHECK(grad_outputs[i].sizes() == outputs[i].sizes(), ShapeError, "grad_to_boundary: gradient ", i,
               " has shape ", grad_outputs[i].sizes(), " but its output has shape ", outputs[i].sizes());
    edges.push_back(gradient_edge(outputs[i]));
    grads.push_back(grad_outputs[i]);
  }
  if (edges.empty()) return TensorList(boundary.size());
  GraphRoot root(std::move(edges), std::move(grads));
  root.retain();
  GraphTask task(create_graph, create_graph);
  task.set_boundary_mode();
  for (size_t i = 0; i < boundary.size(); ++i) {
    KILN_CHECK(boundary[i].is_valid(), ValueError, "grad_to_boundary: boundary edge ", i, " is invalid");
    task.add_capture(boundary[i].function.get(), boundary[i].input_nr, i);
  }
  // No callback list of its own: what its hooks queue runs when the enclosing backward ends.
  return task.run(root, boundary.size());
}

}  // namespace kiln::autograd
