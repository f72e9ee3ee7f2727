#include "kiln/autograd/custom_function.h"

#include <cxxabi.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/core/error.h"

namespace kiln::autograd {

void AutogradContext::save_for_backward(const TensorList& tensors) { to_save_ = tensors; }

TensorList AutogradContext::get_saved_variables() const {
  TensorList out;
  for (const auto& s : saved_) out.push_back(s.unpack(owner_));
  return out;
}

TensorList AutogradContext::differentiate_composite(
    const TensorList& inputs, const TensorList& grads,
    const std::function<TensorList(const TensorList&)>& composite) const {
  const char* fn = owner_ ? owner_->name() : "a custom Function";
  KILN_CHECK(inputs.size() == needs_input_grad_.size(), ValueError, fn,
             ".differentiate_composite: expected one tensor per Tensor argument of forward (",
             needs_input_grad_.size(), "), got ", inputs.size());
  TensorList args(inputs.size()), wrt, out(inputs.size());
  std::vector<size_t> slots;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (!needs_input_grad_[i] || !t.defined()) {
      args[i] = t;
      continue;
    }
    KILN_CHECK(t.requires_grad(), ValueError, fn, ": input ", i,
               " needs a gradient under create_graph, but the tensor saved for it has no history (got ",
               describe(t), "); hint: forward runs under no-grad, so a copy it makes (x.contiguous(), x.to(...)) "
               "is a constant to double backward: save forward's argument itself");
    // A view per argument: the composite's graph then tells the arguments apart even when they alias.
    args[i] = t.view_as(t);
    wrt.push_back(args[i]);
    slots.push_back(i);
  }
  if (wrt.empty()) return out;
  const TensorList outputs = composite(args);
  const TensorList g = grad(outputs, wrt, grads, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t k = 0; k < slots.size(); ++k) out[slots[k]] = g[k];
  return out;
}

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> p(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && p ? std::string(p.get()) : std::string(mangled);
}

}  // namespace kiln::autograd
