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
// forward runs with grad mode off. Tensor arguments are Tensor, std::vector<Tensor>
// (each element is an input) and std::optional<Tensor> (an input slot, undefined
// when empty); any other argument is passed through and gets no gradient, and a
// container of tensors kiln cannot track (std::array, std::tuple, ...) does not
// compile. backward returns either one gradient per tensor input (vector
// elements one by one), undefined for those that need none, or, as libtorch,
// one per argument of forward with undefined slots for the non-tensor ones.
//
// ctx.saved_data["key"] = value in forward; in backward read it back with
// ctx.saved_data.get<T>("key") (a wrong key or type names the key and both
// types) or std::any_cast<T>(ctx.saved_data["key"]). A key forward did not set
// is an error in backward, never a silently inserted empty value.
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
#include <array>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kiln/autograd/functions.h"
#include "kiln/autograd/grad_math.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/record.h"

namespace kiln::autograd {

std::string demangle(const char* mangled);

/// Values a custom Function's forward keeps for its backward (shapes, flags,
/// scalars, structs). Once forward has returned the set is closed: reading a
/// key it did not set is a ValueError that names the key and the saved ones.
class SavedData {
 public:
  /// In forward: the value under `key`, created empty on first use (assign to it).
  /// In backward: the saved value, or a ValueError naming the key.
  std::any& operator[](const std::string& key);
  /// The value under `key` as T; a ValueError naming the key, the type it
  /// holds and T when it holds another type (or naming the key when absent).
  template <typename T>
  T& get(const std::string& key) {
    std::any& v = (*this)[key];
    T* p = std::any_cast<T>(&v);
    if (!p) type_mismatch(key, v, typeid(T));
    return *p;
  }
  bool contains(const std::string& key) const { return values_.count(key) != 0; }
  size_t size() const { return values_.size(); }
  /// The key read last in backward (named when a std::any_cast on it fails).
  const std::string& last_key() const { return last_key_; }
  /// "'k' (double)" for the value under `key`.
  std::string describe(const std::string& key) const;

