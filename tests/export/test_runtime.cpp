// exporter::Session (issue 21): every zoo model's captured graph, run by kiln's
// graph runtime, gives the module's own eval forward within 1e-5 of the
// output's scale, at two batch sizes (and two sequence lengths for GPT), at
// opsets 17 and 13; and the same through an ONNX file (to_onnx -> load_onnx).
#include <gtest/gtest.h>

#include <onnx/onnx_pb.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <functional>
#include <memory>

#include "kiln/core/allocator.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/check.h"
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

// ---------------------------------------------------------------- hostile files

// A one-node model (y = Relu(x), x float [2]) at `opset`, for tests to break.
onnx::ModelProto relu_model(int64_t opset = 17) {
  onnx::ModelProto m;
  m.set_ir_version(8);
  auto* o = m.add_opset_import();
  o->set_domain("");
  o->set_version(opset);
  auto* g = m.mutable_graph();
  g->set_name("relu");
  for (auto* vi : {g->add_input(), g->add_output()}) {
    vi->set_name(vi == &g->input(0) ? "x" : "y");
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(onnx::TensorProto::FLOAT);
    tt->mutable_shape()->add_dim()->set_dim_value(2);
  }
  auto* n = g->add_node();
  n->set_name("n0");
  n->set_op_type("Relu");
  n->add_input("x");
  n->add_output("y");
  return m;
}

std::string write_model(const TempDir& dir, const onnx::ModelProto& m, const std::string& name = "m.onnx") {
  const std::string path = dir.file(name);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  m.SerializeToOstream(&f);
  return path;
}

std::string write_bytes(const TempDir& dir, const std::string& bytes, const std::string& name = "b.onnx") {
  const std::string path = dir.file(name);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

TEST(LoadOnnx, TheOneNodeModelLoadsAndRuns) {
  TempDir dir;
  const Session s(exporter::load_onnx(write_model(dir, relu_model())));
  EXPECT_TRUE(s.run({tensor<float>({-1.0f, 2.0f}, {2})})[0].equal(tensor<float>({0.0f, 2.0f}, {2})));
}

TEST(LoadOnnx, TruncatedFilesAreRefused) {
  TempDir dir;
  manual_seed(3);
  auto mlp = models::MLP(models::MLPOptions{.in_features = 16, .hidden = {8}});
  const std::string path = dir.file("mlp.onnx");
  exporter::to_onnx(mlp, {randn({2, 16})}, path);
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100u);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{16}, bytes.size() / 3, bytes.size() / 2, bytes.size() - 1}) {
    SCOPED_TRACE(cut);
    EXPECT_THROW(exporter::load_onnx(write_bytes(dir, bytes.substr(0, cut))), Error);
  }
  EXPECT_THROW_MSG(exporter::load_onnx(write_bytes(dir, bytes.substr(0, bytes.size() / 2))), FormatError,
                   "truncated, corrupt or not ONNX");
}

TEST(LoadOnnx, RandomBytesAreRefusedWithAnError) {
  TempDir dir;
  Generator gen(7);
  for (int i = 0; i < 50; ++i) {
    const Tensor r = randint(0, 256, {1 + 97 * i}, TensorOptions(kInt64), &gen);
    std::string bytes;
    for (double v : to_doubles(r)) bytes.push_back(static_cast<char>(static_cast<int>(v)));
    EXPECT_THROW(exporter::load_onnx(write_bytes(dir, bytes)), Error) << "random file " << i;
    EXPECT_THROW(exporter::load_onnx_tensor(write_bytes(dir, bytes)), Error) << "random file " << i;
  }
}

TEST(LoadOnnx, ANodeReadingAnUndefinedValueIsRefused) {
  TempDir dir;
  onnx::ModelProto m = relu_model();
  m.mutable_graph()->mutable_node(0)->set_input(0, "nowhere");
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), FormatError, "reads 'nowhere'");
}

