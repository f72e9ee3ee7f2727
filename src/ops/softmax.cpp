// softmax and log_softmax along one dim (fused, numerically stable kernels in
// src/kernels/cpu/softmax.cpp). Backward (autograd issue) needs only the
// output: y * (g - sum(g * y)) for softmax, g - exp(y) * sum(g) for log_softmax.
#include "iter.h"
#include "kiln/ops/reduce.h"
#include "reduce_util.h"

namespace kiln {

namespace {

Tensor softmax_impl(const Tensor& self, int64_t dim, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  ops::check_defined(self, op, "self");
  const int64_t d = wrap_dim(dim, self.dim(), op);
  ops::check_floating(self, op);
  // As torch, the result is contiguous whatever the input's layout.
  const Tensor src = self.contiguous();
  Tensor out = ops::new_output(self.sizes(), self.dtype());
  kernels::softmax(ops::dim_layout(src.sizes(), d), src.dtype(), src.data_ptr(), out.data_ptr(), log);
  return out;
}

}  // namespace

Tensor Tensor::softmax(int64_t dim) const { return softmax_impl(*this, dim, false); }
Tensor Tensor::log_softmax(int64_t dim) const { return softmax_impl(*this, dim, true); }

Tensor softmax(const Tensor& x, int64_t dim) { return x.softmax(dim); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return x.log_softmax(dim); }

}  // namespace kiln
