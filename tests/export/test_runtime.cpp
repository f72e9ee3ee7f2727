// exporter::Session (issue 21): every zoo model's captured graph, run by kiln's
// graph runtime, gives the module's own eval forward within 1e-5 of the
// output's scale, at two batch sizes (and two sequence lengths for GPT), at
// opsets 17 and 13; and the same through an ONNX file (to_onnx -> load_onnx).
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <memory>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/onnx.h"
#include "kiln/export/runtime.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

using exporter::Graph;
using exporter::Session;

constexpr double kTol = 1e-5;

// Expects `stmt` to throw `E` whose message contains `part`.
#define EXPECT_THROW_MSG(stmt, E, part)                                                      \
  do {                                                                                       \
    try {                                                                                    \
      stmt;                                                                                  \
      ADD_FAILURE() << #stmt " did not throw";                                               \
    } catch (const E& e) {                                                                   \
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();           \
    }                                                                                        \
  } while (0)

struct ZooCase {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> make;
  std::function<Tensor(int64_t batch, int64_t seq)> input;
  std::map<int64_t, std::string> dynamic;
  std::vector<std::pair<int64_t, int64_t>> sizes;  // (batch, seq) per run
};

std::vector<ZooCase> zoo() {
  auto image = [](int64_t c, int64_t hw) {
    return [c, hw](int64_t n, int64_t) { return randn({n, c, hw, hw}); };
  };
  return {
      {"mlp", [] { return std::make_shared<models::MLP>(models::MLPOptions{.in_features = 64, .hidden = {32, 16}}); },
       image(1, 8), {{0, "batch"}}, {{2, 0}, {5, 0}}},
      {"cnn",
       [] {
         return std::make_shared<models::CNN>(models::CNNOptions{
             .in_channels = 1, .channels1 = 4, .channels2 = 8, .hidden = 16, .num_classes = 10, .input_size = {12}});
       },
       image(1, 12), {{0, "batch"}}, {{2, 0}, {5, 0}}},
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
       image(3, 16), {{0, "batch"}}, {{2, 0}, {5, 0}}},
      {"vit",
       [] {
         return std::make_shared<models::ViT>(models::ViTOptions{
             .image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32});
       },
       image(1, 8), {{0, "batch"}}, {{2, 0}, {5, 0}}},
      {"gpt",
       [] {
         return std::make_shared<models::GPT>(
             models::GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16});
       },
       [](int64_t b, int64_t t) { return randint(0, 32, {b, t}, TensorOptions(kInt64)); }, {{0, "batch"}, {1, "seq"}},
       {{2, 7}, {3, 12}}},
  };
}

struct ZooParam {
  int model;
  int64_t opset;
};

class RuntimeZoo : public ::testing::TestWithParam<ZooParam> {
 protected:
  void SetUp() override {
    c_ = zoo()[static_cast<size_t>(GetParam().model)];
    manual_seed(21);
    model_ = c_.make();
    model_->eval();
    for (auto [b, t] : c_.sizes) {
      inputs_.push_back(c_.input(b, t));
      const NoGradGuard no_grad;
      want_.push_back((*model_)(inputs_.back()));
    }
  }
  void expect_matches(const Session& s, const char* how) {
    double worst = 0;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const std::vector<Tensor> got = s.run({inputs_[i]});
      ASSERT_EQ(got.size(), 1u);
      ASSERT_EQ(got[0].sizes(), want_[i].sizes()) << got[0].shape_string() << " vs " << want_[i].shape_string();
      const double d = scaled_max_diff(got[0], want_[i]);
      EXPECT_LE(d, kTol) << c_.name << " at input " << inputs_[i].shape_string();
      worst = std::max(worst, d);
    }
    std::printf("runtime %s: %s opset %lld, max scaled diff %.2e over %zu sizes\n", how, c_.name.c_str(),
                static_cast<long long>(GetParam().opset), worst, inputs_.size());
  }
  ZooCase c_;
  std::shared_ptr<nn::Module> model_;
  std::vector<Tensor> inputs_, want_;
};

TEST_P(RuntimeZoo, CapturedGraphRunsAsTheModuleAtTwoSizes) {
  const Graph g = exporter::capture(*model_, {inputs_[0]},
                                    {.dynamic_axes = {{"input", c_.dynamic}}, .opset = GetParam().opset});
  expect_matches(Session(g), "capture");
}