TEST(LoadOnnx, InitializersOfTheWrongSizeAreRefusedBeforeAllocating) {
  TempDir dir;
  onnx::ModelProto m = relu_model();
  auto* init = m.mutable_graph()->add_initializer();
  init->set_name("w");
  init->set_data_type(onnx::TensorProto::FLOAT);
  init->add_dims(4);
  init->set_raw_data(std::string(8, '\0'));
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), FormatError,
                   "tensor 'w' of shape [4] needs 4 elements, its raw_data holds 2");
  // Dims promising 2^40 floats over 8 bytes: refused, nothing allocated; 2^60: the count overflows.
  init->clear_dims();
  for (int i = 0; i < 2; ++i) init->add_dims(int64_t{1} << 20);
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), FormatError, "its raw_data holds 2");
  init->add_dims(int64_t{1} << 20);
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), FormatError, "element count overflows");
  init->clear_raw_data();
  init->clear_dims();
  init->add_dims(3);
  init->add_float_data(1.0f);
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), FormatError, "its float_data holds 1");
  init->clear_float_data();
  // External data is read (test_external_data.cpp); without a location it is refused.
  init->set_data_location(onnx::TensorProto::EXTERNAL);
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), FormatError, "external_data has no location");
}

TEST(LoadOnnx, OpsAndOpsetsWithoutAKernelAreRefusedNamingTheNode) {
  TempDir dir;
  onnx::ModelProto m = relu_model();
  m.mutable_graph()->mutable_node(0)->set_op_type("LSTM");
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, m)), ValueError, "node 'n0' (LSTM)");
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, relu_model(19))), FormatError, "opset 19");
  onnx::ModelProto old = relu_model(11);
  old.mutable_graph()->mutable_node(0)->set_op_type("Softmax");
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, old)), ValueError,
                   "implements it from opset 13");
  onnx::ModelProto seq = relu_model();
  seq.mutable_graph()->mutable_input(0)->mutable_type()->mutable_sequence_type();
  EXPECT_THROW_MSG(exporter::load_onnx(write_model(dir, seq)), FormatError, "is not a tensor");
}

TEST(LoadOnnx, MissingFilesAndNonTensorFilesAreRefused) {
  TempDir dir;
  EXPECT_THROW_MSG(exporter::load_onnx(dir.file("absent.onnx")), IOError, "cannot open");
  EXPECT_THROW(exporter::load_onnx_tensor(write_model(dir, relu_model())), Error);
}

// ---------------------------------------------------------------- per-module check in-process

// The per-module check of check.h with kiln's runtime in ONNX Runtime's place:
// every module of a ViT agrees with kiln's forward, and a LayerNormalization
// broken on purpose (epsilon 0.5) is named as the first divergent module.
TEST(RuntimeCheck, ModuleOutputsAgreeAndABrokenLayerNormIsNamed) {
  manual_seed(5);
  models::ViT vit(models::ViTOptions{
      .image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32});
  vit.eval();
  const Tensor x = randn({2, 1, 8, 8});
  Graph g = exporter::capture(vit, {x}, {.dynamic_axes = {{"input", {{0, "batch"}}}}});
  const auto kiln_values = exporter::module_values(vit, g, x);
  const auto report = exporter::compare_module_outputs(g, kiln_values, exporter::run_all_values(g, {x}), 1e-5);
  EXPECT_FALSE(report.first_divergent.has_value()) << report.str();
  EXPECT_EQ(report.rows.size(), g.module_outputs.size());
  for (exporter::Node& n : g.nodes)
    if (n.module == "blocks.1.ln_2") n.attributes["epsilon"] = 0.5f;
  const auto broken = exporter::compare_module_outputs(g, kiln_values, exporter::run_all_values(g, {x}), 1e-5);
  ASSERT_TRUE(broken.first_divergent.has_value()) << broken.str();
  EXPECT_EQ(broken.rows[*broken.first_divergent].module, "blocks.1.ln_2") << broken.str();
  EXPECT_EQ(broken.rows[*broken.first_divergent].op_type, "LayerNormalization");
}

