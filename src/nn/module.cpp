// nn::Module: registration, traversal, state dicts, hooks and printing.
#include "kiln/nn/module.h"

#include <algorithm>
#include <atomic>
#include <iostream>
#include <set>
#include <sstream>
#include <typeinfo>

#include "kiln/autograd/custom_function.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/allocator.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"

namespace kiln::nn {

namespace {
void check_name(const std::string& name, const char* what) {
  KILN_CHECK(!name.empty(), ValueError, what, " name must not be empty");
  KILN_CHECK(name.find('.') == std::string::npos, ValueError, what, " name must not contain '.', got \"", name, "\"");
}
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + ("\"" + v[i] + "\"");
  return s;
}
}  // namespace

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}

std::string Module::type_name() const {
  if (!type_name_.empty()) return type_name_;
  // The dynamic type is only known after construction, so it is looked up here, not in the constructor.
  std::string n = autograd::demangle(typeid(*this).name());
  if (auto pos = n.rfind("::"); pos != std::string::npos) n = n.substr(pos + 2);
  return n;
}

namespace {
// The modules whose call operator is running on this thread, outermost first.
thread_local std::vector<Module*> t_call_stack;
struct CallFrame {
  explicit CallFrame(Module* m) { t_call_stack.push_back(m); }
  ~CallFrame() { t_call_stack.pop_back(); }
  CallFrame(const CallFrame&) = delete;
  CallFrame& operator=(const CallFrame&) = delete;
};
}  // namespace

// A module with trainable parameters called inside another module's forward
// but registered nowhere under the outermost one: the libtorch slip of a
// member never passed to register_module. Its parameters reach no optimizer
// built from the model and no state_dict, so say so (once per module).
void Module::check_registered_in(Module& root, const Module& caller) {
  checked_root_ = &root;
  if (warned_unregistered_) return;
  for (Module* m : root.modules())
    if (m == this) return;
  const int64_t trainable = num_parameters(/*trainable_only=*/true);
  if (trainable == 0) return;
  warned_unregistered_ = true;
  std::cerr << "kiln warning: " << type_name() << " (" << trainable << " trainable parameters) was called inside "
            << caller.type_name() << "'s forward, but it is not "
            << "registered in " << root.type_name() << ": its parameters are missing from parameters(), "
            << "state_dict() and any optimizer built from them, so they are never trained or saved. Register it: "
            << "member = register_module(\"name\", member).\n";
}

Module::Slot* Module::find_slot(std::vector<std::unique_ptr<Slot>>& slots, const std::string& name) {
  for (auto& s : slots)
    if (s->name == name) return s.get();
  return nullptr;
}

namespace {
std::atomic<uint64_t> g_structure_epoch{0};
}  // namespace

uint64_t Module::structure_epoch() { return g_structure_epoch.load(std::memory_order_acquire); }

Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  g_structure_epoch.fetch_add(1, std::memory_order_acq_rel);
  check_name(name, "parameter");
  KILN_CHECK(!find_slot(buffers_, name), ValueError, "attribute \"", name, "\" is already a buffer");
  if (t.defined()) {
    KILN_CHECK(t.is_leaf(), ValueError, "parameter \"", name,
               "\" must be a leaf tensor (detach() it first); got one with a grad_fn");
    if (requires_grad || t.requires_grad()) t.requires_grad_(requires_grad);
    t.storage()->set_category(MemoryCategory::Parameter);
    autograd::set_name(t, name);
  }
  Slot* s = find_slot(params_, name);
  if (!s) {
    params_.push_back(std::make_unique<Slot>());
    s = params_.back().get();
    s->name = name;
  }
  s->tensor = std::move(t);
  return s->tensor;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  g_structure_epoch.fetch_add(1, std::memory_order_acq_rel);
  check_name(name, "buffer");
  KILN_CHECK(!find_slot(params_, name), ValueError, "attribute \"", name, "\" is already a parameter");
  Slot* s = find_slot(buffers_, name);
  if (!s) {
    buffers_.push_back(std::make_unique<Slot>());
    s = buffers_.back().get();
    s->name = name;
  }
  s->tensor = std::move(t);
  s->persistent = persistent;
  // Running statistics and masks are the model's state, not the activations of whatever step made them.
  if (s->tensor.defined()) s->tensor.storage()->set_category(MemoryCategory::Buffer);
  return s->tensor;
}

