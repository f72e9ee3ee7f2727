// Fills autograd's GradMath table (kiln/autograd/grad_math.h) with ops.
#include "kiln/autograd/grad_math.h"

#include "kiln/ops/factory.h"

namespace kiln {
namespace {

Tensor add(const Tensor& a, const Tensor& b) { return a + b; }
void add_(const Tensor& self, const Tensor& other) { Tensor(self).add_(other); }
Tensor clone(const Tensor& t) { return t.clone(); }
Tensor contiguous(const Tensor& t) { return t.contiguous(); }
Tensor to(const Tensor& t, DType dtype) { return t.to(dtype); }
Tensor view(const Tensor& t, IntArrayRef shape) { return t.view(shape); }
Tensor sum(const Tensor& t, IntArrayRef dims, bool keepdim) { return t.sum(dims, keepdim); }
Tensor ones_like_(const Tensor& t) { return ones_like(t); }
Tensor zeros_(IntArrayRef shape, DType dtype) { return zeros(shape, dtype); }
Tensor as_strided(const Tensor& t, IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  return t.as_strided(sizes, strides, offset);
}
Tensor empty_strided_(IntArrayRef sizes, IntArrayRef strides, DType dtype) {
  return empty_strided(sizes, strides, TensorOptions(dtype));
}
void copy_(const Tensor& self, const Tensor& src) { Tensor(self).copy_(src); }

const autograd::GradMath kMath{add,        add_,   clone,      contiguous,     to,   view, sum,
                               ones_like_, zeros_, as_strided, empty_strided_, copy_};

const bool kInstalled = (autograd::install_grad_math(kMath), true);

}  // namespace
}  // namespace kiln

// Named in kiln_ops's INTERFACE_LINK_OPTIONS (-Wl,--undefined=...), so the
// linker takes this object — and runs its initialiser — in every program that
// links ops, even one that calls nothing else defined here.
extern "C" const bool* kiln_ops_grad_math_anchor() { return &kiln::kInstalled; }
