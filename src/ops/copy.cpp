// copy_, to(dtype), contiguous, clone, fill_, zero_, with their backward.
//
// to/contiguous/clone copy through copy_into, which records nothing; the
// public ops record their own node (ToCopyBackward0, CloneBackward0). copy_,
// fill_ and zero_ are in-place: they check the target (check_inplace) before
// writing and rewrite its history after (rebase_history).
#include "kiln/kernels/copy.h"
#include "grad_ops.h"
#include "iter.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;

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

// The forward of copy_ without autograd: checks, overlap handling, kernel.
void copy_into(const Tensor& dst, const Tensor& src) {
  ops::check_defined(dst, "copy_", "self");
  ops::check_defined(src, "copy_", "src");
  const DimVector shape = broadcast_shapes(dst.sizes(), src.sizes(), "copy_");
  KILN_CHECK(shape.ref() == dst.sizes(), ShapeError, "copy_: source of shape ", src.sizes(),
             " cannot be broadcast to the destination's shape ", dst.sizes());
  if (dst.numel() == 0) return;
  for (int64_t d = 0; d < dst.dim(); ++d) {
    KILN_CHECK(dst.strides()[d] != 0 || dst.sizes()[d] == 1, ValueError, "copy_: the destination (shape ", dst.sizes(),
               ", strides ", dst.strides(), ") has stride 0 in dim ", d,
               ", so several of its elements share one memory location (an expand()ed tensor); clone() it first");
  }
  const Tensor source = may_overlap(dst, src) ? ops::copy_no_grad(src, src.dtype()) : src;
  const auto loop = ops::make_loop(dst.sizes(), {&dst, &source});
  kernels::copy_cast(loop, dst.dtype(), source.dtype());
}

// copy_: the old self is overwritten entirely (no gradient); src gets the
// gradient, which the engine sums to src's broadcast shape and casts to its dtype.
struct CopyBackwards final : autograd::Node {
  const char* name() const override { return "CopyBackwards"; }
  TensorList apply(TensorList&& g) override { return {Tensor(), g[0]}; }
};

// fill_ / zero_: the old self is overwritten, nothing flows back.
struct FillBackward final : autograd::Node {
  const char* node_name = "FillBackward2";
  const char* name() const override { return node_name; }
  TensorList apply(TensorList&&) override { return {Tensor()}; }
};

struct ToCopyBackward final : autograd::Node {
  DType self_dtype = kFloat32;
  const char* name() const override { return "ToCopyBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor()};
    return {g[0].to(self_dtype)};
  }
};

struct CloneBackward final : autograd::Node {
  const char* name() const override { return "CloneBackward0"; }
  TensorList apply(TensorList&& g) override { return {g[0]}; }
};

Tensor& fill_impl(Tensor& self, const Scalar& value, const char* op, const char* node_name, CallSite site) {
  ops::OpScope rs(ops::NamePtr{op}, {&self});
  ops::check_defined(self, op, "self");
  ops::check_scalar_fits(value, self.dtype(), op);
  autograd::check_inplace(self, op, site);
  const auto loop = ops::make_loop(self.sizes(), {&self});
  kernels::fill(loop, self.dtype(), value);
  self.bump_version();
  // A tensor that required grad keeps requiring it (its new value is a
  // constant): its history becomes the fill, through which nothing flows.
  if (autograd::compute_requires_grad({&self})) {
    auto node = make_intrusive<FillBackward>();
    node->node_name = node_name;
    autograd::rebase_history(self, node, {}, site);
  }
  return self;
}

}  // namespace

namespace ops {

Tensor copy_no_grad(const Tensor& t, DType dt) {
  Tensor out = new_output_like(t.sizes(), dt, {&t});  // torch's preserve_format
  copy_into(out, t);
  return out;
}

Tensor copy_no_grad(const Tensor& t, DType dt, MemoryFormat f) {
  Tensor out = new_output(t.sizes(), dt, f);
  copy_into(out, t);
  return out;
}

}  // namespace ops

Tensor& Tensor::copy_(const Tensor& src, std::source_location loc) {
  ops::OpScope rs("copy_", {this, &src});
  const CallSite site = CallSite::from(loc);
  ops::check_defined(*this, "copy_", "self");
  autograd::check_inplace(*this, "copy_", site, {&src});
  // Only a floating destination can carry a gradient (torch: copying into an
  // integer tensor leaves it outside the graph).
  const bool record = is_floating_point() && autograd::compute_requires_grad({this, &src});
  copy_into(*this, src);
  bump_version();
  if (record) autograd::rebase_history(*this, make_intrusive<CopyBackwards>(), {&src}, site);
  return *this;
}

Tensor& Tensor::fill_(const Scalar& value, std::source_location loc) {
  return fill_impl(*this, value, "fill_", "FillBackward2", CallSite::from(loc));
}

Tensor& Tensor::zero_(std::source_location loc) {
  return fill_impl(*this, 0, "zero_", "ZeroBackward0", CallSite::from(loc));
}

Tensor Tensor::to(DType dt, bool copy, std::source_location loc) const {
  ops::OpScope rs("to", {this});
  ops::check_defined(*this, "to", "self");
  if (dt == dtype() && !copy) return *this;
  Tensor out = ops::copy_no_grad(*this, dt);
  // A cast to an integer or bool dtype is not differentiable: the result stays outside the graph.
  if (kiln::is_floating_point(dt) && autograd::compute_requires_grad({this})) {
    auto node = make_intrusive<ToCopyBackward>();
    node->self_dtype = dtype();
    autograd::set_history(out, node, {this}, CallSite::from(loc));
  }
  return out;
}

Tensor Tensor::contiguous(std::source_location loc) const {
  ops::check_defined(*this, "contiguous", "self");
  if (is_contiguous()) return *this;
  return kiln::contiguous(*this, MemoryFormat::Contiguous, loc);
}

Tensor contiguous(const Tensor& t, MemoryFormat f, std::source_location loc) {
  ops::check_defined(t, "contiguous", "self");
  if (f == MemoryFormat::Preserve) f = suggest_memory_format(t);
  KILN_CHECK(f != MemoryFormat::ChannelsLast || t.dim() == 4, ShapeError,
             "contiguous: channels_last needs a 4-D tensor [N, C, H, W], got shape ", t.sizes());
  if (is_contiguous(t, f)) return t;
  // Recorded only when it copies, as torch (Tensor::contiguous returns self before dispatching).
  ops::OpScope rs("contiguous", {&t});
  Tensor out = ops::copy_no_grad(t, t.dtype(), f);
  if (autograd::compute_requires_grad({&t})) {
    autograd::set_history(out, make_intrusive<CloneBackward>(), {&t}, CallSite::from(loc));
  }
  return out;
}

Tensor Tensor::clone(std::source_location loc) const {
  ops::OpScope rs("clone", {this});
  ops::check_defined(*this, "clone", "self");
  Tensor out = ops::copy_no_grad(*this, dtype());
  if (autograd::compute_requires_grad({this})) {
    autograd::set_history(out, make_intrusive<CloneBackward>(), {this}, CallSite::from(loc));
  }
  return out;
}

}  // namespace kiln