void Module::register_module_impl(const std::string& name, ModulePtr m) {
  g_structure_epoch.fetch_add(1, std::memory_order_acq_rel);
  check_name(name, "module");
  KILN_CHECK(m != nullptr, ValueError, "register_module(\"", name, "\"): expected a module, got null");
  KILN_CHECK(m.get() != this, ValueError, "register_module(\"", name, "\"): a module cannot contain itself");
  // Parameters are named by their dotted path from the outermost module that
  // registered them, for autograd's messages (in-place errors name "layers.0.weight").
  for (auto& [n, t] : m->named_parameters()) autograd::set_name(t, name + "." + n);
  for (auto& [n, c] : children_)
    if (n == name) {
      c = std::move(m);
      return;
    }
  children_.emplace_back(name, std::move(m));
}

void Module::collect(const std::string& prefix, bool recurse, bool want_buffers, bool persistent_only,
                     std::vector<std::pair<std::string, Tensor*>>& out, std::vector<const TensorImpl*>& seen) const {
  for (const auto& s : want_buffers ? buffers_ : params_) {
    if (!s->tensor.defined() || (persistent_only && !s->persistent)) continue;
    const TensorImpl* key = s->tensor.impl();
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
    seen.push_back(key);
    out.emplace_back(prefix + s->name, &s->tensor);
  }
  if (!recurse) return;
  for (const auto& [n, c] : children_) c->collect(prefix + n + ".", true, want_buffers, persistent_only, out, seen);
}

NamedTensors Module::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  std::vector<const TensorImpl*> seen;
  collect("", recurse, false, false, slots, seen);
  NamedTensors out;
  for (auto& [n, t] : slots) out.emplace_back(n, *t);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, const Tensor*>> Module::named_tensor_slots() const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  std::vector<const TensorImpl*> seen;
  collect("", true, false, false, slots, seen);
  collect("", true, true, false, slots, seen);
  return {slots.begin(), slots.end()};
}

NamedTensors Module::named_buffers(bool recurse) const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  std::vector<const TensorImpl*> seen;
  collect("", recurse, true, false, slots, seen);
  NamedTensors out;
  for (auto& [n, t] : slots) out.emplace_back(n, *t);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, ModulePtr>> Module::named_children() const { return children_; }

std::vector<ModulePtr> Module::children() const {
  std::vector<ModulePtr> out;
  for (auto& [n, c] : children_) out.push_back(c);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules(const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out;
  std::set<const Module*> seen;
  std::function<void(const std::string&, Module*)> walk = [&](const std::string& p, Module* m) {
    if (!seen.insert(m).second) return;
    out.emplace_back(p, m);
    for (auto& [n, c] : m->children_) walk(p.empty() ? n : p + "." + n, c.get());
  };
  walk(prefix, this);
  return out;
}

std::vector<Module*> Module::modules() {
  std::vector<Module*> out;
  for (auto& [n, m] : named_modules()) out.push_back(m);
  return out;
}

Module& Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [n, c] : children_) c->apply(fn);
  fn(*this);
  return *this;
}

Module& Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  const capture::HostAction host("Module.zero_grad", [this, set_to_none] { zero_grad(set_to_none); });
  for (auto& p : parameters()) {
    capture::note_grad_reset(p);
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad() = Tensor();
    } else {
      NoGradGuard g;
      p.mutable_grad().zero_();
    }
  }
}