// Opset 18's forms of the two runtime ops it changed: ReduceMean's axes as an
// input, Split's num_outputs (uneven: the last part is smaller).
TEST(LoadOnnx, Opset18ReduceAxesInputAndSplitNumOutputs) {
  TempDir dir;
  onnx::ModelProto m = relu_model(18);
  auto* g = m.mutable_graph();
  g->mutable_input(0)->mutable_type()->mutable_tensor_type()->mutable_shape()->add_dim()->set_dim_value(7);
  g->clear_node();
  g->clear_output();
  auto* axes = g->add_initializer();
  axes->set_name("axes");
  axes->set_data_type(onnx::TensorProto::INT64);
  axes->add_dims(1);
  axes->add_int64_data(0);
  auto* mean = g->add_node();
  mean->set_op_type("ReduceMean");
  mean->add_input("x");
  mean->add_input("axes");
  mean->add_output("m");
  auto* keep = mean->add_attribute();
  keep->set_name("keepdims");
  keep->set_type(onnx::AttributeProto::INT);
  keep->set_i(0);
  auto* split = g->add_node();
  split->set_op_type("Split");
  split->add_input("m");
  for (const char* o : {"a", "b", "c"}) split->add_output(o);
  auto* n = split->add_attribute();
  n->set_name("num_outputs");
  n->set_type(onnx::AttributeProto::INT);
  n->set_i(3);
  for (const char* o : {"a", "b", "c"}) {
    auto* vi = g->add_output();
    vi->set_name(o);
    vi->mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::FLOAT);
  }
  const Session s(exporter::load_onnx(write_model(dir, m)));
  const Tensor x = randn({2, 7});
  const auto out = s.run({x});
  ASSERT_EQ(out.size(), 3u);
  const Tensor want = x.mean({0});
  EXPECT_TRUE(out[0].allclose(want.slice(0, 0, 3)));
  EXPECT_TRUE(out[1].allclose(want.slice(0, 3, 6)));
  EXPECT_TRUE(out[2].allclose(want.slice(0, 6, 7)));
}

// Intermediates die after their last reader: a chain of 16 Relu/Neg nodes over
// a 4 MB input holds at most the input, one value being read and the one being
// made, not all sixteen.
TEST(Runtime, IntermediatesAreReleasedAfterTheirLastReader) {
  Graph g;
  g.name = "chain";
  const exporter::Shape shape{exporter::Dim::fixed(1024), exporter::Dim::fixed(1024)};
  g.inputs = {{"x", kFloat32, shape}};
  std::string prev = "x";
  for (int i = 0; i < 16; ++i) {
    exporter::Node n;
    n.name = "n" + std::to_string(i);
    n.op_type = i % 2 ? "Neg" : "Relu";
    n.inputs = {prev};
    n.outputs = {i == 15 ? std::string("output") : "v" + std::to_string(i)};
    prev = n.outputs[0];
    g.nodes.push_back(n);
  }
  g.outputs = {{"output", kFloat32, shape}};
  const Session s(g);
  const Tensor x = randn({1024, 1024});
  const int64_t bytes = x.nbytes();
  memory::empty_cache();
  const int64_t before = memory::stats().live_bytes;
  memory::reset_peak_stats();
  Tensor y = s.run({x})[0];
  const int64_t peak = memory::stats().peak_bytes - before;
  EXPECT_LE(peak, 2 * bytes + 4096) << "peak " << peak << " bytes for values of " << bytes;
  EXPECT_GE(peak, bytes);
  EXPECT_TRUE(y.equal(x.relu().neg().relu().neg().relu().neg().relu().neg().relu().neg().relu().neg().relu().neg()
                          .relu().neg()));
}

}  // namespace
}  // namespace kiln::test
