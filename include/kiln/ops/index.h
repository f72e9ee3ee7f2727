// Indexing and joining ops as free functions, mirroring torch: cat, stack,
// where, embedding, one_hot, and free forms of the Tensor indexing methods
// (index_select, gather, scatter, scatter_add, masked_fill).
//
// Index values are bounds-checked before any element is read or written: a
// bad index raises IndexError naming the value, the dim and its size, and an
// in-place op that raises has not modified its tensor.
//
// All are differentiable in their floating inputs except one_hot (integer
// result); `loc` is the caller's file:line, recorded on the autograd node.
#pragma once

#include <source_location>
#include <vector>

#include "kiln/core/scalar.h"
#include "kiln/core/tensor.h"

namespace kiln {

/// torch.cat: joins tensors along `dim`; sizes must match in every other dim.
/// The result dtype promotes across all inputs. 1-D tensors of shape [0] are
/// skipped (legacy torch behaviour), so cat({empty({0}), x}) == x.
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0,
           std::source_location loc = std::source_location::current());
/// torch.stack: joins equal-shaped tensors along a new dim (in [-ndim-1, ndim]).
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0,
             std::source_location loc = std::source_location::current());

/// torch.where: cond ? a : b elementwise, broadcasting all three. cond must be
/// bool (uint8 is accepted, as torch does with a deprecation). The result
/// dtype follows torch.result_type(a, b): dimensioned tensors outrank 0-dim
/// tensors, which outrank Scalars, within a category (bool < int < float).
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b,
             std::source_location loc = std::source_location::current());
Tensor where(const Tensor& cond, const Scalar& a, const Tensor& b,
             std::source_location loc = std::source_location::current());
Tensor where(const Tensor& cond, const Tensor& a, const Scalar& b,
             std::source_location loc = std::source_location::current());
Tensor where(const Tensor& cond, const Scalar& a, const Scalar& b,
             std::source_location loc = std::source_location::current());

/// torch.nn.functional.embedding: rows of `weight` ([num_embeddings, dim])
/// picked by `indices` (int64 or int32, any shape) -> [*indices.shape, dim].
Tensor embedding(const Tensor& weight, const Tensor& indices,
                 std::source_location loc = std::source_location::current());
/// torch.nn.functional.one_hot: int64 indices -> int64 [*indices.shape, num_classes];
/// num_classes = -1 infers max(indices) + 1.
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1,
               std::source_location loc = std::source_location::current());

// Free forms of the Tensor methods (same semantics).
Tensor index_select(const Tensor& self, int64_t dim, const Tensor& index,
                    std::source_location loc = std::source_location::current());
Tensor gather(const Tensor& self, int64_t dim, const Tensor& index,
              std::source_location loc = std::source_location::current());
Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src,
               std::source_location loc = std::source_location::current());
Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Scalar& value,
               std::source_location loc = std::source_location::current());
Tensor scatter_add(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src,
                   std::source_location loc = std::source_location::current());
Tensor masked_fill(const Tensor& self, const Tensor& mask, const Scalar& value,
                   std::source_location loc = std::source_location::current());
/// `value` must be a 0-dim tensor; it is converted to self's dtype, as torch
/// does, and gets the sum of the gradient over the filled positions.
Tensor masked_fill(const Tensor& self, const Tensor& mask, const Tensor& value,
                   std::source_location loc = std::source_location::current());

}  // namespace kiln
