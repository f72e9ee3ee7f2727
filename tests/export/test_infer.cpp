// Inference optimisation: each graph pass against the unoptimised graph run
// on kiln's runtime (exporter::Session) within 1e-5 relative to the output's
// scale, and infer::optimize on every zoo model against the eager eval model
// within 1e-5 at two batch sizes (two sequence lengths for GPT), with fewer
// nodes than the captured graph.
#include <gtest/gtest.h>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/capture.h"
#include "kiln/export/infer.h"
#include "kiln/export/optimize.h"
#include "kiln/export/runtime.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/ops/factory.h"
#include "support/onnx_consumers.h"

namespace kiln::test {
namespace {

using exporter::Graph;

// Running statistics far from (0, 1), so a fold has something to fold.
void warm_batch_norms(nn::Module& m, const Tensor& x) {
  const NoGradGuard no_grad;
  m.train();
  for (int i = 0; i < 3; ++i) m(x * 3.0 + 1.0);
  m.eval();
}

Tensor eager(nn::Module& m, const Tensor& x) {
  const InferenceModeGuard inference;
  return m(x);
}

Tensor run(const Graph& g, const Tensor& x, exporter::SessionOptions o = {}) {
  return exporter::Session(g, std::move(o)).run({x})[0];
}

const exporter::CaptureOptions kBatch{.dynamic_axes = {{"input", {{0, "batch"}}}}};

TEST(InferPasses, BatchNormFoldIntoConvMatchesUnfoldedSession) {
  manual_seed(11);
  models::ResNet net({.in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 5});
  warm_batch_norms(net, randn({4, 3, 16, 16}));
  const Graph plain = exporter::capture(net, {randn({1, 3, 16, 16})}, kBatch);
  Graph folded = plain;
  EXPECT_EQ(exporter::fold_batch_norm(folded).folded, 6);
  for (int64_t n : {2, 5}) {
    const Tensor x = randn({n, 3, 16, 16});
    EXPECT_LE(scaled_max_diff(run(folded, x), run(plain, x)), 1e-5) << n;
  }
}

TEST(InferPasses, BatchNormFoldIntoLinearMatchesUnfoldedSession) {
  manual_seed(12);
  auto seq = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 6, .out_features = 8}),
      std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = 8}), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 3, .bias = false}),
      std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = 3}));
  warm_batch_norms(*seq, randn({16, 6}));
  const Graph plain = exporter::capture(*seq, {randn({2, 6})}, kBatch);
  Graph folded = plain;
  const auto r = exporter::fold_batch_norm(folded);
  EXPECT_EQ(r.folded, 2);
  EXPECT_EQ(r.nodes_after, r.nodes_before - 2);
  EXPECT_EQ(folded.op_counts().count("BatchNormalization"), 0u);
  for (int64_t n : {3, 7}) {
    const Tensor x = randn({n, 6});
    EXPECT_LE(scaled_max_diff(run(folded, x), run(plain, x)), 1e-5) << n;
    EXPECT_LE(scaled_max_diff(run(folded, x), eager(*seq, x)), 1e-5) << n;
  }
}

TEST(InferPasses, IdentityAndDropoutNodesAreRemoved) {
  manual_seed(13);
  models::MLP mlp({.in_features = 6, .hidden = {8}, .out_features = 3});
  const Graph plain = exporter::capture(mlp, {randn({2, 6})}, kBatch);
  // Capture writes no Identity or Dropout (eval makes them nothing); a graph
  // from elsewhere may: one after the first Gemm, a Dropout with an unread
  // mask before the output.
  Graph g = plain;
  const std::string h = g.nodes[0].outputs[0];
  g.nodes[0].outputs[0] = h + "_pre";
  g.values[h + "_pre"] = g.values.at(h);
  g.nodes.insert(g.nodes.begin() + 1, exporter::Node{.name = "id", .op_type = "Identity", .inputs = {h + "_pre"},
                                                      .outputs = {h}});
  const std::string out = g.nodes.back().outputs[0];
  g.nodes.back().outputs[0] = "pre_out";
  g.values["pre_out"] = g.values.at(out);
  g.nodes.push_back(exporter::Node{.name = "drop", .op_type = "Dropout", .inputs = {"pre_out"},
                                   .outputs = {out, "mask"}});
  g.values["mask"] = exporter::Value{"mask", kBool, g.values.at(out).shape};
  g.validate();
  const int64_t before = static_cast<int64_t>(g.nodes.size());
  EXPECT_EQ(exporter::remove_identities(g), 2);
  EXPECT_EQ(static_cast<int64_t>(g.nodes.size()), before - 2);
  EXPECT_EQ(g.op_counts(), plain.op_counts());
  const Tensor x = randn({4, 6});
  EXPECT_LE(scaled_max_diff(run(g, x), run(plain, x)), 1e-5);
}