Module& Module::to(DType dtype) {
  NoGradGuard g;
  // In place, as torch's module._apply: each parameter and buffer keeps its
  // TensorImpl and only its data changes, so a member holding the Tensor, an
  // optimizer built before to(), hooks and autograd names all follow. A tied
  // tensor is converted once; later slots see the new dtype and skip it.
  auto convert = [&](const Tensor& t) {
    if (!t.defined() || !t.is_floating_point() || t.dtype() == dtype) return;
    Tensor data = t.detach().to(dtype);
    data.storage()->set_category(t.storage()->category());
    t.set_data(data);
    if (const Tensor& grad = t.grad(); grad.defined() && grad.dtype() != dtype) {
      Tensor gdata = grad.to(dtype);
      gdata.storage()->set_category(grad.storage()->category());
      grad.set_data(gdata);
    }
  };
  for (auto* m : modules()) {
    for (auto& s : m->params_) convert(s->tensor);
    for (auto& s : m->buffers_) convert(s->tensor);
  }
  return *this;
}

NamedTensors Module::state_dict() const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  // Per module: parameters then persistent buffers (torch's order). As torch, a
  // tensor shared by several modules (tied weights) is listed under each name.
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m, const std::string& p) {
    std::vector<const TensorImpl*> seen;
    m.collect(p, false, false, false, slots, seen);
    m.collect(p, false, true, true, slots, seen);
    for (auto& [n, c] : m.children_) walk(*c, p + n + ".");
  };
  walk(*this, "");
  NamedTensors out;
  for (auto& [n, t] : slots) out.emplace_back(n, t->detach());
  return out;
}

LoadStateDictResult Module::load_state_dict(const NamedTensors& dict, bool strict) {
  std::vector<std::pair<std::string, Tensor*>> slots;
  // Every name state_dict() lists, tied weights under each of theirs (as torch).
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m, const std::string& p) {
    std::vector<const TensorImpl*> seen;
    m.collect(p, false, false, false, slots, seen);
    m.collect(p, false, true, true, slots, seen);
    for (auto& [n, c] : m.children_) walk(*c, p + n + ".");
  };
  walk(*this, "");
  std::map<std::string, const Tensor*> given;
  for (auto& [n, t] : dict) given[n] = &t;
  LoadStateDictResult res;
  std::vector<std::string> mismatches;
  std::vector<std::pair<Tensor*, const Tensor*>> copies;
  std::set<std::string> expected;
  for (auto& [n, t] : slots) {
    expected.insert(n);
    auto it = given.find(n);
    if (it == given.end()) {
      res.missing_keys.push_back(n);
      continue;
    }
    const Tensor& src = *it->second;
    if (!src.defined() || src.sizes() != t->sizes()) {
      mismatches.push_back("\"" + n + "\": expected shape " + t->shape_string() + ", got " +
                           (src.defined() ? src.shape_string() : std::string("an undefined tensor")));
    } else if (src.dtype() != t->dtype()) {
      mismatches.push_back("\"" + n + "\": expected dtype " + std::string(dtype_name(t->dtype())) + ", got " +
                           std::string(dtype_name(src.dtype())));
    } else {
      copies.emplace_back(t, &src);
    }
  }
  for (auto& [n, t] : dict)
    if (!expected.count(n)) res.unexpected_keys.push_back(n);
  std::string msg;
  if (strict && !res.missing_keys.empty()) msg += "\n  missing keys: " + join(res.missing_keys);
  if (strict && !res.unexpected_keys.empty()) msg += "\n  unexpected keys: " + join(res.unexpected_keys);
  for (auto& m : mismatches) msg += "\n  size/dtype mismatch for " + m;
  KILN_CHECK(msg.empty(), ValueError, "error(s) in load_state_dict for ", type_name(), " (nothing was changed):", msg);
  NoGradGuard g;
  for (auto& [dst, src] : copies) dst->copy_(*src);
  return res;
}

