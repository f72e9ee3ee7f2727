// Quantization-aware training: fake-quantize ops, FakeQuantize, the QAT layers,
// prepare_qat / convert_qat (include/kiln/quant/qat.h).
#include "kiln/quant/qat.h"

#include <cmath>
#include <sstream>
#include <unordered_map>

#include "base_rng.h"
#include "kiln/autograd/custom_function.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/nn/lora.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/linalg.h"
#include "kiln/quant/fuse.h"
#include "replace_layer.h"

namespace kiln::quant {
namespace {

void check_range(int64_t qmin, int64_t qmax, const char* op) {
  KILN_CHECK(qmin <= qmax, ValueError, op, ": expected qmin <= qmax, got qmin=", qmin, ", qmax=", qmax);
}

void check_scale(float scale, int64_t zero_point, int64_t qmin, int64_t qmax, const char* op) {
  KILN_CHECK(std::isfinite(scale) && scale > 0, ValueError, op, ": expected a finite scale > 0, got ", scale);
  KILN_CHECK(zero_point >= qmin && zero_point <= qmax, ValueError, op, ": expected a zero point in [", qmin, ", ", qmax,
             "], got ", zero_point);
}

// One element, as torch's CPU kernels (1.13) compute it: the reciprocal in
// float32, the product rounded half to even, the zero point added in float,
// clamped, back to float. `inside` is the straight-through mask.
inline float fake_quant_one(float x, float scale, float inv_scale, int64_t zp, int64_t qmin, int64_t qmax,
                            uint8_t& inside) {
  const float q = static_cast<float>(zp) + std::nearbyint(x * inv_scale);
  inside = q >= static_cast<float>(qmin) && q <= static_cast<float>(qmax);
  const int64_t qc = static_cast<int64_t>(std::fmin(std::fmax(q, static_cast<float>(qmin)), static_cast<float>(qmax)));
  return static_cast<float>(qc - zp) * scale;
}

// Forward computes the values and the mask in one pass; backward multiplies
// the gradient by the mask. Per tensor: one channel spanning everything.
struct FakeQuantFn : autograd::Function<FakeQuantFn> {
  struct Params {
    std::vector<float> scales;
    std::vector<int64_t> zero_points;
    int64_t axis = -1;
    int64_t qmin = 0, qmax = 0;
  };
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x, std::shared_ptr<const Params> p) {
    const Tensor xc = x.contiguous();
    Tensor y = empty(x.sizes(), TensorOptions(kFloat32));
    Tensor mask = empty(x.sizes(), TensorOptions(kUInt8));
    const int64_t channels = static_cast<int64_t>(p->scales.size());
    int64_t inner = 1;
    if (p->axis >= 0)
      for (int64_t d = p->axis + 1; d < x.dim(); ++d) inner *= x.size(d);
    else
      inner = x.numel();
    const int64_t n = x.numel();
    capture::host_write("fake_quantize", [in = xc.data_ptr<float>(), out = y.data_ptr<float>(),
                                          m = mask.data_ptr<uint8_t>(), channels, inner, n, p]() {
      std::vector<float> inv(p->scales.size());
      for (size_t c = 0; c < inv.size(); ++c) inv[c] = 1.0f / p->scales[c];
      for (int64_t start = 0; start < n; start += inner) {
        const int64_t c = p->axis >= 0 ? (start / inner) % channels : 0;
        const float s = p->scales[c], is = inv[c];
        const int64_t zp = p->zero_points[c];
        const int64_t end = std::min(n, start + inner);
        for (int64_t i = start; i < end; ++i) out[i] = fake_quant_one(in[i], s, is, zp, p->qmin, p->qmax, m[i]);
      }
    });
    ctx.saved_data["mask"] = mask;
    return y;
  }
  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    const Tensor& mask = ctx.saved_data.get<Tensor>("mask");
    const Tensor g = grads[0].to(kFloat32).contiguous();
    Tensor gx = empty(g.sizes(), TensorOptions(kFloat32));
    capture::host_write("fake_quantize_backward", [gi = g.data_ptr<float>(), m = mask.data_ptr<uint8_t>(),
                                                   go = gx.data_ptr<float>(), n = g.numel()]() {
      for (int64_t i = 0; i < n; ++i) go[i] = m[i] ? gi[i] : 0.0f;
    });
    return {gx, Tensor()};
  }
};

}  // namespace

