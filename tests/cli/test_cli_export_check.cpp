// `kiln export --check`: ONNX Runtime beside kiln, node by node (against
// kiln's runtime of the same graph, and at module outputs against kiln's
// module). A correct export of each zoo model agrees at every node; an export
// with one op broken on purpose (a wrong epsilon in one LayerNorm's node) is
// traced to that node, not to the nodes after it that inherit its error.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/export_check.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/optimize.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/ops/factory.h"

namespace kiln::test {
namespace {

TEST(CliExportCheck, GptRunAgreesNodeByNode) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const std::string run = dir.file("run");
  ASSERT_EQ(kiln_cli("train " + dir.file("gpt.toml") + " --out " + run).rc, 0);
  const auto r = kiln_cli("export " + run + " --check");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("check: ONNX Runtime beside kiln on an input [2, 32], node by node"), std::string::npos)
      << r.output;
  // Node rows (an inner node of attention, with its module) and the module summary.
  EXPECT_NE(r.output.find("transformer.h.0.attn (CausalSelfAttention)"), std::string::npos) << r.output;
  for (const char* row : {"transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.gelu",
                          "transformer.ln_f", "<root>"})
    EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
  EXPECT_NE(r.output.find("every module's output agrees within 1e-04"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every node agrees within 1e-04"), std::string::npos) << r.output;

  // The JSON beside the model: every node, each compared with kiln's runtime.
  EXPECT_NE(r.output.find("wrote " + run + "/model.check.json"), std::string::npos) << r.output;
  std::ifstream f(run + "/model.check.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_TRUE(j["first_divergent"].is_null());
  ASSERT_GE(j["nodes"].size(), 40u);  // 50 for this one-layer GPT
  size_t with_module = 0, gelu_inner = 0;
  for (const auto& n : j["nodes"]) {
    EXPECT_EQ(n["verdict"], "ok") << n.dump();
    EXPECT_LE(n["runtime"]["scaled"].get<double>(), 1e-4) << n.dump();
    with_module += !n["eager"].is_null();
    gelu_inner += n["module"] == "transformer.h.0.mlp.gelu" && n["eager"].is_null();
  }
  // A node per distinct module output ("<root>" and lm_head share one) is compared with the module.
  std::set<std::string> module_nodes;
  for (const auto& m : j["modules"]) module_nodes.insert(m["node"].get<std::string>());
  EXPECT_EQ(with_module, module_nodes.size());
  EXPECT_GT(gelu_inner, 0u);  // GELU's inner nodes are rows too, compared with kiln's runtime only
}

struct Case {
  const char* name;
  std::shared_ptr<nn::Module> model;
  Tensor input;
};

std::vector<Case> zoo() {
  manual_seed(11);
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
      {"vit",
       std::make_shared<models::ViT>(models::ViTOptions{
           .image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32}),
       randn({2, 1, 8, 8})},
      {"gpt",
       std::make_shared<models::GPT>(
           models::GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16}),
       randint(0, 32, {2, 9}, TensorOptions(kInt64))},
  };
}

// ONNX Runtime returns every node's output of each zoo model (no duplicate or
// optional output refused) and agrees with kiln at every one.
TEST(CliExportCheck, EveryZooModelAgreesWithOnnxRuntimeAtEveryNode) {
  for (Case& c : zoo()) {
    c.model->eval();
    std::map<int64_t, std::string> dyn{{0, "batch"}};
    if (c.input.dtype() == kInt64) dyn[1] = "seq";
    const exporter::Graph g = exporter::capture(*c.model, {c.input}, {.dynamic_axes = {{"input", dyn}}});
    const auto report = cli::check_export(*c.model, g, c.input, 17);
    EXPECT_FALSE(report.first_divergent.has_value()) << c.name << "\n" << report.str();
    ASSERT_EQ(report.rows.size(), g.nodes.size()) << c.name;
    double worst_rt = 0, worst_mod = 0;
    for (const auto& row : report.rows) {
      EXPECT_TRUE(row.runtime.note.empty()) << c.name << " " << row.node << ": " << row.runtime.note;
      worst_rt = std::max(worst_rt, row.runtime.scaled);
      if (row.eager) worst_mod = std::max(worst_mod, row.eager->scaled);
    }
    std::printf("export check %s: %zu nodes, worst ORT vs kiln runtime %.2e, ORT vs kiln module %.2e\n", c.name,
                report.rows.size(), worst_rt, worst_mod);
    if (std::string(c.name) == "resnet") {
      // --optimize --check: each folded Conv computes its BatchNorm's output, compared with that module.
      exporter::Graph folded = g;
      ASSERT_GT(exporter::fold_batch_norm(folded).folded, 0);
      const auto f = cli::check_export(*c.model, folded, c.input, 17);
      EXPECT_FALSE(f.first_divergent.has_value()) << f.str();
    }
  }
}

TEST(CliExportCheck, AWrongLayerNormEpsilonIsNamedAsTheFirstDivergentNode) {
  manual_seed(4);
  models::ViT vit({.image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32});
  vit.eval();
  exporter::Graph g = exporter::capture(vit, {randn({1, 1, 8, 8})}, {.dynamic_axes = {{"input", {{0, "batch"}}}}});
  int broken = 0;
  for (exporter::Node& n : g.nodes)
    if (n.op_type == "LayerNormalization" && n.module == "blocks.1.ln_2") {
      n.attributes["epsilon"] = 0.5f;  // LayerNorm's is 1e-5
      ++broken;
    }
  ASSERT_EQ(broken, 1);
  const auto report = cli::check_export(vit, g, randn({3, 1, 8, 8}), 17);
  ASSERT_TRUE(report.first_divergent.has_value()) << report.str();
  const auto& first = report.rows[*report.first_divergent];
  EXPECT_EQ(first.node, "blocks.1.ln_2/LayerNormalization") << report.str();
  EXPECT_EQ(first.op_type, "LayerNormalization");
  EXPECT_EQ(first.module, "blocks.1.ln_2");
  EXPECT_EQ(first.module_type, "LayerNorm");
  // ONNX Runtime and kiln's runtime agree on the broken graph; kiln's module does not.
  EXPECT_EQ(first.verdict(), "module");
  EXPECT_GT(first.eager->scaled, 1e-3);
  for (const auto& row : report.rows) EXPECT_FALSE(row.runtime.diverges) << row.node << "\n" << report.str();
  // Every node before it agrees; the model's output inherits the error.
  for (size_t i = 0; i < *report.first_divergent; ++i) EXPECT_FALSE(report.rows[i].diverges) << report.str();
  EXPECT_TRUE(report.rows.back().diverges);
  EXPECT_NE(report.str().find("first divergent node past 1e-04 (relative to the value's scale): "
                              "blocks.1.ln_2/LayerNormalization (LayerNormalization) of kiln module blocks.1.ln_2 "
                              "(LayerNorm): the exported graph differs from kiln's module"),
            std::string::npos)
      << report.str();
  // The figure for docs/export.md: the broken node's row and the verdict.
  std::istringstream lines(report.str());
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("blocks.1.ln_2/", 0) == 0 || line.rfind("first divergent", 0) == 0) std::printf("%s\n", line.c_str());
  // The module summary names the same module first.
  ASSERT_TRUE(report.modules.first_divergent.has_value());
  EXPECT_EQ(report.modules.rows[*report.modules.first_divergent].module, "blocks.1.ln_2");
}

}  // namespace
}  // namespace kiln::test
