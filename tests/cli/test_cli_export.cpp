// `kiln export RUN --format pytorch` (ONNX, the default format, is tested in
// test_cli_export_onnx.cpp): the file loads with strict=True into the
// PyTorch twin of the model (tests/parity/models_twins.py), and the twin's
// logits on an input equal kiln's from the run's checkpoint. An MLP and a
// ResNet (BatchNorm's running statistics and num_batches_tracked travel too).
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/ops/factory.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "support/compare.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

// Loads the exported files into the twins and writes their eval-mode logits.
constexpr const char* kTwinScript = R"PY(
import sys
sys.path.insert(0, sys.argv[1])
import torch
from models_twins import MLP, ResNet, read, write
d = sys.argv[2]
x, _ = read(d + "/x.safetensors")
models = {"mlp": MLP(64, (32,), 10), "resnet": ResNet(1, 4, (4, 8), (1, 1), 10)}
out = {}
for name, model in models.items():
    sd, meta = read(d + "/" + name + ".safetensors")
    if list(sd.keys()) != list(model.state_dict().keys()):
        print("%s: keys differ:\n file:  %s\n torch: %s" % (name, list(sd.keys()), list(model.state_dict().keys())))
        sys.exit(1)
    model.load_state_dict(sd, strict=True)
    model.eval()
    with torch.no_grad():
        out[name] = model(x["x"])
write(d + "/logits.safetensors", out)
print("OK")
)PY";

std::string config_for(const std::string& model) {
  std::string c = tiny_mlp_config();
  const std::string mlp = "type = \"mlp\"\nhidden = [32]\n";
  c.replace(c.find(mlp), mlp.size(), model);
  return c;
}

/// The logits of the model in `run`'s latest checkpoint, as kiln computes them.
Tensor kiln_logits(const fs::path& run, nn::Module& model, const Tensor& x) {
  const auto file = io::load_safetensors((run / "checkpoints" / "ckpt-00000040.safetensors").string());
  io::NamedTensors weights;
  for (const auto& [name, t] : file.tensors)
    if (name.rfind("model.", 0) == 0) weights.emplace_back(name.substr(6), t);
  model.load_state_dict(weights);
  model.eval();
  NoGradGuard no_grad;
  return model(x);
}

TEST(CliExport, PytorchStateDictLoadsIntoTheTwinAndGivesKilnsLogits) {
  const std::string& problem = python_problem(true);
  if (!problem.empty()) GTEST_SKIP() << problem;
  TempDir dir;
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  write_text(dir.path() / "resnet.toml", config_for("type = \"resnet\"\nstem_channels = 4\nwidths = [4, 8]\nblocks = [1, 1]\n"));
  for (const char* m : {"mlp", "resnet"}) {
    const std::string run = dir.file(std::string("run_") + m);
    auto r = kiln_cli(std::string("train ") + dir.file(std::string(m) + ".toml") + " --out " + run);
    ASSERT_EQ(r.rc, 0) << r.output;
    r = kiln_cli("export " + run + " --format pytorch --out " + dir.file(std::string(m) + ".safetensors"));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("ckpt-00000040.safetensors (step 40) with PyTorch's state_dict names"), std::string::npos)
        << r.output;
  }
  // The default output and a step's checkpoint.
  auto r = kiln_cli("export " + dir.file("run_mlp") + " --format pytorch --checkpoint 20");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir.path() / "run_mlp" / "model.safetensors"));
  EXPECT_NE(r.output.find("(step 20)"), std::string::npos) << r.output;
  const auto meta = io::read_safetensors_header(dir.file("resnet.safetensors")).metadata;
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("kiln.step"), "40");

  Tensor x = (arange(4 * 64).to(kFloat32).reshape({4, 1, 8, 8}) * 0.37).sin();
  io::save_safetensors(dir.file("x.safetensors"), io::NamedTensors{{"x", x}});
  write_text(dir.path() / "twins.py", kTwinScript);
  std::string out;
  ASSERT_EQ(run_command(python() + " " + dir.file("twins.py") + " " + shell_quote(source_dir() + "/tests/parity") + " " +
                            shell_quote(dir.path().string()),
                        out),
            0)
      << out;
  const auto torch_logits = io::load_safetensors(dir.file("logits.safetensors"));
  models::MLP mlp({.in_features = 64, .hidden = {32}, .out_features = 10});
  models::ResNet resnet({.in_channels = 1, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 10});
  for (auto [name, model] : {std::pair<const char*, nn::Module*>{"mlp", &mlp}, {"resnet", &resnet}}) {
    SCOPED_TRACE(name);
    const Comparison c = compare_tensors(kiln_logits(dir.path() / (std::string("run_") + name), *model, x),
                                         torch_logits.at(name), 1e-5, 1e-5);
    EXPECT_TRUE(c.ok) << c.message;
  }
}

TEST(CliExport, UnknownFormatsAndCheckpointsExitTwo) {
  TempDir dir;
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  const std::string run = dir.file("run");
  ASSERT_EQ(kiln_cli("train " + dir.file("mlp.toml") + " --out " + run).rc, 0);
  auto r = kiln_cli("export " + run + " --format tflite");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("--format expects onnx (an ONNX model for inference runtimes) or pytorch"),
            std::string::npos)
      << r.output;
  r = kiln_cli("export " + run + " --checkpoint 7");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("no checkpoint of step 7 (checkpoints/ holds: ckpt-00000020.safetensors ckpt-00000040.safetensors)"),
            std::string::npos)
      << r.output;
  r = kiln_cli("export " + run + " --checkpoint best");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("no best.safetensors under checkpoints/"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(fs::path(run) / "model.safetensors"));
}

}  // namespace
}  // namespace kiln::test
