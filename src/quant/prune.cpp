// Unstructured magnitude pruning (include/kiln/quant/prune.h): the masks,
// the hooks that keep a pruned weight at zero through training, remove().
#include "kiln/quant/prune.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <numeric>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"

namespace kiln::quant {
namespace {

// What keeps one pruned parameter pruned. The hooks hold it weakly; the
// registry below owns it until remove().
struct PruneState {
  Tensor weight;  // the parameter (same impl as the module's slot)
  Tensor mask;    // float32, weight's shape
  uint32_t masked_version = 0;
  HookHandle grad_hook, pre_hook;
};

// Pruned parameters by module and name. Keyed by address: an entry whose
// module died is recognised because its weight (kept alive by the entry, so
// its address cannot be reused) is no longer the module's parameter.
std::mutex registry_mutex;
std::map<const nn::Module*, std::map<std::string, std::shared_ptr<PruneState>>>& registry() {
  static std::map<const nn::Module*, std::map<std::string, std::shared_ptr<PruneState>>> r;
  return r;
}

Tensor find_parameter(nn::Module& module, const std::string& name) {
  for (auto& [n, t] : module.named_parameters(false))
    if (n == name) return t;
  std::string have;
  for (auto& [n, t] : module.named_parameters(false)) have += (have.empty() ? "" : ", ") + n;
  throw ValueError("prune: " + module.type_name() + " has no parameter \"" + name +
                   "\" (it has: " + (have.empty() ? "none" : have) + ")");
}

void check_amount(double amount) {
  KILN_CHECK(std::isfinite(amount) && amount >= 0.0 && amount <= 1.0, ValueError,
             "prune: amount expects a fraction in [0, 1], got ", amount);
}

void check_float32(const Tensor& w, const std::string& name) {
  KILN_CHECK(w.dtype() == kFloat32 && w.is_contiguous(), ValueError, "prune: ", name,
             " must be a contiguous float32 tensor, got ", dtype_name(w.dtype()));
}

// The live state of module.<name>, or null (dropping a stale entry).
std::shared_ptr<PruneState> state_of(nn::Module& module, const std::string& name) {
  const Tensor w = find_parameter(module, name);
  const std::lock_guard lock(registry_mutex);
  auto mit = registry().find(&module);
  if (mit == registry().end()) return nullptr;
  auto it = mit->second.find(name);
  if (it == mit->second.end()) return nullptr;
  if (it->second->weight.impl() != w.impl()) {  // another module now lives at this address
    mit->second.erase(it);
    if (mit->second.empty()) registry().erase(mit);
    return nullptr;
  }
  return it->second;
}

// weight *= mask on the raw data (no autograd, allowed under any guard), then
// the version moves so packed copies of the weight (Linear's oneDNN pack) follow.
// In a step (the forward pre-hook) it is recorded for kiln::compile's replay,
// which then applies the mask on every replay, as eager does after each
// optimizer step (the version test is host code a replay does not run).
void apply_mask(PruneState& s) {
  capture::host_write("prune (apply mask)",
                      [w = s.weight.data_ptr<float>(), m = s.mask.data_ptr<float>(), n = s.weight.numel()]() {
                        for (int64_t i = 0; i < n; ++i) w[i] *= m[i];
                      });
  s.weight.bump_version();
  s.masked_version = s.weight.version();
}

// Installs `mask` on module.<name> (replacing the mask of an earlier pruning).
void install(nn::Module& module, const std::string& name, const Tensor& mask) {
  std::shared_ptr<PruneState> s = state_of(module, name);
  if (!s) {
    s = std::make_shared<PruneState>();
    s->weight = find_parameter(module, name);
    std::weak_ptr<PruneState> weak = s;
    if (s->weight.requires_grad())
      s->grad_hook = s->weight.register_hook([weak](const Tensor& g) -> Tensor {
        auto st = weak.lock();
        return st ? g * st->mask : Tensor();
      });
    s->pre_hook = module.register_forward_pre_hook(
        [weak](nn::Module&, const Tensor&) -> Tensor {
          auto st = weak.lock();
          if (!st) return {};
          if (st->weight.version() != st->masked_version)
            apply_mask(*st);
          else  // masked before a capture: its record holds no masking, so a change outside must recapture
            capture::note_reused_derivation("a pruning mask applied before the capture", st->weight);
          return {};
        },
        nn::Module::HookReplay::TensorOpsOnly);  // the masking is a recorded host write
    const std::lock_guard lock(registry_mutex);
    registry()[&module][name] = s;
  }
  s->mask = mask;
  module.register_buffer(name + "_mask", mask, /*persistent=*/false);
  apply_mask(*s);
}

}  // namespace

Tensor l1_unstructured_mask(const Tensor& t, double amount, const Tensor& default_mask) {
  check_amount(amount);
  const Tensor v = t.detach().to(kFloat32).contiguous();
  Tensor mask = default_mask.defined() ? default_mask.detach().to(kFloat32).contiguous().clone()
                                       : ones(t.sizes(), TensorOptions(kFloat32));
  KILN_CHECK(mask.sizes() == v.sizes(), ValueError, "prune: the default mask has shape ", mask.shape_string(),
             ", the tensor ", v.shape_string());
  const float* x = v.data_ptr<float>();
  float* m = mask.data_ptr<float>();
  std::vector<int64_t> alive;
  for (int64_t i = 0; i < v.numel(); ++i)
    if (m[i] == 1.0f) alive.push_back(i);
  // Python's round(amount * n): half to even (the default rounding mode).
  const auto k = static_cast<int64_t>(std::nearbyint(amount * static_cast<double>(alive.size())));
  if (k == 0) return mask;
  // Smallest |x| first, ties by index: a stable order, so the choice is reproducible.
  std::stable_sort(alive.begin(), alive.end(), [x](int64_t a, int64_t b) { return std::fabs(x[a]) < std::fabs(x[b]); });
  for (int64_t i = 0; i < k; ++i) m[alive[static_cast<size_t>(i)]] = 0.0f;
  return mask;
}

void l1_unstructured(nn::Module& module, const std::string& name, double amount) {
  global_unstructured({{&module, name}}, amount);
}

void global_unstructured(const std::vector<std::pair<nn::Module*, std::string>>& params, double amount) {
  check_amount(amount);
  KILN_CHECK(!params.empty(), ValueError, "prune: global_unstructured needs at least one parameter");
  std::vector<Tensor> weights, masks;
  int64_t total = 0;
  for (const auto& [m, name] : params) {
    KILN_CHECK(m != nullptr, ValueError, "prune: global_unstructured got a null module for \"", name, "\"");
    Tensor w = find_parameter(*m, name);
    check_float32(w, name);
    auto s = state_of(*m, name);
    masks.push_back(s ? s->mask : ones(w.sizes(), TensorOptions(kFloat32)));
    weights.push_back(w);
    total += w.numel();
  }
  // One flat vector of all the scores and masks, in the given order (torch's parameters_to_vector).
  Tensor flat = empty({total}, TensorOptions(kFloat32)), flat_mask = empty({total}, TensorOptions(kFloat32));
  int64_t at = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t n = weights[i].numel();
    std::copy_n(weights[i].data_ptr<float>(), n, flat.data_ptr<float>() + at);
    std::copy_n(masks[i].contiguous().data_ptr<float>(), n, flat_mask.data_ptr<float>() + at);
    at += n;
  }
  const Tensor mask = l1_unstructured_mask(flat, amount, flat_mask);
  at = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    Tensor piece = empty(weights[i].sizes(), TensorOptions(kFloat32));
    std::copy_n(mask.data_ptr<float>() + at, weights[i].numel(), piece.data_ptr<float>());
    at += weights[i].numel();
    install(*params[i].first, params[i].second, piece);
  }
}

