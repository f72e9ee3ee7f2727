// Tensor: the value handle users hold. Copying a Tensor copies a pointer
// (one atomic increment); `b = a` aliases, `b = a.clone()` copies data.
//
// Methods mirror PyTorch's names and semantics. They are declared here and
// defined in src/ops/ — the one sanctioned exception to the layering
// (DESIGN.md §1), as in PyTorch. Core defines the handle and its accessors;
// the factories (empty, zeros, randn, ...) are ops, in kiln/ops/factory.h.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <source_location>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kiln/core/dtype.h"
#include "kiln/core/scalar.h"
#include "kiln/core/shape.h"
#include "kiln/core/tensor_impl.h"

namespace kiln {

namespace autograd {
class Node;
}

/// Returned by hook registrations; remove() unregisters the hook (idempotent).
class HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::function<void()> remover) : remover_(std::move(remover)) {}
  void remove() {
    if (remover_) std::exchange(remover_, nullptr)();
  }

 private:
  std::function<void()> remover_;
};

/// Options for factories, in PyTorch's C++ style:
///   zeros({2, 3}, kFloat64); zeros({2, 3}, TensorOptions().dtype(kInt64).requires_grad(false))
class TensorOptions {
 public:
  TensorOptions() = default;
  TensorOptions(DType d) : dtype_(d) {}  // NOLINT
  TensorOptions dtype(DType d) const {
    auto o = *this;
    o.dtype_ = d;
    return o;
  }
  TensorOptions requires_grad(bool r) const {
    auto o = *this;
    o.requires_grad_ = r;
    return o;
  }
  TensorOptions device(Device d) const {
    auto o = *this;
    o.device_ = d;
    return o;
  }
  TensorOptions category(MemoryCategory c) const {
    auto o = *this;
    o.category_ = c;
    return o;
  }

  DType dtype_or_default() const { return dtype_ ? *dtype_ : default_dtype(); }
  std::optional<DType> dtype_opt() const { return dtype_; }
  bool requires_grad() const { return requires_grad_; }
  Device device() const { return device_; }
  /// The allocation category; unset means the thread's current one.
  std::optional<MemoryCategory> category() const { return category_; }

 private:
  std::optional<DType> dtype_;
  bool requires_grad_ = false;
  Device device_{};
  std::optional<MemoryCategory> category_;
};

