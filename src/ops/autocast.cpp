// The autocast casts (kiln/ops/autocast.h): what each policy does to one argument,
// and the parameter-cast cache. The mode itself lives in core (core/autocast.cpp).
#include "kiln/ops/autocast.h"

#include "kiln/core/error.h"
#include "kiln/ops/promotion.h"

namespace kiln {

std::string_view autocast_policy_name(AutocastPolicy p) {
  switch (p) {
    case AutocastPolicy::LowerPrecision: return "lower_precision";
    case AutocastPolicy::Float32: return "float32";
    case AutocastPolicy::Promote: return "promote";
  }
  return "?";
}

// The table is indexed by the enum: a row out of order would give an op
// another op's policy, so the order is checked where it is written.
static_assert(
    [] {
      for (int i = 0; i < kAutocastOpCount; ++i)
        if (static_cast<int>(kAutocastPolicy[i].op) != i) return false;
      return true;
    }(),
    "kAutocastPolicy rows must follow the AutocastOp order");

namespace ops {

void AutocastTarget::add(const Tensor& t) {
  if (!t.defined() || !t.is_floating_point()) return;
  widest_ = any_floating_ ? promote_types(widest_, t.dtype()) : t.dtype();
  any_floating_ = true;
}

DType AutocastTarget::dtype() const {
  switch (policy_) {
    case AutocastPolicy::LowerPrecision: return autocast_dtype();
    case AutocastPolicy::Float32: return kFloat32;
    case AutocastPolicy::Promote: return widest_;
  }
  return kFloat32;
}

namespace {

// torch's is_eligible: float64 is never narrowed (a user who asked for double
// keeps it); bf16/fp16 are what Float32 widens and float32 what LowerPrecision narrows.
bool eligible(const Tensor& t, DType target, AutocastPolicy policy) {
  if (!t.defined() || !t.is_floating_point() || t.dtype() == target) return false;
  switch (policy) {
    case AutocastPolicy::LowerPrecision: return t.dtype() != kFloat64;
    case AutocastPolicy::Float32: return t.dtype() == kBFloat16 || t.dtype() == kFloat16;
    case AutocastPolicy::Promote: return true;
  }
  return false;
}

}  // namespace

Tensor autocast_arg(const Tensor& t, DType target, AutocastPolicy policy) {
  if (!eligible(t, target, policy)) return t;
  auto& counters = autocast_detail::counters();
  // As torch: only parameters (float32 leaves that require grad) are cached;
  // activations are cast once anyway, and caching them would keep them alive.
  const bool cacheable = policy == AutocastPolicy::LowerPrecision && t.dtype() == kFloat32 && t.requires_grad() &&
                         t.is_leaf() && autocast_detail::cache_active();
  if (cacheable) {
    if (Tensor hit = autocast_detail::cache_lookup(t, target); hit.defined()) {
      ++counters.cache_hits;
      return hit;
    }
  }
  Tensor cast = t.to(target);
  ++counters.casts;
  if (cacheable) {
    ++counters.param_casts;
    autocast_detail::cache_store(t, target, cast);
  }
  return cast;
}

std::vector<Tensor> autocast_arg(const std::vector<Tensor>& ts, DType target, AutocastPolicy policy) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(autocast_arg(t, target, policy));
  return out;
}

}  // namespace ops
}  // namespace kiln
