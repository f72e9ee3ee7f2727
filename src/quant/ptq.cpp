// Post-training int8 quantization: prepare / convert and the quantized layers
// (include/kiln/quant/ptq.h).
#include "kiln/quant/ptq.h"

#include <cmath>
#include <iomanip>
#include <map>
#include <sstream>
#include <unordered_map>

#include "base_rng.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/lora.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/fuse.h"
#include "replace_layer.h"

namespace kiln::quant {
namespace {

std::array<int64_t, 2> pair_of(const std::vector<int64_t>& v, const char* what) {
  KILN_CHECK(v.size() == 1 || v.size() == 2, ValueError, "QuantizedConv2d: expected one or two values for ", what,
             ", got ", v.size());
  return {v[0], v.size() == 2 ? v[1] : v[0]};
}

Tensor frozen_copy(const Tensor& t) {
  if (!t.defined()) return {};
  const NoGradGuard no_grad;
  return t.detach().to(kFloat32).contiguous().clone();
}

void keep_buffers(nn::Module& m, const QTensor& w, float input_scale, int64_t input_zero_point) {
  Tensor& bytes = m.register_buffer("weight_int8", w.data);
  bytes.storage()->set_category(MemoryCategory::Parameter);
  m.register_buffer("weight_scales", w.scales);
  m.register_buffer("input_qparams", tensor<float>({input_scale, static_cast<float>(input_zero_point)}, {2}));
}

std::string qparams_repr(float scale, int64_t zp) {
  std::ostringstream s;
  s << ", input_scale=" << scale << ", input_zero_point=" << zp << ", int8";
  return s.str();
}

}  // namespace

QuantizedConv2d::QuantizedConv2d(const nn::Conv2d& src, const QTensor& weight, float input_scale,
                                 int64_t input_zero_point)
    : QuantizedConv2d(src, weight, src.bias, input_scale, input_zero_point) {}

QuantizedConv2d::QuantizedConv2d(const nn::Conv2d& src, const QTensor& weight, const Tensor& bias, float input_scale,
                                 int64_t input_zero_point)
    : nn::Conv2d(detail::conv_options_saving_rng(src)) {
  detail::restore_rng_before_base();
  KILN_CHECK(weight.qdtype == QDType::QInt8 && weight.per_channel() && weight.axis == 0 &&
                 weight.data.sizes() == src.weight.sizes(),
             ValueError, "QuantizedConv2d: expected a qint8 weight quantized per output channel (axis 0) of shape ",
             src.weight.shape_string(), ", got ", weight.describe());
  const Tensor bias_f = frozen_copy(bias);
  register_parameter("weight", Tensor());
  register_parameter("bias", bias_f, /*requires_grad=*/false);
  keep_buffers(*this, weight, input_scale, input_zero_point);
  ops::Int8Conv2dOptions o;
  o.stride = pair_of(options.stride, "stride");
  o.padding = pair_of(options.padding, "padding");
  o.dilation = pair_of(options.dilation, "dilation");
  o.groups = options.groups;
  o.q.input_scale = input_scale;
  o.q.input_zero_point = input_zero_point;
  kernel_ = std::make_shared<ops::Int8Conv2d>(weight.data, weight.scales, bias_f, o);
}

Tensor QuantizedConv2d::forward(const Tensor& x) {
  const NoGradGuard no_grad;
  return (*kernel_)(x.detach());
}

std::string QuantizedConv2d::extra_repr() const {
  const auto& q = kernel_->options().q;
  return nn::Conv2d::extra_repr() + qparams_repr(q.input_scale, q.input_zero_point);
}

QuantizedLinear::QuantizedLinear(const nn::Linear& src, const QTensor& weight, float input_scale,
                                 int64_t input_zero_point)
    : QuantizedLinear(src, weight, src.bias, input_scale, input_zero_point) {}

QuantizedLinear::QuantizedLinear(const nn::Linear& src, const QTensor& weight, const Tensor& bias, float input_scale,
                                 int64_t input_zero_point)
    : nn::Linear(detail::linear_options_saving_rng(src)) {
  detail::restore_rng_before_base();
  KILN_CHECK(weight.qdtype == QDType::QInt8 && weight.per_channel() && weight.axis == 0 &&
                 weight.data.sizes() == src.weight.sizes(),
             ValueError, "QuantizedLinear: expected a qint8 weight quantized per output channel (axis 0) of shape ",
             src.weight.shape_string(), ", got ", weight.describe());
  const Tensor bias_f = frozen_copy(bias);
  register_parameter("weight", Tensor());
  if (bias_f.defined()) register_parameter("bias", bias_f, /*requires_grad=*/false);
  keep_buffers(*this, weight, input_scale, input_zero_point);
  kernel_ = std::make_shared<ops::Int8Linear>(weight.data, weight.scales, bias_f,
                                              ops::Int8Quantization{input_scale, input_zero_point});
  // Parents that fuse a Linear's product with the next step read `weight`
  // directly unless the Linear has a forward hook; this one has no float
  // weight, so a hook that changes nothing makes them call forward().
  register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) { return Tensor(); }, HookReplay::TensorOpsOnly);
}

