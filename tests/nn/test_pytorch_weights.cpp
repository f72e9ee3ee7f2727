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
#include "kiln/ops/factory.h"
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
      auto m = kiln_model(kind);
      nn::save_pytorch_weights(*m, e->folder(kind) + "/kiln_model.safetensors");
      nn::save_pytorch_weights(*m, e->folder(kind) + "/kiln_model_bf16.safetensors", {.dtype = kBFloat16});
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

nn::NamedTensors torch_dict(const std::string& kind) {
  return io::load_safetensors(exchange().torch_file(kind)).tensors;
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

// Both ways again with bfloat16 files (the doc's Python writes and reads BF16 through int16).
TEST_P(PyTorchWeights, BFloat16FilesBothWays) {
  const std::string kind = GetParam();
  auto ref = exchange().outputs(kind);
  ASSERT_NE(test::mismatch(ref.at("torch_bf16_out"), ref.at("torch_out")), "") << "rounding must show";
  auto m = blank_model(kind);
  std::string file = exchange().folder(kind) + "/torch_model_bf16.safetensors";
  EXPECT_NE(load_error(*m, io::load_safetensors(file).tensors).find("pass .convert_dtype = true"), std::string::npos);
  auto res = nn::load_pytorch_weights(*m, file, {.convert_dtype = true});
  EXPECT_FALSE(res.converted.empty());
  EXPECT_EQ(test::mismatch(eval_forward(*m, ref.at("input")), ref.at("torch_bf16_out")), "");
  // kiln's bfloat16 export, cast back by torch's load_state_dict: kiln's rounded weights.
  auto k = kiln_model(kind);
  k->to(kBFloat16).to(kFloat32);
  EXPECT_EQ(test::mismatch(eval_forward(*k, ref.at("input")), ref.at("kiln_bf16_weights_out")), "");
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
  EXPECT_NE(err.find("shape mismatch for \"layer1.0.conv1.weight\": the module has [8, 8, 3, 3], "
                     "the file [8, 8, 1, 1]"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("nothing was changed"), std::string::npos) << err;
  expect_same_state(*m, before);
  // The same from a file: the message names it.
  test::TempDir dir;
  io::write_state_dict(dir.file("bad.safetensors"), d);
  try {
    nn::load_pytorch_weights(*m, dir.file("bad.safetensors"));
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + dir.file("bad.safetensors") + "' does not fit ResNet"),
              std::string::npos)
        << e.what();
  }
  expect_same_state(*m, before);
  // A key twice (possible in memory, not in a file) is named too, not resolved silently.
  auto twice = torch_dict("resnet");
  twice.emplace_back("fc.bias", zeros({5}));
  err = load_error(*m, twice);
  EXPECT_NE(err.find("\"fc.bias\" is given twice"), std::string::npos) << err;
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

// ---- the loader's rules, on torch's files ----

namespace {

Tensor torch_out_of(const std::string& kind, nn::Module& m) {
  return eval_forward(m, exchange().outputs(kind).at("input"));
}

}  // namespace

TEST(PyTorchWeightsRules, ATiedWeightUnderOneNameFillsTheOther) {
  ASSERT_EQ(exchange().problem, "");
  const Tensor want = exchange().outputs("gpt").at("torch_out");
  // As safetensors.torch.save_model and Hugging Face write it: one of the two names.
  for (const std::string dropped : {"lm_head.weight", "transformer.wte.weight"}) {
    auto m = blank_model("gpt");
    auto res = nn::load_pytorch_state_dict(*m, without(torch_dict("gpt"), dropped));
    const std::string kept = dropped == "lm_head.weight" ? "transformer.wte.weight" : "lm_head.weight";
    EXPECT_EQ(res.tied_filled, std::vector<std::string>{dropped + " <- " + kept});
    EXPECT_EQ(test::mismatch(torch_out_of("gpt", *m), want), "") << "without " << dropped;
    auto& gpt = static_cast<models::GPT&>(*m);
    EXPECT_TRUE(gpt.lm_head->weight.is_alias_of(gpt.wte->weight));
  }
  // Both absent: both missing, by name.
  auto m = blank_model("gpt");
  std::string err = load_error(*m, without(without(torch_dict("gpt"), "lm_head.weight"), "transformer.wte.weight"));
  EXPECT_NE(err.find("missing keys: \"transformer.wte.weight\", \"lm_head.weight\""), std::string::npos) << err;
}

TEST(PyTorchWeightsRules, TiedCopiesThatDifferAreAnErrorNotLastOneWins) {
  ASSERT_EQ(exchange().problem, "");
  auto m = blank_model("gpt");
  auto before = snapshot(*m);
  auto d = torch_dict("gpt");
  for (auto& [n, t] : d)
    if (n == "lm_head.weight") t = t * 2.0;
  std::string err = load_error(*m, d);
  EXPECT_NE(err.find("tied weights \"transformer.wte.weight\" and \"lm_head.weight\" differ"), std::string::npos)
      << err;
  expect_same_state(*m, before);
}

TEST(PyTorchWeightsRules, AbsentBatchCountersAreZeroAsTorchDoes) {
  ASSERT_EQ(exchange().problem, "");
  auto m = blank_model("resnet");
  auto d = torch_dict("resnet");
  std::vector<std::string> counters;
  for (auto& [n, t] : d)
    if (n.ends_with("num_batches_tracked")) counters.push_back(n);
  ASSERT_EQ(counters.size(), 6u);  // stem, 2 per block, the downsample's BN
  for (auto& c : counters) d = without(d, c);
  auto res = nn::load_pytorch_state_dict(*m, d);
  EXPECT_EQ(res.defaulted, counters);
  EXPECT_EQ(static_cast<models::ResNet&>(*m).bn1->num_batches_tracked.item<int64_t>(), 0);
  // The counter does not enter eval mode: outputs are torch's.
  EXPECT_EQ(test::mismatch(torch_out_of("resnet", *m), exchange().outputs("resnet").at("torch_out")), "");
}

TEST(PyTorchWeightsRules, DTypesConvertOnlyOnRequest) {
  ASSERT_EQ(exchange().problem, "");
  auto m = blank_model("resnet");
  auto before = snapshot(*m);
  auto d64 = io::cast_floating(torch_dict("resnet"), kFloat64);  // a float64 file: counters stay int64
  std::string err = load_error(*m, d64);
  EXPECT_NE(err.find("dtype mismatch for \"conv1.weight\": the module has float32, the file float64 (pass "
                     ".convert_dtype = true to cast)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("dtype mismatch for \"fc.bias\""), std::string::npos) << err;
  EXPECT_EQ(err.find("num_batches_tracked"), std::string::npos) << err;
  expect_same_state(*m, before);
  auto res = nn::load_pytorch_state_dict(*m, d64, {.convert_dtype = true});
  EXPECT_EQ(res.converted.size(), d64.size() - 6);
  EXPECT_EQ(res.converted[0], "conv1.weight: float64 -> float32");
  EXPECT_EQ(test::mismatch(torch_out_of("resnet", *m), exchange().outputs("resnet").at("torch_out")), "");
  // Integer and floating point never convert into each other.
  auto bad = torch_dict("resnet");
  for (auto& [n, t] : bad)
    if (n == "bn1.num_batches_tracked") t = t.to(kFloat32);
  err = load_error(*m, bad, {.convert_dtype = true});
  EXPECT_NE(err.find("\"bn1.num_batches_tracked\": the module has int64, the file float32 (not converted"),
            std::string::npos)
      << err;
}

TEST(PyTorchWeightsRules, ABFloat16ExportLoadsBackWithConversion) {
  auto m = kiln_model("resnet");
  test::TempDir dir;
  nn::save_pytorch_weights(*m, dir.file("w.safetensors"), {.dtype = kBFloat16});
  auto header = io::read_safetensors_header(dir.file("w.safetensors"));
  for (auto& info : header.tensors)
    EXPECT_EQ(info.dtype, info.name.ends_with("num_batches_tracked") ? kInt64 : kBFloat16) << info.name;
  EXPECT_EQ(header.metadata.at("format"), "pt");
  EXPECT_EQ(header.metadata.at("kiln.module"), "ResNet");
  auto back = blank_model("resnet");
  auto res = nn::load_pytorch_weights(*back, dir.file("w.safetensors"), {.convert_dtype = true});
  EXPECT_FALSE(res.converted.empty());
  auto want = m->state_dict();
  auto got = back->state_dict();
  for (size_t i = 0; i < want.size(); ++i) {
    Tensor w = want[i].second.is_floating_point() ? want[i].second.to(kBFloat16).to(kFloat32) : want[i].second;
    EXPECT_TRUE(test::bitwise_equal(got[i].second, w)) << want[i].first;
  }
}

TEST(PyTorchWeightsRules, WrapperPrefixesRenamesAndIgnoredKeys) {
  ASSERT_EQ(exchange().problem, "");
  const Tensor want = exchange().outputs("gpt").at("torch_out");
  // DDP's "module." and torch.compile's "_orig_mod." go without being asked.
  auto wrapped = io::rename_keys(torch_dict("gpt"), {});
  for (auto& [n, t] : wrapped) n = "module._orig_mod." + n;
  auto m = blank_model("gpt");
  nn::load_pytorch_state_dict(*m, wrapped);
  EXPECT_EQ(test::mismatch(torch_out_of("gpt", *m), want), "");

  // A model whose torch twin names its blocks "blocks": renames on load, the inverse on export.
  const std::vector<io::KeyRename> rules = {{"transformer.h", "blocks"}};
  auto renamed = io::rename_keys(torch_dict("gpt"), rules);
  EXPECT_EQ(renamed[2].first, "blocks.0.ln_1.weight");
  m = blank_model("gpt");
  EXPECT_NE(load_error(*m, renamed).find("unexpected keys: \"blocks.0.ln_1.weight\""), std::string::npos);
  nn::load_pytorch_state_dict(*m, renamed, {.renames = io::inverse(rules)});
  EXPECT_EQ(test::mismatch(torch_out_of("gpt", *m), want), "");
  EXPECT_EQ(test::keys(nn::pytorch_state_dict(*m, {.renames = rules})), test::keys(renamed));

  // nanoGPT's persistent causal-mask buffers: unexpected, with a hint, unless ignored.
  auto with_mask = torch_dict("gpt");
  with_mask.emplace_back("transformer.h.0.attn.bias", zeros({1, 1, 16, 16}));
  with_mask.emplace_back("transformer.h.1.attn.bias", zeros({1, 1, 16, 16}));
  std::string err = load_error(*m, with_mask);
  EXPECT_NE(err.find("unexpected keys: \"transformer.h.0.attn.bias\", \"transformer.h.1.attn.bias\""),
            std::string::npos)
      << err;
  EXPECT_NE(err.find(".ignore = {\"*.attn.bias\"}"), std::string::npos) << err;
  auto res = nn::load_pytorch_state_dict(*m, with_mask, {.ignore = {"*.attn.bias"}});
  EXPECT_EQ(res.ignored_keys.size(), 2u);
}

namespace {

// Persistent and non-persistent buffers side by side (torch's register_buffer(persistent=False)).
class WithBuffers : public nn::Module {
 public:
  WithBuffers()
      : nn::Module("WithBuffers"),
        w(register_parameter("w", zeros({3}))),
        stat(register_buffer("stat", zeros({3}))),
        mask(register_buffer("mask", zeros({3}), /*persistent=*/false)) {}
  Tensor& w;
  Tensor& stat;
  Tensor& mask;
};

}  // namespace

TEST(PyTorchWeightsRules, PersistentBuffersMoveNonPersistentOnesDoNot) {
  WithBuffers a;
  a.w.detach().fill_(1.0);
  a.stat.fill_(2.0);
  a.mask.fill_(3.0);
  auto sd = nn::pytorch_state_dict(a);
  EXPECT_EQ(test::keys(sd), (std::vector<std::string>{"w", "stat"}));
  WithBuffers b;
  nn::load_pytorch_state_dict(b, sd);
  EXPECT_TRUE(test::bitwise_equal(b.stat, a.stat));
  EXPECT_EQ(b.mask.sum().item<float>(), 0.0f);
  // A file that has it anyway (torch with persistent=True): unexpected, or skipped on request.
  sd.emplace_back("mask", a.mask);
  EXPECT_NE(load_error(b, sd).find("unexpected keys: \"mask\""), std::string::npos);
  EXPECT_EQ(nn::load_pytorch_state_dict(b, sd, {.ignore = {"mask"}}).ignored_keys, std::vector<std::string>{"mask"});
}

// ---- kiln/io/state_dict.h ----

TEST(StateDictIO, RenameKeyMatchesWholeSegments) {
  const std::vector<io::KeyRename> r = {{"blocks", "h"}};
  EXPECT_EQ(io::rename_key("blocks.0.w", r), "h.0.w");
  EXPECT_EQ(io::rename_key("enc.blocks.1.w", r), "enc.h.1.w");
  EXPECT_EQ(io::rename_key("myblocks.0.w", r), "myblocks.0.w");
  EXPECT_EQ(io::rename_key("a.blocks", r), "a.h");
  EXPECT_EQ(io::rename_key("x.x.x", {{"x", "y"}}), "y.y.y");
  EXPECT_EQ(io::rename_key("module.fc.weight", {{"module", ""}}), "fc.weight");
  EXPECT_EQ(io::rename_key("attn.qkv.weight", {{"attn.qkv", "attn.c_attn"}}), "attn.c_attn.weight");
  EXPECT_THROW(io::rename_key("a", {{"", "b"}}), ValueError);
  EXPECT_THROW(io::inverse({{"module", ""}}), ValueError);
  auto inv = io::inverse({{"a", "b"}, {"c", "d"}});
  ASSERT_EQ(inv.size(), 2u);
  EXPECT_EQ(inv[0].from, "d");
  EXPECT_EQ(inv[1].to, "a");
}

TEST(StateDictIO, RenameClashesAndPrefixes) {
  nn::NamedTensors d = {{"a.w", zeros({1})}, {"b.w", zeros({1})}};
  try {
    io::rename_keys(d, {{"a", "b"}});
    FAIL() << "expected a clash";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("\"a.w\" and \"b.w\" both become \"b.w\""), std::string::npos) << e.what();
  }
  nn::NamedTensors p = {{"module.a", zeros({1})}, {"module.b", zeros({1})}, {"c", zeros({1})}};
  EXPECT_EQ(io::consume_prefix_in_state_dict_if_present(p, "module."), 2u);
  EXPECT_EQ(test::keys(p), (std::vector<std::string>{"a", "b", "c"}));
  nn::NamedTensors both = {{"module.a", zeros({1})}, {"a", zeros({1})}};
  EXPECT_THROW(io::consume_prefix_in_state_dict_if_present(both, "module."), ValueError);
  EXPECT_EQ(both[0].first, "module.a");  // unchanged after the error
}

