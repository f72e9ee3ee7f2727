// The autocast casts (kiln/ops/autocast.h): what each policy does to one argument,
// and the parameter-cast cache. The mode itself lives in core (core/autocast.cpp).
#include "kiln/ops/autocast.h"

#include <cstdio>
#include <cstdlib>

#include "kiln/core/error.h"
#include "kiln/kernels/dnnl.h"
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

Bf16ProductPath bf16_product_path() {
  Bf16ProductPath p;
  p.native = kernels::bf16_products_on_dnnl();
  // Forced where the switch says what happened (=1 on a CPU without bf16 kernels still runs float32).
  const char* env = std::getenv("KILN_ONEDNN_BF16");
  const std::string_view v = env != nullptr ? env : "";
  p.forced = (v == "0" && !p.native) || (v == "1" && p.native);
  p.amx = kernels::dnnl_has_amx();
  p.dot_vs_fma = kernels::bf16_products_decision_rate();
  p.native_from = kernels::kBf16NativeRate;
  return p;
}

std::string Bf16ProductPath::describe() const {
  char rate[200] = "";
  if (dot_vs_fma > 0)
    std::snprintf(rate, sizeof rate,
                  "this CPU's bf16 dot product (vdpbf16ps) does %.2f of float32 FMA's flops per "
                  "second (the bf16 kernels are used from %.2f)",
                  dot_vs_fma, native_from);
  std::string s;
  if (native) {
    s = "bf16 products run on oneDNN's bf16 kernels: ";
    s += forced ? "KILN_ONEDNN_BF16=1 asks for them" : amx ? "this CPU has AMX" : rate;
    return s;
  }
  s = "bf16 products compute in float32 and round once to bf16: ";
  if (forced) {
    s += "KILN_ONEDNN_BF16=0 asks for that";
  } else if (dot_vs_fma > 0) {
    s += rate;
    s += ", so bf16 autocast saves activation memory here, not time";
  } else {
    s += "this CPU has no bf16 dot product that oneDNN may use (no AVX512_BF16 or AMX), and emulating one is "
         "slower, so bf16 autocast saves activation memory here, not time";
  }
  return s;
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
