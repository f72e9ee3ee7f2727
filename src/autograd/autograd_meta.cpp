#include "kiln/autograd/autograd_meta.h"

#include <atomic>
#include <sstream>

#include "kiln/autograd/functions.h"

namespace kiln::autograd {

AutogradMeta::~AutogradMeta() = default;

AutogradMeta* get_meta(const Tensor& t) {
  return t.defined() ? static_cast<AutogradMeta*>(t.impl()->autograd_meta()) : nullptr;
}

AutogradMeta& materialize_meta(const Tensor& t) {
  if (auto* m = get_meta(t)) return *m;
  auto m = std::make_unique<AutogradMeta>();
  AutogradMeta* raw = m.get();
  t.impl()->set_autograd_meta(std::move(m));
  return *raw;
}

Edge gradient_edge(const Tensor& t) {
  refresh_view(t);
  AutogradMeta* m = get_meta(t);
  if (m && m->grad_fn) return {m->grad_fn, m->output_nr};
  if (!t.requires_grad()) return {};
  AutogradMeta& meta = materialize_meta(t);
  if (meta.grad_accumulator) return {NodePtr(meta.grad_accumulator), 0};
  auto acc = make_intrusive<AccumulateGrad>(t);
  meta.grad_accumulator = acc.get();
  return {NodePtr(acc), 0};
}

std::string describe(const Tensor& t) {
  std::ostringstream os;
  const AutogradMeta* m = get_meta(t);
  if (m && !m->name.empty()) {
    os << "parameter '" << m->name << "'";
  } else if (m && m->grad_fn) {
    os << "output " << m->output_nr << " of " << m->grad_fn->name();
  } else if (t.requires_grad()) {
    os << "a leaf tensor";
  } else {
    os << "a tensor";
  }
  os << " " << t.sizes() << " " << dtype_name(t.dtype());
  return os.str();
}

uint64_t next_hook_id() {
  static std::atomic<uint64_t> id{1};
  return id.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kiln::autograd
