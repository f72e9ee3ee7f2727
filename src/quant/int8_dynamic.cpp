// DynamicInt8Linear and its module swap (include/kiln/quant/int8_dynamic.h).
#include "kiln/quant/int8_dynamic.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "base_rng.h"
#include "int4_internal.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/nn/lora.h"
#include "kiln/ops/factory.h"

namespace kiln::quant {
DynamicInt8Linear::DynamicInt8Linear(const nn::Linear& src) : nn::Linear(detail::linear_options_saving_rng(src)) {
  detail::restore_rng_before_base();
  KILN_CHECK(src.weight.defined(), ValueError, "DynamicInt8Linear: expected a Linear with a float weight, got none");
  const NoGradGuard ng;
  const Tensor w = src.weight.detach().to(kFloat32).contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  w_s8_ = empty({out, in}, TensorOptions(kUInt8));
  w_scales_ = empty({out}, TensorOptions(kFloat32));
  const float* pw = w.data_ptr<float>();
  uint8_t* q = w_s8_.data_ptr<uint8_t>();
  float* s = w_scales_.data_ptr<float>();
  for (int64_t o = 0; o < out; ++o) {
    float m = 0;
    for (int64_t i = 0; i < in; ++i) m = std::max(m, std::abs(pw[o * in + i]));
    KILN_CHECK(std::isfinite(m), ValueError, "DynamicInt8Linear: expected finite weights, got ", m, " in row ", o);
    s[o] = m > 0 ? m / 127.0f : 1.0f;
    for (int64_t i = 0; i < in; ++i) {
      const float v = std::clamp(std::nearbyint(pw[o * in + i] / s[o]), -127.0f, 127.0f);
      q[o * in + i] = static_cast<uint8_t>(static_cast<int8_t>(v));
    }
  }
  register_parameter("weight", Tensor());
  if (src.bias.defined()) register_parameter("bias", src.bias.detach().to(kFloat32).contiguous().clone(), false);
  kernel_ = std::make_shared<ops::Int8DynamicLinear>(w_s8_, w_scales_);
}

Tensor DynamicInt8Linear::run(const Tensor& x, ops::Int8DynamicLinear::Activation act, const Tensor& residual) const {
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == options.in_features, ShapeError,
             "DynamicInt8Linear: expected input with last dim ", options.in_features, ", got shape ", x.shape_string());
  const NoGradGuard ng;
  return (*kernel_)(x.detach().to(kFloat32), bias.defined() ? bias.detach().to(kFloat32) : bias, act,
                    residual.defined() ? residual.detach().to(kFloat32) : residual);
}

Tensor DynamicInt8Linear::forward(const Tensor& x) { return run(x, ops::Int8DynamicLinear::Activation::None, {}); }

Tensor DynamicInt8Linear::forward_gelu(const Tensor& x, const std::string& approximate) {
  KILN_CHECK(approximate == "none" || approximate == "tanh", ValueError,
             "DynamicInt8Linear: expected GELU approximate \"none\" or \"tanh\", got \"", approximate, "\"");
  return run(x,
             approximate == "tanh" ? ops::Int8DynamicLinear::Activation::GeluTanh
                                   : ops::Int8DynamicLinear::Activation::GeluErf,
             {});
}

Tensor DynamicInt8Linear::forward_add(const Tensor& x, const Tensor& residual) {
  return run(x, ops::Int8DynamicLinear::Activation::None, residual);
}

std::string DynamicInt8Linear::extra_repr() const { return nn::Linear::extra_repr() + ", int8 dynamic per-token"; }

int64_t DynamicInt8Linear::weight_bytes() const { return w_s8_.nbytes() + w_scales_.nbytes(); }

std::vector<std::string> quantize_linears_int8_dynamic(nn::Module& model, const std::vector<std::string>& targets) {
  KILN_CHECK(!targets.empty(), ValueError, "quantize_linears_int8_dynamic: expected at least one target, got none");
  std::unordered_map<const TensorImpl*, std::string> param_names;
  for (auto& [n, t] : model.named_parameters()) param_names.emplace(t.impl(), n);
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  std::vector<std::string> paths;
  for (auto& [path, m] : modules) {
    auto* lin = dynamic_cast<nn::Linear*>(m);
    if (path.empty() || !lin || !lin->weight.defined()) continue;
    bool match = false;
    for (const auto& t : targets) match = match || nn::lora::matches(t, path);
    if (!match) continue;
    auto it = param_names.find(lin->weight.impl());
    KILN_CHECK(it == param_names.end() || it->second == path + ".weight", ValueError,
               "quantize_linears_int8_dynamic: '", path, "': its weight is tied to '", it->second,
               "'; leave it out of the targets");
    const size_t dot = path.rfind('.');
    const std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    KILN_CHECK(detail::swap_int4_member(*by_path.at(parent_path), name, nullptr), ValueError,
               "quantize_linears_int8_dynamic: '", path, "': its parent is a ", by_path.at(parent_path)->type_name(),
               ", whose forward may call it through a pointer kiln cannot redirect");
    paths.push_back(path);
  }
  KILN_CHECK(!paths.empty(), ValueError, "quantize_linears_int8_dynamic: the targets match no float Linear module");
  for (const auto& path : paths) {
    nn::Module* m = by_path.at(path);
    const size_t dot = path.rfind('.');
    const std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    auto q = std::make_shared<DynamicInt8Linear>(*static_cast<nn::Linear*>(m));
    nn::Module& parent = *by_path.at(parent_path);
    detail::swap_int4_member(parent, name, q);
    parent.register_module(name, q);
  }
  return paths;
}

}  // namespace kiln::quant
