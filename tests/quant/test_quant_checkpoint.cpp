// Quantized checkpoints (quant::save_quantized / load_quantized): a fresh
// float model loading a converted model's file computes the same outputs bit
// for bit (a CNN with a layer kept in float, a ResNet whose BatchNorm
// statistics come from the file), and hostile files (truncated, not marked
// quantized, wrong dtype or shape of a weight or scale, scales that are zero,
// negative or not finite, zero points out of range or fractional, layers the
// model does not have, missing or extra tensors) are refused with an error
// naming the tensor while the model stays exactly as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/cnn.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/ptq.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::TempDir;

namespace {

models::CNNOptions cnn_options() {
  return {.channels1 = 4, .channels2 = 8, .hidden = 16, .num_classes = 3, .input_size = {8, 8}};
}

models::ResNetOptions resnet_options() {
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

// Calibrates `m` on random inputs and converts it.
void quantize_model(nn::Module& m, std::vector<std::string> keep_float = {}) {
  auto prepared = quant::prepare(m, {.observer = "minmax", .keep_float = std::move(keep_float)});
  {
    const NoGradGuard no_grad;
    for (uint64_t s = 0; s < 3; ++s) m(input(16, 100 + s));
  }
  quant::convert(m, *prepared);
}

Tensor run(nn::Module& m, const Tensor& x) {
  const NoGradGuard no_grad;
  return m(x).contiguous();
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

bool same_state(const nn::NamedTensors& a, const nn::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first || !same_bits(a[i].second, b[i].second)) return false;
  return true;
}

// A converted CNN (fc2 kept float) and its file's tensors.
struct Saved {
  std::map<std::string, Tensor> tensors;
  io::Metadata metadata;
};

const Saved& saved_cnn() {
  static Saved s = [] {
    manual_seed(1);
    models::CNN m(cnn_options());
    m.eval();
    quantize_model(m, {"fc2"});
    TempDir dir;
    quant::save_quantized(m, dir.file("q.safetensors"), {{"note", "test"}});
    const io::SafetensorsFile f = io::load_safetensors(dir.file("q.safetensors"));
    Saved out;
    for (const auto& [k, t] : f.tensors) out.tensors.emplace(k, t.clone());
    out.metadata = f.metadata;
    return out;
  }();
  return s;
}

Tensor with_value(const Tensor& t, int64_t i, float v) {
  Tensor c = t.contiguous().clone();
  c.data_ptr<float>()[i] = v;
  return c;
}

// Writes the CNN's file with `mutate` applied, loads it into a fresh float CNN
// and expects E whose message has every one of `needles`; the model must be unchanged.
template <typename E>
void expect_refused(const std::function<void(Saved&)>& mutate, const std::vector<std::string>& needles) {
  Saved s = saved_cnn();
  mutate(s);
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  io::save_safetensors(path, s.tensors, s.metadata);
  manual_seed(2);
  models::CNN m(cnn_options());
  m.eval();
  const nn::NamedTensors before = m.state_dict();
  const Tensor x = input(4, 7);
  const Tensor y_before = run(m, x);
  try {
    quant::load_quantized(m, path);
    ADD_FAILURE() << "expected an error naming " << needles[0];
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& n : needles) EXPECT_NE(what.find(n), std::string::npos) << "'" << n << "' in: " << what;
  }
  EXPECT_TRUE(same_state(before, m.state_dict())) << "the model's tensors changed";
  for (nn::Module* l : {static_cast<nn::Module*>(m.conv1.get()), static_cast<nn::Module*>(m.conv2.get()),
                        static_cast<nn::Module*>(m.fc1.get()), static_cast<nn::Module*>(m.fc2.get())}) {
    EXPECT_EQ(dynamic_cast<quant::QuantizedConv2d*>(l), nullptr);
    EXPECT_EQ(dynamic_cast<quant::QuantizedLinear*>(l), nullptr);
  }
  for (auto& [name, child] : m.named_modules())
    EXPECT_EQ(dynamic_cast<quant::QuantizedConv2d*>(child) || dynamic_cast<quant::QuantizedLinear*>(child), false)
        << name;
  EXPECT_TRUE(same_bits(y_before, run(m, x)));
}

}  // namespace

