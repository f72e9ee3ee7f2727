// INT4 round-to-nearest quantization, Int4Linear, the Hessian recorder and
// the module swap (include/kiln/quant/int4.h). GPTQ is in gptq.cpp, the
// checkpoints in int4_io.cpp.
#include "kiln/quant/int4.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "base_rng.h"
#include "int4_internal.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/nn/lora.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/int4.h"

namespace kiln::quant {

using kiln::detail::concat;

namespace detail {

Int4GroupParams int4_group_params(float lo, float hi) {
  // The range always holds 0, so that a zero weight is exact (as GPTQ's quantizer).
  lo = std::min(lo, 0.0f);
  hi = std::max(hi, 0.0f);
  if (hi == lo) return {1.0f, 0};  // an all-zero group: codes 0 stand for 0 exactly
  const float scale = (hi - lo) / 15.0f;
  const float z = std::clamp(std::nearbyint(-lo / scale), 0.0f, 15.0f);
  return {scale, static_cast<uint8_t>(z)};
}

uint8_t int4_code(float w, const Int4GroupParams& p) {
  return static_cast<uint8_t>(std::clamp(std::nearbyint(w / p.scale) + static_cast<float>(p.zero), 0.0f, 15.0f));
}

void check_int4_weight(const char* op, const Tensor& weight, int64_t group_size) {
  KILN_CHECK(weight.defined() && is_floating_point(weight.dtype()) && weight.dim() == 2, ValueError, op,
             ": expected a 2-D float weight [out, in], got ",
             weight.defined() ? std::string(dtype_name(weight.dtype())) + " " + weight.shape_string()
                              : std::string("an undefined tensor"));
  KILN_CHECK(group_size > 0 && group_size % 2 == 0 && weight.size(1) % group_size == 0, ValueError, op,
             ": expected an even group size dividing in_features ", weight.size(1), ", got ", group_size);
}

Int4Tensor make_int4(int64_t out, int64_t in, int64_t group_size, const Tensor& codes, const Tensor& scales,
                     const Tensor& zeros) {
  Int4Tensor q;
  q.out = out;
  q.in = in;
  q.group_size = group_size;
  q.packed = ops::int4_pack(codes);
  q.scales = scales;
  q.zeros = zeros;
  return q;
}

}  // namespace detail

int64_t Int4Tensor::nbytes() const {
  int64_t b = 0;
  for (const Tensor* t : {&packed, &scales, &zeros})
    if (t->defined()) b += t->nbytes();
  return b;
}

Int4Tensor quantize_int4_rtn(const Tensor& weight, int64_t group_size) {
  detail::check_int4_weight("quantize_int4_rtn", weight, group_size);
  const NoGradGuard ng;
  const Tensor w = weight.detach().to(kFloat32).contiguous();
  const int64_t out = w.size(0), in = w.size(1), groups = in / group_size;
  Tensor codes = empty({out, in}, TensorOptions(kUInt8));
  Tensor scales = empty({out, groups}, TensorOptions(kFloat32));
  Tensor zeros = empty({out, groups}, TensorOptions(kUInt8));
  const float* x = w.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  uint8_t* z = zeros.data_ptr<uint8_t>();
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + o * in + g * group_size;
      float lo = xg[0], hi = xg[0];
      for (int64_t i = 0; i < group_size; ++i) {
        KILN_CHECK(std::isfinite(xg[i]), ValueError, "quantize_int4_rtn: expected finite weights, got ", xg[i], " at [",
                   o, ", ", g * group_size + i, "]");
        lo = std::min(lo, xg[i]);
        hi = std::max(hi, xg[i]);
      }
      const detail::Int4GroupParams p = detail::int4_group_params(lo, hi);
      s[o * groups + g] = p.scale;
      z[o * groups + g] = p.zero;
      for (int64_t i = 0; i < group_size; ++i) c[o * in + g * group_size + i] = detail::int4_code(xg[i], p);
    }
  }
  return detail::make_int4(out, in, group_size, codes, scales, zeros);
}

Tensor dequantize_int4(const Int4Tensor& q) { return ops::int4_dequantize(q.packed, q.scales, q.zeros, q.group_size); }

