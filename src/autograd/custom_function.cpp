#include "kiln/autograd/custom_function.h"

#include <cxxabi.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "kiln/autograd/engine.h"
#include "kiln/autograd/grad_math.h"
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
             ".differentiate_composite: expected one tensor per Tensor argument of forward (", needs_input_grad_.size(),
             "), got ", inputs.size());
  TensorList args(inputs.size()), wrt, out(inputs.size());
  std::vector<size_t> slots;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (!needs_input_grad_[i] || !t.defined()) {
      args[i] = t;
      continue;
    }
    KILN_CHECK(t.requires_grad(), ValueError, fn, ": input ", i,
               " needs a gradient under create_graph, but the tensor saved for it has no history (got ", describe(t),
               "); hint: forward runs under no-grad, so a copy it makes (x.contiguous(), x.to(...)) "
               "is a constant to double backward: save forward's argument itself");
    // A view per argument: the composite's graph then tells the arguments apart even when they alias.
    args[i] = grad_math().view(t, t.sizes());
    wrt.push_back(args[i]);
    slots.push_back(i);
  }
  if (wrt.empty()) return out;
  const TensorList outputs = composite(args);
  const TensorList g = grad(outputs, wrt, grads, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t k = 0; k < slots.size(); ++k) out[slots[k]] = g[k];
  return out;
}

std::any& SavedData::operator[](const std::string& key) {
  if (!closed_) return values_[key];
  auto it = values_.find(key);
  if (it == values_.end()) {
    std::string keys;
    for (const auto& [k, v] : values_) keys += (keys.empty() ? "" : ", ") + describe(k);
    throw ValueError(::kiln::detail::concat(
        "ctx.saved_data[\"", key,
        "\"]: forward saved no value under this key (saved: ", keys.empty() ? std::string("none") : keys, ")"));
  }
  last_key_ = key;
  return it->second;
}

std::string SavedData::describe(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) return "'" + key + "' (absent)";
  return "'" + key + "' (" + (it->second.has_value() ? demangle(it->second.type().name()) : std::string("empty")) + ")";
}

void SavedData::type_mismatch(const std::string& key, const std::any& v, const std::type_info& want) const {
  throw ValueError(::kiln::detail::concat(
      "ctx.saved_data[\"", key, "\"]: expected a value of type ", demangle(want.name()), ", got one of type ",
      v.has_value() ? demangle(v.type().name()) : std::string("<empty>"), " (what forward stored there)"));
}

TensorList accept_custom_grads(const std::string& name, TensorList&& out, const std::vector<bool>& slot_is_tensor,
                               size_t tensor_inputs) {
  if (out.size() == tensor_inputs) return std::move(out);
  KILN_CHECK(out.size() == slot_is_tensor.size(), ValueError, name, ".backward returned ", out.size(),
             " gradients; expected ", tensor_inputs,
             " (one per tensor input of forward, std::vector<Tensor> elements one by one) or ", slot_is_tensor.size(),
             " (one per argument, undefined for the non-tensor ones)");
  TensorList kept;
  kept.reserve(tensor_inputs);
  for (size_t i = 0; i < out.size(); ++i) {
    if (slot_is_tensor[i]) {
      kept.push_back(std::move(out[i]));
      continue;
    }
    KILN_CHECK(!out[i].defined(), ValueError, name, ".backward returned a defined gradient at position ", i,
               ", which is a non-tensor argument of forward; expected an undefined Tensor() there");
  }
  return kept;
}

void rethrow_bad_any_cast(const std::string& name, const SavedData& data) {
  const std::string& key = data.last_key();
  throw ValueError(::kiln::detail::concat(
      name, ".backward: std::any_cast failed",
      key.empty() ? std::string(" (no saved_data key was read)")
                  : " on the value last read from ctx.saved_data, " + data.describe(key),
      "; hint: ctx.saved_data.get<T>(\"", key.empty() ? "key" : key, "\") names the requested type as well"));
}

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> p(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && p ? std::string(p.get()) : std::string(mangled);
}

}  // namespace kiln::autograd
