// Activation checkpointing. See include/kiln/nn/checkpoint.h and docs/memory.md.
//
// Note [Checkpointing recomputes through a boundary]
// torch's use_reentrant=False checkpoint keeps the segment's graph and swaps
// every tensor a node saves for a placeholder that recomputes the segment on
// first unpack (saved-tensor hooks). kiln's SavedVariable has no such hooks,
// and torch's reentrant variant (a Function whose backward reruns the segment
// and calls backward() on it) loses captured tensors: the outer graph never
// sees the parameters fn reads, so autograd::grad cannot reach them and
// backward() accumulates them behind the outer pass's back. kiln does a third
// thing, with the gradients of the non-reentrant one:
//   forward   fn runs with grad mode on, building its graph as usual; walking
//             it from the outputs down to the nodes that existed before the
//             segment started (and to every AccumulateGrad) gives the
//             segment's boundary: the edges by which gradients leave it (its
//             inputs' grad_fns, captured parameters, captured tensors made
//             earlier). A CheckpointNode takes those edges as its next edges
//             and becomes the outputs' grad_fn; the segment's own graph, with
//             every activation its nodes saved, is dropped at once. Only the
//             inputs are kept.
//   backward  CheckpointNode reruns fn on the same input tensors (same
//             default-Generator state, same autocast state), which rebuilds
//             the same graph down to the same boundary edges, and runs a
//             nested backward pass over that graph only
//             (autograd::grad_to_boundary): boundary nodes are not run, the
//             gradients arriving at them are returned as CheckpointNode's
//             outputs, and the enclosing pass carries them on, running
//             hooks, accumulating .grad or capturing them for autograd::grad.
// The forward therefore takes the same code paths as the uncheckpointed model
// (same kernels, same grad-mode branches) and the rerun reproduces it bit for
// bit, so the gradients are bitwise identical. The cost is one graph's
// bookkeeping per segment in forward, which the recomputation needs anyway.
#include "kiln/nn/checkpoint.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <unordered_set>

#include "kiln/autograd/autograd_meta.h"
#include "kiln/autograd/engine.h"
#include "kiln/autograd/functions.h"
#include "kiln/autograd/graph_census.h"
#include "kiln/autograd/saved_variable.h"
#include "kiln/core/autocast.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/record.h"
#include "kiln/ops/factory.h"

namespace kiln::nn {

namespace {

using autograd::Edge;
using autograd::Node;

bool is_boundary(const Node& n, uint64_t start) { return n.sequence_nr() < start || autograd::is_accumulate_grad(n); }

// The edges by which gradients leave the graph fn built after `start`, in a
// deterministic order (depth-first from the outputs), each once.
std::vector<Edge> find_boundary(const TensorList& outs, uint64_t start) {
  std::vector<Edge> boundary;
  std::set<std::pair<const Node*, uint32_t>> seen_edges;
  std::unordered_set<const Node*> visited;
  std::vector<const Node*> stack;
  auto visit = [&](const Edge& e) {
    if (!e.is_valid()) return;
    const Node* n = e.function.get();
    if (is_boundary(*n, start)) {
      if (seen_edges.insert({n, e.input_nr}).second) boundary.push_back(e);
      return;
    }
    if (visited.insert(n).second) stack.push_back(n);
  };
  for (const Tensor& o : outs) {
    if (o.defined() && o.requires_grad()) visit(autograd::gradient_edge(o));
  }
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) visit(e);
  }
  return boundary;
}

std::string describe_edge(const Edge& e) {
  const Node& n = *e.function;
  if (const auto* acc = dynamic_cast<const autograd::AccumulateGrad*>(&n)) return autograd::describe(acc->leaf());
  std::ostringstream os;
  os << "output " << e.input_nr << " of " << n.name();
  if (n.site().known()) os << " (forward at " << n.site().str() << ")";
  return os.str();
}

std::string describe_meta(bool defined, IntArrayRef shape, DType dtype) {
  if (!defined) return "undefined";
  std::ostringstream os;
  os << shape << " " << dtype_name(dtype);
  return os.str();
}

thread_local int t_recomputing = 0;

// The nested pass needs a recomputed output's gradient edge and shape, not its
// values: a stand-in with the same edge over one element of storage lets the
// output be freed as soon as no node of the recomputed graph holds it, rather
// than at the end of the segment's backward (torch drops it too).
Tensor stand_in(const Tensor& out) {
  const autograd::AutogradMeta* m = autograd::get_meta(out);
  if (!m || !m->grad_fn) return out;  // a leaf (an input returned as is): nothing to free
  Tensor s = empty_strided(out.sizes(), DimVector(static_cast<size_t>(out.dim()), 0), out.dtype());
  autograd::AutogradMeta& sm = autograd::materialize_meta(s);
  sm.grad_fn = m->grad_fn;
  sm.output_nr = m->output_nr;
  s.impl()->set_requires_grad_flag(true);
  return s;
}

