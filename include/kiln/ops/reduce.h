// Reductions, softmax and log_softmax as free functions, mirroring torch.sum,
// torch.softmax... They do exactly what the Tensor methods of the same name do
// (include/kiln/core/tensor.h, section "reductions"):
//   kiln::sum(x, {0, -1}, /*keepdim=*/true);   kiln::softmax(logits, -1);
//   auto [values, indices] = kiln::max(x, 1);
//
// PyTorch semantics: negative dims wrap; an empty dim list reduces every dim;
// a repeated dim is a ValueError; integer and bool sums and products give
// int64; mean/var/std/norm/softmax need floating-point input (DTypeError
// otherwise) while logsumexp turns integers into the default float dtype;
// 16-bit floats accumulate in float and return their own dtype. Over an empty
// dim, sum is 0, prod 1, mean/var NaN, logsumexp -inf, and the ops without an
// identity (max, min, amax, amin, argmax, argmin) raise IndexError.
// Results are deterministic: the same on any number of threads.
#pragma once

#include <optional>
#include <source_location>
#include <tuple>

#include "kiln/core/tensor.h"

namespace kiln {

// `loc` (left to its default) records the caller's file:line for autograd messages.

Tensor sum(const Tensor& x, std::optional<DType> dtype = std::nullopt,
           std::source_location loc = std::source_location::current());
/// With `dtype`, x is converted to it before summing (torch.sum(x, dtype=...));
/// the gradient is converted back to x's dtype.
Tensor sum(const Tensor& x, IntArrayRef dims, bool keepdim = false, std::optional<DType> dtype = std::nullopt,
           std::source_location loc = std::source_location::current());
Tensor mean(const Tensor& x, std::source_location loc = std::source_location::current());
Tensor mean(const Tensor& x, IntArrayRef dims, bool keepdim = false,
            std::source_location loc = std::source_location::current());
/// The gradient is the product of the other elements, also where x holds zeros (as torch).
Tensor prod(const Tensor& x, std::source_location loc = std::source_location::current());
Tensor prod(const Tensor& x, int64_t dim, bool keepdim = false,
            std::source_location loc = std::source_location::current());
/// correction = 1 is Bessel's (torch default), 0 the population variance;
/// correction >= N gives inf (or NaN), as torch. Empty dims: every dim.
/// std's gradient is 0 where std is 0, as torch's.
Tensor var(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false,
           std::source_location loc = std::source_location::current());
Tensor std(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false,
           std::source_location loc = std::source_location::current());

/// Over every element, as a 0-dim tensor; NaN propagates. The gradient is
/// shared evenly among the elements equal to the result (among the NaNs if it is NaN).
Tensor max(const Tensor& x, std::source_location loc = std::source_location::current());
Tensor min(const Tensor& x, std::source_location loc = std::source_location::current());
/// (values, indices) along dim; ties give the first index, a NaN wins (first NaN), as PyTorch on CPU.
/// The gradient goes to the returned index only.
std::tuple<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false,
                               std::source_location loc = std::source_location::current());
std::tuple<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim = false,
                               std::source_location loc = std::source_location::current());
/// The gradient is shared evenly among the tied extremes of each slice.
Tensor amax(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false,
            std::source_location loc = std::source_location::current());
Tensor amin(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false,
            std::source_location loc = std::source_location::current());
/// Without dim: the index into the flattened tensor. Not differentiable.
Tensor argmax(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor argmin(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);

/// log(sum(exp(x))) computed stably; an all -inf slice gives -inf (and a NaN
/// gradient, as torch). An empty dim list reduces every dim (torch 1.13 rejects
/// it; later versions agree with this).
Tensor logsumexp(const Tensor& x, IntArrayRef dims, bool keepdim = false,
                 std::source_location loc = std::source_location::current());
/// torch.linalg.vector_norm: p > 0 any, p = 0 counts nonzeros, +-inf give max/min |x|.
/// Gradients as torch's: 0 where the norm is 0; +-inf share it among the tied
/// extremes; p = 0 has none (the gradient is undefined, as torch's).
Tensor norm(const Tensor& x, double p = 2.0, IntArrayRef dims = {}, bool keepdim = false,
            std::source_location loc = std::source_location::current());

/// Backward runs a fused kernel per row, or (under create_graph) tensor ops
/// that can be differentiated again.
Tensor softmax(const Tensor& x, int64_t dim, std::source_location loc = std::source_location::current());
Tensor log_softmax(const Tensor& x, int64_t dim, std::source_location loc = std::source_location::current());

/// True when every (any) element is nonzero; uint8 input gives uint8, others bool. Not differentiable.
Tensor all(const Tensor& x);
Tensor any(const Tensor& x);

}  // namespace kiln