Int4Linear::Int4Linear(const nn::Linear& src, Int4Tensor q)
    : Int4Linear(src, std::move(q), src.bias.defined() ? src.bias : Tensor()) {}

Int4Linear::Int4Linear(const nn::Linear& src, Int4Tensor q, const Tensor& b)
    : nn::Linear(detail::linear_options_saving_rng(src)), q_(std::move(q)) {
  detail::restore_rng_before_base();
  KILN_CHECK(q_.out == options.out_features && q_.in == options.in_features, ShapeError,
             "Int4Linear: expected an int4 weight [", options.out_features, ", ", options.in_features, "], got [",
             q_.out, ", ", q_.in, "]");
  const NoGradGuard ng;
  register_parameter("weight", Tensor());
  if (options.bias) {
    KILN_CHECK(b.defined() && b.dim() == 1 && b.size(0) == q_.out, ShapeError, "Int4Linear: expected a bias [", q_.out,
               "], got ", b.defined() ? b.shape_string() : std::string("none"));
    register_parameter("bias", b.detach().to(kFloat32).contiguous().clone(), /*requires_grad=*/false);
  }
  auto keep = [this](const char* name, Tensor& t) {
    register_buffer(name, t);
    t.storage()->set_category(MemoryCategory::Parameter);  // the layer's weight, not running state
  };
  keep("weight_int4", q_.packed);
  keep("weight_scales", q_.scales);
  keep("weight_zeros", q_.zeros);
  // TransformerBlock / TransformerMLP read a Linear's float `weight` directly
  // unless it has a forward hook; this one has none, so a hook that changes
  // nothing makes them call forward().
  register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) { return Tensor(); }, HookReplay::TensorOpsOnly);
}

Tensor Int4Linear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == options.in_features, ShapeError, "Int4Linear: expected input with last dim ",
             options.in_features, ", got shape ", x.shape_string());
  return ops::int4_linear(x, q_.packed, q_.scales, q_.zeros, bias, q_.group_size);
}

std::string Int4Linear::extra_repr() const {
  return nn::Linear::extra_repr() + ", int4_group_size=" + std::to_string(q_.group_size);
}

std::vector<std::string> gpt_int4_targets() { return {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}; }

// ---- Hessians ----

struct HessianRecorder::Layer {
  std::string path;
  Tensor h;  // float64 [in, in]: Σ xᵀx so far
  int64_t rows = 0;
  HookHandle hook;
};

HessianRecorder::HessianRecorder(nn::Module& model, const std::vector<std::string>& targets) {
  for (auto& [path, m] : model.named_modules()) {
    auto* lin = dynamic_cast<nn::Linear*>(m);
    if (path.empty() || !lin || dynamic_cast<Int4Linear*>(m)) continue;
    bool match = false;
    for (const auto& t : targets) match = match || nn::lora::matches(t, path);
    if (!match) continue;
    auto layer = std::make_unique<Layer>();
    layer->path = path;
    const int64_t in = lin->options.in_features;
    layer->h = zeros({in, in}, TensorOptions(kFloat64));
    Layer* l = layer.get();
    layer->hook = m->register_forward_hook([l, in](nn::Module&, const Tensor& x, const Tensor&) {
      const NoGradGuard ng;
      // One batch's XᵀX in float32 (oneDNN; float64 BLAS took a minute over 32 GPT batches), summed in float64.
      const Tensor x2 = x.detach().to(kFloat32).reshape({-1, in});
      l->h.add_(x2.transpose(0, 1).matmul(x2).to(kFloat64));
      l->rows += x2.size(0);
      return Tensor();
    });
    layers_.push_back(std::move(layer));
  }
}

HessianRecorder::~HessianRecorder() {
  for (auto& l : layers_) l->hook.remove();
}

Tensor HessianRecorder::hessian(const std::string& path) const {
  for (const auto& l : layers_) {
    if (l->path != path) continue;
    KILN_CHECK(l->rows > 0, ValueError, "HessianRecorder: layer '", path,
               "' saw no calibration input (was the model run after recording started?)");
    const NoGradGuard ng;
    return l->h.mul(2.0 / static_cast<double>(l->rows));
  }
  throw ValueError("HessianRecorder: expected a recorded layer '" + path + "', got none by that path");
}

