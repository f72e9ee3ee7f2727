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
#include <tuple>

#include "kiln/core/tensor.h"

namespace kiln {

Tensor sum(const Tensor& x, std::optional<DType> dtype = std::nullopt);
/// With `dtype`, x is converted to it before summing (torch.sum(x, dtype=...)).
Tensor sum(const Tensor& x, IntArrayRef dims, bool keepdim = false, std::optional<DType> dtype = std::nullopt);
Tensor mean(const Tensor& x);
Tensor mean(const Tensor& x, IntArrayRef dims, bool keepdim = false);
Tensor prod(const Tensor& x);
Tensor prod(const Tensor& x, int64_t dim, bool keepdim = false);
/// correction = 1 is Bessel's (torch default), 0 the population variance;
/// correction >= N gives inf (or NaN), as torch. Empty dims: every dim.
Tensor var(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false);
Tensor std(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false);

/// Over every element, as a 0-dim tensor; NaN propagates.
Tensor max(const Tensor& x);
Tensor min(const Tensor& x);
/// (values, indices) along dim; ties give the first index, a NaN wins (first NaN), as PyTorch on CPU.
std::tuple<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
std::tuple<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor amax(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false);
/// Without dim: the index into the flattened tensor.
Tensor argmax(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor argmin(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);

/// log(sum(exp(x))) computed stably; an all -inf slice gives -inf. An empty dim
/// list reduces every dim (torch 1.13 rejects it; later versions agree with this).
Tensor logsumexp(const Tensor& x, IntArrayRef dims, bool keepdim = false);
/// torch.linalg.vector_norm: p > 0 any, p = 0 counts nonzeros, +-inf give max/min |x|.
Tensor norm(const Tensor& x, double p = 2.0, IntArrayRef dims = {}, bool keepdim = false);

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

/// True when every (any) element is nonzero; uint8 input gives uint8, others bool.
Tensor all(const Tensor& x);
Tensor any(const Tensor& x);

}  // namespace kiln