TEST(InferPasses, FusionOfResNetMatchesUnfusedSession) {
  manual_seed(14);
  models::ResNet net({.in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 5});
  warm_batch_norms(net, randn({4, 3, 16, 16}));
  Graph folded = exporter::capture(net, {randn({1, 3, 16, 16})}, kBatch);
  exporter::fold_batch_norm(folded);
  Graph fused = folded;
  const auto r = exporter::fuse_for_kiln(fused);
  // stem, 2 + 2 block convs, the downsample shortcut; the fc.
  EXPECT_EQ(r.fused_conv, 6);
  EXPECT_EQ(r.fused_gemm, 1);
  const auto ops = fused.op_counts();
  EXPECT_EQ(ops.count("Relu"), 0u) << "every ReLU follows a Conv or a residual Add";
  EXPECT_EQ(ops.count("Add"), 0u) << "both residual Adds go into their block's second conv";
  for (int64_t n : {2, 5}) {
    const Tensor x = randn({n, 3, 16, 16});
    EXPECT_LE(scaled_max_diff(run(fused, x, infer::fused_kernels()), run(folded, x)), 1e-5) << n;
  }
}

TEST(InferPasses, FusionOfGptMatchesUnfusedSession) {
  manual_seed(15);
  models::GPT gpt({.vocab_size = 16, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8});
  const Graph plain = exporter::capture(gpt, {randint(0, 16, {1, 8}, TensorOptions(kInt64))},
                                        {.dynamic_axes = {{"input", {{0, "batch"}, {1, "seq"}}}}});
  Graph fused = plain;
  const auto r = exporter::fuse_for_kiln(fused);
  EXPECT_EQ(r.fused_gemm, 2 * 4 + 1);  // c_attn, attn.c_proj, c_fc, mlp.c_proj per block; lm_head
  const auto ops = fused.op_counts();
  EXPECT_EQ(ops.count("Tanh"), 0u) << "GELU (tanh) goes into c_fc";
  EXPECT_EQ(r.attention, 2);
  EXPECT_EQ(ops.count("MatMul"), 0u) << "attention's products go into kiln.Attention";
  EXPECT_EQ(ops.count("Softmax"), 0u);
  EXPECT_EQ(ops.at("Shape"), 1) << "the causal masks' sizing goes with them; the position embedding's stays";
  for (int64_t t : {3, 8}) {
    const Tensor x = randint(0, 16, {2, t}, TensorOptions(kInt64));
    EXPECT_LE(scaled_max_diff(run(fused, x, infer::fused_kernels()), run(plain, x)), 1e-5) << t;
  }
}

// infer::optimize on each zoo model: the eager eval model's outputs at two
// batch sizes, fewer nodes, and the counts in the report.
infer::OptimizeReport expect_matches_eager(nn::Module& m, const std::vector<Tensor>& inputs, int64_t min_drop) {
  const infer::InferenceModel opt = infer::optimize(m, {inputs[0]});
  const auto& r = opt.report();
  EXPECT_LE(r.nodes_after + min_drop, r.nodes_before) << r.str();
  EXPECT_EQ(r.nodes_after, static_cast<int64_t>(opt.graph().nodes.size()));
  for (const Tensor& x : inputs) EXPECT_LE(scaled_max_diff(opt.forward(x), eager(m, x)), 1e-5) << x.shape_string();
  return r;
}

TEST(InferOptimize, ZooModelsMatchEagerEval) {
  manual_seed(16);
  models::MLP mlp({.in_features = 12, .hidden = {16, 16}, .out_features = 4});
  expect_matches_eager(mlp, {randn({2, 12}), randn({5, 12})}, 2);

  models::CNN cnn({.in_channels = 1, .channels1 = 4, .channels2 = 8, .hidden = 16, .num_classes = 5,
                   .input_size = {12, 12}});
  expect_matches_eager(cnn, {randn({1, 1, 12, 12}), randn({3, 1, 12, 12})}, 3);

  models::ResNet net({.in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 5});
  warm_batch_norms(net, randn({4, 3, 16, 16}));
  expect_matches_eager(net, {randn({2, 3, 16, 16}), randn({5, 3, 16, 16})}, 10);

  models::ViT vit({.image_size = 8, .patch_size = 4, .num_classes = 5, .dim = 16, .depth = 2, .heads = 2, .mlp_dim = 32});
  vit.eval();
  EXPECT_EQ(expect_matches_eager(vit, {randn({2, 1, 8, 8}), randn({5, 1, 8, 8})}, 10).attention, 2)
      << "ViT's attention (not causal) is fused too";

  models::GPT gpt({.vocab_size = 16, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8});
  gpt.eval();
  EXPECT_EQ(expect_matches_eager(
                gpt, {randint(0, 16, {2, 8}, TensorOptions(kInt64)), randint(0, 16, {3, 5}, TensorOptions(kInt64))}, 10)
                .attention,
            2);
}

TEST(InferOptimize, ReportCountsFoldsAndFusions) {
  manual_seed(17);
  models::ResNet net({.in_channels = 3, .stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}, .num_classes = 5});
  warm_batch_norms(net, randn({4, 3, 16, 16}));
  const auto opt = infer::optimize(net, {randn({1, 3, 16, 16})});
  const auto& r = opt.report();
  EXPECT_EQ(r.batch_norms_folded, 6);
  EXPECT_EQ(r.fused_conv, 6);
  EXPECT_EQ(r.fused_gemm, 1);
  EXPECT_EQ(r.ops_before.at("BatchNormalization"), 6);
  EXPECT_EQ(r.ops_after.count("BatchNormalization"), 0u);
  EXPECT_NE(r.str().find("6 BatchNorms folded"), std::string::npos) << r.str();
  EXPECT_TRUE(net.is_training() == false);  // optimize leaves the mode as it found it (eval here)
}

}  // namespace
}  // namespace kiln::test
