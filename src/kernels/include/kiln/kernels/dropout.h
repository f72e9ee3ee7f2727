// Dropout's float32 kernels (kernels layer): the mask drawn, applied and kept
// in one pass over the input, and its backward, instead of the five tensors
// rand, lt, to, mul and mul wrote (Note [Dropout in one pass] in
// src/ops/dropout.cpp).
#pragma once

#include <cstdint>

namespace kiln::kernels {

/// keep[i] = u[i] < keep_below and out[i] = x[i] * (keep[i] ? scale : 0.0f)
/// for i < n, where u[i] is the float32 uniform detail::philox_uniform_floats
/// gives for (key, first_block) with a = 0, span = 1: element i of
/// rand(n) drawn from those blocks. Across the calling thread's OpenMP team.
void dropout_forward(const float* x, float* out, uint8_t* keep, int64_t n, uint64_t key, uint64_t first_block,
                     float keep_below, float scale);

/// gx[i] = g[i] * (keep[i] ? scale : 0.0f); gx may be g.
void dropout_backward(const float* g, const uint8_t* keep, float scale, float* gx, int64_t n);

}  // namespace kiln::kernels