std::pair<int64_t, int64_t> qrange(QDType dtype) {
  return dtype == QDType::QUInt8 ? std::pair<int64_t, int64_t>{0, 255} : std::pair<int64_t, int64_t>{-128, 127};
}

Tensor fake_quantize_per_tensor_affine(const Tensor& x, float scale, int64_t zero_point, int64_t qmin, int64_t qmax) {
  constexpr const char* op = "fake_quantize_per_tensor_affine";
  KILN_CHECK(x.defined() && x.dtype() == kFloat32, ValueError, op, ": expected a float32 tensor, got ",
             x.defined() ? std::string(dtype_name(x.dtype())) : std::string("an undefined tensor"));
  check_range(qmin, qmax, op);
  check_scale(scale, zero_point, qmin, qmax, op);
  auto p = std::make_shared<FakeQuantFn::Params>();
  p->scales = {scale};
  p->zero_points = {zero_point};
  p->qmin = qmin;
  p->qmax = qmax;
  return FakeQuantFn::apply(x, std::shared_ptr<const FakeQuantFn::Params>(p));
}

Tensor fake_quantize_per_channel_affine(const Tensor& x, const Tensor& scales, const Tensor& zero_points, int64_t axis,
                                        int64_t qmin, int64_t qmax) {
  constexpr const char* op = "fake_quantize_per_channel_affine";
  KILN_CHECK(x.defined() && x.dtype() == kFloat32, ValueError, op, ": expected a float32 tensor, got ",
             x.defined() ? std::string(dtype_name(x.dtype())) : std::string("an undefined tensor"));
  KILN_CHECK(axis >= 0 && axis < x.dim(), ValueError, op, ": expected an axis in [0, ", x.dim(), "), got ", axis);
  check_range(qmin, qmax, op);
  const int64_t c = x.size(axis);
  KILN_CHECK(scales.defined() && scales.dim() == 1 && scales.size(0) == c && zero_points.defined() &&
                 zero_points.dim() == 1 && zero_points.size(0) == c,
             ValueError, op, ": expected scales and zero points of shape [", c, "] (x.size(", axis, ")), got ",
             scales.defined() ? scales.shape_string() : "none", " and ",
             zero_points.defined() ? zero_points.shape_string() : "none");
  const Tensor s = scales.to(kFloat32).contiguous();
  const Tensor z = zero_points.to(kInt64).contiguous();
  auto p = std::make_shared<FakeQuantFn::Params>();
  p->scales.assign(s.data_ptr<float>(), s.data_ptr<float>() + c);
  p->zero_points.assign(z.data_ptr<int64_t>(), z.data_ptr<int64_t>() + c);
  for (int64_t i = 0; i < c; ++i) check_scale(p->scales[i], p->zero_points[i], qmin, qmax, op);
  p->axis = axis;
  p->qmin = qmin;
  p->qmax = qmax;
  return FakeQuantFn::apply(x, std::shared_ptr<const FakeQuantFn::Params>(p));
}

// ---- FakeQuantize ----

FakeQuantize::FakeQuantize(std::unique_ptr<Observer> observer, QDType dtype)
    : nn::Module("FakeQuantize"),
      observer_(std::move(observer)),
      dtype_(dtype),
      qmin_(qrange(dtype).first),
      qmax_(qrange(dtype).second),
      scale_(register_buffer("scale", tensor<float>({1.0f}, {1}))),
      zero_point_(register_buffer("zero_point", tensor<int64_t>({0}, {1}))) {
  KILN_CHECK(observer_ != nullptr, ValueError, "FakeQuantize: expected an observer, got none");
}

void FakeQuantize::set_qparams(const QParams& p) {
  KILN_CHECK(p.dtype == dtype_, ValueError, "FakeQuantize: expected parameters of dtype ",
             dtype_ == QDType::QUInt8 ? "quint8" : "qint8", ", got ", p.dtype == QDType::QUInt8 ? "quint8" : "qint8");
  KILN_CHECK(!p.scales.empty() && p.scales.size() == p.zero_points.size() && (p.axis >= 0 || p.scales.size() == 1),
             ValueError, "FakeQuantize: expected as many scales as zero points (one per tensor), got ", p.scales.size(),
             " and ", p.zero_points.size());
  const int64_t n = static_cast<int64_t>(p.scales.size());
  scale_ = tensor<float>(p.scales, {n});
  zero_point_ = tensor<int64_t>(p.zero_points, {n});
  axis_ = p.axis;
  has_qparams_ = true;
}

