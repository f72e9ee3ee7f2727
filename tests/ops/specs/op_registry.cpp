// The registry (tests/ops/specs/op_spec.h): every family's entries in order, and the
// sample-data helpers the families share.
#include "ops/specs/op_spec.h"

#include "kiln/ops/factory.h"

namespace kiln::ops {

Tolerance default_tolerance(DType dt) {
  switch (dt) {
    case kFloat32: return {1e-5, 1e-6};
    case kFloat64: return {1e-10, 1e-12};
    case kBFloat16: return {1.6e-2, 1e-2};
    case kFloat16: return {1e-3, 1e-3};
    default: return {0.0, 0.0};
  }
}

const std::vector<OpSpec>& op_registry() {
  static const std::vector<OpSpec> registry = [] {
    std::vector<OpSpec> r;
    register_factory_ops(r);
    register_view_ops(r);
    register_index_ops(r);
    register_elementwise_ops(r);
    register_reduction_ops(r);
    register_linalg_ops(r);
    register_conv_pool_ops(r);
    register_norm_loss_attention_ops(r);
    return r;
  }();
  return registry;
}

Tensor sample_tensor(IntArrayRef sizes, DType dt, uint64_t seed) {
  Generator g(seed);
  if (is_floating_point(dt)) return randn(sizes, kFloat32, &g).to(dt);
  if (dt == kBool) return randint(0, 2, sizes, kInt64, &g).to(kBool);
  if (dt == kUInt8) return randint(0, 10, sizes, kInt64, &g).to(kUInt8);
  return randint(-5, 5, sizes, kInt64, &g).to(dt);
}

Tensor sample_noncontig(IntArrayRef sizes, DType dt, uint64_t seed) {
  // Allocate with the last dim doubled and take every other element; for 2+ dims
  // also swap the last two dims so the innermost stride is not the smallest.
  DimVector big(sizes);
  if (big.empty()) return sample_tensor(sizes, dt, seed);
  if (big.size() >= 2) std::swap(big[big.size() - 1], big[big.size() - 2]);
  big.back() *= 2;
  Tensor t = sample_tensor(big, dt, seed).slice(-1, 0, std::nullopt, 2);
  if (big.size() >= 2) t = t.transpose(-1, -2);
  return t;
}

Tensor sample_positive(IntArrayRef sizes, DType dt, uint64_t seed, double lo, double hi) {
  Generator g(seed);
  Tensor t = empty(sizes, kFloat32);
  uniform_(t, lo, hi, &g);
  return t.to(dt);
}

}  // namespace kiln::ops
