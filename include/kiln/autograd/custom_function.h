// Custom differentiable functions, as torch.autograd.Function:
//
//   struct Cube : kiln::autograd::Function<Cube> {
//     static Tensor forward(AutogradContext& ctx, const Tensor& x) {
//       ctx.save_for_backward({x});
//       return x * x * x;
//     }
//     static TensorList backward(AutogradContext& ctx, TensorList grad_outputs) {
//       Tensor x = ctx.get_saved_variables()[0];
//       return {grad_outputs[0] * 3 * x * x};
//     }
//   };
//   Tensor y = Cube::apply(x);
//
// forward runs with grad mode off; backward returns one gradient per Tensor
// argument of forward (undefined for those that need none). Non-tensor
// arguments are passed through and get no gradient.
//
// Double backward: under create_graph backward runs with grad mode on, and its
// gradients are differentiated again only through the tensors they were
// computed from. A tensor forward derives (x.contiguous(), x.to(dtype), a
// statistic) is made under the no-grad guard and has no history, so a
// create_graph backward built on it treats it as a constant: save forward's
// arguments themselves (or its outputs) for that branch. A fused backward that
// is not itself differentiable can use differentiate_composite below.
#pragma once

#include <any>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kiln/autograd/functions.h"
#include "kiln/core/guards.h"
#include "kiln/core/factory.h"

namespace kiln::autograd {

template <typename Derived>
struct Function;

class AutogradContext {
 public:
  /// Saved with version checks, like a built-in op's saved tensors.
  void save_for_backward(const TensorList& tensors);
  TensorList get_saved_variables() const;
  /// Arbitrary values for backward (shapes, flags, scalars).
  std::unordered_map<std::string, std::any> saved_data;
  /// Which Tensor arguments of forward required grad.
  const std::vector<bool>& needs_input_grad() const { return needs_input_grad_; }

  /// For the create_graph branch of a backward whose fast path is a fused,
  /// non-differentiable kernel: the gradients of `composite(inputs)` (the
  /// same function as kiln ops) with grad_outputs `grads`, one per forward
  /// Tensor argument, each with its own history. `inputs` are forward's
  /// Tensor arguments as saved. An input that needs a gradient but was saved
  /// without history (a copy forward made) is an error naming the Function,
  /// not a silently missing gradient. Each input is differentiated through
  /// its own alias, so one tensor passed as several arguments (attention's
  /// q = k = v) gets each argument's share, not the total once per argument.
  TensorList differentiate_composite(const TensorList& inputs, const TensorList& grads,
                                     const std::function<TensorList(const TensorList&)>& composite) const;

 private:
  template <typename T>
  friend class CustomNode;
  template <typename T>
  friend struct Function;
  std::vector<SavedVariable> saved_;
  TensorList to_save_;
  std::vector<bool> needs_input_grad_;
  const Node* owner_ = nullptr;
};

template <typename Fn>
class CustomNode final : public Node {
 public:
  explicit CustomNode(std::string name) : name_(std::move(name)) {}
  const char* name() const override { return name_.c_str(); }
  TensorList apply(TensorList&& grads) override {
    ctx.owner_ = this;
    // Undefined incoming gradients become zeros, as PyTorch materialises them.
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = zeros(input_metadata()[i].shape, input_metadata()[i].dtype);
    }
    TensorList out = Fn::backward(ctx, std::move(grads));
    KILN_CHECK(out.size() == next_edges().size(), ValueError, name_, ".backward returned ", out.size(),
               " gradients, but forward received ", next_edges().size(), " tensor arguments");
    return out;
  }
  void release_variables() override {
    for (auto& s : ctx.saved_) s.reset();
  }
  AutogradContext ctx;

 private:
  std::string name_;
};


template <typename Derived>
struct Function {
  template <typename... Args>
  static auto apply(Args&&... args) {
    TensorList tensor_args;
    auto collect = [&](const auto& a) {
      if constexpr (std::is_same_v<std::decay_t<decltype(a)>, Tensor>) tensor_args.push_back(a);
    };
    (collect(args), ...);
    auto node = make_intrusive<CustomNode<Derived>>(demangled_name());
    for (const Tensor& t : tensor_args) node->ctx.needs_input_grad_.push_back(t.defined() && t.requires_grad());
    const bool record = compute_requires_grad(tensor_args);
    auto result = [&] {
      NoGradGuard no_grad;
      return Derived::forward(node->ctx, std::forward<Args>(args)...);
    }();
    if (!record) return result;
    TensorList outputs;
    if constexpr (std::is_same_v<decltype(result), Tensor>) outputs.push_back(result);
    else outputs = result;
    // Outputs that alias inputs would make the graph ambiguous; give them their own impl.
    for (Tensor& o : outputs) o = o.detach();
    set_history(outputs, node, tensor_args);
    node->ctx.saved_.clear();
    for (const Tensor& s : node->ctx.to_save_) {
      bool is_output = false;
      uint32_t nr = 0;
      for (size_t k = 0; k < outputs.size(); ++k) {
        if (outputs[k].storage().get() == s.storage().get() && outputs[k].sizes() == s.sizes()) {
          is_output = true;
          nr = static_cast<uint32_t>(k);
        }
      }
      node->ctx.saved_.emplace_back(is_output ? outputs[nr] : s, is_output, nr);
    }
    node->ctx.to_save_.clear();
    if constexpr (std::is_same_v<decltype(result), Tensor>) return outputs[0];
    else return outputs;
  }

 private:
  static std::string demangled_name();
};

std::string demangle(const char* mangled);

template <typename Derived>
std::string Function<Derived>::demangled_name() {
  std::string n = demangle(typeid(Derived).name());
  if (auto pos = n.rfind("::"); pos != std::string::npos) n = n.substr(pos + 2);
  return n + "Backward";
}

}  // namespace kiln::autograd
