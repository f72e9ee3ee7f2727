// `kiln export --check`: ONNX Runtime beside kiln, module by module. A correct
// export agrees everywhere; an export with one op broken on purpose (a wrong
// epsilon in one LayerNorm's node) is traced to that LayerNorm, not to the
// modules after it that inherit its error.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "cli/export_check.h"
#include "kiln/core/generator.h"
#include "kiln/export/capture.h"
#include "kiln/models/vit.h"
#include "kiln/ops/factory.h"

namespace kiln::test {
namespace {

TEST(CliExportCheck, GptRunAgreesModuleByModule) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", tiny_gpt_config(dir.file("moby.txt")));
  const std::string run = dir.file("run");
  ASSERT_EQ(kiln_cli("train " + dir.file("gpt.toml") + " --out " + run).rc, 0);
  const auto r = kiln_cli("export " + run + " --check");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("check: ONNX Runtime beside kiln on an input [2, 32]"), std::string::npos) << r.output;
  for (const char* row : {"transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.gelu",
                          "transformer.ln_f", "<root>"})
    EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
  EXPECT_NE(r.output.find("every module's output agrees within 1e-04"), std::string::npos) << r.output;
}

TEST(CliExportCheck, AWrongLayerNormEpsilonIsNamedAsTheFirstDivergence) {
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
  EXPECT_EQ(first.module, "blocks.1.ln_2") << report.str();
  EXPECT_EQ(first.module_type, "LayerNorm");
  EXPECT_EQ(first.op_type, "LayerNormalization");
  EXPECT_GT(first.scaled, 1e-3);
  // Everything before it agrees; the modules after it inherit the error.
  for (size_t i = 0; i < *report.first_divergent; ++i) EXPECT_FALSE(report.rows[i].diverges) << report.str();
  EXPECT_TRUE(report.rows.back().diverges);
  EXPECT_NE(report.str().find("first divergence past 1e-04 (relative to the output's scale): module blocks.1.ln_2 "
                              "(LayerNorm), node blocks.1.ln_2/LayerNormalization (LayerNormalization)"),
            std::string::npos)
      << report.str();

  // The unbroken graph agrees everywhere.
  const exporter::Graph good = exporter::capture(vit, {randn({1, 1, 8, 8})}, {.dynamic_axes = {{"input", {{0, "batch"}}}}});
  const auto ok = cli::check_export(vit, good, randn({3, 1, 8, 8}), 17);
  EXPECT_FALSE(ok.first_divergent.has_value()) << ok.str();
}

}  // namespace
}  // namespace kiln::test
