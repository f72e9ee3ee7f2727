// nn layers, as torch.nn: Linear, Conv2d, Embedding, Dropout, pooling,
// activations, Flatten/Identity and the containers Sequential, ModuleList,
// ModuleDict. Options are structs with designated initialisers:
//   auto fc = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 784, .out_features = 512});
// Default initialisation matches PyTorch's in distribution.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "kiln/nn/module.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/linalg.h"

namespace kiln::nn {

struct LinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  std::optional<DType> dtype = std::nullopt;
};
/// y = x W^T + b; weight [out, in] kaiming_uniform(a=sqrt(5)), bias U(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  explicit Linear(LinearOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  /// Re-draws weight and bias as at construction.
  void reset_parameters();
  /// gelu(forward(x), approximate) and forward(x) + residual, each as one op
  /// where the layer can: what a transformer block calls when no hook needs the
  /// layer's own output (kiln::linear_gelu / linear_add here, GELU or the add
  /// inside the product). A subclass with another product (an int8 layer)
  /// overrides them with its own fused epilogue.
  virtual Tensor forward_gelu(const Tensor& x, const std::string& approximate);
  virtual Tensor forward_add(const Tensor& x, const Tensor& residual);
  const LinearOptions options;
  Tensor& weight;
  Tensor& bias;  // undefined when options.bias is false
  /// Inference (nothing to differentiate) reads the weight packed for oneDNN
  /// from here; it follows weight by identity and version (kiln::WeightPack).
  WeightPack weight_pack;
};

struct Conv2dOptions {
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  std::vector<int64_t> kernel_size = {1, 1};  // one value for both dims, or {kH, kW}
  std::vector<int64_t> stride = {1};
  std::vector<int64_t> padding = {0};
  std::vector<int64_t> dilation = {1};
  int64_t groups = 1;
  bool bias = true;
  std::optional<DType> dtype = std::nullopt;
};
/// kiln::conv2d; weight [out, in / groups, kH, kW] initialised as torch's Conv2d.
class Conv2d : public Module {
 public:
  explicit Conv2d(Conv2dOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void reset_parameters();
  const Conv2dOptions options;
  Tensor& weight;
  Tensor& bias;
};

struct EmbeddingOptions {
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  /// This row starts at zeros and receives no gradient (negative counts from the end), as torch.
  std::optional<int64_t> padding_idx = std::nullopt;
  std::optional<DType> dtype = std::nullopt;
};
/// Rows of weight [num_embeddings, embedding_dim] (N(0, 1)) picked by integer indices.
class Embedding : public Module {
 public:
  explicit Embedding(EmbeddingOptions o);
  Tensor forward(const Tensor& indices) override;
  std::string extra_repr() const override;
  const EmbeddingOptions options;
  Tensor& weight;

 private:
  std::optional<int64_t> padding_idx_;  // normalised to [0, num_embeddings)
};

/// Zeroes each element with probability p in training (kiln::rand on the
/// default generator) and scales the rest by 1/(1-p); identity in eval.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const double p;
};

struct Pool2dOptions {
  std::vector<int64_t> kernel_size = {1};
  std::vector<int64_t> stride = {};  // empty: kernel_size
  std::vector<int64_t> padding = {0};
  std::vector<int64_t> dilation = {1};  // MaxPool2d only
  bool ceil_mode = false;
  bool count_include_pad = true;  // AvgPool2d only
};
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Pool2dOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const Pool2dOptions options;
};
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Pool2dOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const Pool2dOptions options;
};
/// output_size: one value for both dims or two ({oH, oW}); in the
/// OptionalSize2d form std::nullopt is torch's None, "keep the input's size":
///   AdaptiveAvgPool2d(OptionalSize2d{std::nullopt, 7})  // nn.AdaptiveAvgPool2d((None, 7))
/// It prints itself as torch does: output_size=1, (3, 2), (None, 7).
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::vector<int64_t> output_size);
  /// {3, 2} and {1}: the integer form (a braced list would fit the other two constructors equally well).
  explicit AdaptiveAvgPool2d(std::initializer_list<int64_t> output_size);
  explicit AdaptiveAvgPool2d(OptionalSize2d output_size);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  /// Both dims (one value given: repeated); nullopt keeps the input's size in that dim.
  const OptionalSize2d output_size;

 private:
  bool one_value_ = false;  // given as one int: printed as one, as torch
};

/// x.flatten(start_dim, end_dim); defaults keep the batch dim, as torch.
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const int64_t start_dim, end_dim;
};