TEST(QuantCheckpoint, CNNReloadsBitForBit) {
  manual_seed(1);
  models::CNN src(cnn_options());
  src.eval();
  quantize_model(src, {"fc2"});
  TempDir dir;
  const std::string path = dir.file("q.safetensors");
  quant::save_quantized(src, path);
  EXPECT_EQ(io::read_safetensors_header(path).metadata.at("kiln.quantized"), "int8-ptq");

  manual_seed(5);  // different float weights: everything must come from the file
  models::CNN dst(cnn_options());
  dst.eval();
  const std::vector<std::string> paths = quant::load_quantized(dst, path);
  EXPECT_EQ(paths, (std::vector<std::string>{"conv1", "conv2", "fc1"}));
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(dst.conv1.get()), nullptr);
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(dst.conv2.get()), nullptr);
  EXPECT_NE(dynamic_cast<quant::QuantizedLinear*>(dst.fc1.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QuantizedLinear*>(dst.fc2.get()), nullptr);
  EXPECT_EQ(dst.conv1.get(), dst.named_modules()[1].second) << "the typed member and the registered child agree";
  EXPECT_TRUE(same_state(src.state_dict(), dst.state_dict()));
  for (uint64_t seed : {11, 12}) {
    const Tensor x = input(8, seed);
    EXPECT_TRUE(same_bits(run(src, x), run(dst, x))) << "seed " << seed;
  }
}

TEST(QuantCheckpoint, ResNetReloadsBitForBitWithItsBatchNormStatistics) {
  manual_seed(3);
  models::ResNet src(resnet_options());
  {
    const NoGradGuard no_grad;
    src.train();
    src(input(16, 40));  // running statistics away from their defaults
  }
  src.eval();
  quantize_model(src);
  TempDir dir;
  const std::string path = dir.file("r.safetensors");
  quant::save_quantized(src, path);
  manual_seed(6);
  models::ResNet dst(resnet_options());
  dst.eval();
  const std::vector<std::string> paths = quant::load_quantized(dst, path);
  EXPECT_GE(paths.size(), 6u);
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(dst.conv1.get()), nullptr);
  EXPECT_NE(dynamic_cast<quant::QuantizedLinear*>(dst.fc.get()), nullptr);
  EXPECT_TRUE(same_state(src.state_dict(), dst.state_dict()));
  const Tensor x = input(8, 41);
  EXPECT_TRUE(same_bits(run(src, x), run(dst, x)));
}

TEST(QuantCheckpoint, TruncatedFileIsRefused) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors"), cut = dir.file("cut.safetensors");
  io::save_safetensors(good, saved_cnn().tensors, saved_cnn().metadata);
  std::ifstream in(good, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const size_t keep : {size_t{5}, bytes.size() / 2, bytes.size() - 1}) {
    std::ofstream(cut, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(keep));
    manual_seed(2);
    models::CNN m(cnn_options());
    const nn::NamedTensors before = m.state_dict();
    EXPECT_THROW(quant::load_quantized(m, cut), Error) << keep << " bytes";
    EXPECT_TRUE(same_state(before, m.state_dict()));
    EXPECT_EQ(dynamic_cast<quant::QuantizedConv2d*>(m.conv1.get()), nullptr);
  }
}

TEST(QuantCheckpoint, FileNotMarkedQuantizedIsRefused) {
  expect_refused<FormatError>([](Saved& s) { s.metadata.erase("kiln.quantized"); },
                              {"kiln.quantized", "int8-ptq", "got none"});
  expect_refused<FormatError>([](Saved& s) { s.metadata["kiln.quantized"] = "int4"; }, {"int8-ptq", "\"int4\""});
}

