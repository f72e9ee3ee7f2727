// ONNX export of the model zoo (issue 21), checked by the consumers a user
// would deploy to: the ONNX checker, ONNX Runtime and OpenCV DNN. One file per
// model with a dynamic batch axis (and sequence axis for GPT), run at two
// batch sizes; every consumer's output must be kiln's within 1e-4 of the
// output's scale. Prints the export matrix (model x consumer: scaled max diff).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/onnx.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

using exporter::capture;
using exporter::to_onnx;

constexpr double kTol = 1e-4;

struct Case {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> make;
  std::function<Tensor(int64_t batch, int64_t seq)> input;
  std::map<int64_t, std::string> dynamic;
  std::vector<std::pair<int64_t, int64_t>> sizes;  // (batch, seq) per run
  bool opencv_expected;                            // OpenCV's importer must run it
};

// A few training-mode forwards, so BatchNorm's running statistics are not the
// identity (mean 0, var 1) and the exported BatchNormalization nodes matter.
void warm_batch_norm(nn::Module& m, const Tensor& x) {
  const NoGradGuard no_grad;
  m.train();
  for (int i = 0; i < 3; ++i) m(x * (1.0 + i) + 0.5 * i);
  m.eval();
}

std::vector<Case> zoo() {
  auto image = [](int64_t c, int64_t hw) {
    return [c, hw](int64_t n, int64_t) { return randn({n, c, hw, hw}); };
  };
  return {
      {"mlp", [] { return std::make_shared<models::MLP>(models::MLPOptions{.in_features = 64, .hidden = {32, 16}}); },
       image(1, 8), {{0, "batch"}}, {{2, 0}, {5, 0}}, true},
      {"cnn",
       [] {
         return std::make_shared<models::CNN>(models::CNNOptions{
             .in_channels = 1, .channels1 = 4, .channels2 = 8, .hidden = 16, .num_classes = 10, .input_size = {12}});
       },
       image(1, 12), {{0, "batch"}}, {{2, 0}, {5, 0}}, true},
      {"resnet",
       [] {
         auto m = std::make_shared<models::ResNet>(models::ResNetOptions{
             .in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 2}, .num_classes = 10});
         warm_batch_norm(*m, randn({4, 3, 16, 16}));
         return m;
       },
       image(3, 16), {{0, "batch"}}, {{2, 0}, {5, 0}}, true},
      {"vit",
       [] {
         return std::make_shared<models::ViT>(models::ViTOptions{
             .image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32});
       },
       image(1, 8), {{0, "batch"}}, {{2, 0}, {5, 0}}, false},
      {"gpt",
       [] {
         return std::make_shared<models::GPT>(
             models::GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16});
       },
       [](int64_t b, int64_t t) { return randint(0, 32, {b, t}, TensorOptions(kInt64)); }, {{0, "batch"}, {1, "seq"}},
       {{2, 7}, {3, 12}}, false},
  };
}

class OnnxZoo : public ::testing::TestWithParam<int> {};

TEST_P(OnnxZoo, CheckerOnnxRuntimeAndOpenCVGiveKilnsOutputsAtTwoBatchSizes) {
  const Case c = zoo()[static_cast<size_t>(GetParam())];
  SCOPED_TRACE(c.name);
  manual_seed(21);
  auto model = c.make();
  model->eval();
  std::vector<Tensor> inputs, want;
  for (auto [b, t] : c.sizes) {
    inputs.push_back(c.input(b, t));
    const NoGradGuard no_grad;
    want.push_back((*model)(inputs.back()));
  }
  TempDir dir;
  const std::string path = dir.file(c.name + ".onnx");
  const auto report = to_onnx(*model, {inputs[0]}, path, {.dynamic_axes = {{"input", c.dynamic}}});
  EXPECT_GT(report.nodes, 0);
  EXPECT_EQ(report.parameters >= model->num_parameters(), true) << report.parameters;
  const OnnxConsumerRun run = run_onnx_consumers(path, inputs, /*opencv=*/true, dir.path().string());
  EXPECT_TRUE(run.checker_ok) << run.checker_error;
  std::string line = "export matrix: " + c.name + " checker " + (run.checker_ok ? "ok" : "FAIL");
  for (const char* consumer : {"onnxruntime", "opencv"}) {
    auto it = run.outputs.find(consumer);
    if (it == run.outputs.end()) {
      line += std::string(" ") + consumer + " refused";
      continue;
    }
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double d = scaled_max_diff(it->second[i], want[i]);
      EXPECT_LE(d, kTol) << consumer << " at input " << i << " " << want[i].shape_string() << " got "
                         << it->second[i].shape_string();
      worst = std::max(worst, d);
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.2e", consumer, worst);
    line += buf;
  }
  if (c.opencv_expected)
    EXPECT_TRUE(run.outputs.count("opencv")) << "OpenCV refused " << c.name << ": " << run.opencv_error;
  else if (!run.opencv_error.empty())
    line += " (OpenCV: " + run.opencv_error.substr(0, 300) + ")";
  std::printf("%s\n", line.c_str());
}

INSTANTIATE_TEST_SUITE_P(Zoo, OnnxZoo, ::testing::Range(0, 5), [](const ::testing::TestParamInfo<int>& i) {
  return zoo()[static_cast<size_t>(i.param)].name;
});

}  // namespace
}  // namespace kiln::test
