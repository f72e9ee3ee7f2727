// ONNX external data (issue 21: weights past 2 GB): the writer's side file
// "<model>.onnx.data" (forced here, so tiny models exercise it) is read by the
// ONNX checker (path form, which resolves external data), ONNX Runtime and
// kiln's load_onnx + Session, each giving kiln's outputs within 1e-5 of the
// output's scale; the automatic 2 GiB decision with its limit lowered; the
// writer's temporaries; and load_onnx refusing hostile locations, offsets and
// lengths with errors that name what was wrong.
#include <gtest/gtest.h>

#include <onnx/onnx_pb.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/onnx.h"
#include "kiln/export/runtime.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

namespace fs = std::filesystem;
using exporter::ExternalDataOptions;
using Mode = exporter::ExternalDataOptions::Mode;

constexpr double kTol = 1e-5;

#define EXPECT_THROW_MSG(stmt, E, part)                                            \
  do {                                                                             \
    try {                                                                          \
      stmt;                                                                        \
      ADD_FAILURE() << #stmt " did not throw";                                     \
    } catch (const E& e) {                                                         \
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what(); \
    }                                                                              \
  } while (0)

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

onnx::ModelProto read_model(const std::string& path) {
  onnx::ModelProto m;
  EXPECT_TRUE(m.ParseFromString(slurp(path))) << path;
  return m;
}

void write_model(const onnx::ModelProto& m, const std::string& path) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(m.SerializeToOstream(&f));
}

ExternalDataOptions forced(int64_t min_bytes = 64) {
  ExternalDataOptions o;
  o.mode = Mode::kAlways;
  o.min_bytes = min_bytes;
  return o;
}

struct ZooCase {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> make;
  std::function<Tensor(int64_t batch, int64_t seq)> input;
  std::map<int64_t, std::string> dynamic;
  std::vector<std::pair<int64_t, int64_t>> sizes;  // (batch, seq) per run
};

std::vector<ZooCase> zoo() {
  return {
      {"resnet",
       [] {
         auto m = std::make_shared<models::ResNet>(models::ResNetOptions{
             .in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 2}, .num_classes = 10});
         // Training-mode forwards, so the running statistics are not the identity.
         const NoGradGuard no_grad;
         m->train();
         for (int i = 0; i < 3; ++i) (*m)(randn({4, 3, 16, 16}) * (1.0 + i) + 0.5 * i);
         m->eval();
         return m;
       },
       [](int64_t n, int64_t) { return randn({n, 3, 16, 16}); }, {{0, "batch"}}, {{2, 0}, {5, 0}}},
      {"gpt",
       [] {
         return std::make_shared<models::GPT>(
             models::GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16});
       },
       [](int64_t b, int64_t t) { return randint(0, 32, {b, t}, TensorOptions(kInt64)); }, {{0, "batch"}, {1, "seq"}},
       {{2, 7}, {3, 12}}},
  };
}

class ExternalZoo : public ::testing::TestWithParam<int> {};

