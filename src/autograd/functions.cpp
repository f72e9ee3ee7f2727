#include "kiln/autograd/functions.h"
#include "kiln/autograd/grad_math.h"

#include <utility>

#include "kiln/autograd/anomaly.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/core/memory_history.h"
#include "kiln/core/record.h"
#include "view_history.h"

namespace kiln::autograd {

AccumulateGrad::AccumulateGrad(Tensor leaf) : leaf_(std::move(leaf)) { add_input_metadata(leaf_); }

AccumulateGrad::~AccumulateGrad() {
  if (AutogradMeta* m = get_meta(leaf_); m && m->grad_accumulator == this) m->grad_accumulator = nullptr;
}

bool is_accumulate_grad(const Node& n) { return dynamic_cast<const AccumulateGrad*>(&n) != nullptr; }

TensorList AccumulateGrad::apply(TensorList&& grads) {
  AutogradMeta& m = materialize_meta(leaf_);
  // Moved out of the list, so use_count() below counts only references held
  // elsewhere (another leaf's buffer, a hook that kept it).
  Tensor g = grads.empty() ? Tensor() : std::move(grads[0]);
  if (!g.defined()) return {};
  if (!m.leaf_hooks.empty() || !m.post_accumulate_hooks.empty())
    capture::graph_break_if_recording("a hook on a leaf tensor (register_hook, post-accumulate hook) runs host code");
  for (auto& h : m.leaf_hooks) {
    Tensor r = h.fn(g);
    if (r.defined()) g = r;
  }
  MemoryCategoryGuard category(MemoryCategory::Gradient);
  capture::note_grad_before_accumulation(leaf_, m.grad);
  if (!m.grad.defined()) {
    // Take the incoming buffer when nothing else can see it (torch's
    // AccumulateGrad steals it too); otherwise copy, so that a later in-place
    // accumulation cannot write into another tensor. Not under create_graph,
    // where .grad must keep its history. A gradient in another layout (a
    // transposed view) is copied contiguous: optimizers and DDP's buckets
    // expect .grad laid out as the parameter.
    const bool exclusive = !grad_mode_enabled() && g.use_count() == 1 && g.storage().use_count() == 1 &&
                           g.is_contiguous() && g.storage()->owns_memory();
    if (exclusive) {
      m.grad = g.detach();
      m.grad.storage()->set_category(MemoryCategory::Gradient);
    } else {
      m.grad = grad_mode_enabled() ? g : grad_math().clone(g);
    }
    // A replay computes the gradient into the same buffer; setting .grad is host state it repeats.
    capture::record_host("AccumulateGrad", [leaf = leaf_, grad = m.grad] { materialize_meta(leaf).grad = grad; });
  } else if (grad_mode_enabled()) {
    m.grad = grad_math().add(m.grad, g);  // create_graph: keep the accumulation differentiable
  } else {
    grad_math().add_(m.grad, g);  // in place: a .grad that is a view into a bucket (DDP) keeps receiving
  }
  for (auto& h : m.post_accumulate_hooks) h.fn(leaf_);
  return {};
}

bool compute_requires_grad(std::initializer_list<const Tensor*> inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor* t : inputs) {
    if (t && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

bool compute_requires_grad(const TensorList& inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

namespace {

void attach(Tensor& out, const NodePtr& node) {
  const uint32_t nr = node->add_input_metadata(out);
  AutogradMeta& m = materialize_meta(out);
  m.grad_fn = node;
  m.output_nr = nr;
  out.impl()->set_requires_grad_flag(true);
}

// The op that made an output names its block in memory history (Note [Call sites of allocations]).
void claim_output(const Tensor& out, const Node& node, CallSite site) {
  if (out.storage()) memory::detail::claim(out.storage()->data(), site.file, site.line, node.name());
}

// `claim`: false for views, whose bytes belong to the op that made their base.
void set_history_impl(std::initializer_list<Tensor*> outputs, const NodePtr& node,
                      std::initializer_list<const Tensor*> inputs, CallSite site, bool claim) {
  // Edges first: an in-place op passes the same tensor as input and output.
  for (const Tensor* in : inputs) node->add_next_edge(in && in->defined() ? gradient_edge(*in) : Edge{});
  node->set_site(site);
  // The op being recorded (record.h) made this node: its event takes the sequence number.
  record::note_sequence(static_cast<int64_t>(node->sequence_nr()));
  for (Tensor* out : outputs) {
    if (out && out->defined()) {
      attach(*out, node);
      if (claim) claim_output(*out, *node, site);
    }
  }
  if (anomaly_mode_enabled()) {
    std::vector<const Tensor*> outs;
    for (Tensor* out : outputs)
      if (out && out->defined()) outs.push_back(out);
    TensorList ins;
    for (const Tensor* in : inputs) ins.push_back(in ? *in : Tensor());
    check_forward_outputs(*node, outs.data(), outs.size(), ins);
  }
}

}  // namespace

void set_history(std::initializer_list<Tensor*> outputs, const NodePtr& node,
                 std::initializer_list<const Tensor*> inputs, CallSite site) {
  set_history_impl(outputs, node, inputs, site, true);
}

void set_history(Tensor& output, const NodePtr& node, std::initializer_list<const Tensor*> inputs, CallSite site) {
  set_history_impl({&output}, node, inputs, site, true);
}

void set_history(TensorList& outputs, const NodePtr& node, const TensorList& inputs, CallSite site) {
  for (const Tensor& in : inputs) node->add_next_edge(in.defined() ? gradient_edge(in) : Edge{});
  node->set_site(site);
  record::note_sequence(static_cast<int64_t>(node->sequence_nr()));
  for (Tensor& out : outputs) {
    if (out.defined()) {
      attach(out, node);
      claim_output(out, *node, site);
    }
  }
  if (anomaly_mode_enabled()) {
    std::vector<const Tensor*> outs;
    for (Tensor& out : outputs)
      if (out.defined()) outs.push_back(&out);
    check_forward_outputs(*node, outs.data(), outs.size(), inputs);
  }
}

void set_view_history(Tensor& view, const NodePtr& node, const Tensor& base, CallSite site, ViewCreation creation) {
  set_history_impl({&view}, node, {&base}, site, false);
  mark_view(view, base, creation);
}

void check_inplace(const Tensor& self, const char* op, CallSite site,
                   std::initializer_list<const Tensor*> other_inputs) {
  self.storage()->record_write(op, site.file, site.line);
  if (!grad_mode_enabled()) return;
  AutogradMeta* m = get_meta(self);
  if (m && m->is_view) {
    // Recorded when anything involved requires grad; a view made in no-grad
    // mode counts its base too (torch's view of it would require grad).
    bool record = self.requires_grad() || (m->view_base.defined() && m->view_base.requires_grad());
    for (const Tensor* t : other_inputs) record = record || (t && t->defined() && t->requires_grad());
    if (record) detail::check_view_inplace(self, *m, op, site);
    return;
  }
  if (!self.requires_grad()) return;
  const bool leaf = !m || !m->grad_fn;
  KILN_CHECK(!leaf, ValueError, op, ": ", describe(self),
             " is a leaf that requires grad and cannot be modified in place while grad mode is on",
             site.known() ? " (at " + site.str() + ")" : std::string(),
             "; update parameters under NoGradGuard (as optimizers do), or use the out-of-place op");
}

void rebase_history(Tensor& self, const NodePtr& node, std::initializer_list<const Tensor*> other_inputs,
                    CallSite site) {
  if (AutogradMeta* m = get_meta(self); m && m->is_view) {
    detail::rebase_view_history(self, *m, node, other_inputs, site);
    return;
  }
  node->add_next_edge(gradient_edge(self));
  for (const Tensor* in : other_inputs) node->add_next_edge(in && in->defined() ? gradient_edge(*in) : Edge{});
  node->set_site(site);
  record::note_sequence(static_cast<int64_t>(node->sequence_nr()));
  attach(self, node);
}

void set_name(const Tensor& t, std::string name) { materialize_meta(t).name = std::move(name); }

}  // namespace kiln::autograd