TEST(StateDictIO, SharedGroupsAndCastsKeepTies) {
  models::GPT gpt(kGPT);
  auto sd = gpt.state_dict();
  auto groups = io::shared_groups(sd);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0], (std::vector<std::string>{"transformer.wte.weight", "lm_head.weight"}));
  auto half = io::cast_floating(sd, kBFloat16);
  EXPECT_EQ(io::shared_groups(half), groups);
  EXPECT_EQ(half[0].second.dtype(), kBFloat16);
  Tensor a = zeros({2, 3});
  EXPECT_TRUE(io::shared_groups({{"a", a}, {"t", a.t()}}).empty());  // same storage, other layout
  EXPECT_TRUE(io::equal_bytes(a, zeros({2, 3})));
  EXPECT_FALSE(io::equal_bytes(a, zeros({3, 2})));
  EXPECT_FALSE(io::equal_bytes(a, zeros({2, 3}, TensorOptions(kFloat64))));
  EXPECT_THROW(io::cast_floating(sd, kInt64), DTypeError);
}

TEST(StateDictIO, WriteAndReadKeepOrderMetadataAndTies) {
  test::TempDir dir;
  models::GPT gpt(kGPT);
  auto sd = gpt.state_dict();
  io::write_state_dict(dir.file("g.safetensors"), sd, {.metadata = {{"step", "12"}}});
  auto f = io::read_state_dict(dir.file("g.safetensors"));
  EXPECT_EQ(test::keys(f.tensors), test::keys(sd));
  EXPECT_EQ(f.metadata.at("format"), "pt");
  EXPECT_EQ(f.metadata.at("step"), "12");
  for (size_t i = 0; i < sd.size(); ++i) EXPECT_TRUE(test::bitwise_equal(f.tensors[i].second, sd[i].second));
  EXPECT_TRUE(io::shared_groups(f.tensors).empty());  // each name has its own bytes on disk
  auto g = io::read_state_dict(dir.file("g.safetensors"), {.dtype = kFloat64, .renames = {{"transformer", "t"}}});
  EXPECT_EQ(g.tensors[0].first, "t.wte.weight");
  EXPECT_EQ(g.tensors[0].second.dtype(), kFloat64);
  nn::NamedTensors undefined = {{"x", Tensor()}};
  EXPECT_THROW(io::write_state_dict(dir.file("u.safetensors"), undefined), ValueError);
}
