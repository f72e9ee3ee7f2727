// copy_, to(dtype), contiguous, clone, fill_, zero_.
#include "iter.h"
#include "kiln/kernels/copy.h"
#include "kiln/core/factory.h"

namespace kiln {

namespace {

// True when some element of `dst` could be read from `src` after being written.
bool may_overlap(const Tensor& dst, const Tensor& src) {
  if (dst.storage().get() != src.storage().get()) return false;
  const int64_t es_d = dst.element_size(), es_s = src.element_size();
  auto extent = [](const Tensor& t, int64_t es, int64_t& lo, int64_t& hi) {
    lo = t.storage_offset() * es;
    hi = lo;
    for (int64_t d = 0; d < t.dim(); ++d) hi += (t.sizes()[d] - 1) * t.strides()[d] * es;
    hi += es;
  };
  int64_t a0, a1, b0, b1;
  extent(dst, es_d, a0, a1);
  extent(src, es_s, b0, b1);
  if (a1 <= b0 || b1 <= a0) return false;
  // Identical views are safe (elementwise self-copy).
  return !(a0 == b0 && dst.sizes() == src.sizes() && dst.strides() == src.strides() && es_d == es_s);
}

}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  ops::check_defined(*this, "copy_", "self");
  ops::check_defined(src, "copy_", "src");
  const DimVector shape = broadcast_shapes(sizes(), src.sizes(), "copy_");
  KILN_CHECK(shape.ref() == sizes(), ShapeError, "copy_: source of shape ", src.sizes(),
             " cannot be broadcast to the destination's shape ", sizes());
  if (numel() == 0) return *this;
  for (int64_t d = 0; d < dim(); ++d) {
    KILN_CHECK(strides()[d] != 0 || sizes()[d] == 1, ValueError, "copy_: the destination (shape ", sizes(),
               ", strides ", strides(), ") has stride 0 in dim ", d,
               ", so several of its elements share one memory location (an expand()ed tensor); clone() it first");
  }
  Tensor source = may_overlap(*this, src) ? src.clone() : src;
  const auto loop = ops::make_loop(sizes(), {this, &source});
  kernels::copy_cast(loop, dtype(), source.dtype());
  bump_version();
  return *this;
}

Tensor& Tensor::fill_(const Scalar& value) {
  ops::check_defined(*this, "fill_", "self");
  ops::check_scalar_fits(value, dtype(), "fill_");
  const auto loop = ops::make_loop(sizes(), {this});
  kernels::fill(loop, dtype(), value);
  bump_version();
  return *this;
}

Tensor& Tensor::zero_() { return fill_(0); }

Tensor Tensor::to(DType dt, bool copy) const {
  ops::check_defined(*this, "to", "self");
  if (dt == dtype() && !copy) return *this;
  Tensor out = ops::new_output(sizes(), dt);
  out.copy_(*this);
  return out;
}

Tensor Tensor::contiguous() const {
  ops::check_defined(*this, "contiguous", "self");
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  ops::check_defined(*this, "clone", "self");
  Tensor out = ops::new_output(sizes(), dtype());
  out.copy_(*this);
  return out;
}

}  // namespace kiln
