// Tensor factories, as in PyTorch: empty zeros ones full arange linspace eye
// rand randn randint, their *_like forms, tensors from C++ values, and
// from_blob over memory the caller owns.
//
// Declared and defined in the ops layer (src/ops/factory.cpp): layers above
// ops create tensors through these; core and autograd, below, never do
// (autograd's engine reaches tensor arithmetic through autograd/grad_math.h).
// Each factory notes its caller's line for memory history (memory_history.h).
#pragma once

#include <functional>
#include <initializer_list>
#include <optional>
#include <source_location>
#include <vector>

#include "kiln/core/generator.h"
#include "kiln/core/tensor.h"

namespace kiln {

Tensor empty(IntArrayRef sizes, TensorOptions options = {}, std::source_location loc = std::source_location::current());
Tensor empty_strided(IntArrayRef sizes, IntArrayRef strides, TensorOptions options = {},
                     std::source_location loc = std::source_location::current());
Tensor zeros(IntArrayRef sizes, TensorOptions options = {}, std::source_location loc = std::source_location::current());
Tensor ones(IntArrayRef sizes, TensorOptions options = {}, std::source_location loc = std::source_location::current());
/// dtype defaults to the scalar's natural one (an integer fill gives int64, as torch.full).
Tensor full(IntArrayRef sizes, const Scalar& value, TensorOptions options = {},
            std::source_location loc = std::source_location::current());
/// A 0-dim tensor holding `value`.
Tensor scalar_tensor(const Scalar& value, TensorOptions options = {},
                     std::source_location loc = std::source_location::current());

Tensor empty_like(const Tensor& t, std::optional<TensorOptions> options = std::nullopt,
                  std::source_location loc = std::source_location::current());
Tensor zeros_like(const Tensor& t, std::optional<TensorOptions> options = std::nullopt,
                  std::source_location loc = std::source_location::current());
Tensor ones_like(const Tensor& t, std::optional<TensorOptions> options = std::nullopt,
                 std::source_location loc = std::source_location::current());
Tensor full_like(const Tensor& t, const Scalar& value, std::optional<TensorOptions> options = std::nullopt,
                 std::source_location loc = std::source_location::current());
Tensor rand_like(const Tensor& t, Generator* gen = nullptr, std::source_location loc = std::source_location::current());
Tensor randn_like(const Tensor& t, Generator* gen = nullptr,
                  std::source_location loc = std::source_location::current());

/// [start, end) in steps of `step`; int64 when all three are integers, else the default float dtype.
/// Integer outputs convert start/end/step to int64 first, as PyTorch (bool is not supported).
Tensor arange(const Scalar& end, TensorOptions options = {},
              std::source_location loc = std::source_location::current());
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step = 1, TensorOptions options = {},
              std::source_location loc = std::source_location::current());
/// `steps` values from start to end inclusive, in the default float dtype unless given.
Tensor linspace(const Scalar& start, const Scalar& end, int64_t steps, TensorOptions options = {},
                std::source_location loc = std::source_location::current());
Tensor eye(int64_t n, std::optional<int64_t> m = std::nullopt, TensorOptions options = {},
           std::source_location loc = std::source_location::current());

/// Uniform on [0, 1).
Tensor rand(IntArrayRef sizes, TensorOptions options = {}, Generator* gen = nullptr,
            std::source_location loc = std::source_location::current());
/// Standard normal (Box-Muller over Philox).
Tensor randn(IntArrayRef sizes, TensorOptions options = {}, Generator* gen = nullptr,
             std::source_location loc = std::source_location::current());
/// Integers uniform on [low, high); int64 unless options say otherwise.
Tensor randint(int64_t low, int64_t high, IntArrayRef sizes, TensorOptions options = {}, Generator* gen = nullptr,
               std::source_location loc = std::source_location::current());
Tensor randperm(int64_t n, Generator* gen = nullptr, std::source_location loc = std::source_location::current());

/// In-place fills (used by nn::init): uniform_ on [from, to), normal_ with mean/std.
Tensor& uniform_(Tensor& t, double from = 0.0, double to = 1.0, Generator* gen = nullptr);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);

/// A tensor holding a copy of `values` with shape `sizes` (1-D of values.size() when empty).
/// int values give int64 (as torch.tensor([1, 2]) in Python); float -> float32, double -> float64.
template <typename T>
Tensor tensor(const std::vector<T>& values, IntArrayRef sizes = {},
              std::source_location loc = std::source_location::current());
template <typename T>
Tensor tensor(std::initializer_list<T> values, IntArrayRef sizes = {},
              std::source_location loc = std::source_location::current()) {
  return tensor(std::vector<T>(values), sizes, loc);
}

/// Wraps memory the caller owns; no copy. `deleter`, if given, runs when the
/// last tensor referring to it is gone. Contiguous strides unless given.
Tensor from_blob(void* data, IntArrayRef sizes, DType dtype, std::function<void(void*)> deleter = nullptr);
Tensor from_blob(void* data, IntArrayRef sizes, IntArrayRef strides, DType dtype,
                 std::function<void(void*)> deleter = nullptr);

}  // namespace kiln
