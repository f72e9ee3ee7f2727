// einsum, as torch.einsum: sums of products over the dims of several tensors,
// named by one letter each in an equation.
//
//   einsum("ij,jk->ik", {a, b});          // matmul
//   einsum("bhqd,bhkd->bhqk", {q, k});    // attention scores
//   einsum("ii", {a});                    // trace (implicit output)
//   einsum("...ij,...jk->...ik", {a, b}); // batched, batch dims broadcast
//
// Subscripts are letters [a-zA-Z]; spaces are ignored. `...` stands for the
// dims a subscript list does not name (at most one per operand; the dims it
// covers broadcast across operands, right-aligned). Without "->" the output
// is `...` followed by the subscripts that appear exactly once, in ASCII
// order (upper case before lower case, as torch). A subscript repeated in one
// operand takes that operand's diagonal; one absent from the output is summed
// over, and so are the `...` dims when the explicit output has no `...`. A
// subscript's size must be the same in every operand, or 1 (it broadcasts).
//
// It is made of differentiable ops (diagonal, permute, reshape, sum, mul, and
// bmm for each pairwise contraction), so gradients of any order follow.
// Operands are contracted left to right, as torch 1.13 does without
// opt_einsum. All operands must share one dtype (DTypeError otherwise).
#pragma once

#include <source_location>
#include <string_view>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln {

/// Evaluates `equation` over `operands` (one or more). A malformed equation,
/// or operands that do not fit it, is a ValueError / ShapeError saying which
/// character, operand or subscript is wrong, what was expected and what was got.
Tensor einsum(std::string_view equation, const std::vector<Tensor>& operands,
              std::source_location loc = std::source_location::current());

}  // namespace kiln