TEST_P(ExternalZoo, CheckerOnnxRuntimeAndLoadOnnxReadTheSideFile) {
  const ZooCase c = zoo()[static_cast<size_t>(GetParam())];
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
  const std::string inline_path = dir.file(c.name + "_inline.onnx");
  const auto inl = exporter::to_onnx(*model, {inputs[0]}, inline_path, {.dynamic_axes = {{"input", c.dynamic}}});
  EXPECT_TRUE(inl.data_path.empty());
  EXPECT_FALSE(fs::exists(inline_path + ".data"));

  const fs::path sub = dir.path() / "ext";
  fs::create_directory(sub);
  const std::string path = (sub / (c.name + ".onnx")).string();
  const auto r = exporter::to_onnx(*model, {inputs[0]}, path,
                                   {.dynamic_axes = {{"input", c.dynamic}}, .external_data = forced()});
  ASSERT_EQ(r.data_path, path + ".data");
  EXPECT_GT(r.external_initializers, 0);
  EXPECT_EQ(r.bytes, static_cast<int64_t>(fs::file_size(path)));
  EXPECT_EQ(r.data_bytes, static_cast<int64_t>(fs::file_size(r.data_path)));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_FALSE(fs::exists(r.data_path + ".tmp"));

  // The convention's fields: a relative location, offsets 4096-aligned, lengths = byte sizes,
  // and the bytes at each offset are the initializer's.
  const onnx::ModelProto proto = read_model(path);
  const std::string data = slurp(r.data_path);
  int64_t external = 0, external_bytes = 0;
  for (const auto& t : proto.graph().initializer()) {
    if (t.data_location() != onnx::TensorProto::EXTERNAL) {
      EXPECT_LT(static_cast<int64_t>(t.raw_data().size()), 64) << t.name();
      continue;
    }
    ++external;
    std::map<std::string, std::string> kv;
    for (const auto& e : t.external_data()) kv[e.key()] = e.value();
    EXPECT_EQ(kv["location"], c.name + ".onnx.data");
    const int64_t offset = std::stoll(kv["offset"]), length = std::stoll(kv["length"]);
    EXPECT_EQ(offset % 4096, 0) << t.name();
    ASSERT_LE(offset + length, static_cast<int64_t>(data.size()));
    const auto inl_proto = read_model(inline_path);
    for (const auto& i : inl_proto.graph().initializer()) {
      if (i.name() == t.name()) EXPECT_EQ(data.substr(offset, length), i.raw_data()) << t.name();
    }
    external_bytes += length;
  }
  EXPECT_EQ(external, r.external_initializers);
  EXPECT_LT(r.bytes + external_bytes, inl.bytes + 64 * r.external_initializers);
  std::printf("external data: %s inline %lld bytes; forced external: model %lld bytes + %s %lld bytes (%lld of %lld "
              "initializers, %lld weight bytes)\n",
              c.name.c_str(), static_cast<long long>(inl.bytes), static_cast<long long>(r.bytes),
              fs::path(r.data_path).filename().c_str(), static_cast<long long>(r.data_bytes),
              static_cast<long long>(r.external_initializers), static_cast<long long>(r.initializers),
              static_cast<long long>(external_bytes));

  // kiln's own runtime.
  const exporter::Session s(exporter::load_onnx(path));
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor got = s.run({inputs[i]})[0];
    ASSERT_EQ(got.sizes(), want[i].sizes());
    EXPECT_LE(scaled_max_diff(got, want[i]), kTol) << "load_onnx at " << inputs[i].shape_string();
  }
  // The ONNX checker (path form) and ONNX Runtime, from a directory the pair was moved to:
  // the location is relative to the model, not to where it was written.
  const fs::path moved = dir.path() / "moved";
  fs::create_directory(moved);
  fs::rename(path, moved / "m.onnx");
  fs::rename(r.data_path, moved / fs::path(r.data_path).filename());
  const OnnxConsumerRun run = run_onnx_consumers((moved / "m.onnx").string(), inputs, false, dir.path().string());
  EXPECT_TRUE(run.checker_ok) << run.checker_error;
  ASSERT_TRUE(run.outputs.count("onnxruntime")) << run.log;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = scaled_max_diff(run.outputs.at("onnxruntime")[i], want[i]);
    EXPECT_LE(d, kTol) << "onnxruntime at " << inputs[i].shape_string();
    worst = std::max(worst, d);
  }
  std::printf("external data: %s checker %s, onnxruntime max scaled diff %.2e\n", c.name.c_str(),
              run.checker_ok ? "ok" : "FAIL", worst);
}

INSTANTIATE_TEST_SUITE_P(Zoo, ExternalZoo, ::testing::Range(0, 2), [](const ::testing::TestParamInfo<int>& i) {
  return zoo()[static_cast<size_t>(i.param)].name;
});

std::shared_ptr<models::MLP> small_mlp() {
  manual_seed(3);
  auto m = std::make_shared<models::MLP>(models::MLPOptions{.in_features = 64, .hidden = {32, 16}});
  m->eval();
  return m;
}

