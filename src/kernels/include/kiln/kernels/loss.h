// Fused cross-entropy kernels (the kernels layer: raw pointers, no Tensor).
//
// ops::cross_entropy (src/ops/loss.cpp) calls these for class-index
// targets. Logits are a contiguous [rows, classes] block of float32, float64
// or bfloat16 (computed in float, or double for float64). One pass per row
// finds the max and the sum of exp(x - max) (the row stays in cache), from
// which the row's log-sum-exp, its weighted negative log-likelihood and its
// label-smoothing term follow; backward recomputes softmax from the saved
// log-sum-exp, so no [rows, classes] log-probabilities are kept. Rows are
// spread over OpenMP threads above a grain.
#pragma once

#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln::kernels {

struct CrossEntropyRows {
  int64_t rows = 0;
  int64_t classes = 0;
  const int64_t* target = nullptr;  // [rows] class indices
  const void* weight = nullptr;     // [classes] in the logits' dtype, or null: every weight 1
  int64_t ignore_index = -100;
};

/// Forward. Per row r with target t (all zero where t == ignore_index):
///   lse[r] = log sum_c exp(x_c), nll[r] = -w_t (x_t - lse), wrow[r] = w_t,
///   smooth[r] = -sum_c w_c (x_c - lse)   (skipped when smooth is null).
/// Returns -1, or the first row whose target is neither ignore_index nor in [0, classes).
int64_t cross_entropy_forward(DType dtype, const CrossEntropyRows& a, const void* logits, double* lse, double* nll,
                              double* wrow, double* smooth);

/// Backward into a contiguous [rows, classes] grad of the logits' dtype, with p = exp(x - lse[r]):
///   grad[r, c] = ca[r] w_t (p - [c == t]) + cb[r] (W p - w_c),  W = sum_c w_c,
/// cb may be null (no smoothing term); rows whose target is ignore_index get 0.
void cross_entropy_backward(DType dtype, const CrossEntropyRows& a, const void* logits, const double* lse,
                            const double* ca, const double* cb, void* grad);

}  // namespace kiln::kernels
