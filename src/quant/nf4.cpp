// NF4 quantization, NF4Linear and the module swap (include/kiln/quant/nf4.h).
#include "kiln/quant/nf4.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "base_rng.h"
#include "kiln/autograd/custom_function.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/parallel.h"
#include "kiln/models/gpt.h"
#include "kiln/models/vit.h"
#include "kiln/nn/lora.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/linalg.h"

namespace kiln::quant {

using kiln::detail::concat;

namespace {

// bitsandbytes' NF4 table (create_normal_map with offset 0.9677083, in float32).
constexpr std::array<float, 16> kLevels = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// Midpoints between adjacent levels: the index of the nearest level of v is the
// number of midpoints below v (a tie goes to the upper level).
constexpr std::array<float, 15> midpoints() {
  std::array<float, 15> m{};
  for (size_t i = 0; i < 15; ++i) m[i] = (kLevels[i] + kLevels[i + 1]) / 2;
  return m;
}
constexpr std::array<float, 15> kMid = midpoints();

uint8_t nearest_level(float v) {
  uint8_t i = 0;
  while (i < 15 && v >= kMid[i]) ++i;
  return i;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const std::array<float, 16>& nf4_levels() { return kLevels; }

int64_t NF4Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
int64_t NF4Tensor::num_blocks() const { return ceil_div(numel(), options.block_size); }
int64_t NF4Tensor::nbytes() const {
  int64_t b = 0;
  for (const Tensor* t : {&codes, &absmax, &absmax_codes, &absmax_factors, &absmax_offset})
    if (t->defined()) b += t->nbytes();
  return b;
}

NF4Tensor quantize_nf4(const Tensor& t, const NF4Options& o) {
  KILN_CHECK(o.block_size > 0 && o.block_size % 2 == 0, ValueError,
             "quantize_nf4: expected a positive even block_size, got ", o.block_size);
  KILN_CHECK(!o.double_quant || o.scale_block_size > 0, ValueError,
             "quantize_nf4: expected a positive scale_block_size, got ", o.scale_block_size);
  KILN_CHECK(t.defined() && is_floating_point(t.dtype()), DTypeError, "quantize_nf4: expected a float tensor, got ",
             t.defined() ? std::string(dtype_name(t.dtype())) : std::string("an undefined tensor"));
  NoGradGuard ng;
  NF4Tensor q;
  q.shape.assign(t.shape().begin(), t.shape().end());
  q.options = o;
  const Tensor src = t.detach().to(kFloat32).contiguous();
  const int64_t n = src.numel(), nb = q.num_blocks(), bs = o.block_size;
  const float* x = src.data_ptr<float>();
  q.codes = zeros({ceil_div(n, 2)}, TensorOptions(kUInt8));
  Tensor scales = empty({nb}, TensorOptions(kFloat32));
  uint8_t* c = q.codes.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  // Blocks are even-sized, so no byte is shared between two blocks (the last may be short).
  parallel_for(nb, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * bs, hi = std::min(n, lo + bs);
      float m = 0;
      for (int64_t i = lo; i < hi; ++i) m = std::max(m, std::abs(x[i]));
      s[b] = m;
      const float inv = m > 0 ? 1.0f / m : 0.0f;
      for (int64_t i = lo; i < hi; ++i) {
        const uint8_t code = nearest_level(x[i] * inv);
        c[i / 2] |= (i % 2 == 0) ? static_cast<uint8_t>(code << 4) : code;
      }
    }
  });
  if (!o.double_quant) {
    q.absmax = scales;
    return q;
  }
  // Double quantization: centre the scales on their mean, then 8 bits per scale
  // with one float32 factor per scale block.
  double sum = 0;
  for (int64_t b = 0; b < nb; ++b) sum += s[b];
  const float offset = nb > 0 ? static_cast<float>(sum / static_cast<double>(nb)) : 0.0f;
  const int64_t sb = o.scale_block_size, ns = ceil_div(nb, sb);
  q.absmax_codes = empty({nb}, TensorOptions(kUInt8));
  q.absmax_factors = empty({ns}, TensorOptions(kFloat32));
  q.absmax_offset = tensor<float>({offset}, {1});
  uint8_t* ac = q.absmax_codes.data_ptr<uint8_t>();
  float* af = q.absmax_factors.data_ptr<float>();
  for (int64_t k = 0; k < ns; ++k) {
    const int64_t lo = k * sb, hi = std::min(nb, lo + sb);
    float m = 0;
    for (int64_t b = lo; b < hi; ++b) m = std::max(m, std::abs(s[b] - offset));
    af[k] = m / 127.0f;
    const float inv = m > 0 ? 127.0f / m : 0.0f;
    for (int64_t b = lo; b < hi; ++b) {
      const float v = std::clamp(std::nearbyint((s[b] - offset) * inv), -127.0f, 127.0f);
      ac[b] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
  }
  return q;
}

Tensor nf4_block_scales(const NF4Tensor& q) {
  if (!q.options.double_quant) return q.absmax;
  const int64_t nb = q.num_blocks(), sb = q.options.scale_block_size;
  KILN_CHECK(q.absmax_codes.defined() && q.absmax_codes.numel() == nb, ValueError, "nf4_block_scales: expected ", nb,
             " scale codes");
  Tensor s = empty({nb}, TensorOptions(kFloat32));
  // Each NF4Linear forward and backward: recorded for kiln::compile's replay.
  capture::host_write("nf4_block_scales",
                      [ac = q.absmax_codes.data_ptr<uint8_t>(), af = q.absmax_factors.data_ptr<float>(),
                       off = q.absmax_offset.data_ptr<float>(), out = s.data_ptr<float>(), nb, sb]() {
                        const float offset = off[0];
                        for (int64_t b = 0; b < nb; ++b)
                          out[b] = static_cast<float>(static_cast<int>(ac[b]) - 128) * af[b / sb] + offset;
                      });
  return s;
}

Tensor dequantize_nf4(const NF4Tensor& q, DType dtype) {
  const int64_t n = q.numel(), nb = q.num_blocks(), bs = q.options.block_size;
  KILN_CHECK(q.codes.defined() && q.codes.numel() == (n + 1) / 2, ValueError, "dequantize_nf4: expected ", (n + 1) / 2,
             " code bytes for shape of ", n, " elements, got ", q.codes.defined() ? q.codes.numel() : 0);
  NoGradGuard ng;
  const Tensor scales = nf4_block_scales(q);
  Tensor out = empty(q.shape, TensorOptions(kFloat32));
  // Each NF4Linear forward and backward: recorded for kiln::compile's replay.
  capture::host_write("dequantize_nf4", [c = q.codes.data_ptr<uint8_t>(), s = scales.data_ptr<float>(),
                                         y = out.data_ptr<float>(), n, nb, bs]() {
    parallel_for(nb, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t lo = b * bs, hi = std::min(n, lo + bs);
        for (int64_t i = lo; i < hi; ++i) {
          const uint8_t code = (i % 2 == 0) ? (c[i / 2] >> 4) : (c[i / 2] & 0x0F);
          y[i] = kLevels[code] * s[b];
        }
      }
    });
  });
  return dtype == kFloat32 ? out : out.to(dtype);
}

