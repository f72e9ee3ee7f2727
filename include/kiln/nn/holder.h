// model(x) instead of (*model)(x): a shared pointer to a module that can be
// called like the module itself, for libtorch users used to module holders.
//
//   auto model = nn::make_module<Net>(opts);   // nn::ModuleHolder<Net>
//   Tensor y = model(x);                        // hooks run, as (*model)(x)
//   optim::AdamW opt(*model, {...});             // and everything a shared_ptr does
//
// It is a std::shared_ptr<M> (it derives from one), so it goes wherever a
// module pointer goes: register_module, DDP, containers. No macro: a plain
// template over the module class (DESIGN.md §10 rules out TORCH_MODULE).
#pragma once

#include <memory>
#include <utility>

#include "kiln/nn/module.h"

namespace kiln::nn {

template <typename M>
class ModuleHolder : public std::shared_ptr<M> {
 public:
  ModuleHolder() = default;
  ModuleHolder(std::shared_ptr<M> p) : std::shared_ptr<M>(std::move(p)) {}  // NOLINT: a holder is its pointer
  /// Runs the module with its hooks; an empty holder throws instead of crashing.
  Tensor operator()(const Tensor& input) const { return (*get_checked())(input); }
  Tensor operator()(const Tensor& input, const Tensor& other) const { return (*get_checked())(input, other); }

 private:
  M* get_checked() const {
    KILN_CHECK(this->get() != nullptr, ValueError,
               "nn::ModuleHolder: called an empty holder (expected one made by "
               "nn::make_module<M>(...) or assigned a module)");
    return this->get();
  }
};

/// std::make_shared for modules, returning a callable holder.
template <typename M, typename... Args>
ModuleHolder<M> make_module(Args&&... args) {
  return ModuleHolder<M>(std::make_shared<M>(std::forward<Args>(args)...));
}

}  // namespace kiln::nn
