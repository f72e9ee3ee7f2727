// Histories of differentiable views (docs/autograd.md, "Views"): marking a
// view with its base, rebuilding a stale view's grad_fn, and rewriting the
// base's history when a view is written in place (torch's CopySlices).
//
// Note [In-place writes into views]
// A view v of base b and an in-place op f on v: afterwards b's values are
// "b with v's region replaced by f(v, others)". So b's new grad_fn is a
// CopySlices node: it takes the gradient for all of b, hands f's backward
// the part of it that lies in v's region (which yields the gradient for v's
// old values and for f's other inputs), writes v's old-value gradient back
// into that region, and passes the whole to b's old history — the region's
// old values came from there, the rest of b is unchanged. v itself (and any
// other view of b) then gets a history derived from b's: an as_strided of b
// with v's geometry, rebuilt lazily whenever the storage version moves on.
#include "view_history.h"
#include "kiln/autograd/autograd_meta.h"
#include "kiln/autograd/functions.h"
#include "kiln/autograd/grad_math.h"
#include "kiln/core/guards.h"
#include "kiln/core/record.h"

namespace kiln::autograd {

namespace {

std::string at(CallSite site) { return site.known() ? " (at " + site.str() + ")" : std::string(); }

std::string last_writer(const Tensor& t) {
  const auto w = t.storage()->last_write();
  return std::string(w.op ? w.op : "an in-place op") + (w.file ? " at " + CallSite{w.file, w.line}.str() : "");
}

// The view's grad_fn becomes as_strided(base, view's geometry) recorded on
// the base's current history.
void regenerate(const Tensor& view, AutogradMeta& m) {
  EnableGradGuard grad_on;
  const Tensor& base = m.view_base;
  Tensor fresh = grad_math().as_strided(base, view.sizes(), view.strides(), view.storage_offset());
  const AutogradMeta* fm = get_meta(fresh);
  KILN_CHECK(fm && fm->grad_fn, InternalError,
             "refresh_view: as_strided of a base that requires grad recorded no node");
  NodePtr node = fm->grad_fn;
  // Name the write that made the rebuild necessary as the node's forward site.
  const auto w = view.storage()->last_write();
  if (w.file) node->set_site(CallSite{w.file, w.line});
  m.grad_fn = std::move(node);
  m.output_nr = 0;
  m.view_version = view.version();
  view.impl()->set_requires_grad_flag(true);
}

class CopySlices final : public Node {
 public:
  CopySlices(const Tensor& base, const Tensor& view, NodePtr fn)
      : base_sizes_(base.sizes()),
        base_strides_(base.strides()),
        view_sizes_(view.sizes()),
        view_strides_(view.strides()),
        view_offset_(view.storage_offset() - base.storage_offset()),
        fn_(std::move(fn)) {
    add_input_metadata(base);
  }
  const char* name() const override { return "CopySlices"; }

  TensorList apply(TensorList&& grads) override {
    TensorList out(next_edges().size());
    const Tensor g = grads.empty() ? Tensor() : grads[0];
    if (!g.defined()) return out;
    const GradMath& gm = grad_math();
    // The base's gradient laid out as the base, so the view's geometry
    // (relative to the base's offset) picks out the region written.
    Tensor result = gm.empty_strided(base_sizes_, base_strides_, g.dtype());
    gm.copy_(result, g);
    Tensor region = gm.as_strided(result, view_sizes_, view_strides_, view_offset_);
    TensorList res = fn_->apply({gm.clone(region)});
    KILN_CHECK(res.size() == out.size(), InternalError, "CopySlices: ", fn_->name(), " returned ", res.size(),
               " gradients for ", out.size(), " inputs");
    // The old values of the region got res[0]; nothing else of the base changed.
    gm.copy_(region, res[0].defined() ? res[0] : gm.zeros(view_sizes_, g.dtype()));
    out[0] = std::move(result);
    for (size_t i = 1; i < res.size(); ++i) out[i] = std::move(res[i]);
    return out;
  }

  void release_variables() override { fn_->release_variables(); }

