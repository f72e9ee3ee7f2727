// Matrix products with PyTorch's semantics: mm (2-D · 2-D), bmm (3-D · 3-D),
// matmul (torch.matmul: dot, matrix-vector, and batched products that
// broadcast the leading dims), and linear (x · Wᵀ + b, torch.nn.functional.linear).
//
// float32 and bfloat16 run on oneDNN, float64 on OpenBLAS, float16 computes
// in float32 and rounds back, and int64/int32/uint8 use a plain loop (torch
// multiplies integers on CPU; bool is rejected as in torch). Both operands
// must have the same dtype (DTypeError otherwise, as torch). Transposed and
// other strided operands with a unit stride in one of their last two dims are
// read in place; anything else is copied to contiguous first.
//
// All four are differentiable (float types): grad_a = grad · bᵀ and grad_b =
// aᵀ · grad are themselves products (transposed operands read in place), so
// gradients of any order follow; matmul sums the gradient over the batch dims
// an operand was broadcast over, and linear's bias gradient sums the rows.
// The trailing `loc` records the call site for autograd's error messages.
#pragma once

#include <memory>
#include <source_location>
#include <string_view>

#include "kiln/core/tensor.h"

namespace kiln {

/// [n, k] · [k, m] -> [n, m].
Tensor mm(const Tensor& self, const Tensor& mat2, std::source_location loc = std::source_location::current());
/// [b, n, k] · [b, k, m] -> [b, n, m]; the batch sizes must match (no broadcasting).
Tensor bmm(const Tensor& self, const Tensor& mat2, std::source_location loc = std::source_location::current());
/// torch.matmul: 1-D · 1-D is a dot product (0-dim result); a 1-D first
/// operand gets a leading 1 prepended and a 1-D second operand a trailing 1
/// appended, removed again from the result; leading (batch) dims broadcast.
Tensor matmul(const Tensor& self, const Tensor& other, std::source_location loc = std::source_location::current());
/// input [..., in_features] · weight[out_features, in_features]ᵀ + bias
/// [out_features] -> [..., out_features]. The bias is fused into the product
/// (any bias that broadcasts to the output is accepted, as torch); weight is
/// read transposed in place, never copied. A 1-D weight [in_features] gives
/// input · weight, the last dim dropped ([...]), as torch's 1-D weight form;
/// its bias must then broadcast to that output without enlarging it (a 0-dim
/// bias, as torch's in-place add of the bias requires).
Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
              std::source_location loc = std::source_location::current());
/// out = self · other written into `out`, which may be a strided view (unit
/// stride in the last dim, batch dims that merge into one stride, rows that do
/// not overlap): a product fills part of a larger tensor without a copy. The
/// operands are [..., m, k] and [..., k, n] with equal batch dims; anything the
/// kernel cannot write in place is computed and copied. Records no gradient
/// (ValueError when an operand requires one), as torch's out= variants.
void matmul_into(const Tensor& self, const Tensor& other, const Tensor& out,
                 std::source_location loc = std::source_location::current());

/// A weight matrix kept packed in the layout the matrix-product backend reads
/// fastest (the layout itself is the backend's business), for the inference forms of
/// linear and linear_gelu below. It remembers which tensor it packed and that
/// tensor's version, and packs again when given another tensor or the same
/// one modified in place (an optimizer step, load_state_dict). It holds a
/// reference to the packed tensor until then. nn::Linear keeps one per
/// layer. Copies share the same pack; use from several threads is serialised.
class WeightPack {
 public:
  WeightPack();

 private:
  struct State;  // defined by the ops layer; opaque to users
  friend struct WeightPackAccess;
  std::shared_ptr<State> state_;
};

/// linear(input, weight, bias) that, when nothing needs a gradient
/// (inference), outside autocast, for float32/bfloat16 with an [out_features]
/// bias (or none), reads the weight from `pack`. Otherwise exactly linear().
Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias, WeightPack& pack,
              std::source_location loc = std::source_location::current());

/// addend + linear(input, weight, bias) (a residual connection), the same
/// function. When nothing needs a gradient, outside autocast, for
/// float32/bfloat16 with an [out_features] bias (or none) and a contiguous
/// addend of the output's shape, the add runs inside the product on each
/// tile of the output (a oneDNN post-op) and the weight is read from `pack`
/// when given; otherwise it is exactly the two ops.
Tensor linear_add(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& addend,
                  WeightPack* pack = nullptr, std::source_location loc = std::source_location::current());

/// linear(input, weight, bias).gelu(approximate), the same function. When
/// nothing needs a gradient (inference), outside autocast, for float32 and
/// bfloat16 with an [out_features] bias (or none), GELU runs as part of the
/// product kernel and the weight is read from `pack` when given; otherwise it
/// is exactly the two ops. float32 tanh GELU runs kiln's GELU over the output
/// while it is still in cache (faster than oneDNN's post-op here, and bitwise
/// linear then gelu); the others run on each tile as a oneDNN post-op.
Tensor linear_gelu(const Tensor& input, const Tensor& weight, const Tensor& bias, std::string_view approximate,
                   WeightPack* pack = nullptr, std::source_location loc = std::source_location::current());

}  // namespace kiln