namespace {

// y = x Wᵀ + b with W dequantized for the product only: the float weight is a
// temporary of forward and of backward, never saved between them.
struct NF4Matmul : autograd::Function<NF4Matmul> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x, std::optional<Tensor> bias,
                        std::shared_ptr<const NF4Tensor> w) {
    ctx.saved_data["w"] = w;
    Tensor W;
    {
      MemoryCategoryGuard g(MemoryCategory::Workspace);
      W = dequantize_nf4(*w, x.dtype());
    }
    return kiln::linear(x, W, bias ? *bias : Tensor());
  }
  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    auto w = ctx.saved_data.get<std::shared_ptr<const NF4Tensor>>("w");
    const Tensor& g = grads[0];
    Tensor gx, gb;
    if (ctx.needs_input_grad()[0]) {
      Tensor W;
      {
        MemoryCategoryGuard mg(MemoryCategory::Workspace);
        W = dequantize_nf4(*w, g.dtype());
      }
      gx = g.matmul(W);
    }
    if (ctx.needs_input_grad().size() > 1 && ctx.needs_input_grad()[1]) gb = g.reshape({-1, g.size(-1)}).sum(0);
    return {gx, gb};
  }
};

}  // namespace

NF4Linear::NF4Linear(const nn::Linear& src, const NF4Options& options)
    : nn::Linear(detail::linear_options_saving_rng(src)) {
  detail::restore_rng_before_base();
  KILN_CHECK(src.weight.defined(), ValueError, "NF4Linear: expected a Linear with a float weight, got none");
  q_ = std::make_shared<NF4Tensor>(quantize_nf4(src.weight, options));
  // The float weight is released: the codes are the weight now.
  register_parameter("weight", Tensor());
  if (src.bias.defined()) {
    NoGradGuard g;
    register_parameter("bias", src.bias.detach().clone(), /*requires_grad=*/false);
  }
  auto keep = [this](const char* name, Tensor& t) {
    if (!t.defined()) return;
    register_buffer(std::string("weight_nf4_") + name, t);
    // They are the layer's weight, not running state: counted with the parameters.
    t.storage()->set_category(MemoryCategory::Parameter);
  };
  keep("codes", q_->codes);
  keep("absmax", q_->absmax);
  keep("absmax_codes", q_->absmax_codes);
  keep("absmax_factors", q_->absmax_factors);
  keep("absmax_offset", q_->absmax_offset);
  // TransformerBlock and TransformerMLP fuse a Linear's product with the next
  // step by reading its `weight` directly unless the Linear has a forward hook;
  // this one has no float weight, so it carries a hook that changes nothing and
  // makes them call forward().
  register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) { return Tensor(); });
}