QParams FakeQuantize::qparams() const {
  KILN_CHECK(has_qparams_, ValueError,
             "FakeQuantize: no quantization parameters yet (the observer has seen nothing and none were set)");
  QParams p;
  p.dtype = dtype_;
  p.axis = axis_;
  const Tensor s = scale_.contiguous(), z = zero_point_.contiguous();
  p.scales.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
  p.zero_points.assign(z.data_ptr<int64_t>(), z.data_ptr<int64_t>() + z.numel());
  return p;
}

Tensor FakeQuantize::forward(const Tensor& x) {
  if (observer_enabled_) {
    // The observer reads x on the host and its parameters become constants of the fake quant below.
    // (Frozen, they are buffers: replacing them fails kiln::compile's guards, which recompile.)
    capture::graph_break_if_recording(
        "a QAT observer (FakeQuantize with its observer enabled) reads activations "
        "on the host");
    {
      const NoGradGuard no_grad;
      observer_->observe(x.detach());
    }
    set_qparams(observer_->qparams());
  }
  if (!fake_quant_enabled_) return x;
  KILN_CHECK(has_qparams_, ValueError,
             "FakeQuantize: fake quant is enabled but the observer is disabled and has seen nothing: no parameters");
  if (axis_ < 0) {
    return fake_quantize_per_tensor_affine(x, scale_.data_ptr<float>()[0], zero_point_.data_ptr<int64_t>()[0], qmin_,
                                           qmax_);
  }
  return fake_quantize_per_channel_affine(x, scale_, zero_point_, axis_, qmin_, qmax_);
}

std::string FakeQuantize::extra_repr() const {
  std::ostringstream s;
  s << "observer=" << observer_->name() << ", dtype=" << (dtype_ == QDType::QUInt8 ? "quint8" : "qint8")
    << ", quant_min=" << qmin_ << ", quant_max=" << qmax_ << ", observer_enabled=" << observer_enabled_
    << ", fake_quant_enabled=" << fake_quant_enabled_;
  if (has_qparams_) {
    if (axis_ < 0)
      s << ", scale=" << scale_.data_ptr<float>()[0] << ", zero_point=" << zero_point_.data_ptr<int64_t>()[0];
    else
      s << ", ch_axis=" << axis_;
  }
  return s.str();
}

// ---- QAT layers ----

namespace {

std::shared_ptr<FakeQuantize> weight_fake_quantizer() {
  // PTQ's weight parameters: per output channel, symmetric qint8, from the min and max.
  return std::make_shared<FakeQuantize>(std::make_unique<PerChannelMinMaxObserver>(0), QDType::QInt8);
}

}  // namespace

QatConv2d::QatConv2d(const nn::Conv2d& src, std::unique_ptr<Observer> input_observer)
    : nn::Conv2d(detail::conv_options_saving_rng(src)) {
  detail::restore_rng_before_base();
  register_parameter("weight", src.weight, src.weight.requires_grad());
  register_parameter("bias", src.bias, src.bias.defined() && src.bias.requires_grad());
  input_fake_quant =
      register_module("input_fake_quant", std::make_shared<FakeQuantize>(std::move(input_observer), QDType::QUInt8));
  weight_fake_quant = register_module("weight_fake_quant", weight_fake_quantizer());
  train(src.is_training());
}

Tensor QatConv2d::forward(const Tensor& x) {
  return conv2d((*input_fake_quant)(x), (*weight_fake_quant)(weight), bias, options.stride, options.padding,
                options.dilation, options.groups);
}

QatLinear::QatLinear(const nn::Linear& src, std::unique_ptr<Observer> input_observer)
    : nn::Linear(detail::linear_options_saving_rng(src)) {
  detail::restore_rng_before_base();
  register_parameter("weight", src.weight, src.weight.requires_grad());
  if (src.bias.defined()) register_parameter("bias", src.bias, src.bias.requires_grad());
  input_fake_quant =
      register_module("input_fake_quant", std::make_shared<FakeQuantize>(std::move(input_observer), QDType::QUInt8));
  weight_fake_quant = register_module("weight_fake_quant", weight_fake_quantizer());
  train(src.is_training());
  // Parents that fuse a Linear's product with the next step read `weight`
  // directly unless the Linear has a forward hook, which would skip the fake
  // quantizers: a hook that changes nothing makes them call forward().
  register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) { return Tensor(); });
}

