// Tensor's autograd methods (declared in include/kiln/core/tensor.h).
#include <algorithm>

#include "kiln/autograd/engine.h"
#include "kiln/autograd/functions.h"
#include "kiln/autograd/grad_math.h"

namespace kiln {

using autograd::AutogradMeta;
using autograd::get_meta;
using autograd::materialize_meta;

namespace {
const Tensor& undefined_tensor() {
  static const Tensor t;
  return t;
}
}  // namespace

Tensor& Tensor::requires_grad_(bool r) {
  KILN_CHECK(defined(), ValueError, "requires_grad_: called on an undefined tensor");
  const AutogradMeta* m = get_meta(*this);
  if (m && m->grad_fn) {
    KILN_CHECK(r, ValueError, "requires_grad_(false): ", autograd::describe(*this),
               " is not a leaf; you can only change requires_grad of leaf tensors. Use detach() to get a "
               "tensor outside the graph");
    return *this;
  }
  KILN_CHECK(!r || is_floating_point(), DTypeError,
             "requires_grad_: only tensors of floating point dtype can require gradients, got ", dtype_name(dtype()));
  impl_->set_requires_grad_flag(r);
  return *this;
}

Tensor Tensor::grad() const {
  const AutogradMeta* m = get_meta(*this);
  return m ? m->grad : undefined_tensor();
}

Tensor& Tensor::mutable_grad() const { return materialize_meta(*this).grad; }

autograd::Node* Tensor::grad_fn() const {
  autograd::refresh_view(*this);
  const AutogradMeta* m = get_meta(*this);
  return m ? m->grad_fn.get() : nullptr;
}

bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

int64_t Tensor::output_nr() const {
  const AutogradMeta* m = get_meta(*this);
  return m ? m->output_nr : 0;
}

void Tensor::backward(const Tensor& gradient, std::optional<bool> retain_graph, bool create_graph) const {
  autograd::backward({*this}, gradient.defined() ? TensorList{gradient} : TensorList{},
                     retain_graph.value_or(create_graph), create_graph);
}

Tensor Tensor::detach() const {
  KILN_CHECK(defined(), ValueError, "detach: called on an undefined tensor");
  auto impl = make_intrusive<TensorImpl>(storage(), dtype(), sizes(), strides(), storage_offset());
  impl->set_inference(impl_->is_inference());
  return Tensor(std::move(impl));
}

Tensor& Tensor::detach_() {
  KILN_CHECK(defined(), ValueError, "detach_: called on an undefined tensor");
  if (AutogradMeta* m = get_meta(*this)) {
    // As torch: the view would stay tied to its base's history through refresh_view.
    KILN_CHECK(!m->is_view, ValueError, "detach_: ", autograd::describe(*this),
               " is a view; views cannot be detached in place. Use detach(), which returns a new tensor");
    m->grad_fn.reset();
    m->output_nr = 0;
  }
  impl_->set_requires_grad_flag(false);
  return *this;
}

void Tensor::retain_grad() const {
  KILN_CHECK(requires_grad(), ValueError,
             "retain_grad: cannot retain the gradient of a tensor that does not "
             "require grad (",
             autograd::describe(*this), ")");
  autograd::refresh_view(*this);
  AutogradMeta& m = materialize_meta(*this);
  if (!m.grad_fn || m.retains_grad) return;
  m.retains_grad = true;
  // The hook holds the impl raw: the node is owned (through the graph) by this
  // tensor's meta, so the hook cannot outlive the tensor's history.
  TensorImpl* self = impl_.get();
  const uint64_t id = autograd::next_hook_id();
  m.retain_grad_hook_id = id;
  m.grad_fn->add_pre_hook(m.output_nr, id, [self](const Tensor& g) {
    auto* meta = static_cast<AutogradMeta*>(self->autograd_meta());
    if (meta)
      meta->grad =
          meta->grad.defined() ? autograd::grad_math().add(meta->grad, g) : autograd::grad_math().clone(g.detach());
    return Tensor();
  });
}

bool Tensor::retains_grad() const {
  const AutogradMeta* m = get_meta(*this);
  return m && m->retains_grad;
}

HookHandle Tensor::register_hook(std::function<Tensor(const Tensor&)> hook) const {
  KILN_CHECK(requires_grad(), ValueError,
             "register_hook: cannot register a hook on a tensor that does not "
             "require grad (",
             autograd::describe(*this), ")");
  autograd::refresh_view(*this);
  AutogradMeta& m = materialize_meta(*this);
  const uint64_t id = autograd::next_hook_id();
  if (m.grad_fn) {
    autograd::NodePtr node = m.grad_fn;
    node->add_pre_hook(m.output_nr, id, std::move(hook));
    return HookHandle([node, id] { node->remove_pre_hook(id); });
  }
  m.leaf_hooks.push_back({id, std::move(hook)});
  IntrusivePtr<TensorImpl> impl = impl_;
  return HookHandle([impl, id] {
    if (auto* meta = static_cast<AutogradMeta*>(impl->autograd_meta())) {
      std::erase_if(meta->leaf_hooks, [id](const AutogradMeta::Hook& h) { return h.id == id; });
    }
  });
}

HookHandle Tensor::register_post_accumulate_grad_hook(std::function<void(Tensor&)> hook) const {
  KILN_CHECK(requires_grad() && is_leaf(), ValueError,
             "register_post_accumulate_grad_hook: only leaf tensors "
             "that require grad accumulate gradients; got ",
             autograd::describe(*this));
  AutogradMeta& m = materialize_meta(*this);
  const uint64_t id = autograd::next_hook_id();
  m.post_accumulate_hooks.push_back({id, std::move(hook)});
  IntrusivePtr<TensorImpl> impl = impl_;
  return HookHandle([impl, id] {
    if (auto* meta = static_cast<AutogradMeta*>(impl->autograd_meta())) {
      std::erase_if(meta->post_accumulate_hooks,
                    [id](const AutogradMeta::PostAccumulateHook& h) { return h.id == id; });
    }
  });
}

}  // namespace kiln
