#include "kiln/autograd/custom_function.h"

#include <cxxabi.h>

#include <cstdlib>
#include <memory>

namespace kiln::autograd {

void AutogradContext::save_for_backward(const TensorList& tensors) { to_save_ = tensors; }

TensorList AutogradContext::get_saved_variables() const {
  TensorList out;
  for (const auto& s : saved_) out.push_back(s.unpack(owner_));
  return out;
}

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> p(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && p ? std::string(p.get()) : std::string(mangled);
}

}  // namespace kiln::autograd