Tensor NF4Linear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == options.in_features, ShapeError, "NF4Linear: expected input with last dim ",
             options.in_features, ", got shape ", x.shape_string());
  std::optional<Tensor> b;
  if (bias.defined()) b = bias;
  return NF4Matmul::apply(x, b, std::shared_ptr<const NF4Tensor>(q_));
}

std::string NF4Linear::extra_repr() const {
  return nn::Linear::extra_repr() + ", nf4_block_size=" + std::to_string(q_->options.block_size) +
         ", double_quant=" + (q_->options.double_quant ? "True" : "False");
}

Tensor NF4Linear::dequantized_weight() const { return dequantize_nf4(*q_); }

namespace {

// Points the parent's typed member at `q`, where the parent's forward calls its
// child through one; false for a parent or member kiln does not know. With q
// null it only answers whether it could.
bool swap_typed_member(nn::Module& parent, const std::string& name, const std::shared_ptr<NF4Linear>& q) {
  std::shared_ptr<nn::Linear>* slot = nullptr;
  if (auto* a = dynamic_cast<nn::CausalSelfAttention*>(&parent)) {
    slot = name == "c_attn" ? &a->c_attn : name == "c_proj" ? &a->c_proj : nullptr;
  } else if (auto* m = dynamic_cast<nn::TransformerMLP*>(&parent)) {
    slot = name == "c_fc" ? &m->c_fc : name == "c_proj" ? &m->c_proj : nullptr;
  } else if (auto* g = dynamic_cast<models::GPT*>(&parent)) {
    slot = name == "lm_head" ? &g->lm_head : nullptr;
  } else if (auto* v = dynamic_cast<models::ViT*>(&parent)) {
    slot = name == "head" ? &v->head : nullptr;
  } else {
    // Containers call their children through the entries alone.
    return dynamic_cast<nn::Sequential*>(&parent) || dynamic_cast<nn::ModuleList*>(&parent) ||
           dynamic_cast<nn::ModuleDict*>(&parent);
  }
  if (slot && q) *slot = q;
  return slot != nullptr;
}

}  // namespace

QuantizeReport quantize_linears_nf4(nn::Module& model, const std::vector<std::string>& targets,
                                    const NF4Options& options) {
  KILN_CHECK(!targets.empty(), ValueError, "quantize_linears_nf4: expected at least one target, got none");
  std::unordered_map<const TensorImpl*, std::string> param_names;
  for (auto& [n, t] : model.named_parameters()) param_names.emplace(t.impl(), n);
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  struct Job {
    std::string path;
    nn::Module* parent;
    std::string name;
    nn::Linear* linear;
  };
  std::vector<Job> jobs;
  std::string problems;
  for (const auto& pattern : targets) {
    bool any = false;
    for (auto& [path, m] : modules) {
      if (path.empty() || !nn::lora::matches(pattern, path)) continue;
      auto* lin = dynamic_cast<nn::Linear*>(m);
      if (!lin || dynamic_cast<NF4Linear*>(m)) continue;
      any = true;
      bool dup = false;
      for (const auto& j : jobs) dup = dup || j.linear == lin;
      if (dup) continue;
      const size_t dot = path.rfind('.');
      const std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
      const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
      nn::Module* parent = by_path.at(parent_path);
      auto it = param_names.find(lin->weight.impl());
      if (it != param_names.end() && it->second != path + ".weight") {
        problems += concat("\n  '", path, "': its weight is tied to '", it->second,
                           "'; quantizing it would untie them (leave it out of the targets)");
        continue;
      }
      jobs.push_back({path, parent, name, lin});
    }
    if (!any) problems += concat("\n  target '", pattern, "' matches no float Linear module");
  }
  for (const auto& j : jobs)
    if (!swap_typed_member(*j.parent, j.name, nullptr))
      problems += concat("\n  '", j.path, "': its parent is a ", j.parent->type_name(),
                         ", whose forward may call it through a pointer kiln cannot redirect");
  KILN_CHECK(problems.empty(), ValueError, "quantize_linears_nf4:", problems);
  QuantizeReport report;
  for (const auto& j : jobs) {
    auto q = std::make_shared<NF4Linear>(*j.linear, options);
    report.float_bytes += j.linear->weight.nbytes();
    report.nf4_bytes += q->weight_nf4().nbytes();
    swap_typed_member(*j.parent, j.name, q);
    j.parent->register_module(j.name, q);
    report.paths.push_back(j.path);
  }
  return report;
}

}  // namespace kiln::quant