 private:
  template <typename T>
  friend class CustomNode;
  template <typename T>
  friend struct Function;
  [[noreturn]] void type_mismatch(const std::string& key, const std::any& v, const std::type_info& want) const;
  std::unordered_map<std::string, std::any> values_;
  bool closed_ = false;
  std::string last_key_;
};

namespace fn_args {

/// Classifies a forward argument: how many tensor inputs it contributes.
template <typename T>
struct TensorArg {
  static constexpr bool is_tensor = false;
};
template <>
struct TensorArg<Tensor> {
  static constexpr bool is_tensor = true;
  static void collect(const Tensor& t, TensorList& out) { out.push_back(t); }
};
template <>
struct TensorArg<std::vector<Tensor>> {
  static constexpr bool is_tensor = true;
  static void collect(const std::vector<Tensor>& v, TensorList& out) { out.insert(out.end(), v.begin(), v.end()); }
};
template <>
struct TensorArg<std::optional<Tensor>> {
  static constexpr bool is_tensor = true;
  static void collect(const std::optional<Tensor>& o, TensorList& out) { out.push_back(o ? *o : Tensor()); }
};

/// Containers of tensors whose elements kiln would not see as inputs.
template <typename T>
struct HidesTensors : std::false_type {};
template <size_t N>
struct HidesTensors<std::array<Tensor, N>> : std::true_type {};
template <typename... Ts>
struct HidesTensors<std::tuple<Ts...>> : std::bool_constant<(TensorArg<Ts>::is_tensor || ...)> {};
template <typename A, typename B>
struct HidesTensors<std::pair<A, B>> : std::bool_constant<TensorArg<A>::is_tensor || TensorArg<B>::is_tensor> {};
template <>
struct HidesTensors<std::vector<std::optional<Tensor>>> : std::true_type {};
template <>
struct HidesTensors<std::optional<std::vector<Tensor>>> : std::true_type {};
template <>
struct HidesTensors<std::initializer_list<Tensor>> : std::true_type {};
template <>
struct HidesTensors<Tensor*> : std::true_type {};
template <>
struct HidesTensors<const Tensor*> : std::true_type {};

}  // namespace fn_args

template <typename Derived>
struct Function;

class AutogradContext {
 public:
  /// Saved with version checks, like a built-in op's saved tensors.
  void save_for_backward(const TensorList& tensors);
  TensorList get_saved_variables() const;
  /// Arbitrary values for backward (shapes, flags, scalars); see SavedData.
  SavedData saved_data;
  /// Which tensor inputs of forward required grad (vector elements one by one).
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
  /// Per argument of forward in libtorch's counting (vector elements one by
  /// one, each non-tensor argument one slot): true for tensor inputs.
  std::vector<bool> slot_is_tensor_;
  const Node* owner_ = nullptr;
};

/// Checks what a custom backward returned against forward's arguments and
/// keeps one gradient per tensor input (see the header comment).
TensorList accept_custom_grads(const std::string& name, TensorList&& out, const std::vector<bool>& slot_is_tensor,
                               size_t tensor_inputs);
/// Rethrows a std::bad_any_cast from a custom backward naming the saved_data key it read last.
[[noreturn]] void rethrow_bad_any_cast(const std::string& name, const SavedData& data);

template <typename Fn>
class CustomNode final : public Node {
 public:
  explicit CustomNode(std::string name) : name_(std::move(name)) {}
  const char* name() const override { return name_.c_str(); }
  TensorList apply(TensorList&& grads) override {
    ctx.owner_ = this;
    // Undefined incoming gradients become zeros, as PyTorch materialises them.
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = grad_math().zeros(input_metadata()[i].shape, input_metadata()[i].dtype);
    }
    TensorList out;
    try {
      out = Fn::backward(ctx, std::move(grads));
    } catch (const std::bad_any_cast&) {
      rethrow_bad_any_cast(name_, ctx.saved_data);
    }
    return accept_custom_grads(name_, std::move(out), ctx.slot_is_tensor_, next_edges().size());
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
    return apply_at(CallSite{}, std::forward<Args>(args)...);
  }
  /// apply, with the node recording where its forward was called (a call site
  /// cannot follow a parameter pack): kiln's own ops built on Function pass
  /// their caller's, as the built-in ops do, so that anomaly mode, the memory
  /// history and kiln::compile's profile can name the line.
  template <typename... Args>
  static auto apply_at(CallSite site, Args&&... args) {
    TensorList tensor_args;
    auto node = make_intrusive<CustomNode<Derived>>(demangled_name());
    auto collect = [&](const auto& a) {
      using A = std::decay_t<decltype(a)>;
      static_assert(!fn_args::HidesTensors<A>::value,
                    "Function::apply: this argument holds tensors that would get no gradient; pass each as a "
                    "Tensor, or use std::vector<Tensor> or std::optional<Tensor>");
      if constexpr (fn_args::TensorArg<A>::is_tensor) {
        const size_t before = tensor_args.size();
        fn_args::TensorArg<A>::collect(a, tensor_args);
        node->ctx.slot_is_tensor_.insert(node->ctx.slot_is_tensor_.end(), tensor_args.size() - before, true);
      } else {
        node->ctx.slot_is_tensor_.push_back(false);
      }
    };
    (collect(args), ...);
    // Recorded as torch records a custom Function: an op named after the class, which makes the node.
    std::string event;
    if (record::active()) {
      event = demangled_name();
      event.resize(event.size() - std::string_view("Backward").size());
    }
    const auto input = [&](size_t i) { return i < tensor_args.size() ? &tensor_args[i] : nullptr; };
    const record::Scope rs(record::Kind::Op, event, {input(0), input(1), input(2), input(3)});
    for (const Tensor& t : tensor_args) node->ctx.needs_input_grad_.push_back(t.defined() && t.requires_grad());
    const bool record = compute_requires_grad(tensor_args);
    auto result = [&] {
      NoGradGuard no_grad;
      return Derived::forward(node->ctx, std::forward<Args>(args)...);
    }();
    node->ctx.saved_data.closed_ = true;
    if (!record) return result;
    TensorList outputs;
    if constexpr (std::is_same_v<decltype(result), Tensor>)
      outputs.push_back(result);
    else
      outputs = result;
    // Outputs that alias inputs would make the graph ambiguous; give them their own impl.
    for (Tensor& o : outputs) o = o.detach();
    set_history(outputs, node, tensor_args, site);
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
    if constexpr (std::is_same_v<decltype(result), Tensor>)
      return outputs[0];
    else
      return outputs;
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