Tensor QuantizedLinear::forward(const Tensor& x) {
  const NoGradGuard no_grad;
  return (*kernel_)(x.detach());
}

std::string QuantizedLinear::extra_repr() const {
  const auto& q = kernel_->quantization();
  return nn::Linear::extra_repr() + qparams_repr(q.input_scale, q.input_zero_point);
}

// ---- prepare / convert ----

Prepared::~Prepared() {
  for (Layer& l : layers) l.hook.remove();
}

std::shared_ptr<Prepared> prepare(nn::Module& model, const PrepareOptions& options) {
  make_observer(options.observer);  // an unknown name fails here, before any hook
  KILN_CHECK(options.report_batches >= 0, ValueError, "quant::prepare: expected report_batches >= 0, got ",
             options.report_batches);
  if (options.fuse_bn) fuse_conv_bn(model);
  auto p = std::make_shared<Prepared>();
  p->options = options;
  std::vector<bool> pattern_used(options.keep_float.size(), false);
  for (auto& [path, m] : model.named_modules()) {
    // Layers with a float weight: not already quantized (int8 here, NF4), not a LoRA wrapper's frozen base.
    auto* cm = dynamic_cast<nn::Conv2d*>(m);
    auto* lm = dynamic_cast<nn::Linear*>(m);
    const bool conv = cm && cm->weight.defined() && cm->weight.dtype() == kFloat32;
    const bool linear = lm && lm->weight.defined() && lm->weight.dtype() == kFloat32;
    if (!conv && !linear) continue;
    bool keep = false;
    for (size_t i = 0; i < options.keep_float.size(); ++i)
      if (nn::lora::matches(options.keep_float[i], path)) {
        keep = true;
        pattern_used[i] = true;
      }
    if (keep) {
      p->kept_float.push_back(path);
      continue;
    }
    Prepared::Layer l;
    l.path = path;
    l.module = m;
    l.conv = conv;
    l.observer = make_observer(options.observer, {QDType::QUInt8, false});
    p->layers.push_back(std::move(l));
  }
  for (size_t i = 0; i < options.keep_float.size(); ++i)
    KILN_CHECK(pattern_used[i], ValueError, "quant::prepare: keep_float pattern '", options.keep_float[i],
               "' matches no Conv2d or Linear of the model");
  // Hooks capture their layer's address: the vector is complete and never grows again.
  for (Prepared::Layer& l : p->layers) {
    Prepared::Layer* lp = &l;
    const int64_t keep_n = options.report_batches;
    l.hook = l.module->register_forward_hook([lp, keep_n](nn::Module&, const Tensor& in, const Tensor&) {
      const NoGradGuard no_grad;
      const Tensor x = in.detach();
      lp->observer->observe(x);
      if (static_cast<int64_t>(lp->samples.size()) < keep_n) lp->samples.push_back(x.contiguous().clone());
      ++lp->calls;
      return Tensor();
    });
  }
  return p;
}

