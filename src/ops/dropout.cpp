// Dropout in training (kiln/ops/dropout.h).
//
// Note [Dropout in one pass]
// The composite drew rand(x.sizes()) into a float tensor, compared it into a
// bool tensor, converted that to float, scaled it and multiplied x by it:
// five passes and three activation-sized temporaries, and the scaled float
// mask kept for backward. With dropout 0.1, configs/gpt_mobydick.toml spent
// 24.5 ms of a 160 ms step in those ops (2 threads, --set profile.steps).
// The fused op draws each thread's uniforms a chunk at a time into an L1
// buffer (the same Philox blocks rand reserves), writes x * (u < 1 - p ?
// scale : 0) and a byte of mask, and its backward multiplies the gradient by
// the same factor, over the incoming gradient when nothing else holds it
// (Note [GELU's gradient over its incoming buffer] in unary.cpp): 15.3 ms a
// step, and 37.5 MiB less activation memory (254.4 -> 216.9 MiB). The
// comparison and the scale are the composite's float32 ones (the scalars
// rounded to float32 as lt and mul round them), so values and gradients are
// its bits.
#include "kiln/ops/dropout.h"

#include <cstdint>
#include <utility>

#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/autograd/node.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/dropout.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln::ops {

namespace {

struct NativeDropoutBackward final : autograd::Node {
  Tensor keep;  // uint8, x's shape: outside the graph
  float scale = 1.0f;
  const char* name() const override { return "NativeDropoutBackward0"; }
  TensorList apply(TensorList&& grads) override {
    if (!grads[0].defined() || !next_edges()[0].is_valid()) return {Tensor()};
    if (grad_mode_enabled()) {
      // create_graph: a differentiable product with the mask's factor, a constant of the graph.
      Tensor factor;
      {
        const NoGradGuard no_grad;
        factor = keep.to(kFloat32).mul(static_cast<double>(scale));
      }
      return {grads[0] * factor};
    }
    Tensor g = std::move(grads[0]);
    if (!g.is_contiguous() || g.dtype() != kFloat32) g = g.contiguous().to(kFloat32);
    const bool reuse = writable_incoming_grad(g) && g.sizes() == keep.sizes();
    Tensor gx = reuse ? g : empty(keep.sizes(), TensorOptions(kFloat32));
    if (reuse) gx.bump_version();
    if (gx.numel() > 0)
      kernels::dropout_backward(g.data_ptr<float>(), keep.data_ptr<uint8_t>(), scale, gx.data_ptr<float>(), gx.numel());
    return {gx};
  }
  void release_variables() override { keep = Tensor(); }
};

Tensor composite(const Tensor& x, double p) {
  const Tensor keep = rand(x.sizes(), TensorOptions(x.dtype())).lt(1.0 - p).to(x.dtype());
  return x * keep.mul(1.0 / (1.0 - p));
}

}  // namespace

Tensor dropout_train(const Tensor& x, double p, std::source_location loc) {
  KILN_CHECK(p > 0.0 && p < 1.0, ValueError, "dropout_train: expected 0 < p < 1, got ", p);
  if (x.dtype() != kFloat32 || !x.is_contiguous()) return composite(x, p);
  OpScope rs("dropout", {&x});
  Tensor out = new_output(x.sizes(), kFloat32);
  Tensor keep = new_output(x.sizes(), kUInt8);
  const int64_t n = x.numel();
  // The composite's scalars as lt and mul use them on a float32 tensor.
  const float keep_below = static_cast<float>(1.0 - p), scale = static_cast<float>(1.0 / (1.0 - p));
  if (n > 0) {
    Generator* g = &default_generator();
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    uint8_t* kp = keep.data_ptr<uint8_t>();
    // Recorded whole under kiln::compile, as rand's fill is: a replay reserves fresh blocks.
    capture::host_write("dropout", [g, xp, op, kp, n, keep_below, scale] {
      const uint64_t seed = g->get_state().seed;
      const uint64_t first = g->reserve(static_cast<uint64_t>((n + 3) / 4));
      kernels::dropout_forward(xp, op, kp, n, seed, first, keep_below, scale);
    });
  }
  if (autograd::compute_requires_grad({&x})) {
    auto node = make_intrusive<NativeDropoutBackward>();
    node->keep = keep;
    node->scale = scale;
    autograd::set_history(out, node, {&x}, autograd::CallSite::from(loc));
  }
  return out;
}

}  // namespace kiln::ops
