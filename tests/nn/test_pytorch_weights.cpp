// Weights between kiln and PyTorch (kiln/nn/pytorch_weights.h, kiln/io/state_dict.h).
// One run of tests/parity/pytorch_weights.py per test binary (it runs the
// Python blocks of docs/interop.md) serves every case, for a small GPT and a
// small ResNet:
//  (a) torch builds its twin with a fixed seed and saves the state dict; kiln
//      loads it into its own model and must give torch's eval-mode output;
//  (b) kiln builds with its own seed and exports; torch loads the file with
//      load_state_dict(strict=True) and must give kiln's eval-mode output.
// Tolerance (float32): |kiln - torch| <= 1e-5 + 1e-4 |torch| elementwise
// (tests/nn/twin_check.h). The rest are the loader's own rules and errors,
// checked on those files without Python.
#include "kiln/nn/pytorch_weights.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>

#include "kiln/core/error.h"
#include "kiln/core/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/state_dict.h"
#include "kiln/models/gpt.h"
#include "kiln/models/resnet.h"
#include "support/test_util.h"
#include "twin_check.h"

using namespace kiln;

namespace {

const models::GPTOptions kGPT{.vocab_size = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
const char* kGPTConfig = R"({"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32})";
const models::ResNetOptions kResNet{
    .in_channels = 3, .stem_channels = 8, .widths = {8, 16}, .blocks = {1, 1}, .num_classes = 5};
const char* kResNetConfig =
    R"({"in_channels": 3, "stem_channels": 8, "widths": [8, 16], "blocks": [1, 1], "num_classes": 5})";

// kiln's own models for direction (b): deterministic, so a test can rebuild
// exactly what was exported. The ResNet runs three train-mode batches first so
// that its BatchNorm running statistics (and counters) are worth exporting.
std::shared_ptr<nn::Module> kiln_model(const std::string& kind) {
  if (kind == "gpt") {
    manual_seed(101);
    return std::make_shared<models::GPT>(kGPT);
  }
  manual_seed(202);
  auto m = std::make_shared<models::ResNet>(kResNet);
  NoGradGuard g;
  m->train();
  for (int i = 0; i < 3; ++i) (*m)(randn({2, 3, 16, 16}) * 1.5 - 0.25);
  m->eval();
  return m;
}

std::shared_ptr<nn::Module> blank_model(const std::string& kind) {
  manual_seed(999);
  if (kind == "gpt") return std::make_shared<models::GPT>(kGPT);
  return std::make_shared<models::ResNet>(kResNet);
}

// The exchange with Python, made once per process.
struct Exchange {
  test::TempDir dir;
  std::string problem;  // empty when the script ran
  std::string folder(const std::string& kind) const { return dir.file(kind); }
  std::string torch_file(const std::string& kind) const { return folder(kind) + "/torch_model.safetensors"; }
  io::SafetensorsFile outputs(const std::string& kind) const {
    return io::load_safetensors(folder(kind) + "/outputs.safetensors");
  }
};

const Exchange& exchange() {
  static const std::unique_ptr<Exchange> ex = [] {
    auto e = std::make_unique<Exchange>();
    e->problem = test::python_problem();
    if (!e->problem.empty()) return e;
    const std::pair<const char*, std::string> cases[] = {
        {"gpt", std::string(R"({"model": "gpt", "seed": 7, "input": [2, 16], "config": )") + kGPTConfig + "}"},
        {"resnet",
         std::string(R"({"model": "resnet", "seed": 8, "input": [2, 3, 16, 16], "config": )") + kResNetConfig + "}"}};
    for (const auto& [kind, spec] : cases) {
      std::filesystem::create_directory(e->folder(kind));
      std::ofstream(e->folder(kind) + "/case.json") << spec;
      nn::save_pytorch_weights(*kiln_model(kind), e->folder(kind) + "/kiln_model.safetensors");
    }
    std::string out;
    int rc = test::run_command(test::shell_quote(test::python()) + " " +
                                   test::shell_quote(test::source_dir() + "/tests/parity/pytorch_weights.py") + " " +
                                   test::shell_quote(e->dir.path().string()),
                               out);
    if (rc != 0 || out.find("OK") == std::string::npos) e->problem = "pytorch_weights.py failed:\n" + out;
    return e;
  }();
  return *ex;
}

Tensor eval_forward(nn::Module& m, const Tensor& x) {
  NoGradGuard g;
  m.eval();
  return m(x);
}

// The model's whole state, for "nothing was changed".
nn::NamedTensors snapshot(const nn::Module& m) {
  nn::NamedTensors s;
  for (auto& [n, t] : m.state_dict()) s.emplace_back(n, t.clone());
  return s;
}

void expect_same_state(const nn::Module& m, const nn::NamedTensors& before) {
  auto now = m.state_dict();
  ASSERT_EQ(now.size(), before.size());
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(now[i].second, before[i].second)) << now[i].first;
}

nn::NamedTensors without(nn::NamedTensors d, const std::string& name) {
  std::erase_if(d, [&](const auto& kv) { return kv.first == name; });
  return d;
}

std::string load_error(nn::Module& m, const nn::NamedTensors& d, const nn::PyTorchLoadOptions& o = {}) {
  try {
    nn::load_pytorch_state_dict(m, d, o);
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

class PyTorchWeights : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_EQ(exchange().problem, ""); }
};

