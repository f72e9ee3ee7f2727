// quant::fuse_conv_bn on a tiny ResNet with BatchNorm statistics and affine
// parameters away from their defaults: the folded float model computes what
// the unfolded one does (within 1e-5), every Conv2d + BatchNorm2d pair of the
// stem, the blocks and the downsample shortcut is folded, a model in training
// mode is refused untouched, and prepare(.fuse_bn) quantizes the folded model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/fuse.h"
#include "kiln/quant/ptq.h"

using namespace kiln;

namespace {

models::ResNetOptions options() {
  models::ResNetOptions o;
  o.in_channels = 1;
  o.stem_channels = 4;
  o.widths = {4, 8};
  o.blocks = {1, 1};
  o.num_classes = 3;
  return o;
}

Tensor input(int64_t n, uint64_t seed) {
  Generator g(seed);
  return randn({n, 1, 8, 8}, TensorOptions(kFloat32), &g);
}

// A ResNet whose BatchNorms have moved: running statistics from a few
// training-mode passes, and random affine parameters.
std::shared_ptr<models::ResNet> model_with_statistics() {
  manual_seed(4);
  auto m = std::make_shared<models::ResNet>(options());
  const NoGradGuard no_grad;
  m->train();
  for (uint64_t s = 0; s < 3; ++s) (*m)(input(16, 20 + s).mul(2.0).add(0.5));
  Generator g(9);
  for (auto& [name, t] : m->named_parameters())
    if (name.find("bn") != std::string::npos || name.find("downsample.1") != std::string::npos)
      t.copy_(rand(t.sizes(), TensorOptions(kFloat32), &g).add(0.5));
  m->eval();
  return m;
}

double max_abs_diff(const Tensor& a, const Tensor& b) { return a.sub(b).abs().max().item<float>(); }

}  // namespace

TEST(FuseConvBN, FoldedResNetMatchesUnfolded) {
  auto ref = model_with_statistics();
  auto m = std::make_shared<models::ResNet>(options());
  m->load_state_dict(ref->state_dict());
  m->eval();
  const std::vector<std::string> folded = quant::fuse_conv_bn(*m);
  EXPECT_EQ(folded, (std::vector<std::string>{"bn1", "layer1.0.bn1", "layer1.0.bn2", "layer2.0.bn1", "layer2.0.bn2",
                                              "layer2.0.downsample.1"}));
  EXPECT_NE(dynamic_cast<quant::FoldedBatchNorm2d*>(m->bn1.get()), nullptr);
  EXPECT_TRUE(m->conv1->bias.defined());
  for (auto& [name, t] : m->state_dict())
    EXPECT_EQ(name.find("running_mean"), std::string::npos) << name << ": no BatchNorm statistics remain";
  const NoGradGuard no_grad;
  for (uint64_t seed : {31, 32}) {
    const Tensor x = input(8, seed);
    const Tensor y_ref = (*ref)(x), y = (*m)(x);
    EXPECT_LE(max_abs_diff(y, y_ref), 1e-5 * std::max(1.0f, y_ref.abs().max().item<float>())) << "seed " << seed;
  }
  EXPECT_TRUE(quant::fuse_conv_bn(*m).empty()) << "folding twice folds nothing more";
}

TEST(FuseConvBN, TrainingModeIsRefusedUntouched) {
  auto m = model_with_statistics();
  m->train();
  const auto bn = m->bn1;
  try {
    quant::fuse_conv_bn(*m);
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("eval mode"), std::string::npos) << e.what();
  }
  EXPECT_EQ(m->bn1, bn);
  EXPECT_FALSE(m->conv1->bias.defined());
}

TEST(FuseConvBN, PrepareFoldsThenQuantizes) {
  auto ref = model_with_statistics();
  auto m = std::make_shared<models::ResNet>(options());
  m->load_state_dict(ref->state_dict());
  m->eval();
  auto prepared = quant::prepare(*m, {.observer = "minmax", .fuse_bn = true});
  EXPECT_NE(dynamic_cast<quant::FoldedBatchNorm2d*>(m->bn1.get()), nullptr);
  EXPECT_EQ(prepared->layers.size(), 7u) << "stem, 2 blocks x 2 convs, the downsample conv, fc";
  const NoGradGuard no_grad;
  for (uint64_t s = 0; s < 3; ++s) (*m)(input(16, 50 + s));
  const quant::ConvertReport r = quant::convert(*m, *prepared);
  for (const auto& l : r.layers) EXPECT_TRUE(l.quantized) << l.path << ": " << l.note;
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(m->conv1.get()), nullptr);
  const Tensor x = input(8, 60);
  const Tensor y_ref = (*ref)(x), y = (*m)(x);
  const double rel = std::sqrt(y.sub(y_ref).pow(2).sum().item<float>() / y_ref.pow(2).sum().item<float>());
  EXPECT_LT(rel, 0.1) << r.table();
}
