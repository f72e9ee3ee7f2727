// Internal to the ops layer: the building blocks of the view, copy and
// indexing backward formulas, and copies that forwards use without recording.
//
// The building blocks are differentiable themselves (each records a node when
// its input requires grad and grad mode is on), so create_graph=true gives
// second derivatives through the formulas that use them. Each is the adjoint
// of a gathering op: view_scatter_zeros of as_strided, index_add_zeros of
// index_select, scatter_add_zeros of gather.
#pragma once

#include "kiln/autograd/functions.h"
#include "kiln/core/tensor.h"
#include "kiln/ops/memory_format.h"

namespace kiln::ops {

/// A contiguous copy of `t` converted to `dt`, recording nothing (for use
/// inside forwards, which record their own node).
/// A copy in dtype `dt`, in `t`'s memory format (channels-last stays so), recording nothing.
Tensor copy_no_grad(const Tensor& t, DType dt);
/// The same in memory format `f`.
Tensor copy_no_grad(const Tensor& t, DType dt, MemoryFormat f);

/// zeros(base_sizes) with `grad` written into its view of geometry (sizes,
/// strides, offset), strides and offset counted in elements of the contiguous
/// base. The geometry must not overlap itself (slice, select and diagonal
/// views never do). `name` names the node ("SliceBackwardBackward0").
Tensor view_scatter_zeros(const Tensor& grad, IntArrayRef base_sizes, IntArrayRef sizes, IntArrayRef strides,
                          int64_t offset, const char* name);

/// zeros(sizes) with the slices of `src` along `dim` added at the positions
/// `index` (a vector, int64 or int32, values already in range) names:
/// torch's zeros(sizes).index_add_(dim, index, src), repeated indices summed
/// in index order, bit-identical for any thread count.
Tensor index_add_zeros(IntArrayRef sizes, int64_t dim, const Tensor& index, const Tensor& src);

/// zeros(sizes, src.dtype()).scatter_add_(dim, index, src) (deterministic, as scatter_add_).
Tensor scatter_add_zeros(IntArrayRef sizes, int64_t dim, const Tensor& index, const Tensor& src);

/// Sizes, strides and storage offset of a view (in elements).
struct StridedGeometry {
  DimVector sizes, strides;
  int64_t offset = 0;
};

/// The gradient of x.as_strided(output) for x of geometry `input` (both on
/// x's storage), as PyTorch computes it: `grad` is accumulated into a zeros
/// buffer standing for the storage through the output geometry (overlapping
/// output elements sum), divided by how often the input geometry sees each
/// location when it overlaps itself, and read back through the input
/// geometry. When `input_is_view` and the output reached memory outside the
/// input's elements (that belongs to the input's base), raises instead of
/// dropping that part of the gradient.
Tensor as_strided_backward(const Tensor& grad, const StridedGeometry& input, const StridedGeometry& output,
                           bool input_is_view);

/// `g` summed over the dims in which `sizes` was broadcast to g's shape.
Tensor sum_to_size(const Tensor& g, IntArrayRef sizes);

}  // namespace kiln::ops
