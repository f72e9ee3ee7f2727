// Helpers shared by the loss functions in src/nn/loss*.cpp (private).
#pragma once

#include <string>
#include <string_view>

#include "kiln/core/error.h"
#include "kiln/core/tensor.h"

namespace kiln::nn::functional::detail {

enum class Reduction { None, Mean, Sum, BatchMean };

inline Reduction parse_reduction(const char* fn, std::string_view r, bool allow_batchmean = false) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  if (allow_batchmean && r == "batchmean") return Reduction::BatchMean;
  KILN_CHECK(false, ValueError, fn, ": expected reduction 'none', 'mean' or 'sum'",
             allow_batchmean ? " (or 'batchmean')" : "", ", got '", r, "'");
  return Reduction::None;
}

inline Tensor apply_reduction(const Tensor& loss, Reduction r) {
  switch (r) {
    case Reduction::None: return loss;
    case Reduction::Sum: return loss.sum();
    case Reduction::Mean: return loss.mean();
    case Reduction::BatchMean: return loss.dim() == 0 ? loss.sum() : loss.sum() / static_cast<double>(loss.size(0));
  }
  return loss;
}

inline void check_floating(const char* fn, const char* what, const Tensor& t) {
  KILN_CHECK(t.defined() && t.is_floating_point(), DTypeError, fn, ": expected ", what, " of a floating dtype, got ",
             t.defined() ? std::string(dtype_name(t.dtype())) : "an undefined tensor");
}

}  // namespace kiln::nn::functional::detail
