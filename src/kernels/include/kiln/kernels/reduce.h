// Reduction and softmax kernels over raw pointers and byte strides (the
// kernels layer: no Tensor here).
//
// The ops layer describes a reduction as a ReduceLayout: the kept (output)
// dims and the reduced dims of a strided input, each coalesced and ordered
// innermost first, and a contiguous output holding one element per kept
// index. The kernels pick one of two shapes from the layout:
//   rows    — the innermost reduced dim is the fastest in memory (sum over
//             features, softmax over the last dim): each output reduces runs
//             of elements with many independent accumulators;
//   columns — the innermost kept dim is contiguous and the reduction walks an
//             outer dim (sum over the batch of an [N, C] gradient): whole rows
//             are accumulated into a block of outputs at once.
//
// Note [Deterministic reductions]
// Every reduction is a fixed tree: runs are cut into pieces of a fixed size
// (kReducePiece elements, or kReduceColPiece rows), pieces are reduced with
// pairwise sums of multi-lane partials, and piece results are combined
// pairwise by index. The tree depends only on the sizes and the layout, never
// on the thread count: threads only decide who computes which piece, so a sum
// is bitwise identical on 1 or 32 threads. Pairwise summation also keeps a
// float32 sum of 16M elements accurate to a few ulp.
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"
#include "kiln/kernels/loop.h"

namespace kiln::kernels {

/// Elements of a row reduced as one piece of the tree (and the unit of parallel work).
inline constexpr int64_t kReducePiece = 32768;
/// Rows of a column reduction reduced as one piece.
inline constexpr int64_t kReduceColPiece = 512;

struct ReduceLayout {
  int out_ndim = 0;  // kept dims, innermost first, coalesced; 0: a single output
  int64_t out_sizes[kMaxLoopDims] = {};
  int64_t out_strides[kMaxLoopDims] = {};  // input byte strides of the kept dims
  int red_ndim = 0;                        // reduced dims, innermost (smallest stride) first; 0: one element each
  int64_t red_sizes[kMaxLoopDims] = {};
  int64_t red_strides[kMaxLoopDims] = {};  // input byte strides
  const char* in = nullptr;
  char* out = nullptr;  // contiguous: output o is the kept multi-index in row-major order

  int64_t num_outputs() const {
    int64_t n = 1;
    for (int d = 0; d < out_ndim; ++d) n *= out_sizes[d];
    return n;
  }
  int64_t reduce_numel() const {
    int64_t n = 1;
    for (int d = 0; d < red_ndim; ++d) n *= red_sizes[d];
    return n;
  }
};

// All reductions accept every dtype of their op (the ops layer checks which);
// 16-bit floats accumulate in float, float32 in float, float64 in double,
// integers and bool in int64 (var: double for every float type). An empty
// reduction writes the op's identity.

/// out = sum; `out` is `in` or int64 (integral/bool inputs).
void sum(const ReduceLayout& l, DType in, DType out);
/// out = sum / count (floating dtypes; 0/0 gives NaN for an empty reduction).
void mean(const ReduceLayout& l, DType dt);
/// out = product; `out` is `in` or int64.
void prod(const ReduceLayout& l, DType in, DType out);
/// out = max (is_max) or min; NaN propagates.
void amax_amin(const ReduceLayout& l, DType dt, bool is_max);
/// out = all (is_all) or any element nonzero; `out` is bool or uint8.
void all_any(const ReduceLayout& l, DType in, DType out, bool is_all);
/// Two-pass variance: sum((x - mean)^2) / max(0, count - correction); sqrt when take_sqrt.
void var(const ReduceLayout& l, DType dt, int64_t correction, bool take_sqrt);
/// Vector p-norm (torch.linalg.vector_norm): p = 0 counts nonzeros, +-inf are max/min |x|.
void norm(const ReduceLayout& l, DType dt, double p);
/// log(sum(exp(x - m))) + m with m the max (0 where the max is infinite, so an
/// all -inf row gives -inf, not NaN).
void logsumexp(const ReduceLayout& l, DType dt);

/// A contiguous block viewed as [outer, n, inner]; the op runs along n.
struct DimLayout {
  int64_t outer = 1;
  int64_t n = 0;
  int64_t inner = 1;
};

/// Max (is_max) or min along n of `in`, written to values (may be null; dtype dt)
/// and indices (int64), both laid out [outer, inner]. Ties give the first index;
/// a NaN wins and reports its first index, as PyTorch on CPU. Requires n >= 1.
void arg_reduce(const DimLayout& l, DType dt, const void* in, void* values, int64_t* indices, bool is_max);

/// softmax (or log_softmax when `log`) along n; `out` is laid out as `in`.
/// Three fused passes per row: max, sum of exp, write.
void softmax(const DimLayout& l, DType dt, const void* in, void* out, bool log);

/// The gradient of softmax along n from its output y and the output's gradient g:
/// out = y * (g - sum(g * y)); with `log`, of log_softmax: out = g - exp(y) * sum(g).
/// y, g and out are laid out as the forward's output; 16-bit floats compute in
/// float and round once. One fused pass for the sum, one to write, per row.
void softmax_backward(const DimLayout& l, DType dt, const void* y, const void* g, void* out, bool log);

}  // namespace kiln::kernels
