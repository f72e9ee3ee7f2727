// Tensor::repeat: tiles the tensor, copying (unlike expand, which is a view
// with stride 0). Backward (autograd issue): sum the gradient over the tiles.
//
// The output [r0*s0, r1*s1, ...] is walked as the 2n-dim shape
// [r0, s0, r1, s1, ...]: tile dims r_i advance the output by a whole tile and
// the input not at all (stride 0), size dims s_i advance both as usual. One
// strided copy then fills every tile, and dims that are dense in both merge,
// so tiling along the outermost dim becomes a few large memcpys and tiling a
// single column becomes vectorised fills.
#include "iter.h"
#include "kiln/kernels/index.h"

namespace kiln {

Tensor Tensor::repeat(IntArrayRef repeats) const {
  ops::check_defined(*this, "repeat", "self");
  const int64_t n = static_cast<int64_t>(repeats.size());
  KILN_CHECK(n >= dim(), ShapeError, "repeat: the number of repeat dims (", n,
             ") can not be smaller than the number of dims of the tensor (", dim(), ", shape ", sizes(), ")");
  for (int64_t r : repeats) {
    KILN_CHECK(r >= 0, ShapeError, "repeat: repeats must be non-negative, got ", repeats);
  }
  const int64_t lead = n - dim();
  DimVector in_sizes(n, 1), in_strides(n, 0), out_sizes(n);
  for (int64_t i = 0; i < n; ++i) {
    if (i >= lead) {
      in_sizes[i] = sizes()[i - lead];
      in_strides[i] = strides()[i - lead];
    }
    out_sizes[i] = in_sizes[i] * repeats[i];
  }
  Tensor out = ops::new_output(out_sizes, dtype());
  if (out.numel() == 0) return out;
  DimVector shape(2 * n), out_st(2 * n), in_st(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    shape[2 * i] = repeats[i];
    shape[2 * i + 1] = in_sizes[i];
    out_st[2 * i] = in_sizes[i] * out.strides()[i];
    out_st[2 * i + 1] = out.strides()[i];
    in_st[2 * i] = 0;
    in_st[2 * i + 1] = in_strides[i];
  }
  const auto loop = kernels::make_strided_loop(
      shape, {{static_cast<char*>(out.data_ptr()), out_st, element_size()},
              {static_cast<char*>(data_ptr()), in_st, element_size()}});
  kernels::tile_copy(loop, dtype());
  return out;
}

}  // namespace kiln
