// Tensor::repeat: tiles the tensor, copying (unlike expand, which is a view
// with stride 0). Backward: the gradient summed over the tiles — viewed as
// [r0, s0, r1, s1, ...] and summed over the r dims.
//
// The output [r0*s0, r1*s1, ...] is walked as the 2n-dim shape
// [r0, s0, r1, s1, ...]: tile dims r_i advance the output by a whole tile and
// the input not at all (stride 0), size dims s_i advance both as usual. One
// strided copy then fills every tile, and dims that are dense in both merge,
// so tiling along the outermost dim becomes a few large memcpys and tiling a
// single column becomes vectorised fills.
#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/kernels/index.h"
#include "op_record.h"

namespace kiln {

namespace {

struct RepeatBackward final : autograd::Node {
  DimVector self_sizes, repeats;
  const char* name() const override { return "RepeatBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    const int64_t n = static_cast<int64_t>(repeats.size()), lead = n - static_cast<int64_t>(self_sizes.size());
    DimVector split, dims;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = i < lead ? 1 : self_sizes[i - lead];
      split.push_back(repeats[i]);
      split.push_back(s);
      if (repeats[i] != 1) dims.push_back(2 * i);
    }
    if (dims.empty()) return {g[0].reshape(self_sizes)};
    return {g[0].reshape(split).sum(dims.ref()).reshape(self_sizes)};
  }
};

// Fills `out` with tiles of `self` (seen with `in_sizes`/`in_strides`, padded
// to the repeat dims): one strided copy over [r0, s0, r1, s1, ...].
void tile(const Tensor& out, const Tensor& self, IntArrayRef in_sizes, IntArrayRef in_strides, IntArrayRef repeats) {
  const int64_t n = static_cast<int64_t>(repeats.size());
  DimVector shape(2 * n), out_st(2 * n), in_st(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    shape[2 * i] = repeats[i];
    shape[2 * i + 1] = in_sizes[i];
    out_st[2 * i] = in_sizes[i] * out.strides()[i];
    out_st[2 * i + 1] = out.strides()[i];
    in_st[2 * i] = 0;
    in_st[2 * i + 1] = in_strides[i];
  }
  const auto loop =
      kernels::make_strided_loop(shape, {{static_cast<char*>(out.data_ptr()), out_st, self.element_size()},
                                         {static_cast<char*>(self.data_ptr()), in_st, self.element_size()}});
  kernels::tile_copy(loop, self.dtype());
}

}  // namespace

Tensor Tensor::repeat(IntArrayRef repeats, std::source_location loc) const {
  ops::OpScope rs("repeat", {this});
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
  if (out.numel() > 0) tile(out, *this, in_sizes, in_strides, repeats);
  if (autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<RepeatBackward>();
    node->self_sizes = DimVector(sizes());
    node->repeats = DimVector(repeats);
    autograd::set_history(out, node, {this}, autograd::CallSite::from(loc));
  }
  return out;
}

}  // namespace kiln