class Identity : public Module {
 public:
  Identity() : Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

/// A function as a module, for a step that has no module of its own inside a
/// Sequential (libtorch's nn::Functional):
///   std::make_shared<nn::Functional>([](const Tensor& x) { return x.flatten(1); }, "flatten")
/// It holds no parameters; its hooks run like any module's.
class Functional : public Module {
 public:
  using Fn = std::function<Tensor(const Tensor&)>;
  /// `name` is shown in the printed model: Functional(flatten).
  explicit Functional(Fn fn, std::string name = {});
  Tensor forward(const Tensor& x) override { return fn_(x); }
  std::string extra_repr() const override { return name_; }

 private:
  Fn fn_;
  std::string name_;
};
class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override { return x.relu(); }
};
/// approximate: "none" (erf) or "tanh".
class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override { return x.gelu(approximate); }
  std::string extra_repr() const override { return "approximate='" + approximate + "'"; }
  const std::string approximate;
};
class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) override { return x.silu(); }
};
class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override { return x.tanh(); }
};
class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override { return x.sigmoid(); }
};
class Softmax : public Module {
 public:
  explicit Softmax(int64_t dim) : Module("Softmax"), dim(dim) {}
  Tensor forward(const Tensor& x) override { return x.softmax(dim); }
  std::string extra_repr() const override { return "dim=" + std::to_string(dim); }
  const int64_t dim;
};

/// Children named "0", "1", ...; forward feeds each one's output to the next.
namespace detail {

/// The elements of a Sequential or ModuleList, for range-for and typed access.
class ModuleSeq : public Module {
 public:
  using Module::Module;
  /// Iterates the elements in order: for (const ModulePtr& m : *list).
  class iterator {
   public:
    using Base = std::vector<std::pair<std::string, ModulePtr>>::const_iterator;
    explicit iterator(Base it) : it_(it) {}
    const ModulePtr& operator*() const { return it_->second; }
    const ModulePtr* operator->() const { return &it_->second; }
    iterator& operator++() {
      ++it_;
      return *this;
    }
    bool operator==(const iterator&) const = default;

   private:
    Base it_;
  };
  iterator begin() const { return iterator(child_entries().begin()); }
  iterator end() const { return iterator(child_entries().end()); }
  size_t size() const { return child_entries().size(); }
  bool empty() const { return child_entries().empty(); }
  /// Element i; IndexError past the end.
  ModulePtr operator[](size_t i) const;
  /// Element i as its own type (list->at<Linear>(0)->weight); ValueError naming
  /// the element's type when it is another.
  template <typename M>
  std::shared_ptr<M> at(size_t i) const {
    ModulePtr m = (*this)[i];
    auto typed = std::dynamic_pointer_cast<M>(m);
    if (!typed) wrong_type(i, *m, typeid(M));
    return typed;
  }
  /// Appends `m` under the next index.
  void append(ModulePtr m);

 private:
  [[noreturn]] void wrong_type(size_t i, const Module& m, const std::type_info& want) const;
};

}  // namespace detail

/// Runs its modules in order. Build it from a brace list,
/// Sequential({a, b}), or from the modules themselves, which std::make_shared
/// can forward: std::make_shared<Sequential>(a, b, c).
class Sequential : public detail::ModuleSeq {
 public:
  Sequential() : ModuleSeq("Sequential") {}
  Sequential(std::initializer_list<ModulePtr> modules);
  template <typename... M>
  requires(sizeof...(M) > 0 && (std::is_base_of_v<Module, M> && ...)) explicit Sequential(std::shared_ptr<M>... modules)
      : Sequential() {
    (append(std::move(modules)), ...);
  }
  Sequential& push_back(ModulePtr m);
  Tensor forward(const Tensor& x) override;
};

/// Holds modules under "0", "1", ... with no forward of its own; range-for
/// gives the elements, at<M>(i) one as its type.
class ModuleList : public detail::ModuleSeq {
 public:
  ModuleList() : ModuleSeq("ModuleList") {}
  ModuleList(std::initializer_list<ModulePtr> modules);
  template <typename... M>
  requires(sizeof...(M) > 0 && (std::is_base_of_v<Module, M> && ...)) explicit ModuleList(std::shared_ptr<M>... modules)
      : ModuleList() {
    (append(std::move(modules)), ...);
  }
  ModuleList& push_back(ModulePtr m);
};

/// Holds modules by name, in insertion order, with no forward of its own.
class ModuleDict : public Module {
 public:
  ModuleDict() : Module("ModuleDict") {}
  ModuleDict(std::initializer_list<std::pair<std::string, ModulePtr>> modules);
  ModuleDict& insert(const std::string& name, ModulePtr m);
  bool contains(const std::string& name) const;
  /// The module called `name`; ValueError listing the names otherwise.
  ModulePtr operator[](const std::string& name) const;
  size_t size() const { return children().size(); }
};

}  // namespace kiln::nn