int64_t HessianRecorder::rows(const std::string& path) const {
  for (const auto& l : layers_)
    if (l->path == path) return l->rows;
  return 0;
}

// ---- the swap ----

namespace detail {

bool swap_int4_member(nn::Module& parent, const std::string& name, const std::shared_ptr<nn::Linear>& q) {
  std::shared_ptr<nn::Linear>* slot = nullptr;
  if (auto* a = dynamic_cast<nn::CausalSelfAttention*>(&parent)) {
    slot = name == "c_attn" ? &a->c_attn : name == "c_proj" ? &a->c_proj : nullptr;
  } else if (auto* m = dynamic_cast<nn::TransformerMLP*>(&parent)) {
    slot = name == "c_fc" ? &m->c_fc : name == "c_proj" ? &m->c_proj : nullptr;
  } else {
    return dynamic_cast<nn::Sequential*>(&parent) || dynamic_cast<nn::ModuleList*>(&parent) ||
           dynamic_cast<nn::ModuleDict*>(&parent);
  }
  if (slot && q) *slot = q;
  return slot != nullptr;
}

}  // namespace detail

Int4Report quantize_linears_int4(nn::Module& model, const std::vector<std::string>& targets, const Int4Options& o,
                                 const HessianRecorder* hessians) {
  KILN_CHECK(!targets.empty(), ValueError, "quantize_linears_int4: expected at least one target, got none");
  std::unordered_map<const TensorImpl*, std::string> param_names;
  for (auto& [n, t] : model.named_parameters()) param_names.emplace(t.impl(), n);
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  struct Job {
    std::string path, name;
    nn::Module* parent;
    nn::Linear* linear;
  };
  std::vector<Job> jobs;
  std::string problems;
  for (const auto& pattern : targets) {
    bool any = false;
    for (auto& [path, m] : modules) {
      if (path.empty() || !nn::lora::matches(pattern, path)) continue;
      auto* lin = dynamic_cast<nn::Linear*>(m);
      if (!lin || !lin->weight.defined()) continue;
      any = true;
      bool dup = false;
      for (const auto& j : jobs) dup = dup || j.linear == lin;
      if (dup) continue;
      const size_t dot = path.rfind('.');
      const std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
      const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
      auto it = param_names.find(lin->weight.impl());
      if (it != param_names.end() && it->second != path + ".weight") {
        problems += concat("\n  '", path, "': its weight is tied to '", it->second, "'; leave it out of the targets");
        continue;
      }
      if (lin->options.in_features % o.group_size != 0) {
        problems += concat("\n  '", path, "': in_features ", lin->options.in_features,
                           " is not a multiple of the group size ", o.group_size);
        continue;
      }
      jobs.push_back({path, name, by_path.at(parent_path), lin});
    }
    if (!any) problems += concat("\n  target '", pattern, "' matches no float Linear module");
  }
  for (const auto& j : jobs)
    if (!detail::swap_int4_member(*j.parent, j.name, nullptr))
      problems += concat("\n  '", j.path, "': its parent is a ", j.parent->type_name(),
                         ", whose forward may call it through a pointer kiln cannot redirect");
  KILN_CHECK(problems.empty(), ValueError, "quantize_linears_int4:", problems);
  // Every Hessian first, so that a layer the calibration missed fails before any swap.
  std::vector<Tensor> hs(jobs.size());
  if (hessians)
    for (size_t i = 0; i < jobs.size(); ++i) hs[i] = hessians->hessian(jobs[i].path);
  Int4Report report;
  report.gptq = hessians != nullptr;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    Int4Tensor q =
        hessians ? quantize_int4_gptq(j.linear->weight, hs[i], o) : quantize_int4_rtn(j.linear->weight, o.group_size);
    auto m = std::make_shared<Int4Linear>(*j.linear, std::move(q));
    report.float_bytes += j.linear->weight.nbytes();
    report.int4_bytes += m->weight_int4().nbytes();
    detail::swap_int4_member(*j.parent, j.name, m);
    j.parent->register_module(j.name, m);
    report.paths.push_back(j.path);
  }
  return report;
}

}  // namespace kiln::quant