bool is_pruned(nn::Module& module, const std::string& name) { return state_of(module, name) != nullptr; }

void remove(nn::Module& module, const std::string& name) {
  std::shared_ptr<PruneState> s = state_of(module, name);
  KILN_CHECK(s != nullptr, ValueError, "prune: remove(", module.type_name(), ", \"", name,
             "\"): that parameter is not pruned");
  apply_mask(*s);
  s->grad_hook.remove();
  s->pre_hook.remove();
  module.register_buffer(name + "_mask", Tensor(), /*persistent=*/false);
  const std::lock_guard lock(registry_mutex);
  auto mit = registry().find(&module);
  mit->second.erase(name);
  if (mit->second.empty()) registry().erase(mit);
}

int64_t remove_all(nn::Module& model) {
  int64_t n = 0;
  for (auto& [path, m] : model.named_modules())
    for (auto& [name, t] : m->named_parameters(false))
      if (is_pruned(*m, name)) {
        remove(*m, name);
        ++n;
      }
  return n;
}

std::vector<std::pair<std::string, nn::Module*>> prunable_layers(nn::Module& model) {
  std::vector<std::pair<std::string, nn::Module*>> out;
  for (auto& [path, m] : model.named_modules())
    if (dynamic_cast<nn::Conv2d*>(m) || dynamic_cast<nn::Linear*>(m)) out.emplace_back(path, m);
  return out;
}

std::vector<LayerSparsity> weight_sparsity(nn::Module& model) {
  std::vector<LayerSparsity> out;
  for (auto& [path, m] : prunable_layers(model)) {
    const Tensor w = find_parameter(*m, "weight").detach().to(kFloat32).contiguous();
    LayerSparsity s{path, 0, w.numel()};
    const float* x = w.data_ptr<float>();
    for (int64_t i = 0; i < w.numel(); ++i) s.zeros += x[i] == 0.0f;
    out.push_back(s);
  }
  return out;
}

}  // namespace kiln::quant
