// `kiln eval --int8` and `kiln export --int8`: a tiny CNN and a tiny ResNet
// (BatchNorm folded) trained on synthetic images and quantized; eval of the
// int8 file prints the same accuracy and loss `kiln quantize` measured, the
// export writes a QDQ ONNX file (int8 weights) that kiln's runtime runs to the
// eager int8 model's numbers and ONNX Runtime runs too; a missing file and
// options that are not for int8 exit 2 with a message.
#include <gtest/gtest.h>

#include <regex>

#include "cli/cli_util.h"
#include "kiln/export/onnx.h"
#include "kiln/export/runtime.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

namespace {

// "int8:    test accuracy 91.22% (loss 0.2465)" -> "91.22% ... 0.2465" pair as text.
std::pair<std::string, std::string> accuracy_and_loss(const std::string& out, const std::regex& re) {
  std::smatch m;
  if (!std::regex_search(out, m, re)) return {};
  return {m[1].str(), m[2].str()};
}

}  // namespace

TEST(CliInt8, EvalAndExportTheQuantizedModel) {
  TempDir dir;
  write_text(dir.path() / "cnn.toml", tiny_image_config("cnn"));
  write_text(dir.path() / "resnet.toml", tiny_image_config("resnet"));
  for (const char* m : {"cnn", "resnet"}) {
    SCOPED_TRACE(m);
    const std::string run = dir.file(std::string("run_") + m);
    auto r = kiln_cli(std::string("train ") + dir.file(std::string(m) + ".toml") + " --out " + run);
    ASSERT_EQ(r.rc, 0) << r.output;
    r = kiln_cli("quantize " + run + " --observer minmax --calib-batches 2 --bench-batch 4 --bench-iters 1" +
                 (std::string(m) == "resnet" ? " --fuse-bn" : ""));
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto quantized = accuracy_and_loss(r.output, std::regex(R"(int8: +test accuracy ([0-9.]+)% \(loss ([0-9.]+)\))"));
    ASSERT_FALSE(quantized.first.empty()) << r.output;

    r = kiln_cli("eval " + run + " --int8");
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto evaluated = accuracy_and_loss(r.output, std::regex(R"(loss ([0-9.]+)  accuracy ([0-9.]+)%)"));
    EXPECT_EQ(evaluated.first, quantized.second) << r.output;   // loss
    EXPECT_EQ(evaluated.second, quantized.first) << r.output;  // accuracy

    r = kiln_cli("export " + run + " --int8");
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("max |diff| 0.00e+00"), std::string::npos) << r.output;
    const std::string onnx = (fs::path(run) / "model.int8.onnx").string();
    const exporter::Graph g = exporter::load_onnx(onnx);
    EXPECT_GT(g.op_counts().at("QuantizeLinear"), 0);
    EXPECT_TRUE(g.int8_values.count("conv1.weight_int8"));
    std::vector<int64_t> shape{3};
    for (size_t i = 1; i < g.inputs[0].shape.size(); ++i) shape.push_back(g.inputs[0].shape[i].size);
    const Tensor x = randn(shape);
    const auto consumers = run_onnx_consumers(onnx, {x}, /*opencv=*/false, dir.path().string());
    EXPECT_TRUE(consumers.checker_ok) << consumers.checker_error;
    ASSERT_TRUE(consumers.outputs.count("onnxruntime")) << consumers.log;
    // Without VNNI ONNX Runtime's u8 x s8 kernels saturate in int16 (7.4e-2 on an AVX2 EPYC); test_qdq.cpp.
    EXPECT_LE(scaled_max_diff(consumers.outputs.at("onnxruntime")[0], exporter::Session(g).run({x})[0]),
              test::cpu_has_vnni() ? 1e-2 : 2e-1);
  }
}

TEST(CliInt8, AMissingFileOrAFloatOptionExitsWithAMessage) {
  TempDir dir;
  write_text(dir.path() / "cnn.toml", tiny_image_config("cnn"));
  const std::string run = dir.file("run");
  ASSERT_EQ(kiln_cli("train " + dir.file("cnn.toml") + " --out " + run).rc, 0);
  auto r = kiln_cli("eval " + run + " --int8");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("write it with `kiln quantize"), std::string::npos) << r.output;
  r = kiln_cli("export " + run + " --int8 " + dir.file("none.safetensors"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("none.safetensors"), std::string::npos) << r.output;
  ASSERT_EQ(kiln_cli("quantize " + run + " --calib-batches 1 --bench-iters 1").rc, 0);
  r = kiln_cli("export " + run + " --int8 --optimize");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("are for float exports"), std::string::npos) << r.output;
}