// (a) torch -> kiln.
TEST_P(PyTorchWeights, TorchStateDictLoadsIntoKilnAndOutputsAgree) {
  const std::string kind = GetParam();
  auto m = blank_model(kind);
  auto ref = exchange().outputs(kind);
  EXPECT_NE(test::mismatch(eval_forward(*m, ref.at("input")), ref.at("torch_out")), "") << "a vacuous check";
  auto res = nn::load_pytorch_weights(*m, exchange().torch_file(kind));
  EXPECT_TRUE(res.tied_filled.empty() && res.defaulted.empty() && res.converted.empty() && res.ignored_keys.empty());
  auto file = io::load_safetensors(exchange().torch_file(kind));
  auto sd = m->state_dict();
  ASSERT_EQ(test::keys(sd), test::keys(file.tensors));  // same names, same order: nothing mapped
  for (auto& [n, t] : sd) EXPECT_TRUE(test::bitwise_equal(t, file.at(n))) << n;
  EXPECT_EQ(test::mismatch(eval_forward(*m, ref.at("input")), ref.at("torch_out")), "");
  if (kind == "gpt") {
    auto& gpt = static_cast<models::GPT&>(*m);
    EXPECT_TRUE(gpt.lm_head->weight.is_alias_of(gpt.wte->weight)) << "the load must keep the tie";
  } else {
    EXPECT_EQ(static_cast<models::ResNet&>(*m).bn1->num_batches_tracked.item<int64_t>(), 3);
  }
}

// (b) kiln -> torch.
TEST_P(PyTorchWeights, KilnExportLoadsStrictlyIntoTorchAndOutputsAgree) {
  const std::string kind = GetParam();
  auto m = kiln_model(kind);
  auto ref = exchange().outputs(kind);
  EXPECT_EQ(test::mismatch(eval_forward(*m, ref.at("input")), ref.at("kiln_weights_out")), "");
  // What torch holds after load_state_dict(strict=True) is kiln's state, bit for bit.
  for (auto& [n, t] : nn::pytorch_state_dict(*m)) EXPECT_TRUE(test::bitwise_equal(t, ref.at("loaded." + n))) << n;
}

INSTANTIATE_TEST_SUITE_P(Models, PyTorchWeights, ::testing::Values("gpt", "resnet"));

TEST(PyTorchWeightsErrors, MissingExtraAndWrongShapeReportedTogetherModelUnchanged) {
  ASSERT_EQ(exchange().problem, "");
  auto m = blank_model("resnet");
  auto before = snapshot(*m);
  auto d = without(io::load_safetensors(exchange().torch_file("resnet")).tensors, "fc.bias");
  d.emplace_back("fc.extra", zeros({5}));
  for (auto& [n, t] : d)
    if (n == "layer1.0.conv1.weight") t = zeros({8, 8, 1, 1});
  std::string err = load_error(*m, d);
  EXPECT_NE(err.find("missing keys: \"fc.bias\""), std::string::npos) << err;
  EXPECT_NE(err.find("unexpected keys: \"fc.extra\""), std::string::npos) << err;
  EXPECT_NE(err.find("shape mismatch for \"layer1.0.conv1.weight\": the module has [8, 8, 3, 3], the file [8, 8, 1, 1]"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("nothing was changed"), std::string::npos) << err;
  expect_same_state(*m, before);
  // Not strict: the mismatched shape still stops everything.
  err = load_error(*m, d, {.strict = false});
  EXPECT_NE(err.find("layer1.0.conv1.weight"), std::string::npos) << err;
  EXPECT_EQ(err.find("missing keys"), std::string::npos) << err;
  expect_same_state(*m, before);
}

TEST(PyTorchWeightsErrors, NotStrictLoadsWhatMatchesAndListsTheRest) {
  ASSERT_EQ(exchange().problem, "");
  auto m = blank_model("resnet");
  auto d = without(io::load_safetensors(exchange().torch_file("resnet")).tensors, "fc.bias");
  d.emplace_back("fc.extra", zeros({5}));
  const Tensor old_bias = static_cast<models::ResNet&>(*m).fc->bias.clone();
  auto res = nn::load_pytorch_state_dict(*m, d, {.strict = false});
  EXPECT_EQ(res.missing_keys, std::vector<std::string>{"fc.bias"});
  EXPECT_EQ(res.unexpected_keys, std::vector<std::string>{"fc.extra"});
  auto& net = static_cast<models::ResNet&>(*m);
  EXPECT_TRUE(test::bitwise_equal(net.fc->bias, old_bias));
  for (auto& [n, t] : d) {
    if (n == "fc.weight") {
      EXPECT_TRUE(test::bitwise_equal(net.fc->weight, t));
    }
  }
}

TEST(PyTorchWeightsErrors, WrongFileIsAFormatErrorAndMissingFileAnIOError) {
  test::TempDir dir;
  auto m = blank_model("gpt");
  std::ofstream(dir.file("junk.safetensors")) << "not a safetensors file";
  EXPECT_THROW(nn::load_pytorch_weights(*m, dir.file("junk.safetensors")), FormatError);
  EXPECT_THROW(nn::load_pytorch_weights(*m, dir.file("absent.safetensors")), IOError);
}

}  // namespace