Tensor QatLinear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == options.in_features, ShapeError, "QatLinear: expected input with last dim ",
             options.in_features, ", got shape ", x.shape_string());
  return kiln::linear((*input_fake_quant)(x), (*weight_fake_quant)(weight), bias);
}

// ---- prepare / convert ----

QatPrepared::~QatPrepared() {
  for (Layer& l : layers) l.hook.remove();
}

void QatPrepared::freeze_observers() {
  for (Layer& l : layers) {
    if (l.input_fq) l.input_fq->disable_observer();
    if (l.weight_fq) l.weight_fq->disable_observer();
  }
  frozen_ = true;
}

void QatPrepared::freeze_observers_after(int64_t k) {
  KILN_CHECK(k >= 0, ValueError, "QatPrepared::freeze_observers_after: expected a step count >= 0, got ", k);
  freeze_after_ = k;
  if (steps_ >= k) freeze_observers();
}

void QatPrepared::step() {
  ++steps_;
  if (freeze_after_ >= 0 && steps_ >= freeze_after_ && !frozen_) freeze_observers();
}

std::shared_ptr<QatPrepared> prepare_qat(nn::Module& model, const QatOptions& options) {
  make_observer(options.observer);  // an unknown name fails here, before anything changes
  KILN_CHECK(options.report_batches >= 0, ValueError, "quant::prepare_qat: expected report_batches >= 0, got ",
             options.report_batches);
  if (options.fuse_bn) fuse_conv_bn(model);
  auto p = std::make_shared<QatPrepared>();
  p->options = options;
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  std::vector<bool> pattern_used(options.keep_float.size(), false);
  struct Todo {
    std::string path;
    nn::Module* module;
    nn::Module* parent;
    std::string name;
    bool conv;
  };
  std::vector<Todo> todo;
  for (auto& [path, m] : modules) {
    auto* cm = dynamic_cast<nn::Conv2d*>(m);
    auto* lm = dynamic_cast<nn::Linear*>(m);
    const bool conv = cm && cm->weight.defined() && cm->weight.dtype() == kFloat32;
    const bool linear = lm && lm->weight.defined() && lm->weight.dtype() == kFloat32;
    if (!conv && !linear) continue;
    KILN_CHECK(!dynamic_cast<QatConv2d*>(m) && !dynamic_cast<QatLinear*>(m), ValueError, "quant::prepare_qat: '", path,
               "' is already prepared for quantization-aware training");
    bool keep = false;
    for (size_t i = 0; i < options.keep_float.size(); ++i)
      if (nn::lora::matches(options.keep_float[i], path)) keep = pattern_used[i] = true;
    if (keep) {
      p->kept_float.push_back(path);
      continue;
    }
    const size_t dot = path.rfind('.');
    const std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    auto pit = by_path.find(parent_path);
    if (path.empty() || pit == by_path.end() ||
        !detail::replace_layer(*pit->second, name, std::shared_ptr<nn::Module>(std::shared_ptr<nn::Module>(), m),
                               true)) {
      LayerReport r;
      r.path = path;
      r.kind = conv ? "Conv2d" : "Linear";
      r.note = "kept in float: its parent " + std::string(pit == by_path.end() ? "?" : pit->second->type_name()) +
               " calls it through a member quant does not know";
      p->not_prepared.push_back(r);
      continue;
    }
    todo.push_back({path, m, pit->second, name, conv});
  }
  for (size_t i = 0; i < options.keep_float.size(); ++i)
    KILN_CHECK(pattern_used[i], ValueError, "quant::prepare_qat: keep_float pattern '", options.keep_float[i],
               "' matches no Conv2d or Linear of the model");
  for (const Todo& t : todo) {
    QatPrepared::Layer l;
    l.path = t.path;
    l.conv = t.conv;
    std::shared_ptr<nn::Module> q;
    if (t.conv) {
      auto c = std::make_shared<QatConv2d>(*static_cast<nn::Conv2d*>(t.module),
                                           make_observer(options.observer, {QDType::QUInt8, false}));
      l.input_fq = c->input_fake_quant.get();
      l.weight_fq = c->weight_fake_quant.get();
      q = c;
    } else {
      auto c = std::make_shared<QatLinear>(*static_cast<nn::Linear*>(t.module),
                                           make_observer(options.observer, {QDType::QUInt8, false}));
      l.input_fq = c->input_fake_quant.get();
      l.weight_fq = c->weight_fake_quant.get();
      q = c;
    }
    l.module = q.get();
    detail::replace_layer(*t.parent, t.name, q, false);
    p->layers.push_back(std::move(l));
  }
  // Hooks capture their layer's address: the vector is complete and never grows again.
  for (QatPrepared::Layer& l : p->layers) {
    if (options.report_batches == 0) break;
    QatPrepared::Layer* lp = &l;
    const int64_t keep_n = options.report_batches;
    l.hook = l.module->register_forward_pre_hook([lp, keep_n](nn::Module&, const Tensor& in) {
      if (static_cast<int64_t>(lp->samples.size()) < keep_n) {
        const NoGradGuard no_grad;
        lp->samples.push_back(in.detach().contiguous().clone());
      }
      return Tensor();
    });
  }
  return p;
}