namespace {

// Points the parent's typed member at the quantized module where the parent's
// forward calls its child through one. False for a parent kiln does not know.
template <typename Base>
bool swap_member(nn::Module& parent, const std::string& name, const std::shared_ptr<Base>& q, bool dry_run) {
  std::shared_ptr<Base>* slot = nullptr;
  if constexpr (std::is_same_v<Base, nn::Conv2d>) {
    if (auto* c = dynamic_cast<models::CNN*>(&parent))
      slot = name == "conv1" ? &c->conv1 : name == "conv2" ? &c->conv2 : nullptr;
    else if (auto* b = dynamic_cast<models::BasicBlock*>(&parent))
      slot = name == "conv1" ? &b->conv1 : name == "conv2" ? &b->conv2 : nullptr;
    else if (auto* r = dynamic_cast<models::ResNet*>(&parent))
      slot = name == "conv1" ? &r->conv1 : nullptr;
  } else {
    if (auto* c = dynamic_cast<models::CNN*>(&parent))
      slot = name == "fc1" ? &c->fc1 : name == "fc2" ? &c->fc2 : nullptr;
    else if (auto* r = dynamic_cast<models::ResNet*>(&parent))
      slot = name == "fc" ? &r->fc : nullptr;
  }
  if (!slot)
    return dynamic_cast<nn::Sequential*>(&parent) || dynamic_cast<nn::ModuleList*>(&parent) ||
           dynamic_cast<nn::ModuleDict*>(&parent);
  if (!dry_run) *slot = q;
  return true;
}

}  // namespace

namespace detail {

bool replace_layer(nn::Module& parent, const std::string& name, const std::shared_ptr<nn::Module>& layer,
                   bool dry_run) {
  bool ok = false;
  if (auto c = std::dynamic_pointer_cast<nn::Conv2d>(layer))
    ok = swap_member<nn::Conv2d>(parent, name, c, dry_run);
  else if (auto l = std::dynamic_pointer_cast<nn::Linear>(layer))
    ok = swap_member<nn::Linear>(parent, name, l, dry_run);
  if (ok && !dry_run) parent.register_module(name, layer);
  return ok;
}

}  // namespace detail

