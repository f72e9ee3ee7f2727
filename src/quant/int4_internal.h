// Internal to quant's INT4 files (int4.cpp, gptq.cpp, int4_io.cpp): the group
// parameters both quantizers share and the parent swap load_int4 reuses.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kiln/quant/int4.h"

namespace kiln::quant::detail {

struct Int4GroupParams {
  float scale = 1.0f;
  uint8_t zero = 0;
};

/// Asymmetric parameters for a group whose values lie in [lo, hi].
Int4GroupParams int4_group_params(float lo, float hi);
/// clamp(round_half_even(w / scale) + zero, 0, 15).
uint8_t int4_code(float w, const Int4GroupParams& p);
void check_int4_weight(const char* op, const Tensor& weight, int64_t group_size);
/// An Int4Tensor from unpacked codes uint8 [out, in].
Int4Tensor make_int4(int64_t out, int64_t in, int64_t group_size, const Tensor& codes, const Tensor& scales,
                     const Tensor& zeros);
/// Points the parent's typed member (or, for containers, nothing) at q; with q
/// null it only answers whether it could.
bool swap_int4_member(nn::Module& parent, const std::string& name, const std::shared_ptr<nn::Linear>& q);

}  // namespace kiln::quant::detail