struct OutputInfo {
  bool defined = false;
  bool differentiable = false;  // an output of the CheckpointNode
  DimVector shape;
  DType dtype = kFloat32;
};

class CheckpointNode final : public Node {
 public:
  const char* name() const override { return "CheckpointBackward"; }

  TensorList apply(TensorList&& grads) override {
    const bool any = std::any_of(grads.begin(), grads.end(), [](const Tensor& g) { return g.defined(); });
    if (!any) return TensorList(next_edges().size());
    const bool create_graph = grad_mode_enabled();
    TensorList inputs;
    for (const auto& s : inputs_) inputs.push_back(s.unpack(this));
    TensorList outs;
    std::vector<Edge> boundary;
    {
      Generator& gen = default_generator();
      struct RestoreRng {
        Generator& gen;
        GeneratorState state;
        ~RestoreRng() { gen.set_state(state); }
      } restore{gen, gen.get_state()};
      gen.set_state(rng_);
      const EnableGradGuard grad;
      // Inside backward's disabled region (engine.cpp): re-enter forward's state.
      const AutocastGuard amp(autocast_dtype_, autocast_on_);
      if (autocast_on_) autocast_detail::clear_cache();
      struct Recomputing {
        Recomputing() { ++t_recomputing; }
        ~Recomputing() {
          --t_recomputing;
          // The casts made for the rerun would otherwise live until backward ends.
          autocast_detail::clear_cache();
        }
      } recomputing;
      const uint64_t start = autograd::next_sequence_nr();
      outs = fn_(inputs);
      boundary = find_boundary(outs, start);
    }
    check_same(outs, boundary);
    TensorList diff_outs, diff_grads;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!info_[i].differentiable) continue;
      diff_outs.push_back(stand_in(outs[i]));
      diff_grads.push_back(grads[diff_outs.size() - 1]);
    }
    outs.clear();  // with the stand-ins, each output lives only as long as the graph holds it
    return autograd::grad_to_boundary(diff_outs, diff_grads, next_edges(), create_graph);
  }

  void release_variables() override {
    for (auto& s : inputs_) s.reset();
  }

  CheckpointFn fn_;
  std::vector<autograd::SavedVariable> inputs_;
  std::vector<OutputInfo> info_;
  std::string label_;
  GeneratorState rng_;
  bool autocast_on_ = false;
  DType autocast_dtype_ = kBFloat16;

 private:
  [[noreturn]] void mismatch(const std::string& what) const {
    throw ValueError("checkpoint: the recomputed forward of " + label_ +
                     " does not match the original forward: " + what +
                     ". The segment runs again in backward and must compute the same thing; did a module, its "
                     "parameters or a tensor fn reads change between forward and backward?");
  }

  void check_same(const TensorList& outs, const std::vector<Edge>& boundary) const {
    if (outs.size() != info_.size()) {
      mismatch("it returned " + std::to_string(outs.size()) + " outputs, the original " + std::to_string(info_.size()));
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      const Tensor& o = outs[i];
      const OutputInfo& w = info_[i];
      const bool same =
          o.defined() == w.defined && (!w.defined || (o.sizes() == w.shape.ref() && o.dtype() == w.dtype &&
                                                      (o.requires_grad() == w.differentiable)));
      if (!same) {
        std::string now = o.defined() ? describe_meta(true, o.sizes(), o.dtype()) : "undefined";
        std::string was = describe_meta(w.defined, w.shape, w.dtype);
        if (o.defined() && w.defined && o.sizes() == w.shape.ref() && o.dtype() == w.dtype) {
          now += o.requires_grad() ? " requiring grad" : " not requiring grad";
          was += w.differentiable ? " requiring grad" : " not requiring grad";
        }
        mismatch("output " + std::to_string(i) + " is " + now + ", the original was " + was);
      }
    }
    std::set<std::pair<const Node*, uint32_t>> want, got;
    for (const Edge& e : next_edges()) want.insert({e.function.get(), e.input_nr});
    for (const Edge& e : boundary) {
      got.insert({e.function.get(), e.input_nr});
      if (!want.count({e.function.get(), e.input_nr}))
        mismatch("it reads " + describe_edge(e) + ", which the original did not");
    }
    for (const Edge& e : next_edges()) {
      if (!got.count({e.function.get(), e.input_nr}))
        mismatch("it no longer reads " + describe_edge(e) + ", which the original did");
    }
  }
};

std::string default_label(const TensorList& inputs) {
  std::ostringstream os;
  os << "the checkpointed segment with inputs (";
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i) os << ", ";
    os << describe_meta(inputs[i].defined(), inputs[i].defined() ? inputs[i].sizes() : IntArrayRef{},
                        inputs[i].defined() ? inputs[i].dtype() : kFloat32);
  }
  os << ")";
  return os.str();
}

}  // namespace

bool is_recomputing() { return t_recomputing > 0; }

TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs, const std::string& name) {
  KILN_CHECK(static_cast<bool>(fn), ValueError, "checkpoint: fn is empty");
  if (!grad_mode_enabled()) return fn(inputs);
  // The op that makes CheckpointBackward: the segment's own ops nest inside it.
  const auto input = [&](size_t i) { return i < inputs.size() ? &inputs[i] : nullptr; };
  const record::Scope rs(record::Kind::Op, "checkpoint", {input(0), input(1), input(2), input(3)});
  auto node = make_intrusive<CheckpointNode>();
  node->rng_ = default_generator().get_state();
  node->autocast_on_ = autocast_enabled();
  node->autocast_dtype_ = autocast_dtype();
  // Casts cached earlier in the region would put their nodes on the boundary, and the
  // rerun (in its own region) makes its own: let the segment make its own here too.
  if (node->autocast_on_) autocast_detail::clear_cache();
  const uint64_t start = autograd::next_sequence_nr();
  TensorList outs = fn(inputs);
  std::vector<Edge> boundary = find_boundary(outs, start);
  if (boundary.empty()) return outs;  // nothing in the segment needs a gradient
  node->fn_ = fn;
  node->label_ = name.empty() ? default_label(inputs) : "segment '" + name + "'";
  for (const Tensor& in : inputs) node->inputs_.emplace_back(in, /*is_output=*/false);
  for (Edge& e : boundary) node->add_next_edge(std::move(e));
  TensorList diff;
  for (const Tensor& o : outs) {
    OutputInfo w;
    w.defined = o.defined();
    if (w.defined) {
      w.shape = o.sizes();
      w.dtype = o.dtype();
      w.differentiable = o.requires_grad();
    }
    if (w.differentiable) diff.push_back(o.detach());
    node->info_.push_back(std::move(w));
  }
  autograd::set_history(diff, node, TensorList{});
  // Dropping the originals frees the segment's graph and every activation it saved.
  TensorList result;
  size_t k = 0;
  for (size_t i = 0; i < outs.size(); ++i) result.push_back(node->info_[i].differentiable ? diff[k++] : outs[i]);
  return result;
}

Tensor checkpoint_sequential(const std::vector<ModulePtr>& modules, int64_t segments, const Tensor& x) {
  const auto n = static_cast<int64_t>(modules.size());
  KILN_CHECK(segments >= 1, ValueError, "checkpoint_sequential: segments must be >= 1, got ", segments);
  KILN_CHECK(n >= 1, ValueError, "checkpoint_sequential: no modules to run");
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(modules[i] != nullptr, ValueError, "checkpoint_sequential: module ", i, " is null");
  auto run = [modules](int64_t begin, int64_t end, Tensor h) {
    for (int64_t i = begin; i < end; ++i) h = (*modules[i])(h);
    return h;
  };
  // torch's split: segments - 1 checkpointed runs of n / segments modules, then the rest plain.
  const int64_t size = n / segments;
  Tensor h = x;
  int64_t end = 0;
  for (int64_t begin = 0; begin < size * (segments - 1); begin += size) {
    end = begin + size;
    h = checkpoint([run, begin, end](const TensorList& in) -> TensorList { return {run(begin, end, in[0])}; }, {h},
                   "modules " + std::to_string(begin) + "-" + std::to_string(end - 1))[0];
  }
  return run(end, n, h);
}

Tensor checkpoint_sequential(const Module& seq, int64_t segments, const Tensor& x) {
  return checkpoint_sequential(seq.children(), segments, x);
}

CheckpointPolicy CheckpointPolicy::every_k(int64_t k) {
  KILN_CHECK(k >= 1, ValueError, "activation checkpointing: a segment must hold at least one block, got k = ", k);
  return {k};
}

Tensor run_blocks(const CheckpointPolicy& policy, int64_t n, const std::function<Tensor(int64_t, const Tensor&)>& block,
                  const Tensor& x, const std::string& prefix) {
  Tensor h = x;
  if (!policy.enabled() || !grad_mode_enabled()) {
    for (int64_t i = 0; i < n; ++i) h = block(i, h);
    return h;
  }
  for (int64_t begin = 0; begin < n; begin += policy.every) {
    const int64_t end = std::min(n, begin + policy.every);
    if (end == n) {
      // The last run plain, as torch's checkpoint_sequential: backward needs its activations
      // first, so recomputing them would cost a forward of the run and save no peak memory
      // (measured on the gpt workload: 1.46x the step time instead of 1.22x, and a higher
      // activation peak, since the rerun overlaps the head's gradients).
      for (int64_t i = begin; i < end; ++i) h = block(i, h);
      break;
    }
    const std::string name =
        prefix + "." + std::to_string(begin) + (end - begin > 1 ? "-" + std::to_string(end - 1) : std::string());
    h = checkpoint(
        [block, begin, end](const TensorList& in) -> TensorList {
          Tensor t = in[0];
          for (int64_t i = begin; i < end; ++i) t = block(i, t);
          return {t};
        },
        {h}, name)[0];
  }
  return h;
}

}  // namespace kiln::nn
