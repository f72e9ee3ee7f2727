// Internal to the ops layer: attention's products over a causal block, which
// skip the triangle the mask hides (Note [Causal products] in
// kiln/kernels/dnnl.h). Recorded as "matmul" with the FLOPs the band leaves.
#pragma once

#include "kiln/core/tensor.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::ops {

/// out = self · other under `band`, into `out` as matmul_into (equal batch
/// dims, no operand requiring grad).
void banded_matmul_into(const Tensor& self, const Tensor& other, const Tensor& out, kernels::MatmulBand band);
/// The same into a new contiguous tensor [..., m, n].
Tensor banded_matmul(const Tensor& self, const Tensor& other, kernels::MatmulBand band);

}  // namespace kiln::ops