TEST(QuantCheckpoint, WrongDTypeOrShapeIsRefused) {
  expect_refused<ValueError>([](Saved& s) { s.tensors["fc1.weight_scales"] = s.tensors["fc1.weight_scales"].to(kFloat64); },
                             {"fc1.weight_scales", "float32 [16]", "float64 [16]"});
  expect_refused<ValueError>(
      [](Saved& s) { s.tensors["fc1.weight_scales"] = s.tensors["fc1.weight_scales"].slice(0, 0, 3).clone(); },
      {"fc1.weight_scales", "[16]", "[3]"});
  expect_refused<ValueError>(
      [](Saved& s) { s.tensors["conv2.weight_int8"] = s.tensors["conv2.weight_int8"].to(kFloat32); },
      {"conv2.weight_int8", "uint8", "float32"});
  expect_refused<ValueError>(
      [](Saved& s) { s.tensors["fc1.weight_int8"] = s.tensors["fc1.weight_int8"].slice(0, 0, 8).clone(); },
      {"fc1.weight_int8", "[16, 32]", "[8, 32]"});
  expect_refused<ValueError>([](Saved& s) { s.tensors["fc1.input_qparams"] = zeros({3}, TensorOptions(kFloat32)); },
                             {"fc1.input_qparams", "[2]", "[3]"});
  expect_refused<ValueError>([](Saved& s) { s.tensors["fc1.bias"] = zeros({15}, TensorOptions(kFloat32)); },
                             {"fc1.bias", "[16]", "[15]"});
  expect_refused<ValueError>([](Saved& s) { s.tensors["fc2.weight"] = zeros({3, 15}, TensorOptions(kFloat32)); },
                             {"fc2.weight", "[3, 16]", "[3, 15]"});
}

TEST(QuantCheckpoint, BadScalesAndZeroPointsAreRefused) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const float bad : {0.0f, -0.5f, nan, inf})
    expect_refused<ValueError>(
        [bad](Saved& s) { s.tensors["fc1.weight_scales"] = with_value(s.tensors["fc1.weight_scales"], 5, bad); },
        {"fc1.weight_scales", "finite scales > 0", "channel 5"});
  for (const float bad : {0.0f, -1.0f, nan})
    expect_refused<ValueError>(
        [bad](Saved& s) { s.tensors["conv2.input_qparams"] = with_value(s.tensors["conv2.input_qparams"], 0, bad); },
        {"conv2.input_qparams", "input scale", "finite and > 0"});
  for (const float bad : {-1.0f, 256.0f, 2.5f, nan})
    expect_refused<ValueError>(
        [bad](Saved& s) { s.tensors["conv2.input_qparams"] = with_value(s.tensors["conv2.input_qparams"], 1, bad); },
        {"conv2.input_qparams", "zero point", "[0, 255]"});
}

TEST(QuantCheckpoint, LayersAndTensorsTheModelDoesNotHaveAreRefused) {
  expect_refused<ValueError>(
      [](Saved& s) { s.tensors["fc9.weight_int8"] = s.tensors["fc1.weight_int8"].clone(); },
      {"fc9.weight_int8", "expected a Conv2d or Linear at 'fc9'", "no module"});
  expect_refused<ValueError>([](Saved& s) { s.tensors["fc2.extra"] = zeros({1}, TensorOptions(kFloat32)); },
                             {"fc2.extra", "does not have"});
  expect_refused<ValueError>([](Saved& s) { s.tensors.erase("fc1.bias"); }, {"fc1.bias", "got none"});
  expect_refused<ValueError>([](Saved& s) { s.tensors.erase("fc1.weight_scales"); }, {"fc1.weight_scales", "got none"});
  expect_refused<ValueError>([](Saved& s) { s.tensors.erase("fc2.weight"); }, {"fc2.weight", "got none"});
  expect_refused<ValueError>(
      [](Saved& s) { s.tensors["fc1.weight"] = zeros({16, 32}, TensorOptions(kFloat32)); },
      {"fc1.weight", "int8 or float"});
}
