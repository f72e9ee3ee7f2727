// Conv2d + BatchNorm2d folding (include/kiln/quant/fuse.h).
#include "kiln/quant/fuse.h"

#include <cmath>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"

namespace kiln::quant {

FoldedBatchNorm2d::FoldedBatchNorm2d(int64_t num_features)
    : nn::BatchNorm2d({.num_features = num_features, .affine = false, .track_running_stats = false}) {
  // BatchNorm's fused ReLU / add-ReLU paths run (*this)(x) when a forward hook
  // is present: one that changes nothing routes them through forward().
  register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) { return Tensor(); }, HookReplay::TensorOpsOnly);
}

Tensor FoldedBatchNorm2d::forward(const Tensor& x) { return x; }

std::string FoldedBatchNorm2d::extra_repr() const {
  return std::to_string(options.num_features) + ", folded into the convolution";
}

namespace {

struct Pair {
  std::string bn_path;
  std::shared_ptr<nn::Conv2d>* conv;
  std::shared_ptr<nn::BatchNorm2d>* bn;  // null: bn_module in a Sequential
  nn::Module* conv_parent;
  std::string conv_name, bn_name;
  std::shared_ptr<nn::Conv2d> conv_module;
  std::shared_ptr<nn::BatchNorm2d> bn_module;
};

std::shared_ptr<nn::Conv2d> folded(const nn::Conv2d& c, const nn::BatchNorm& bn) {
  const NoGradGuard no_grad;
  const int64_t out = c.weight.size(0);
  const Tensor w = c.weight.detach().to(kFloat64).contiguous();
  const Tensor mean = bn.running_mean.detach().to(kFloat64).contiguous();
  const Tensor var = bn.running_var.detach().to(kFloat64).contiguous();
  const Tensor gamma = bn.weight.defined() ? bn.weight.detach().to(kFloat64).contiguous() : Tensor();
  const Tensor beta = bn.bias.defined() ? bn.bias.detach().to(kFloat64).contiguous() : Tensor();
  const Tensor b = c.bias.defined() ? c.bias.detach().to(kFloat64).contiguous() : Tensor();
  const int64_t per = w.numel() / out;
  std::vector<float> wf(w.numel()), bf(out);
  for (int64_t o = 0; o < out; ++o) {
    const double s =
        (gamma.defined() ? gamma.data_ptr<double>()[o] : 1.0) / std::sqrt(var.data_ptr<double>()[o] + bn.options.eps);
    for (int64_t i = 0; i < per; ++i) wf[o * per + i] = static_cast<float>(w.data_ptr<double>()[o * per + i] * s);
    bf[o] = static_cast<float>(((b.defined() ? b.data_ptr<double>()[o] : 0.0) - mean.data_ptr<double>()[o]) * s +
                               (beta.defined() ? beta.data_ptr<double>()[o] : 0.0));
  }
  nn::Conv2dOptions o = c.options;
  o.bias = true;
  const GeneratorState rng = default_generator().get_state();  // the fresh conv's draw is thrown away
  auto f = std::make_shared<nn::Conv2d>(o);
  default_generator().set_state(rng);
  f->load_state_dict({{"weight", tensor<float>(wf, c.weight.sizes())}, {"bias", tensor<float>(bf, {out})}});
  if (!c.is_training()) f->eval();
  return f;
}

}  // namespace

std::vector<std::string> fuse_conv_bn(nn::Module& model) {
  std::vector<Pair> pairs;
  for (auto& [path, m] : model.named_modules()) {
    const std::string pre = path.empty() ? "" : path + ".";
    if (auto* r = dynamic_cast<models::ResNet*>(m)) {
      pairs.push_back({pre + "bn1", &r->conv1, &r->bn1, r, "conv1", "bn1", r->conv1, r->bn1});
    } else if (auto* b = dynamic_cast<models::BasicBlock*>(m)) {
      pairs.push_back({pre + "bn1", &b->conv1, &b->bn1, b, "conv1", "bn1", b->conv1, b->bn1});
      pairs.push_back({pre + "bn2", &b->conv2, &b->bn2, b, "conv2", "bn2", b->conv2, b->bn2});
      if (b->downsample) {
        const auto ch = b->downsample->children();
        auto c = ch.size() == 2 ? std::dynamic_pointer_cast<nn::Conv2d>(ch[0]) : nullptr;
        auto n = ch.size() == 2 ? std::dynamic_pointer_cast<nn::BatchNorm2d>(ch[1]) : nullptr;
        if (c && n) pairs.push_back({pre + "downsample.1", nullptr, nullptr, b->downsample.get(), "0", "1", c, n});
      }
    }
  }
  std::vector<Pair> todo;
  for (Pair& p : pairs) {
    if (dynamic_cast<FoldedBatchNorm2d*>(p.bn_module.get())) continue;
    KILN_CHECK(!p.bn_module->is_training() && p.bn_module->running_mean.defined(), ValueError,
               "quant::fuse_conv_bn: expected ", p.bn_path, " in eval mode with running statistics, got ",
               p.bn_module->is_training() ? "training mode" : "no running statistics");
    KILN_CHECK(p.conv_module->weight.defined() && p.conv_module->weight.dtype() == kFloat32, ValueError,
               "quant::fuse_conv_bn: expected the float32 convolution before ", p.bn_path, ", got ",
               p.conv_module->type_name());
    todo.push_back(p);
  }
  std::vector<std::shared_ptr<nn::Conv2d>> convs;
  for (Pair& p : todo) convs.push_back(folded(*p.conv_module, *p.bn_module));
  std::vector<std::string> paths;
  for (size_t i = 0; i < todo.size(); ++i) {
    Pair& p = todo[i];
    auto id = std::make_shared<FoldedBatchNorm2d>(p.bn_module->options.num_features);
    if (!p.bn_module->is_training()) id->eval();
    if (p.conv) *p.conv = convs[i];
    if (p.bn) *p.bn = id;
    p.conv_parent->register_module(p.conv_name, convs[i]);
    p.conv_parent->register_module(p.bn_name, id);
    paths.push_back(p.bn_path);
  }
  return paths;
}

}  // namespace kiln::quant