TEST(ExternalData, DecisionIsInlineBelowTheLimitAndExternalFromIt) {
  ExternalDataOptions o;  // automatic at protobuf's limit
  EXPECT_FALSE(exporter::use_external_data(1'000'000'000, o));
  EXPECT_FALSE(exporter::use_external_data(2147483646, o));
  EXPECT_TRUE(exporter::use_external_data(2147483647, o));
  EXPECT_TRUE(exporter::use_external_data(3'000'000'000, o));
  o.mode = Mode::kNever;
  EXPECT_FALSE(exporter::use_external_data(3'000'000'000, o));
  o.mode = Mode::kAlways;
  EXPECT_TRUE(exporter::use_external_data(10, o));
}

TEST(ExternalData, AutomaticGoesExternalPastALoweredLimit) {
  auto m = small_mlp();
  TempDir dir;
  const Tensor x = randn({2, 1, 8, 8});
  const auto inl = exporter::to_onnx(*m, {x}, dir.file("a.onnx"));
  EXPECT_TRUE(inl.data_path.empty());
  EXPECT_FALSE(fs::exists(dir.file("a.onnx.data")));

  ExternalDataOptions o;
  o.limit_bytes = inl.bytes + 4096;  // the model stays under it: inline
  auto r = exporter::to_onnx(*m, {x}, dir.file("b.onnx"), {.external_data = o});
  EXPECT_TRUE(r.data_path.empty());
  EXPECT_EQ(r.bytes, inl.bytes);
  EXPECT_FALSE(fs::exists(dir.file("b.onnx.data")));

  o.limit_bytes = inl.bytes / 2;  // past it: every initializer of >= 1 KiB goes to the side file
  r = exporter::to_onnx(*m, {x}, dir.file("c.onnx"), {.external_data = o});
  EXPECT_EQ(r.data_path, dir.file("c.onnx.data"));
  EXPECT_EQ(r.external_initializers, 2);  // the 64x32 and 32x16 weights; 16x10 (640 bytes) and biases stay
  EXPECT_LT(r.bytes, inl.bytes / 2);
  const exporter::Session s(exporter::load_onnx(dir.file("c.onnx")));
  const NoGradGuard no_grad;
  EXPECT_LE(scaled_max_diff(s.run({x})[0], (*m)(x)), kTol);

  o.mode = Mode::kNever;
  r = exporter::to_onnx(*m, {x}, dir.file("d.onnx"), {.external_data = o});
  EXPECT_TRUE(r.data_path.empty());  // the lowered limit only decides; protobuf's own is 2 GiB
}

TEST(ExternalData, LocationOptionMustBeAPlainFileName) {
  auto m = small_mlp();
  TempDir dir;
  const Tensor x = randn({2, 1, 8, 8});
  ExternalDataOptions o = forced();
  for (const char* bad : {"sub/w.data", "../w.data", "/tmp/w.data", ".."}) {
    o.location = bad;
    EXPECT_THROW_MSG(exporter::to_onnx(*m, {x}, dir.file("m.onnx"), {.external_data = o}), ValueError,
                     "plain file name");
  }
  o.location = "m.onnx";
  EXPECT_THROW_MSG(exporter::to_onnx(*m, {x}, dir.file("m.onnx"), {.external_data = o}), ValueError,
                   "is the model file itself");
  EXPECT_FALSE(fs::exists(dir.file("m.onnx")));
  o.location = "weights.bin";
  const auto r = exporter::to_onnx(*m, {x}, dir.file("m.onnx"), {.external_data = o});
  EXPECT_EQ(r.data_path, dir.file("weights.bin"));
  EXPECT_NO_THROW(exporter::load_onnx(dir.file("m.onnx")));
}

TEST(ExternalData, AFailedExportLeavesThePreviousPairIntact) {
  auto m = small_mlp();
  TempDir dir;
  const Tensor x = randn({2, 1, 8, 8});
  const std::string path = dir.file("m.onnx");
  exporter::to_onnx(*m, {x}, path, {.external_data = forced()});
  const std::string model_before = slurp(path), data_before = slurp(path + ".data");
  // The model's temporary cannot be created (a non-empty directory holds its name):
  // the new side file was already written to its own temporary, and must not replace the old one.
  fs::create_directory(path + ".tmp");
  std::ofstream(path + ".tmp/keep") << "x";
  {
    const NoGradGuard no_grad;
    for (auto& p : m->parameters()) p.fill_(0.5);
  }
  EXPECT_THROW_MSG(exporter::to_onnx(*m, {x}, path, {.external_data = forced()}), IOError, "m.onnx.tmp");
  EXPECT_EQ(slurp(path), model_before);
  EXPECT_EQ(slurp(path + ".data"), data_before);
  EXPECT_FALSE(fs::exists(path + ".data.tmp"));
  EXPECT_NO_THROW(exporter::load_onnx(path));
}

// A forced-external MLP whose first external initializer's entries a case rewrites.
class HostileExternal : public ::testing::Test {
 protected:
  void SetUp() override {
    model_dir_ = dir_.path() / "model";
    fs::create_directory(model_dir_);
    auto m = small_mlp();
    const auto r = exporter::to_onnx(*m, {randn({2, 1, 8, 8})}, (model_dir_ / "m.onnx").string(),
                                     {.external_data = forced()});
    ASSERT_GT(r.external_initializers, 0);
    proto_ = read_model((model_dir_ / "m.onnx").string());
    for (int i = 0; i < proto_.graph().initializer_size(); ++i)
      if (proto_.graph().initializer(i).data_location() == onnx::TensorProto::EXTERNAL) {
        index_ = i;
        break;
      }
    data_size_ = static_cast<int64_t>(fs::file_size(model_dir_ / "m.onnx.data"));
  }
  // Sets `key` of the chosen initializer (removing it when `value` is null), writes the model
  // as bad.onnx beside the original and loads it.
  void load_with(const std::string& key, const char* value) {
    onnx::ModelProto p = proto_;
    auto* t = p.mutable_graph()->mutable_initializer(index_);
    auto* entries = t->mutable_external_data();
    for (int i = 0; i < entries->size(); ++i)
      if (entries->Get(i).key() == key) {
        entries->DeleteSubrange(i, 1);
        break;
      }
    if (value) {
      auto* e = t->add_external_data();
      e->set_key(key);
      e->set_value(value);
    }
    write_model(p, (model_dir_ / "bad.onnx").string());
    exporter::load_onnx((model_dir_ / "bad.onnx").string());
  }
  int64_t entry(const std::string& key) const {
    for (const auto& e : proto_.graph().initializer(index_).external_data())
      if (e.key() == key) return std::stoll(e.value());
    return -1;
  }
  TempDir dir_;
  fs::path model_dir_;
  onnx::ModelProto proto_;
  int index_ = -1;
  int64_t data_size_ = 0;
};

TEST_F(HostileExternal, TheUntouchedModelLoads) { EXPECT_NO_THROW(load_with("checksum", nullptr)); }

TEST_F(HostileExternal, AbsoluteLocationIsRefused) {
  const std::string abs = (model_dir_ / "m.onnx.data").string();  // exists, and still refused
  EXPECT_THROW_MSG(load_with("location", abs.c_str()), FormatError, "is absolute");
  EXPECT_THROW_MSG(load_with("location", "/etc/passwd"), FormatError, "is absolute");
}

TEST_F(HostileExternal, DotDotIsRefused) {
  fs::copy_file(model_dir_ / "m.onnx.data", dir_.path() / "outside.data");
  EXPECT_THROW_MSG(load_with("location", "../outside.data"), FormatError, "leaves the model's directory");
  EXPECT_THROW_MSG(load_with("location", "sub/../../outside.data"), FormatError, "leaves the model's directory");
  EXPECT_THROW_MSG(load_with("location", "./../model/m.onnx.data"), FormatError, "leaves the model's directory");
}

TEST_F(HostileExternal, SymlinkOutOfTheDirectoryIsRefused) {
  fs::copy_file(model_dir_ / "m.onnx.data", dir_.path() / "outside.data");
  fs::create_symlink(dir_.path() / "outside.data", model_dir_ / "link.data");
  EXPECT_THROW_MSG(load_with("location", "link.data"), FormatError, "outside the model's directory");
  fs::create_directory_symlink(dir_.path(), model_dir_ / "up");
  EXPECT_THROW_MSG(load_with("location", "up/outside.data"), FormatError, "outside the model's directory");
  // A symlink that stays inside is a plain file to the reader.
  fs::create_symlink(model_dir_ / "m.onnx.data", model_dir_ / "inside.data");
  EXPECT_NO_THROW(load_with("location", "inside.data"));
}

TEST_F(HostileExternal, MissingFileIsNamed) {
  EXPECT_THROW_MSG(load_with("location", "nowhere.data"), IOError, "nowhere.data");
  EXPECT_THROW_MSG(load_with("location", nullptr), FormatError, "has no location");
  fs::create_directory(model_dir_ / "dir.data");
  EXPECT_THROW_MSG(load_with("location", "dir.data"), FormatError, "not a regular file");
}

TEST_F(HostileExternal, OffsetAndLengthMustFitTheFileAndTheTensor) {
  const int64_t length = entry("length");
  ASSERT_GT(length, 0);
  const std::string past = std::to_string(data_size_ - length + 4);
  EXPECT_THROW_MSG(load_with("offset", past.c_str()), FormatError, "lies past the end");
  const std::string huge = std::to_string(int64_t{1} << 50);
  EXPECT_THROW_MSG(load_with("offset", huge.c_str()), FormatError, "lies past the end");
  const std::string shorter = std::to_string(length - 4);
  EXPECT_THROW_MSG(load_with("length", shorter.c_str()), FormatError, "need " + std::to_string(length) + " bytes");
  const std::string longer = std::to_string(length + 4);
  EXPECT_THROW_MSG(load_with("length", longer.c_str()), FormatError, "need " + std::to_string(length) + " bytes");
  for (const char* bad : {"-4", "abc", "", "1e3", "99999999999999999999"})
    EXPECT_THROW_MSG(load_with("offset", bad), FormatError, "non-negative decimal");
}

TEST_F(HostileExternal, InconsistentFieldsAreRefused) {
  onnx::ModelProto p = proto_;
  p.mutable_graph()->mutable_initializer(index_)->set_raw_data("abcd");
  write_model(p, (model_dir_ / "bad.onnx").string());
  EXPECT_THROW_MSG(exporter::load_onnx((model_dir_ / "bad.onnx").string()), FormatError, "also holds data");
  p = proto_;
  p.mutable_graph()->mutable_initializer(index_)->set_data_location(onnx::TensorProto::DEFAULT);
  write_model(p, (model_dir_ / "bad.onnx").string());
  EXPECT_THROW_MSG(exporter::load_onnx((model_dir_ / "bad.onnx").string()), FormatError,
                   "data_location is not EXTERNAL");
  EXPECT_THROW_MSG(load_with("sha256", "x"), FormatError, "unknown external_data key");
}

}  // namespace
}  // namespace kiln::test