TEST_P(RuntimeZoo, OnnxRoundTripRunsAsTheModuleAtTwoSizes) {
  TempDir dir;
  const std::string path = dir.file(c_.name + ".onnx");
  exporter::to_onnx(*model_, {inputs_[0]}, path, {.dynamic_axes = {{"input", c_.dynamic}}, .opset = GetParam().opset});
  const Graph g = exporter::load_onnx(path);
  ASSERT_EQ(g.inputs.size(), 1u);
  EXPECT_EQ(g.inputs[0].shape[0].symbol, "batch");
  expect_matches(Session(g), "onnx round trip");
}

std::vector<ZooParam> zoo_params() {
  std::vector<ZooParam> p;
  for (int m = 0; m < 5; ++m)
    for (int64_t opset : {17, 13}) p.push_back({m, opset});
  return p;
}

INSTANTIATE_TEST_SUITE_P(Zoo, RuntimeZoo, ::testing::ValuesIn(zoo_params()),
                         [](const ::testing::TestParamInfo<ZooParam>& i) {
                           return zoo()[static_cast<size_t>(i.param.model)].name + "_opset" +
                                  std::to_string(i.param.opset);
                         });

// ---------------------------------------------------------------- Session's checks

Graph tiny_graph() {
  Graph g;
  g.name = "tiny";
  g.inputs = {{"a", kFloat32, {exporter::Dim::sym("batch"), exporter::Dim::fixed(3)}},
              {"b", kFloat32, {exporter::Dim::sym("batch"), exporter::Dim::fixed(3)}}};
  exporter::Node add;
  add.name = "add0";
  add.op_type = "Add";
  add.inputs = {"a", "b"};
  add.outputs = {"sum"};
  exporter::Node relu;
  relu.name = "relu0";
  relu.op_type = "Relu";
  relu.inputs = {"sum"};
  relu.outputs = {"output"};
  g.nodes = {add, relu};
  g.outputs = {{"output", kFloat32, {exporter::Dim::sym("batch"), exporter::Dim::fixed(3)}}};
  return g;
}

TEST(Runtime, RunsATinyGraph) {
  const Session s(tiny_graph());
  const Tensor a = tensor<float>({1, -2, 3, -4, 5, -6}, {2, 3});
  const Tensor b = tensor<float>({1, 1, 1, 1, 1, 1}, {2, 3});
  const Tensor y = s.run({a, b})[0];
  EXPECT_TRUE(y.equal(tensor<float>({2, 0, 4, 0, 6, 0}, {2, 3})));
}

TEST(Runtime, InputChecksNameTheInputAndWhatWasExpected) {
  const Session s(tiny_graph());
  EXPECT_THROW_MSG(s.run({randn({2, 3})}), ValueError, "expects 2 inputs, got 1");
  EXPECT_THROW_MSG(s.run({randn({2, 3}), randn({2, 4})}), ShapeError, "input 'b' expects shape [batch, 3], got [2, 4]");
  EXPECT_THROW_MSG(s.run({randn({2, 3}), randn({5, 3})}), ShapeError, "\"batch\") is 5, but \"batch\" is 2");
  EXPECT_THROW_MSG(s.run({randn({2, 3}), zeros({2, 3}, TensorOptions(kInt64))}), DTypeError,
                   "input 'b' expects dtype float32, got int64");
}

TEST(Runtime, UnknownOpIsRefusedNamingTheNode) {
  Graph g = tiny_graph();
  g.nodes[1].op_type = "Frobnicate";
  EXPECT_THROW_MSG(Session{g}, ValueError, "node 'relu0' (Frobnicate)");
}

TEST(Runtime, OptionsOverrideAKernel) {
  exporter::SessionOptions o;
  int calls = 0;
  o.kernels["Relu"] = [&calls](const exporter::Node&, const Graph&) -> exporter::Kernel {
    return [&calls](const std::vector<Tensor>& in) {
      ++calls;
      return std::vector<Tensor>{in[0].neg()};
    };
  };
  const Session s(tiny_graph(), o);
  const Tensor y = s.run({ones({1, 3}), ones({1, 3})})[0];
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(y.equal(full({1, 3}, -2.0f)));
}

TEST(Runtime, KernelErrorsNameTheNode) {
  Graph g = tiny_graph();
  g.inputs[1].shape[1] = exporter::Dim::sym("other");
  const Session s(g);
  EXPECT_THROW_MSG(s.run({randn({2, 3}), randn({2, 4})}), ValueError, "node 'add0' (Add)");
}

}  // namespace
}  // namespace kiln::test
