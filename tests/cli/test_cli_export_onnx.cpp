// `kiln export RUN` (--format onnx, the default): the run's model as an ONNX
// file with a dynamic batch axis (and sequence axis for the GPT) that the ONNX
// checker accepts and ONNX Runtime (and, for the ResNet, OpenCV DNN) runs to
// kiln's logits from the same checkpoint, within 1e-4 of their scale, at two
// input sizes from one file. And the options it refuses.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/gpt.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

// The model of `ckpt` (a training checkpoint), in eval mode.
void load_model(const fs::path& ckpt, nn::Module& model) {
  const auto file = io::load_safetensors(ckpt.string());
  io::NamedTensors weights;
  for (const auto& [name, t] : file.tensors)
    if (name.rfind("model.", 0) == 0) weights.emplace_back(name.substr(6), t);
  model.load_state_dict(weights);
  model.eval();
}

Tensor logits(nn::Module& model, const Tensor& x) {
  const NoGradGuard no_grad;
  return model(x);
}

TEST(CliExportOnnx, ResNetRunRunsInOnnxRuntimeAndOpenCVAtTwoBatchSizes) {
  TempDir dir;
  std::string config = tiny_mlp_config();
  const std::string mlp = "type = \"mlp\"\nhidden = [32]\n";
  config.replace(config.find(mlp), mlp.size(), "type = \"resnet\"\nstem_channels = 4\nwidths = [4, 8]\nblocks = [1, 1]\n");
  write_text(dir.path() / "resnet.toml", config);
  const std::string run = dir.file("run");
  auto r = kiln_cli("train " + dir.file("resnet.toml") + " --out " + run);
  ASSERT_EQ(r.rc, 0) << r.output;
  r = kiln_cli("export " + run);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("ckpt-00000040.safetensors (step 40) as ONNX, opset 17"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("input \"input\" float32 [batch, 1, 8, 8]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("BatchNormalization 6"), std::string::npos) << r.output;
  const std::string onnx = (fs::path(run) / "model.onnx").string();
  ASSERT_TRUE(fs::exists(onnx));

  models::ResNet net({.in_channels = 1, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 10});
  load_model(fs::path(run) / "checkpoints" / "ckpt-00000040.safetensors", net);
  manual_seed(5);
  const std::vector<Tensor> inputs{randn({2, 1, 8, 8}), randn({5, 1, 8, 8})};
  const OnnxConsumerRun c = run_onnx_consumers(onnx, inputs, /*opencv=*/true, dir.path().string());
  EXPECT_TRUE(c.checker_ok) << c.checker_error;
  ASSERT_TRUE(c.outputs.count("opencv")) << c.opencv_error;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor want = logits(net, inputs[i]);
    EXPECT_LE(scaled_max_diff(c.outputs.at("onnxruntime")[i], want), 1e-4) << i;
    EXPECT_LE(scaled_max_diff(c.outputs.at("opencv")[i], want), 1e-4) << i;
  }
  // With the BatchNorms folded, still kiln's model: checked module by module in ONNX Runtime.
  r = kiln_cli("export " + run + " --optimize --check --out " + dir.file("folded.onnx"));
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("optimised: 6 BatchNorms folded into their convolutions, 22 nodes -> 16"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("every module's output agrees"), std::string::npos) << r.output;
  // --external-data: the weights in a side file beside the model, which ONNX Runtime reads.
  r = kiln_cli("export " + run + " --external-data --out " + dir.file("ext.onnx"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("as external data in " + dir.file("ext.onnx.data")), std::string::npos) << r.output;
  EXPECT_LT(fs::file_size(dir.file("ext.onnx")), fs::file_size(onnx));
  const OnnxConsumerRun e = run_onnx_consumers(dir.file("ext.onnx"), inputs, /*opencv=*/false, dir.path().string());
  EXPECT_TRUE(e.checker_ok) << e.checker_error;
  for (size_t i = 0; i < inputs.size(); ++i)
    EXPECT_LE(scaled_max_diff(e.outputs.at("onnxruntime")[i], logits(net, inputs[i])), 1e-4) << i;
}

TEST(CliExportOnnx, GptRunHasDynamicBatchAndSequence) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const std::string run = dir.file("run");
  auto r = kiln_cli("train " + dir.file("gpt.toml") + " --out " + run);
  ASSERT_EQ(r.rc, 0) << r.output;
  const std::string onnx = dir.file("gpt.onnx");
  r = kiln_cli("export " + run + " --out " + onnx + " --opset 13");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("input \"input\" int64 token ids [batch, seq]"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("LayerNormalization"), std::string::npos) << "opset 13 writes LayerNorm out\n" << r.output;

  models::GPT gpt({.vocab_size = 256, .block_size = 32, .n_layer = 1, .n_head = 2, .n_embd = 32});
  fs::path ckpt;
  for (const auto& e : fs::directory_iterator(fs::path(run) / "checkpoints"))
    if (e.path().filename().string().rfind("ckpt-", 0) == 0 && (ckpt.empty() || e.path() > ckpt)) ckpt = e.path();
  ASSERT_FALSE(ckpt.empty());
  load_model(ckpt, gpt);
  manual_seed(6);
  const std::vector<Tensor> inputs{randint(0, 256, {1, 5}, TensorOptions(kInt64)),
                                   randint(0, 256, {3, 32}, TensorOptions(kInt64))};
  const OnnxConsumerRun c = run_onnx_consumers(onnx, inputs, /*opencv=*/false, dir.path().string());
  EXPECT_TRUE(c.checker_ok) << c.checker_error;
  for (size_t i = 0; i < inputs.size(); ++i)
    EXPECT_LE(scaled_max_diff(c.outputs.at("onnxruntime")[i], logits(gpt, inputs[i])), 1e-4) << i;
}

TEST(CliExportOnnx, OptionsItCannotHonourExitTwo) {
  TempDir dir;
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  const std::string run = dir.file("run");
  ASSERT_EQ(kiln_cli("train " + dir.file("mlp.toml") + " --out " + run).rc, 0);
  auto r = kiln_cli("export " + run + " --dynamic batch,seq");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("--dynamic expects batch or none (comma-separated), got \"seq\" (seq is the language "
                          "model's sequence axis; this model has none)"),
            std::string::npos)
      << r.output;
  r = kiln_cli("export " + run + " --opset 18");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("--opset expects 13 to 17"), std::string::npos) << r.output;
  r = kiln_cli("export " + run + " --dtype bfloat16");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("--dtype bfloat16 is for --format pytorch"), std::string::npos) << r.output;
  for (const char* flag : {"--dynamic batch", "--external-data"}) {
    r = kiln_cli("export " + run + " --format pytorch " + flag);
    EXPECT_EQ(r.rc, 2) << r.output;
    EXPECT_NE(r.output.find("--dynamic, --opset, --optimize, --check and --external-data are for --format onnx"),
              std::string::npos)
        << r.output;
  }
  EXPECT_FALSE(fs::exists(fs::path(run) / "model.onnx"));
  // --dynamic none: every axis fixed to the example's (batch 1).
  r = kiln_cli("export " + run + " --dynamic none");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("float32 [1, 1, 8, 8]"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kiln::test
