// Indexing kernels (kernels layer: raw pointers and strides, no Tensor):
// gather / index_select, index_add, scatter / scatter_add, masked_fill, where, one_hot,
// index bounds scans, and the strided-loop builder their callers use.
//
// The ops layer checks shapes and dtypes and bounds-checks index values
// (index_min_max / first_out_of_range) before calling the gather and scatter
// kernels, so these never read or write out of bounds on valid arguments and
// an in-place scatter never half-completes on a bad index.
//
// Note [Gather/scatter as a restrided loop]: gather(self, dim, index) is a loop
// over index's shape with three operands — out, self with its stride along
// `dim` set to 0, and index — where each element reads
// self_ptr[index * self_dim_stride]. index_select is the same loop with an
// index whose strides are 0 except along `dim`; scatter swaps the roles of
// the read and the write. Keeping one loop form keeps non-contiguous inputs
// on the same code path as contiguous ones.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "kiln/core/dtype.h"
#include "kiln/core/scalar.h"
#include "kiln/core/shape.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

/// Calls f.template operator()<I>() with I = int64_t or int32_t, the two
/// index dtypes index kernels take (index_select and embedding accept both).
template <typename F>
decltype(auto) visit_index_dtype(DType t, F&& f) {
  if (t == DType::Int32) return f.template operator()<int32_t>();
  KILN_ASSERT(t == DType::Int64, "index kernels take int64 or int32 indices, got ", dtype_name(t));
  return f.template operator()<int64_t>();
}

/// One operand of a loop, described without a Tensor: base pointer of
/// element 0, one stride per loop dim (in elements, outermost dim first,
/// aligned with the loop's shape), and the element size in bytes.
struct StridedOperand {
  char* data;
  IntArrayRef strides;
  int64_t element_size;
};

/// A LoopSpec over `shape` (outermost first): size-1 dims are dropped and
/// adjacent dims merged where every operand is dense across them. Throws
/// ShapeError if more than kMaxLoopDims dims remain.
LoopSpec make_strided_loop(IntArrayRef shape, std::initializer_list<StridedOperand> operands);

/// Smallest and largest value of an int64/int32 index (operand 0 of `s`).
/// An empty index gives min > max.
struct IndexRange {
  int64_t min;
  int64_t max;
};
IndexRange index_min_max(const LoopSpec& s, DType index_dt);

/// The first value, in row-major order of the loop, outside [lo, hi). Call
/// only when index_min_max showed there is one (it scans serially).
int64_t first_out_of_range(const LoopSpec& s, DType index_dt, int64_t lo, int64_t hi);

/// Operands {out, src, index}, src restrided (Note above):
/// out[i] = *(src[i] + index[i] * src_dim_stride) with the stride in bytes.
/// Returns false if some index lies outside [0, dim_size); such an element
/// reads index 0 instead (never out of bounds, given dim_size > 0) and the
/// caller raises — gather checks indices in the same pass it copies them.
bool gather(const LoopSpec& s, DType dt, DType index_dt, int64_t src_dim_stride_bytes, int64_t dim_size);

/// index_select over contiguous memory: src is [outer, src_size, inner] and
/// out [outer, k, inner] (both contiguous); out[o, j, :] = src[o, index[j], :].
/// `index` holds k values of index_dt `index_stride` elements apart.
void index_select_contiguous(char* out, const char* src, const void* index, DType dt, DType index_dt,
                             int64_t index_stride, int64_t outer, int64_t src_size, int64_t k, int64_t inner);

/// index_add over contiguous memory, for floating dtypes: src is [outer, k,
/// inner] and out [outer, out_size, inner] (both contiguous); out[o, index[j],
/// :] += src[o, j, :]. The backward of index_select and embedding. Repeated
/// indices are summed in ascending j, in compute precision, and each output
/// row is rounded once; threads own disjoint output rows (a counting sort of
/// `index` lists each row's j), so the result is bit-identical for any
/// thread count. Indices must already lie in [0, out_size).
void index_add_contiguous(char* out, const char* src, const void* index, DType dt, DType index_dt, int64_t index_stride,
                          int64_t outer, int64_t out_size, int64_t k, int64_t inner);

enum class ScatterMode { Assign, Add };

/// Operands {self, src, index}, self restrided (its stride 0 marks the
/// scatter dim; self has no other stride-0 dim — the ops layer rejects
/// self-overlapping outputs): *(self[i] + index[i] * self_dim_stride) = (or
/// +=) src[i], indices already checked. Threads split the work along a dim
/// other than the scatter dim, so duplicate indices resolve in index order —
/// the last write wins, Add sums in index order — bit-identically for any
/// thread count.
void scatter(const LoopSpec& s, DType dt, DType index_dt, int64_t self_dim_stride_bytes, ScatterMode mode);
/// As scatter with every src element equal to `value`; operands {self, index}.
void scatter_value(const LoopSpec& s, DType dt, DType index_dt, int64_t self_dim_stride_bytes, const Scalar& value);

/// Operands {out, self, mask(bool)}: out = mask ? value : self. out may be self.
void masked_fill(const LoopSpec& s, DType dt, const Scalar& value);

/// Operands {out, cond, a, b}: out = cond ? a : b. a, b and out share `dt`;
/// cond is bool or uint8.
void where(const LoopSpec& s, DType dt, DType cond_dt);

/// Operands {out, src} of one dtype: out = src, elementwise. Unlike a byte
/// copy, a row that reads one value (src stride 0, as when tiling) becomes a
/// vectorised fill.
void tile_copy(const LoopSpec& s, DType dt);

/// out (n x num_classes int64, zeroed by the caller): out[i, index[i]] = 1 for
/// a contiguous int64 index of n values already checked to lie in [0, num_classes).
void one_hot(const int64_t* index, int64_t n, int64_t num_classes, int64_t* out);

}  // namespace kiln::kernels
