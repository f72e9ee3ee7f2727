// exporter::fold_batch_norm: the ResNet's BatchNorms folded into their
// convolutions give the unfolded graph's outputs within 1e-5 (relative to the
// output's scale) in ONNX Runtime, with fewer nodes.
#include <gtest/gtest.h>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/onnx.h"
#include "kiln/export/optimize.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

TEST(ExportOptimize, FoldedBatchNormResNetMatchesUnfoldedWithSixFewerNodes) {
  manual_seed(8);
  models::ResNet net({.in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 10});
  {
    // Running statistics far from (0, 1), so folding has something to fold.
    const NoGradGuard no_grad;
    for (int i = 0; i < 3; ++i) net(randn({4, 3, 16, 16}) * 3.0 + 1.0);
  }
  net.eval();
  const exporter::CaptureOptions opts{.dynamic_axes = {{"input", {{0, "batch"}}}}};
  const exporter::Graph plain = exporter::capture(net, {randn({1, 3, 16, 16})}, opts);
  exporter::Graph folded = plain;
  const auto r = exporter::fold_batch_norm(folded);
  EXPECT_EQ(r.folded, 6);
  EXPECT_EQ(r.nodes_before, 22);
  EXPECT_EQ(r.nodes_after, 16);
  EXPECT_EQ(folded.op_counts().count("BatchNormalization"), 0u);
  for (const auto& [name, t] : folded.initializers) EXPECT_EQ(name.find("running_"), std::string::npos) << name;
  TempDir dir;
  exporter::write_onnx(plain, dir.file("plain.onnx"), 17);
  exporter::write_onnx(folded, dir.file("folded.onnx"), 17);
  const std::vector<Tensor> inputs{randn({2, 3, 16, 16}), randn({5, 3, 16, 16})};
  const auto a = run_onnx_consumers(dir.file("plain.onnx"), inputs, false, dir.path().string());
  const auto b = run_onnx_consumers(dir.file("folded.onnx"), inputs, true, dir.path().string());
  EXPECT_TRUE(b.checker_ok) << b.checker_error;
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_LE(scaled_max_diff(b.outputs.at("onnxruntime")[i], a.outputs.at("onnxruntime")[i]), 1e-5) << i;
    ASSERT_TRUE(b.outputs.count("opencv")) << b.opencv_error;
    EXPECT_LE(scaled_max_diff(b.outputs.at("opencv")[i], a.outputs.at("onnxruntime")[i]), 1e-5) << i;
    Tensor want;
    {
      const NoGradGuard no_grad;
      want = net(inputs[i]);
    }
    EXPECT_LE(scaled_max_diff(b.outputs.at("onnxruntime")[i], want), 1e-4) << i;
  }
}

}  // namespace
}  // namespace kiln::test