namespace {

double l2(const Tensor& t) {
  const Tensor c = t.to(kFloat32).contiguous();
  const float* p = c.data_ptr<float>();
  double s = 0;
  for (int64_t i = 0; i < c.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return std::sqrt(s);
}

}  // namespace

ConvertReport convert(nn::Module& model, Prepared& prepared) {
  KILN_CHECK(!prepared.converted, ValueError, "quant::convert: these observers were already converted");
  prepared.converted = true;
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  ConvertReport report;
  for (const std::string& path : prepared.kept_float) {
    LayerReport r;
    r.path = path;
    r.kind = dynamic_cast<nn::Conv2d*>(by_path.at(path)) ? "Conv2d" : "Linear";
    r.note = "kept in float (keep_float)";
    report.layers.push_back(r);
  }
  const NoGradGuard no_grad;
  for (Prepared::Layer& l : prepared.layers) {
    l.hook.remove();
    LayerReport r;
    r.path = l.path;
    r.kind = l.conv ? "Conv2d" : "Linear";
    const size_t dot = l.path.rfind('.');
    const std::string parent_path = dot == std::string::npos ? "" : l.path.substr(0, dot);
    const std::string name = dot == std::string::npos ? l.path : l.path.substr(dot + 1);
    auto pit = by_path.find(parent_path);
    if (!l.input_qparams && (l.calls == 0 || !l.observer || !l.observer->observed())) {
      r.note = "kept in float: never called during calibration";
    } else if (pit == by_path.end() || !(l.conv ? swap_member<nn::Conv2d>(*pit->second, name, nullptr, true)
                                                : swap_member<nn::Linear>(*pit->second, name, nullptr, true))) {
      r.note = "kept in float: its parent " + std::string(pit == by_path.end() ? "?" : pit->second->type_name()) +
               " calls it through a member quant does not know";
    }
    if (!r.note.empty()) {
      report.layers.push_back(r);
      continue;
    }
    nn::Module& parent = *pit->second;
    const QParams aq = l.input_qparams ? *l.input_qparams : l.observer->qparams();
    if (l.input_qparams) {
      // The range the fixed parameters represent.
      r.range_min = static_cast<float>(0 - aq.zero_points[0]) * aq.scales[0];
      r.range_max = static_cast<float>(255 - aq.zero_points[0]) * aq.scales[0];
    } else {
      std::tie(r.range_min, r.range_max) = l.observer->range();
    }
    r.input_scale = aq.scales[0];
    r.input_zero_point = aq.zero_points[0];
    const Tensor& w = l.conv ? static_cast<nn::Conv2d*>(l.module)->weight : static_cast<nn::Linear*>(l.module)->weight;
    QParams wp;
    if (l.weight_qparams) {
      wp = *l.weight_qparams;
    } else {
      PerChannelMinMaxObserver wobs;
      wobs.observe(w);
      wp = wobs.qparams();
    }
    const QTensor wq = quantize(w, wp);
    report.float_weight_bytes += w.numel() * 4;
    report.int8_weight_bytes += wq.data.numel() + wq.scales.numel() * 4;
    std::shared_ptr<nn::Module> q;
    if (l.conv) {
      auto qc =
          std::make_shared<QuantizedConv2d>(*static_cast<nn::Conv2d*>(l.module), wq, r.input_scale, r.input_zero_point);
      if (!l.samples.empty()) r.implementation = qc->kernel().implementation(l.samples[0]);
      q = qc;
    } else {
      auto ql =
          std::make_shared<QuantizedLinear>(*static_cast<nn::Linear*>(l.module), wq, r.input_scale, r.input_zero_point);
      if (!l.samples.empty()) r.implementation = ql->kernel().implementation(l.samples[0]);
      q = ql;
    }
    double err = 0, ref = 0;
    for (const Tensor& x : l.samples) {
      const Tensor yf = l.module->forward(x);
      const Tensor yq = q->forward(x);
      const double e = l2(yq.sub(yf)), f = l2(yf);
      err += e * e;
      ref += f * f;
    }
    if (ref > 0) {
      r.rel_error = std::sqrt(err / ref);
      r.sqnr_db = r.rel_error > 0 ? -20 * std::log10(r.rel_error) : INFINITY;
    }
    l.samples.clear();
    if (l.conv)
      swap_member<nn::Conv2d>(parent, name, std::static_pointer_cast<nn::Conv2d>(q), false);
    else
      swap_member<nn::Linear>(parent, name, std::static_pointer_cast<nn::Linear>(q), false);
    parent.register_module(name, q);
    r.quantized = true;
    report.layers.push_back(r);
  }
  // Model order: named_modules' order.
  std::unordered_map<std::string, size_t> order;
  for (size_t i = 0; i < modules.size(); ++i) order.emplace(modules[i].first, i);
  std::stable_sort(report.layers.begin(), report.layers.end(),
                   [&](const LayerReport& a, const LayerReport& b) { return order[a.path] < order[b.path]; });
  return report;
}

std::string ConvertReport::table() const {
  std::ostringstream s;
  s << std::left << std::setw(24) << "layer" << std::setw(8) << "kind" << std::setw(22) << "activation range"
    << std::setw(12) << "scale" << std::setw(5) << "zp" << std::setw(11) << "rel.error" << std::setw(9) << "SQNR dB"
    << "kernel / note\n";
  for (const LayerReport& r : layers) {
    s << std::left << std::setw(24) << r.path << std::setw(8) << r.kind;
    if (!r.quantized) {
      s << r.note << "\n";
      continue;
    }
    std::ostringstream range;
    range << std::setprecision(4) << "[" << r.range_min << ", " << r.range_max << "]";
    std::ostringstream scale, err, sqnr;
    scale << std::setprecision(4) << r.input_scale;
    err << std::setprecision(3) << r.rel_error;
    sqnr << std::fixed << std::setprecision(1) << r.sqnr_db;
    s << std::setw(22) << range.str() << std::setw(12) << scale.str() << std::setw(5) << r.input_zero_point
      << std::setw(11) << err.str() << std::setw(9) << sqnr.str() << r.implementation << "\n";
  }
  s << "weights: " << float_weight_bytes << " bytes float32 -> " << int8_weight_bytes << " bytes int8 (+ scales)\n";
  return s.str();
}

// ---- quantized checkpoints ----

namespace {

constexpr const char* kQuantizedKey = "kiln.quantized";
constexpr const char* kQuantizedValue = "int8-ptq";

std::string describe_tensor(const Tensor& t) { return std::string(dtype_name(t.dtype())) + " " + t.shape_string(); }

// The file's tensor `name`, which must have `dtype` and `shape`.
const Tensor& expect_tensor(const io::SafetensorsFile& f, const std::string& file, const std::string& name, DType dtype,
                            IntArrayRef shape) {
  KILN_CHECK(f.contains(name), ValueError, "quant::load_quantized: ", file, ": expected tensor '", name, "' (",
             dtype_name(dtype), " ", shape_str(shape), "), got none");
  const Tensor& t = f.at(name);
  KILN_CHECK(t.dtype() == dtype && t.sizes() == shape, ValueError, "quant::load_quantized: ", file, ": tensor '", name,
             "': expected ", dtype_name(dtype), " ", shape_str(shape), ", got ", describe_tensor(t));
  return t;
}

struct PendingLayer {
  std::string path, parent_path, name;
  bool conv = false;
  std::shared_ptr<nn::Module> quantized;
};

}  // namespace

void save_quantized(const nn::Module& model, const std::string& path, io::Metadata metadata) {
  metadata[kQuantizedKey] = kQuantizedValue;
  io::save_safetensors(path, model.state_dict(), metadata);
}

std::vector<std::string> load_quantized(nn::Module& model, const std::string& path) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  const auto mark = f.metadata.find(kQuantizedKey);
  if (mark == f.metadata.end() || mark->second != kQuantizedValue)
    throw FormatError("quant::load_quantized: " + path + ": expected metadata \"" + kQuantizedKey + "\" = \"" +
                      kQuantizedValue + "\", got " + (mark == f.metadata.end() ? "none" : "\"" + mark->second + "\""));
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  std::unordered_map<std::string, size_t> order;
  for (size_t i = 0; i < modules.size(); ++i) order.emplace(modules[i].first, i);