int64_t Module::num_parameters(bool trainable_only) const {
  int64_t n = 0;
  for (auto& p : parameters())
    if (!trainable_only || p.requires_grad()) n += p.numel();
  return n;
}

Tensor Module::forward(const Tensor&) {
  KILN_CHECK(false, ValueError, type_name(), " has no forward(); call its submodules instead");
  return {};
}

Tensor Module::forward(const Tensor&, const Tensor&) {
  KILN_CHECK(false, ValueError, type_name(),
             " was called with two inputs, but it has no two-input forward; call it with one input, or override "
             "Tensor forward(const Tensor&, const Tensor&) in it");
  return {};
}

Tensor Module::operator()(const Tensor& input) { return call_with_hooks(input, nullptr); }

Tensor Module::operator()(const Tensor& input, const Tensor& other) { return call_with_hooks(input, &other); }

Tensor Module::call_with_hooks(const Tensor& input, const Tensor* other) {
  if (!t_call_stack.empty() && checked_root_ != t_call_stack.front())
    check_registered_in(*t_call_stack.front(), *t_call_stack.back());
  CallFrame frame(this);
  // Copies: a hook may add or remove hooks (itself included) while running.
  const auto pre = hooks_->pre;
  Tensor x = input;
  for (auto& [id, h] : pre) {
    if (h.replay == HookReplay::HostCode) hook_break();
    Tensor r = h.fn(*this, x);
    if (r.defined()) x = r;
  }
  Tensor y = other ? forward(x, *other) : forward(x);
  const auto post = hooks_->post;
  for (auto& [id, h] : post) {
    if (h.replay == HookReplay::HostCode) hook_break();
    Tensor r = h.fn(*this, x, y);
    if (r.defined()) y = r;
  }
  return y;
}

void Module::hook_break() const {
  if (!capture::recording()) return;
  const std::string what = "a forward hook on " + type_name_ +
                           " runs host code, which a replay would not run (register it with "
                           "Module::HookReplay::TensorOpsOnly if it only computes tensors)";
  capture::graph_break(what.c_str());
}

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook, HookReplay replay) {
  int64_t id = hooks_->next_id++;
  hooks_->pre.emplace(id, Hook<ForwardPreHook>{std::move(hook), replay});
  std::weak_ptr<Hooks> w = hooks_;
  return HookHandle([w, id] {
    if (auto h = w.lock()) h->pre.erase(id);
  });
}

HookHandle Module::register_forward_hook(ForwardHook hook, HookReplay replay) {
  int64_t id = hooks_->next_id++;
  hooks_->post.emplace(id, Hook<ForwardHook>{std::move(hook), replay});
  std::weak_ptr<Hooks> w = hooks_;
  return HookHandle([w, id] {
    if (auto h = w.lock()) h->post.erase(id);
  });
}

void Module::repr_into(std::string& out, int indent) const {
  out += type_name() + "(" + extra_repr();
  if (children_.empty()) {
    out += ")";
    return;
  }
  out += "\n";
  std::string pad(static_cast<size_t>(indent + 2), ' ');
  for (auto& [n, c] : children_) {
    out += pad + "(" + n + "): ";
    c->repr_into(out, indent + 2);
    out += "\n";
  }
  out += std::string(static_cast<size_t>(indent), ' ') + ")";
}

std::string Module::to_string() const {
  std::string s;
  repr_into(s, 0);
  return s;
}

std::string Module::summary() const {
  std::ostringstream os;
  os << to_string() << "\n";
  int64_t total = 0, trainable = 0;
  for (auto& [n, p] : named_parameters()) {
    os << "  " << n << " " << p.shape_string() << " " << p.numel() << "\n";
    total += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  os << "Total params: " << total << "\nTrainable params: " << trainable
     << "\nNon-trainable params: " << (total - trainable) << "\n";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Module& m) { return os << m.to_string(); }

}  // namespace kiln::nn
