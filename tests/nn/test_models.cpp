// The model zoo against its PyTorch twins (tests/parity/models_twins.py).
// For each model kiln writes its initial state_dict, an input and class
// targets to safetensors; the twin loads the state dict with strict=True (so
// names, order and shapes match exactly) and returns its eval-mode output, its
// train-mode output, the cross-entropy loss, every parameter's gradient and
// the state_dict after the train step (BatchNorm running stats). kiln does the
// same and compares; then it loads the state_dict of a torch-initialised twin
// by name (strict) and checks the values arrive bit for bit.
// Tolerance (float32): |kiln - torch| <= 1e-5 + 1e-4 * |torch| elementwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/cnn.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/functional.h"
#include "support/test_util.h"
#include "twin_check.h"

using namespace kiln;

namespace {

Tensor class_loss(const Tensor& logits, const Tensor& targets) { return nn::functional::cross_entropy(logits, targets); }

// The exchange described at the top of this file (tests/nn/twin_check.h).
void check_against_twin(nn::Module& model, const std::string& name, const std::string& config, const Tensor& x,
                        const Tensor& target) {
  test::check_against_twin(model, "models_twins.py", name, config, x, target, class_loss);
}

using test::keys;
using test::mismatch;

}  // namespace

TEST(Models, MLPWorkloadMatchesTorch) {
  manual_seed(11);
  models::MLP m({.in_features = 784, .hidden = {512, 512}, .out_features = 10});
  EXPECT_EQ(keys(m.state_dict()), (std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.2.weight",
                                                            "layers.2.bias", "layers.4.weight", "layers.4.bias"}));
  EXPECT_EQ(m.num_parameters(), 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10);
  Tensor x = randn({8, 1, 28, 28});  // flattened from dim 1
  check_against_twin(m, "mlp", R"({"in_features": 784, "hidden": [512, 512], "out_features": 10})", x,
                     randint(0, 10, {8}, TensorOptions(kInt64)));
}

TEST(Models, MLPConfiguredWithoutBiasMatchesTorch) {
  manual_seed(12);
  models::MLP m({.in_features = 12, .hidden = {16, 8, 4}, .out_features = 3, .bias = false});
  EXPECT_EQ(keys(m.state_dict()),
            (std::vector<std::string>{"layers.0.weight", "layers.2.weight", "layers.4.weight", "layers.6.weight"}));
  check_against_twin(m, "mlp", R"({"in_features": 12, "hidden": [16, 8, 4], "out_features": 3, "bias": false})",
                     randn({5, 12}), randint(0, 3, {5}, TensorOptions(kInt64)));
}

TEST(Models, CNNWorkloadMatchesTorch) {
  manual_seed(13);
  models::CNN m;
  EXPECT_EQ(keys(m.state_dict()), (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight",
                                                            "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight",
                                                            "fc2.bias"}));
  EXPECT_EQ(m.fc1->weight.sizes(), (std::vector<int64_t>{128, 3136}));
  check_against_twin(m, "cnn", "{}", randn({4, 1, 28, 28}), randint(0, 10, {4}, TensorOptions(kInt64)));
}

TEST(Models, CNNConfiguredMatchesTorch) {
  manual_seed(14);
  models::CNN m({.in_channels = 3, .channels1 = 4, .channels2 = 6, .hidden = 10, .num_classes = 5,
                 .input_size = {12, 18}});
  EXPECT_EQ(m.fc1->weight.sizes(), (std::vector<int64_t>{10, 6 * 3 * 4}));
  check_against_twin(m, "cnn",
                     R"({"in_channels": 3, "channels1": 4, "channels2": 6, "hidden": 10, "num_classes": 5,
                         "input_size": [12, 18]})",
                     randn({3, 3, 12, 18}), randint(0, 5, {3}, TensorOptions(kInt64)));
}

TEST(Models, ResNetWorkloadMatchesTorch) {
  manual_seed(15);
  models::ResNet m;
  auto k = keys(m.state_dict());
  std::vector<std::string> bn = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"};
  std::vector<std::string> want = {"conv1.weight"};
  auto add_bn = [&](const std::string& p) {
    for (auto& s : bn) want.push_back(p + "." + s);
  };
  add_bn("bn1");
  for (int l = 1; l <= 3; ++l) {
    std::string p = "layer" + std::to_string(l) + ".0.";
    want.push_back(p + "conv1.weight");
    add_bn(p + "bn1");
    want.push_back(p + "conv2.weight");
    add_bn(p + "bn2");
    if (l > 1) {
      want.push_back(p + "downsample.0.weight");
      add_bn(p + "downsample.1");
    }
  }
  want.push_back("fc.weight");
  want.push_back("fc.bias");
  EXPECT_EQ(k, want);
  EXPECT_EQ(m.fc->weight.sizes(), (std::vector<int64_t>{10, 64}));
  check_against_twin(m, "resnet", "{}", randn({4, 3, 32, 32}), randint(0, 10, {4}, TensorOptions(kInt64)));
}

TEST(Models, ResNetConfiguredMatchesTorch) {
  manual_seed(16);
  // Stem of 6 channels into a 4-wide first stage: layer1.0 needs a stride-1 downsample; layer1.1 none.
  models::ResNet m({.in_channels = 2, .stem_channels = 6, .widths = {4, 8}, .blocks = {2, 1}, .num_classes = 3});
  auto k = keys(m.state_dict());
  auto has = [&](const std::string& s) { return std::find(k.begin(), k.end(), s) != k.end(); };
  EXPECT_TRUE(has("layer1.0.downsample.0.weight"));
  EXPECT_FALSE(has("layer1.1.downsample.0.weight"));
  EXPECT_TRUE(has("layer2.0.downsample.1.running_var"));
  EXPECT_FALSE(has("layer3.0.conv1.weight"));
  check_against_twin(m, "resnet",
                     R"({"in_channels": 2, "stem_channels": 6, "widths": [4, 8], "blocks": [2, 1], "num_classes": 3})",
                     randn({3, 2, 10, 10}), randint(0, 3, {3}, TensorOptions(kInt64)));
}

TEST(Models, RejectBadConfigurationsAndInputs) {
  EXPECT_THROW(models::MLP({.in_features = 0}), ValueError);
  EXPECT_THROW(models::MLP({.in_features = 4, .hidden = {0}}), ValueError);
  models::MLP mlp({.in_features = 4, .hidden = {3}, .out_features = 2});
  EXPECT_THROW(mlp(randn({2, 5})), ShapeError);
  EXPECT_THROW(mlp(randn({4})), ShapeError);
  EXPECT_THROW(models::CNN({.input_size = {2, 2}}), ValueError);
  EXPECT_THROW(models::CNN({.input_size = {1, 2, 3}}), ValueError);
  models::CNN cnn({.channels1 = 2, .channels2 = 2, .hidden = 4, .input_size = {8}});
  EXPECT_EQ(cnn(randn({2, 1, 8, 8})).sizes(), (std::vector<int64_t>{2, 10}));
  EXPECT_THROW(cnn(randn({2, 1, 8, 9})), ShapeError);
  EXPECT_THROW(cnn(randn({2, 3, 8, 8})), ShapeError);
  EXPECT_THROW(models::ResNet({.widths = {16, 32}, .blocks = {1}}), ValueError);
  EXPECT_THROW(models::ResNet({.widths = {16}, .blocks = {0}}), ValueError);
  models::ResNet res({.widths = {4}, .blocks = {1}});
  EXPECT_THROW(res(randn({2, 1, 8, 8})), ShapeError);
}