 private:
  DimVector base_sizes_, base_strides_, view_sizes_, view_strides_;
  int64_t view_offset_;
  NodePtr fn_;  // the in-place op's own node; its first edge (the view's old history) is not followed
};

}  // namespace

void mark_view(const Tensor& view, const Tensor& base, ViewCreation creation) {
  AutogradMeta& m = materialize_meta(view);
  const AutogradMeta* bm = get_meta(base);
  const bool base_is_view = bm && bm->is_view;
  m.is_view = true;
  // A view of a view looks into the same root, and inherits a restriction
  // its parent has (torch propagates creation_meta the same way).
  m.view_creation = base_is_view && bm->view_creation != ViewCreation::kDefault ? bm->view_creation : creation;
  m.view_version = view.version();
  m.view_base = base_is_view ? bm->view_base : base;
  // A view made in no-grad mode of a base that needs no grad only has to
  // remember how it was made; holding the base would keep its storage shared
  // and stop backward from reusing gradient buffers (AccumulateGrad's steal).
  if (m.view_creation == ViewCreation::kNoGradMode && m.view_base.defined() && !m.view_base.requires_grad())
    m.view_base = Tensor();
}

void refresh_view(const Tensor& t) {
  AutogradMeta* m = get_meta(t);
  if (!m || !m->is_view || m->view_creation == ViewCreation::kNoGradMode) return;
  if (!m->view_base.requires_grad()) return;
  const bool stale = t.version() != m->view_version;
  if (m->grad_fn && !stale) return;
  if (m->view_creation == ViewCreation::kMultipleOutput && stale) {
    throw ValueError(kiln::detail::concat(
        "autograd: ", describe(t),
        " is one of several views returned by one op (split, chunk or unbind), and its base or another view of "
        "its base was modified in place (by ",
        last_writer(t),
        ") after it was made. Like torch, kiln does not rebuild the history of such views. clone() the pieces "
        "before the in-place op, or make the change out of place"));
  }
  regenerate(t, *m);
}

namespace detail {

void check_view_inplace(const Tensor& self, const AutogradMeta& m, const char* op, CallSite site) {
  const Tensor& base = m.view_base;
  const bool base_rg = base.defined() && base.requires_grad();
  KILN_CHECK(!(self.impl()->requires_grad() && !m.grad_fn && !base_rg), ValueError, op, ": ", describe(self),
             " is a view that was made a leaf requiring grad (requires_grad_() on a view); a view of a leaf that "
             "requires grad cannot be modified in place",
             at(site), ". clone() it first");
  KILN_CHECK(
      !(base_rg && base.grad_fn() == nullptr), ValueError, op, ": ", describe(self), " is a view of ", describe(base),
      ", a leaf that requires grad; a view of a leaf that requires grad cannot be modified in place while "
      "grad mode is on",
      at(site), ". Update parameters under NoGradGuard (as optimizers do), or clone() the leaf and work on the copy");
  KILN_CHECK(m.view_creation != ViewCreation::kMultipleOutput, ValueError, op, ": ", describe(self),
             " is one of several views returned by one op (split, chunk or unbind); like torch, kiln does not let "
             "such views be modified in place with grad mode on",
             at(site), ". clone() the piece first, or use the out-of-place op");
  KILN_CHECK(m.view_creation != ViewCreation::kNoGradMode, ValueError, op, ": ", describe(self),
             " is a view made with grad mode off (under NoGradGuard), and is being modified in place with grad mode "
             "on; whether the write should be recorded is ambiguous, so like torch kiln refuses it",
             at(site),
             ". Make the view and the in-place op both under NoGradGuard (not recorded) or both outside it "
             "(recorded)");
}

void rebase_view_history(Tensor& self, AutogradMeta& m, const NodePtr& fn,
                         std::initializer_list<const Tensor*> other_inputs, CallSite site) {
  KILN_CHECK(m.view_creation == ViewCreation::kDefault, InternalError,
             "rebase_history: a restricted view reached the in-place rewrite; check_inplace should have refused it");
  // fn as if recorded on its own: edge 0 is the view's history before the write.
  fn->add_next_edge(gradient_edge(self));
  for (const Tensor* in : other_inputs) fn->add_next_edge(in && in->defined() ? gradient_edge(*in) : Edge{});
  fn->set_site(site);
  fn->add_input_metadata(self);
  Tensor base = m.view_base;
  auto slices = make_intrusive<CopySlices>(base, self, fn);
  slices->add_next_edge(gradient_edge(base));
  for (size_t i = 1; i < fn->next_edges().size(); ++i) slices->add_next_edge(fn->next_edges()[i]);
  slices->set_site(site);
  // CopySlices is the node backward runs for the in-place op (fn runs inside it).
  record::note_sequence(static_cast<int64_t>(slices->sequence_nr()));
  AutogradMeta& bm = materialize_meta(base);
  bm.grad_fn = slices;
  bm.output_nr = 0;
  base.impl()->set_requires_grad_flag(true);
  regenerate(self, m);
}

}  // namespace detail

}  // namespace kiln::autograd