ConvertReport convert_qat(nn::Module& model, QatPrepared& prepared) {
  KILN_CHECK(!prepared.converted, ValueError, "quant::convert_qat: this QAT model was already converted");
  prepared.freeze_observers();
  Prepared ptq;
  ptq.kept_float = prepared.kept_float;
  for (QatPrepared::Layer& l : prepared.layers) {
    Prepared::Layer pl;
    pl.path = l.path;
    pl.module = l.module;
    pl.conv = l.conv;
    l.hook.remove();
    pl.samples = std::move(l.samples);
    if (l.input_fq->has_qparams() && l.weight_fq->has_qparams()) {
      pl.input_qparams = l.input_fq->qparams();
      pl.weight_qparams = l.weight_fq->qparams();
      pl.calls = 1;
    }
    ptq.layers.push_back(std::move(pl));
  }
  ConvertReport r = convert(model, ptq);
  prepared.converted = true;
  // A layer convert left float is still a QatConv2d / QatLinear: it becomes a
  // plain float layer again (same tensors), so the model's state_dict is the
  // float model's plus the int8 layers' and load_quantized reads it back.
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  for (QatPrepared::Layer& l : prepared.layers)
    for (LayerReport& lr : r.layers) {
      if (lr.path != l.path || lr.quantized) continue;
      if (!l.input_fq->has_qparams() || !l.weight_fq->has_qparams())
        lr.note = "kept in float: its fake quantizers never observed anything (not called before the freeze)";
      const size_t dot = l.path.rfind('.');
      nn::Module& parent = *by_path.at(dot == std::string::npos ? "" : l.path.substr(0, dot));
      const std::string name = dot == std::string::npos ? l.path : l.path.substr(dot + 1);
      std::shared_ptr<nn::Module> plain;
      if (l.conv) {
        const auto& src = *static_cast<QatConv2d*>(l.module);
        auto c = std::make_shared<nn::Conv2d>(detail::conv_options_saving_rng(src));
        detail::restore_rng_before_base();
        c->register_parameter("weight", src.weight, src.weight.requires_grad());
        c->register_parameter("bias", src.bias, src.bias.defined() && src.bias.requires_grad());
        c->train(src.is_training());
        plain = c;
      } else {
        const auto& src = *static_cast<QatLinear*>(l.module);
        auto c = std::make_shared<nn::Linear>(detail::linear_options_saving_rng(src));
        detail::restore_rng_before_base();
        c->register_parameter("weight", src.weight, src.weight.requires_grad());
        if (src.bias.defined()) c->register_parameter("bias", src.bias, src.bias.requires_grad());
        c->train(src.is_training());
        plain = c;
      }
      detail::replace_layer(parent, name, plain, false);
    }
  // The QAT layers are gone from the model (and freed unless held elsewhere).
  for (QatPrepared::Layer& l : prepared.layers) {
    l.module = nullptr;
    l.input_fq = l.weight_fq = nullptr;
  }
  r.layers.insert(r.layers.end(), prepared.not_prepared.begin(), prepared.not_prepared.end());
  return r;
}

}  // namespace kiln::quant