  // 1. Every "<path>.weight_int8" names a float Conv2d / Linear whose parent quant can swap.
  const std::string suffix = ".weight_int8";
  std::vector<PendingLayer> pending;
  for (const auto& [key, t] : f.tensors) {
    if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) {
      KILN_CHECK(key != "weight_int8", ValueError, "quant::load_quantized: ", path,
                 ": tensor 'weight_int8': expected it under a layer's path, got it at the model's root");
      continue;
    }
    PendingLayer l;
    l.path = key.substr(0, key.size() - suffix.size());
    const auto it = by_path.find(l.path);
    KILN_CHECK(it != by_path.end(), ValueError, "quant::load_quantized: ", path, ": tensor '", key,
               "': expected a Conv2d or Linear at '", l.path, "' in the model (", model.type_name(),
               "), got no module there");
    auto* cm = dynamic_cast<nn::Conv2d*>(it->second);
    auto* lm = dynamic_cast<nn::Linear*>(it->second);
    const bool conv = cm && cm->weight.defined() && cm->weight.dtype() == kFloat32;
    const bool linear = lm && lm->weight.defined() && lm->weight.dtype() == kFloat32;
    KILN_CHECK(conv || linear, ValueError, "quant::load_quantized: ", path, ": tensor '", key, "': expected '", l.path,
               "' to be a float Conv2d or Linear, got ", it->second->type_name());
    l.conv = conv;
    const size_t dot = l.path.rfind('.');
    l.parent_path = dot == std::string::npos ? "" : l.path.substr(0, dot);
    l.name = dot == std::string::npos ? l.path : l.path.substr(dot + 1);
    nn::Module& parent = *by_path.at(l.parent_path);
    KILN_CHECK(conv ? swap_member<nn::Conv2d>(parent, l.name, nullptr, true)
                    : swap_member<nn::Linear>(parent, l.name, nullptr, true),
               ValueError, "quant::load_quantized: ", path, ": tensor '", key, "': its layer's parent ",
               parent.type_name(), " calls it through a member quant does not know");
    pending.push_back(std::move(l));
  }
  std::sort(pending.begin(), pending.end(),
            [&](const PendingLayer& a, const PendingLayer& b) { return order[a.path] < order[b.path]; });

  // 2. Each quantized layer's tensors, checked and built into a module the model does not hold yet.
  for (PendingLayer& l : pending) {
    nn::Module* m = by_path.at(l.path);
    const Tensor& w = l.conv ? static_cast<nn::Conv2d*>(m)->weight : static_cast<nn::Linear*>(m)->weight;
    const Tensor& b = l.conv ? static_cast<nn::Conv2d*>(m)->bias : static_cast<nn::Linear*>(m)->bias;
    const int64_t out = w.size(0);
    KILN_CHECK(!f.contains(l.path + ".weight"), ValueError, "quant::load_quantized: ", path, ": tensor '", l.path,
               ".weight': expected none beside '", l.path, ".weight_int8' (a layer is int8 or float), got ",
               describe_tensor(f.at(l.path + ".weight")));
    const Tensor& bytes = expect_tensor(f, path, l.path + ".weight_int8", kUInt8, w.sizes());
    const Tensor& scales = expect_tensor(f, path, l.path + ".weight_scales", kFloat32, {out});
    const Tensor sc = scales.contiguous();
    for (int64_t i = 0; i < out; ++i) {
      const float s = sc.data_ptr<float>()[i];
      KILN_CHECK(std::isfinite(s) && s > 0, ValueError, "quant::load_quantized: ", path, ": tensor '", l.path,
                 ".weight_scales': expected finite scales > 0, got ", s, " at channel ", i);
    }
    const Tensor qp = expect_tensor(f, path, l.path + ".input_qparams", kFloat32, {2}).contiguous();
    const float in_scale = qp.data_ptr<float>()[0], in_zp = qp.data_ptr<float>()[1];
    KILN_CHECK(std::isfinite(in_scale) && in_scale > 0, ValueError, "quant::load_quantized: ", path, ": tensor '",
               l.path, ".input_qparams': expected an input scale (element 0) finite and > 0, got ", in_scale);
    KILN_CHECK(std::isfinite(in_zp) && in_zp == std::nearbyint(in_zp) && in_zp >= qmin(QDType::QUInt8) &&
                   in_zp <= qmax(QDType::QUInt8),
               ValueError, "quant::load_quantized: ", path, ": tensor '", l.path,
               ".input_qparams': expected an input zero point (element 1) that is an integer in [0, 255], got ", in_zp);
    Tensor bias;
    if (b.defined())
      bias = expect_tensor(f, path, l.path + ".bias", kFloat32, {out});
    else
      KILN_CHECK(!f.contains(l.path + ".bias"), ValueError, "quant::load_quantized: ", path, ": tensor '", l.path,
                 ".bias': expected none (the layer has no bias), got ", describe_tensor(f.at(l.path + ".bias")));
    QTensor wq;
    wq.data = bytes.contiguous().clone();
    wq.qdtype = QDType::QInt8;
    wq.scales = sc.clone();
    wq.zero_points = zeros({out}, TensorOptions(kInt64));
    wq.axis = 0;
    const int64_t zp = static_cast<int64_t>(in_zp);
    if (l.conv)
      l.quantized = std::make_shared<QuantizedConv2d>(*static_cast<nn::Conv2d*>(m), wq, bias, in_scale, zp);
    else
      l.quantized = std::make_shared<QuantizedLinear>(*static_cast<nn::Linear*>(m), wq, bias, in_scale, zp);
  }

  // 3. The rest of the file against the model as it will be: the same names, dtypes and shapes.
  std::unordered_map<std::string, const PendingLayer*> quantized_at;
  for (const PendingLayer& l : pending) quantized_at.emplace(l.path, &l);
  std::map<std::string, Tensor> expected;
  for (auto& [name, t] : model.state_dict()) {
    const size_t dot = name.rfind('.');
    if (dot != std::string::npos && quantized_at.count(name.substr(0, dot))) continue;
    expected.emplace(name, t);
  }
  for (const PendingLayer& l : pending)
    for (auto& [name, t] : l.quantized->state_dict()) expected.emplace(l.path + "." + name, t);
  for (const auto& [name, t] : f.tensors) {
    const auto it = expected.find(name);
    KILN_CHECK(it != expected.end(), ValueError, "quant::load_quantized: ", path, ": tensor '", name,
               "': expected only the model's (", model.type_name(), ") tensors, got one it does not have");
    KILN_CHECK(t.dtype() == it->second.dtype() && t.sizes() == it->second.sizes(), ValueError,
               "quant::load_quantized: ", path, ": tensor '", name, "': expected ", describe_tensor(it->second),
               ", got ", describe_tensor(t));
  }
  for (const auto& [name, t] : expected)
    KILN_CHECK(f.contains(name), ValueError, "quant::load_quantized: ", path, ": expected tensor '", name, "' (",
               describe_tensor(t), "), got none");

  // 4. Nothing can fail from here on.
  std::vector<std::string> paths;
  for (const PendingLayer& l : pending) {
    nn::Module& parent = *by_path.at(l.parent_path);
    if (l.conv)
      swap_member<nn::Conv2d>(parent, l.name, std::static_pointer_cast<nn::Conv2d>(l.quantized), false);
    else
      swap_member<nn::Linear>(parent, l.name, std::static_pointer_cast<nn::Linear>(l.quantized), false);
    parent.register_module(l.name, l.quantized);
    paths.push_back(l.path);
  }
  model.load_state_dict(f.tensors, /*strict=*/true);
  return paths;
}

}  // namespace kiln::quant
