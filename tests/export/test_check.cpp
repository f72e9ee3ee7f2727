// The per-node check (check.h's compare_nodes) in-process, kiln's runtime
// standing in for the consumer: each zoo model's healthy graph has no
// divergent node; an exporter bug (a wrong LayerNorm epsilon) is named at its
// node with the verdict "module"; a consumer that computes one op differently
// (Erf by an approximation) is named at the first node of that op, inside a
// module, with the verdict "runtime"; one that misreads a module output's op
// gets "both". ONNX Runtime as the consumer:
// tests/cli/test_cli_export_check.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <set>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/check.h"
#include "kiln/export/runtime.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/ops/factory.h"

namespace kiln::test {
namespace {

using exporter::Graph;

std::shared_ptr<models::ViT> tiny_vit() {
  return std::make_shared<models::ViT>(models::ViTOptions{
      .image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32});
}

struct Case {
  const char* name;
  std::shared_ptr<nn::Module> model;
  Tensor input;
};

std::vector<Case> zoo() {
  manual_seed(7);
  auto resnet = std::make_shared<models::ResNet>(
      models::ResNetOptions{.in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 10});
  {
    // Running statistics that are not the identity.
    const NoGradGuard no_grad;
    for (int i = 0; i < 2; ++i) (*resnet)(randn({4, 3, 16, 16}) * 2.0 + 0.5);
  }
  return {
      {"mlp", std::make_shared<models::MLP>(models::MLPOptions{.in_features = 64, .hidden = {32, 16}}),
       randn({2, 1, 8, 8})},
      {"cnn",
       std::make_shared<models::CNN>(models::CNNOptions{
           .in_channels = 1, .channels1 = 4, .channels2 = 8, .hidden = 16, .num_classes = 10, .input_size = {12}}),
       randn({2, 1, 12, 12})},
      {"resnet", resnet, randn({2, 3, 16, 16})},
      {"vit", tiny_vit(), randn({2, 1, 8, 8})},
      {"gpt",
       std::make_shared<models::GPT>(
           models::GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16}),
       randint(0, 32, {2, 9}, TensorOptions(kInt64))},
  };
}

Graph capture_of(nn::Module& m, const Tensor& x, int64_t opset = 17) {
  std::map<int64_t, std::string> dyn{{0, "batch"}};
  if (x.dtype() == kInt64) dyn[1] = "seq";
  return exporter::capture(m, {x}, {.dynamic_axes = {{"input", dyn}}, .opset = opset});
}

TEST(NodeCheck, EveryZooModelAgreesAtEveryNode) {
  for (Case& c : zoo()) {
    c.model->eval();
    for (int64_t opset : {17, 13}) {
      const Graph g = capture_of(*c.model, c.input, opset);
      const auto values = exporter::run_all_values(g, {c.input});
      const auto report =
          exporter::compare_nodes(g, values, values, exporter::module_values(*c.model, g, c.input), 1e-4);
      EXPECT_FALSE(report.first_divergent.has_value()) << c.name << " opset " << opset << "\n" << report.str();
      ASSERT_EQ(report.rows.size(), g.nodes.size()) << c.name;
      size_t with_module = 0;
      for (const auto& row : report.rows) {
        EXPECT_EQ(row.verdict(), "ok") << c.name << " " << row.node;
        with_module += row.eager.has_value();
      }
      // Every module output is some node's output, so each has an eager comparison.
      std::set<std::string> module_values;
      for (const auto& m : g.module_outputs) module_values.insert(m.value);
      EXPECT_EQ(with_module, module_values.size()) << c.name;
      EXPECT_EQ(report.modules.rows.size(), g.module_outputs.size()) << c.name;
      EXPECT_NE(report.str().find("every node agrees within 1e-04"), std::string::npos) << report.str();
    }
  }
}

// An exporter bug: consumer and kiln's runtime agree on the wrong graph; only
// the module's own forward shows it, at the LayerNorm's node (opset 17: one
// LayerNormalization) or at the last of its written-out nodes (opset 13).
TEST(NodeCheck, AWrongLayerNormEpsilonIsNamedAtItsNode) {
  manual_seed(3);
  auto vit = tiny_vit();
  vit->eval();
  const Tensor x = randn({2, 1, 8, 8});
  for (int64_t opset : {17, 13}) {
    Graph g = capture_of(*vit, x, opset);
    const auto eager = exporter::module_values(*vit, g, x);
    int broken = 0;
    if (opset == 17) {
      for (exporter::Node& n : g.nodes)
        if (n.module == "blocks.1.ln_2" && n.op_type == "LayerNormalization") {
          n.attributes["epsilon"] = 0.5f;
          ++broken;
        }
    } else {
      // The written-out LayerNorm adds epsilon, a scalar constant, to the
      // variance; this Add alone reads a new one.
      for (exporter::Node& n : g.nodes) {
        if (n.module != "blocks.1.ln_2" || n.op_type != "Add") continue;
        const Tensor* c = exporter::find_initializer(g, n.inputs[1]);
        if (!c || c->numel() != 1) continue;
        const Tensor eps = full(c->sizes(), 0.5f);
        g.initializers.emplace_back("broken_eps", eps);
        g.values["broken_eps"] = g.values.at(n.inputs[1]);
        g.values["broken_eps"].name = "broken_eps";
        n.inputs[1] = "broken_eps";
        ++broken;
      }
    }
    ASSERT_EQ(broken, 1) << "opset " << opset;
    const auto values = exporter::run_all_values(g, {x});
    const auto report = exporter::compare_nodes(g, values, values, eager, 1e-4);
    ASSERT_TRUE(report.first_divergent.has_value()) << report.str();
    const auto& first = report.rows[*report.first_divergent];
    EXPECT_EQ(first.module, "blocks.1.ln_2") << report.str();
    EXPECT_EQ(first.module_type, "LayerNorm");
    EXPECT_EQ(first.eager_module, "blocks.1.ln_2");
    EXPECT_EQ(first.verdict(), "module");
    if (opset == 17) EXPECT_EQ(first.op_type, "LayerNormalization");
    EXPECT_GT(first.eager->scaled, 1e-2);
    // No node reads differently in the two runtimes; the error is the graph's.
    for (const auto& row : report.rows) EXPECT_FALSE(row.runtime.diverges) << row.node;
    ASSERT_TRUE(report.modules.first_divergent.has_value());
    EXPECT_EQ(report.modules.rows[*report.modules.first_divergent].module, "blocks.1.ln_2");
    EXPECT_NE(report.str().find("first divergent node past 1e-04 (relative to the value's scale): " + first.node + " (" +
                                first.op_type + ") of kiln module blocks.1.ln_2 (LayerNorm): the exported graph "
                                                "differs from kiln's module"),
              std::string::npos)
        << report.str();
    EXPECT_NE(report.json().find("\"first_divergent\": \"" + first.node + "\""), std::string::npos) << report.json();
  }
}

// A consumer that computes one op differently (Tanh by the Pade approximant
// x (27 + x^2) / (27 + 9 x^2), clamped to [-1, 1], as fast-math kernels do;
// off by up to about 0.02): the first Tanh node, inside the first GELU and no
// module's output, is named with the verdict "runtime", though every node
// before it agrees.
TEST(NodeCheck, AConsumerThatComputesAnOpDifferentlyIsNamedAtThatNode) {
  manual_seed(4);
  auto vit = tiny_vit();
  vit->eval();
  const Tensor x = randn({2, 1, 8, 8});
  const Graph g = capture_of(*vit, x);
  exporter::SessionOptions skewed;
  skewed.kernels["Tanh"] = [](const exporter::Node&, const Graph&) -> exporter::Kernel {
    return [](const std::vector<Tensor>& in) {
      const Tensor x2 = in[0] * in[0];
      return std::vector<Tensor>{(in[0] * (x2 + 27.0) / (x2 * 9.0 + 27.0)).clamp(-1.0, 1.0)};
    };
  };
  const auto consumer = exporter::run_all_values(g, {x}, skewed);
  const auto report = exporter::compare_nodes(g, consumer, exporter::run_all_values(g, {x}),
                                              exporter::module_values(*vit, g, x), 1e-4);
  ASSERT_TRUE(report.first_divergent.has_value()) << report.str();
  const auto& first = report.rows[*report.first_divergent];
  EXPECT_EQ(first.op_type, "Tanh") << report.str();
  EXPECT_EQ(first.module, "blocks.0.mlp.gelu");
  EXPECT_EQ(first.module_type, "GELU");
  EXPECT_FALSE(first.eager.has_value());  // an inner node of the GELU
  EXPECT_EQ(first.verdict(), "runtime");
  for (size_t i = 0; i < *report.first_divergent; ++i) EXPECT_FALSE(report.rows[i].diverges) << report.rows[i].node;
  EXPECT_NE(report.str().find("ONNX Runtime and kiln's runtime of the same graph disagree"), std::string::npos)
      << report.str();
}

// A consumer that misreads an attribute at a module's output node (it takes
// LayerNormalization's epsilon as 0.5): it differs from kiln's runtime and
// from kiln's module there, the verdict "both".
TEST(NodeCheck, AConsumerWrongAtAModuleOutputDiffersFromBothKilnSides) {
  manual_seed(6);
  auto vit = tiny_vit();
  vit->eval();
  const Tensor x = randn({2, 1, 8, 8});
  const Graph g = capture_of(*vit, x);
  exporter::SessionOptions misread;
  misread.kernels["LayerNormalization"] = [](const exporter::Node& n, const Graph& graph) {
    exporter::Node wrong = n;
    wrong.attributes["epsilon"] = 0.5f;
    return exporter::builtin_kernel("LayerNormalization")(wrong, graph);
  };
  const auto report =
      exporter::compare_nodes(g, exporter::run_all_values(g, {x}, misread), exporter::run_all_values(g, {x}),
                              exporter::module_values(*vit, g, x), 1e-4);
  ASSERT_TRUE(report.first_divergent.has_value()) << report.str();
  const auto& first = report.rows[*report.first_divergent];
  EXPECT_EQ(first.op_type, "LayerNormalization") << report.str();
  EXPECT_EQ(first.module, "blocks.0.ln_1");
  EXPECT_EQ(first.verdict(), "both");
  EXPECT_NE(report.str().find("ONNX Runtime differs from both kiln's runtime and kiln's module"), std::string::npos);
}

TEST(NodeCheck, EveryNodeOutputBecomesAGraphOutputOnce) {
  auto vit = tiny_vit();
  const Tensor x = randn({1, 1, 8, 8});
  const Graph g = capture_of(*vit, x);
  const Graph all = exporter::with_node_outputs(g);
  std::set<std::string> names;
  for (const auto& v : all.outputs) EXPECT_TRUE(names.insert(v.name).second) << "twice: " << v.name;
  EXPECT_EQ(all.outputs.front().name, "output");
  size_t node_outputs = 0;
  for (const auto& n : g.nodes)
    for (const auto& o : n.outputs) {
      node_outputs += !o.empty();
      EXPECT_TRUE(o.empty() || names.count(o)) << o;
    }
  EXPECT_EQ(all.outputs.size(), node_outputs);  // "output" is a node's output too
  all.validate();
}

// Values that a consumer reports with another shape, NaN where kiln has a
// number, or a different infinity diverge whatever their size; equal
// infinities (an attention mask's -inf) agree.
TEST(NodeCheck, ShapeNanAndInfinityDifferencesDiverge) {
  Graph g;
  g.name = "one";
  const exporter::Shape s{exporter::Dim::fixed(3)};
  g.inputs = {{"x", kFloat32, s}};
  exporter::Node n;
  n.name = "relu";
  n.op_type = "Relu";
  n.inputs = {"x"};
  n.outputs = {"output"};
  g.nodes = {n};
  g.outputs = {{"output", kFloat32, s}};
  g.values = {{"x", g.inputs[0]}, {"output", g.outputs[0]}};
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor kiln = tensor(std::vector<float>{1.f, -inf, 2.f}, {3});
  auto check = [&](const Tensor& consumer) {
    return exporter::compare_nodes(g, {{"output", consumer}}, {{"output", kiln}}, {}, 1e-4).rows[0].runtime;
  };
  EXPECT_FALSE(check(tensor(std::vector<float>{1.f, -inf, 2.f}, {3})).diverges);
  const auto nan = check(tensor(std::vector<float>{1.f, -inf, std::nanf("")}, {3}));
  EXPECT_TRUE(nan.diverges);
  EXPECT_EQ(nan.note, "NaN on one side only");
  const auto other_inf = check(tensor(std::vector<float>{1.f, inf, 2.f}, {3}));
  EXPECT_TRUE(other_inf.diverges);
  EXPECT_EQ(other_inf.note, "inf on one side only, or of the other sign");
  const auto shape = check(tensor(std::vector<float>{1.f, 2.f}, {2}));
  EXPECT_TRUE(shape.diverges);
  EXPECT_EQ(shape.note, "shape [2] where kiln has [3]");
  const auto small = check(tensor(std::vector<float>{1.f, -inf, 2.0001f}, {3}));
  EXPECT_FALSE(small.diverges);  // 1e-4 / 2 = 5e-5 of the scale
  EXPECT_NEAR(small.scaled, 5e-5, 1e-6);
  const auto missing = exporter::compare_nodes(g, {}, {{"output", kiln}}, {}, 1e-4);
  EXPECT_TRUE(missing.rows[0].runtime.diverges);
  EXPECT_EQ(missing.rows[0].verdict(), "runtime");
}

}  // namespace
}  // namespace kiln::test