class Tensor;
using TensorList = std::vector<Tensor>;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(IntrusivePtr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- identity and metadata (src/core/tensor.cpp) ----
  bool defined() const { return static_cast<bool>(impl_); }
  TensorImpl* impl() const { return impl_.get(); }
  const IntrusivePtr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  int64_t use_count() const { return impl_.use_count(); }

  int64_t dim() const { return impl_->dim(); }
  int64_t ndimension() const { return dim(); }
  int64_t numel() const { return impl_->numel(); }
  // Note [sizes() of a temporary]: on a named tensor sizes() is a view of its
  // metadata; on a temporary (f(x).sizes()) the tensor may die at the end of
  // the full expression, so it returns an owning DimVector instead and
  // `auto s = f(x).sizes();` cannot dangle. (An IntArrayRef variable, like
  // c10::ArrayRef, must still never be initialised from a temporary.)
  IntArrayRef sizes() const& { return impl_->sizes(); }
  DimVector sizes() const&& { return DimVector(impl_->sizes()); }
  IntArrayRef strides() const& { return impl_->strides(); }
  DimVector strides() const&& { return DimVector(impl_->strides()); }
  IntArrayRef shape() const& { return sizes(); }
  DimVector shape() const&& { return DimVector(impl_->sizes()); }
  /// size(-1) is the last dim; out of range raises IndexError.
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t storage_offset() const { return impl_->storage_offset(); }
  DType dtype() const { return impl_->dtype(); }
  Device device() const { return impl_->device(); }
  int64_t element_size() const { return kiln::element_size(dtype()); }
  int64_t nbytes() const { return numel() * element_size(); }
  bool is_contiguous() const { return impl_->is_contiguous(); }
  bool is_floating_point() const { return kiln::is_floating_point(dtype()); }
  const Storage& storage() const { return impl_->storage(); }
  bool is_alias_of(const Tensor& o) const { return storage().get() == o.storage().get(); }
  /// The shared version counter (Note [Version counter lives on Storage]).
  uint32_t version() const { return storage()->version(); }
  void bump_version() const { storage()->bump_version(); }
  /// Makes this tensor use `new_data`'s storage, dtype and shape while staying
  /// the same tensor (every handle, its grad, hooks and name follow), as torch's
  /// `t.data = new_data` / set_data. The autograd history is not touched.
  void set_data(const Tensor& new_data) const;

  void* data_ptr() const { return impl_->data(); }
  /// Typed pointer to element 0 of this view; T must match dtype() exactly.
  template <typename T>
  T* data_ptr() const {
    check_dtype_for_access(dtype_of_v<T>, "data_ptr");
    return static_cast<T*>(impl_->data());
  }
  /// The value of a one-element tensor, converted to T. `loc` is the caller's
  /// line: kiln::compile names it when the read is a graph break.
  template <typename T = double>
  T item(std::source_location loc = std::source_location::current()) const {
    Scalar s = item_scalar(loc);
    return s.to<T>();
  }
  Scalar item_scalar(std::source_location loc = std::source_location::current()) const;

  std::string to_string() const;
  std::string shape_string() const { return shape_str(sizes()); }

  // ---- autograd (defined in src/autograd/tensor_autograd.cpp) ----
  bool requires_grad() const { return impl_->requires_grad(); }
  /// Marks a leaf as requiring grad (floating dtypes only), as torch's requires_grad_().
  Tensor& requires_grad_(bool requires_grad = true);
  /// The accumulated gradient of a leaf (or of a non-leaf after retain_grad()); undefined if none.
  /// A handle (not a reference to the slot), so in-place ops work on it as in
  /// libtorch: p.grad().mul_(s) scales the stored gradient.
  Tensor grad() const;
  /// Assignable gradient slot (x.mutable_grad() = {} clears it, as x.grad = None).
  Tensor& mutable_grad() const;
  /// The node that produced this tensor; null for leaves and tensors outside the graph.
  autograd::Node* grad_fn() const;
  bool is_leaf() const;
  int64_t output_nr() const;
  /// Accumulates gradients of this tensor into the leaves' .grad. `gradient` may be
  /// omitted for a one-element tensor. retain_graph defaults to create_graph.
  void backward(const Tensor& gradient = {}, std::optional<bool> retain_graph = std::nullopt,
                bool create_graph = false) const;
  /// A new tensor sharing data and version counter, outside the graph.
  Tensor detach() const;
  Tensor& detach_();
  /// Keep .grad for a non-leaf after backward (no-op on leaves).
  void retain_grad() const;
  bool retains_grad() const;
  /// hook(grad) runs when the gradient for this tensor is computed; a defined
  /// return value replaces the gradient.
  HookHandle register_hook(std::function<Tensor(const Tensor&)> hook) const;
  /// Leaves only: hook(leaf) runs after the gradient was accumulated into leaf.grad().
  HookHandle register_post_accumulate_grad_hook(std::function<void(Tensor&)> hook) const;

  // ---- conversion and copy ----
  // `loc` (every method of this section and the next two) is the caller's
  // file:line, recorded on the autograd node so errors can name it.
  Tensor to(DType dtype, bool copy = false, std::source_location loc = std::source_location::current()) const;
  Tensor contiguous(std::source_location loc = std::source_location::current()) const;
  Tensor clone(std::source_location loc = std::source_location::current()) const;
  Tensor& copy_(const Tensor& src, std::source_location loc = std::source_location::current());
  Tensor& fill_(const Scalar& value, std::source_location loc = std::source_location::current());
  Tensor& zero_(std::source_location loc = std::source_location::current());

  // ---- views (share storage and version counter) ----
  Tensor view(IntArrayRef sizes, std::source_location loc = std::source_location::current()) const;
  Tensor reshape(IntArrayRef sizes, std::source_location loc = std::source_location::current()) const;
  Tensor view_as(const Tensor& other, std::source_location loc = std::source_location::current()) const {
    return view(other.sizes(), loc);
  }
  Tensor reshape_as(const Tensor& other, std::source_location loc = std::source_location::current()) const {
    return reshape(other.sizes(), loc);
  }
  Tensor transpose(int64_t dim0, int64_t dim1, std::source_location loc = std::source_location::current()) const;
  Tensor permute(IntArrayRef dims, std::source_location loc = std::source_location::current()) const;
  Tensor t(std::source_location loc = std::source_location::current()) const;
  Tensor squeeze(std::source_location loc = std::source_location::current()) const;
  Tensor squeeze(int64_t dim, std::source_location loc = std::source_location::current()) const;
  Tensor unsqueeze(int64_t dim, std::source_location loc = std::source_location::current()) const;
  Tensor expand(IntArrayRef sizes, std::source_location loc = std::source_location::current()) const;
  Tensor expand_as(const Tensor& other, std::source_location loc = std::source_location::current()) const {
    return expand(other.sizes(), loc);
  }
  Tensor narrow(int64_t dim, int64_t start, int64_t length,
                std::source_location loc = std::source_location::current()) const;
  /// x[start:end:step] along dim; end is clamped, negative start/end wrap.
  Tensor slice(int64_t dim, std::optional<int64_t> start = std::nullopt, std::optional<int64_t> end = std::nullopt,
               int64_t step = 1, std::source_location loc = std::source_location::current()) const;
  Tensor select(int64_t dim, int64_t index, std::source_location loc = std::source_location::current()) const;
  Tensor operator[](int64_t index) const { return select(0, index); }
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1,
                 std::source_location loc = std::source_location::current()) const;
  Tensor unflatten(int64_t dim, IntArrayRef sizes, std::source_location loc = std::source_location::current()) const;
  std::vector<Tensor> split(int64_t split_size, int64_t dim = 0,
                            std::source_location loc = std::source_location::current()) const;
  std::vector<Tensor> split_with_sizes(IntArrayRef split_sizes, int64_t dim = 0,
                                       std::source_location loc = std::source_location::current()) const;
  std::vector<Tensor> chunk(int64_t chunks, int64_t dim = 0,
                            std::source_location loc = std::source_location::current()) const;
  std::vector<Tensor> unbind(int64_t dim = 0, std::source_location loc = std::source_location::current()) const;
  Tensor as_strided(IntArrayRef sizes, IntArrayRef strides, std::optional<int64_t> storage_offset = std::nullopt,
                    std::source_location loc = std::source_location::current()) const;
  Tensor diagonal(int64_t offset = 0, int64_t dim1 = 0, int64_t dim2 = 1,
                  std::source_location loc = std::source_location::current()) const;
  /// Copies (unlike expand): tiles the tensor `repeats` times per dim.
  Tensor repeat(IntArrayRef repeats, std::source_location loc = std::source_location::current()) const;

  // ---- indexing ----
  Tensor index_select(int64_t dim, const Tensor& index,
                      std::source_location loc = std::source_location::current()) const;
  Tensor gather(int64_t dim, const Tensor& index, std::source_location loc = std::source_location::current()) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Tensor& src,
                 std::source_location loc = std::source_location::current()) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Scalar& value,
                 std::source_location loc = std::source_location::current()) const;
  Tensor scatter_add(int64_t dim, const Tensor& index, const Tensor& src,
                     std::source_location loc = std::source_location::current()) const;
  Tensor& scatter_(int64_t dim, const Tensor& index, const Tensor& src,
                   std::source_location loc = std::source_location::current());
  Tensor& scatter_(int64_t dim, const Tensor& index, const Scalar& value,
                   std::source_location loc = std::source_location::current());
  Tensor& scatter_add_(int64_t dim, const Tensor& index, const Tensor& src,
                       std::source_location loc = std::source_location::current());
  Tensor masked_fill(const Tensor& mask, const Scalar& value,
                     std::source_location loc = std::source_location::current()) const;
  Tensor& masked_fill_(const Tensor& mask, const Scalar& value,
                       std::source_location loc = std::source_location::current());
  /// torch's advanced indexing with index tensors, x[i0, i1, ...]: one tensor per
  /// leading dim, int64/int32 (broadcast together; negative values count from the
  /// end) or bool (a mask over as many dims as it has, standing for its nonzero
  /// positions). The indexed dims become the broadcast index shape, followed by
  /// the remaining dims. Always a copy.
  Tensor index(const std::vector<Tensor>& indices, std::source_location loc = std::source_location::current()) const;
  /// x[indices] = values (values broadcast to the indexed shape); with
  /// `accumulate`, x[indices] += values, summing repeated positions.
  Tensor& index_put_(const std::vector<Tensor>& indices, const Tensor& values, bool accumulate = false,
                     std::source_location loc = std::source_location::current());
  Tensor index_put(const std::vector<Tensor>& indices, const Tensor& values, bool accumulate = false,
                   std::source_location loc = std::source_location::current()) const;

  // ---- elementwise arithmetic (broadcasting, PyTorch promotion) ----
  // `loc` (this section and the next) is the caller's file:line, recorded on
  // the autograd node (and, for in-place ops, on the storage) for error messages.
  Tensor add(const Tensor& other, const Scalar& alpha = 1,
             std::source_location loc = std::source_location::current()) const;
  Tensor add(const Scalar& other, const Scalar& alpha = 1,
             std::source_location loc = std::source_location::current()) const;
  Tensor sub(const Tensor& other, const Scalar& alpha = 1,
             std::source_location loc = std::source_location::current()) const;
  Tensor sub(const Scalar& other, const Scalar& alpha = 1,
             std::source_location loc = std::source_location::current()) const;
  Tensor mul(const Tensor& other, std::source_location loc = std::source_location::current()) const;
  Tensor mul(const Scalar& other, std::source_location loc = std::source_location::current()) const;
  Tensor div(const Tensor& other, std::source_location loc = std::source_location::current()) const;
  Tensor div(const Scalar& other, std::source_location loc = std::source_location::current()) const;
  Tensor pow(const Tensor& exponent, std::source_location loc = std::source_location::current()) const;
  Tensor pow(const Scalar& exponent, std::source_location loc = std::source_location::current()) const;
  Tensor maximum(const Tensor& other, std::source_location loc = std::source_location::current()) const;
  Tensor minimum(const Tensor& other, std::source_location loc = std::source_location::current()) const;
  Tensor& add_(const Tensor& other, const Scalar& alpha = 1,
               std::source_location loc = std::source_location::current());
  Tensor& add_(const Scalar& other, const Scalar& alpha = 1,
               std::source_location loc = std::source_location::current());
  Tensor& sub_(const Tensor& other, const Scalar& alpha = 1,
               std::source_location loc = std::source_location::current());
  Tensor& sub_(const Scalar& other, const Scalar& alpha = 1,
               std::source_location loc = std::source_location::current());
  Tensor& mul_(const Tensor& other, std::source_location loc = std::source_location::current());
  Tensor& mul_(const Scalar& other, std::source_location loc = std::source_location::current());
  Tensor& div_(const Tensor& other, std::source_location loc = std::source_location::current());
  Tensor& div_(const Scalar& other, std::source_location loc = std::source_location::current());
  Tensor& pow_(const Scalar& exponent, std::source_location loc = std::source_location::current());

  // ---- elementwise unary ----
  Tensor neg(std::source_location loc = std::source_location::current()) const;
  Tensor abs(std::source_location loc = std::source_location::current()) const;
  Tensor exp(std::source_location loc = std::source_location::current()) const;
  Tensor log(std::source_location loc = std::source_location::current()) const;
  Tensor log1p(std::source_location loc = std::source_location::current()) const;
  Tensor sqrt(std::source_location loc = std::source_location::current()) const;
  Tensor rsqrt(std::source_location loc = std::source_location::current()) const;
  Tensor sin(std::source_location loc = std::source_location::current()) const;
  Tensor cos(std::source_location loc = std::source_location::current()) const;
  Tensor tanh(std::source_location loc = std::source_location::current()) const;
  Tensor sigmoid(std::source_location loc = std::source_location::current()) const;
  Tensor relu(std::source_location loc = std::source_location::current()) const;
  /// approximate: "none" (erf) or "tanh", as torch.nn.functional.gelu.
  Tensor gelu(std::string_view approximate = "none", std::source_location loc = std::source_location::current()) const;
  Tensor silu(std::source_location loc = std::source_location::current()) const;
  Tensor clamp(std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt,
               std::source_location loc = std::source_location::current()) const;
  Tensor& neg_(std::source_location loc = std::source_location::current());
  Tensor& abs_(std::source_location loc = std::source_location::current());
  Tensor& exp_(std::source_location loc = std::source_location::current());
  Tensor& log_(std::source_location loc = std::source_location::current());
  Tensor& sqrt_(std::source_location loc = std::source_location::current());
  Tensor& tanh_(std::source_location loc = std::source_location::current());
  Tensor& sigmoid_(std::source_location loc = std::source_location::current());
  Tensor& relu_(std::source_location loc = std::source_location::current());
  Tensor& clamp_(std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt,
                 std::source_location loc = std::source_location::current());

  // ---- comparison and logic (results are bool) ----
  Tensor eq(const Tensor& other) const;
  Tensor eq(const Scalar& other) const;
  Tensor ne(const Tensor& other) const;
  Tensor ne(const Scalar& other) const;
  Tensor lt(const Tensor& other) const;
  Tensor lt(const Scalar& other) const;
  Tensor le(const Tensor& other) const;
  Tensor le(const Scalar& other) const;
  Tensor gt(const Tensor& other) const;
  Tensor gt(const Scalar& other) const;
  Tensor ge(const Tensor& other) const;
  Tensor ge(const Scalar& other) const;
  Tensor logical_and(const Tensor& other) const;
  Tensor logical_or(const Tensor& other) const;
  Tensor logical_xor(const Tensor& other) const;
  Tensor logical_not() const;
  /// True when every element is equal and shapes match (torch.equal).
  bool equal(const Tensor& other) const;
  /// torch.allclose: |a - b| <= atol + rtol * |b| everywhere (NaNs unequal unless equal_nan).
  bool allclose(const Tensor& other, double rtol = 1e-5, double atol = 1e-8, bool equal_nan = false) const;

  // ---- reductions ----
  // `loc` (left to its default) records the caller's file:line for autograd messages.
  Tensor sum(std::optional<DType> dtype = std::nullopt,
             std::source_location loc = std::source_location::current()) const;
  Tensor sum(IntArrayRef dims, bool keepdim = false, std::optional<DType> dtype = std::nullopt,
             std::source_location loc = std::source_location::current()) const;
  Tensor mean(std::source_location loc = std::source_location::current()) const;
  Tensor mean(IntArrayRef dims, bool keepdim = false, std::source_location loc = std::source_location::current()) const;
  Tensor prod(std::source_location loc = std::source_location::current()) const;
  Tensor prod(int64_t dim, bool keepdim = false, std::source_location loc = std::source_location::current()) const;
  /// correction = 1 is Bessel's (torch default); 0 is the population variance.
  /// Empty dims reduce every dim, as torch.var(x, dim=[]). (Not optional<IntArrayRef>:
  /// x.var({1}) would build the optional from the int and keep a dangling reference.)
  Tensor var(IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false,
             std::source_location loc = std::source_location::current()) const;
  Tensor std(IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false,
             std::source_location loc = std::source_location::current()) const;
  Tensor max(std::source_location loc = std::source_location::current()) const;
  Tensor min(std::source_location loc = std::source_location::current()) const;
  /// (values, indices) along dim; ties give the first index, as PyTorch on CPU.
  std::tuple<Tensor, Tensor> max(int64_t dim, bool keepdim = false,
                                 std::source_location loc = std::source_location::current()) const;
  std::tuple<Tensor, Tensor> min(int64_t dim, bool keepdim = false,
                                 std::source_location loc = std::source_location::current()) const;
  Tensor amax(IntArrayRef dims, bool keepdim = false, std::source_location loc = std::source_location::current()) const;
  Tensor amin(IntArrayRef dims, bool keepdim = false, std::source_location loc = std::source_location::current()) const;
  /// Not differentiable (integer results): no call site to record.
  Tensor argmax(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor argmin(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor logsumexp(IntArrayRef dims, bool keepdim = false,
                   std::source_location loc = std::source_location::current()) const;
  /// p-norm over dims (all dims when empty); p = 2 by default, inf allowed.
  Tensor norm(double p = 2.0, IntArrayRef dims = {}, bool keepdim = false,
              std::source_location loc = std::source_location::current()) const;
  Tensor softmax(int64_t dim, std::source_location loc = std::source_location::current()) const;
  Tensor log_softmax(int64_t dim, std::source_location loc = std::source_location::current()) const;
  Tensor all() const;
  Tensor any() const;

  // ---- dense math (oneDNN) ----
  Tensor mm(const Tensor& other, std::source_location loc = std::source_location::current()) const;
  Tensor bmm(const Tensor& other, std::source_location loc = std::source_location::current()) const;
  Tensor matmul(const Tensor& other, std::source_location loc = std::source_location::current()) const;

 private:
  void check_dtype_for_access(DType requested, const char* what) const;

  IntrusivePtr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// Operators follow PyTorch: comparisons return bool tensors.
//
// An operator function cannot have a default argument, but a converting
// constructor can: the arithmetic operators take one operand through TensorAt
// or ScalarAt, whose std::source_location default is evaluated where the
// conversion happens — the user's expression. So `total += loss` records its
// file:line for autograd's messages and memory history like a method call.
struct TensorAt {
  TensorAt(const Tensor& tensor, std::source_location where = std::source_location::current())  // NOLINT
      : t(tensor), loc(where) {}
  const Tensor& t;
  std::source_location loc;
};
template <typename T>
concept ScalarValue = std::is_constructible_v<Scalar, const T&>;
struct ScalarAt {
  template <ScalarValue T>
  ScalarAt(const T& value, std::source_location where = std::source_location::current())  // NOLINT
      : s(value), loc(where) {}
  Scalar s;
  std::source_location loc;
};
Tensor operator+(const Tensor& a, TensorAt b);
Tensor operator-(const Tensor& a, TensorAt b);
Tensor operator*(const Tensor& a, TensorAt b);
Tensor operator/(const Tensor& a, TensorAt b);
Tensor operator+(const Tensor& a, ScalarAt b);
Tensor operator-(const Tensor& a, ScalarAt b);
Tensor operator*(const Tensor& a, ScalarAt b);
Tensor operator/(const Tensor& a, ScalarAt b);
Tensor operator+(const Scalar& a, TensorAt b);
Tensor operator-(const Scalar& a, TensorAt b);
Tensor operator*(const Scalar& a, TensorAt b);
Tensor operator/(const Scalar& a, TensorAt b);
Tensor operator-(TensorAt a);
Tensor& operator+=(Tensor& a, TensorAt b);
Tensor& operator-=(Tensor& a, TensorAt b);
Tensor& operator*=(Tensor& a, TensorAt b);
Tensor& operator/=(Tensor& a, TensorAt b);
Tensor& operator+=(Tensor& a, ScalarAt b);
Tensor& operator-=(Tensor& a, ScalarAt b);
Tensor& operator*=(Tensor& a, ScalarAt b);
Tensor& operator/=(Tensor& a, ScalarAt b);
Tensor operator==(const Tensor& a, const Tensor& b);
Tensor operator!=(const Tensor& a, const Tensor& b);
Tensor operator<(const Tensor& a, const Tensor& b);
Tensor operator<=(const Tensor& a, const Tensor& b);
Tensor operator>(const Tensor& a, const Tensor& b);
Tensor operator>=(const Tensor& a, const Tensor& b);
Tensor operator==(const Tensor& a, const Scalar& b);
Tensor operator!=(const Tensor& a, const Scalar& b);
Tensor operator<(const Tensor& a, const Scalar& b);
Tensor operator<=(const Tensor& a, const Scalar& b);
Tensor operator>(const Tensor& a, const Scalar& b);
Tensor operator>=(const Tensor& a, const Scalar& b);
// On bool tensors these are the logical ops (torch's & | ^ ~).
Tensor operator&(const Tensor& a, const Tensor& b);
Tensor operator|(const Tensor& a, const Tensor& b);
Tensor operator^(const Tensor& a, const Tensor& b);
Tensor operator~(const Tensor& a);

}  // namespace kiln
