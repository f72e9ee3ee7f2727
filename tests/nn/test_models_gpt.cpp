// models::GPT and models::ViT against their PyTorch twins
// (tests/parity/models_twins_gpt.py), as tests/nn/test_models.cpp does for the
// vision zoo: kiln writes its initial state_dict (tied weights under both
// names, as torch), an input and targets; the twin loads them with
// strict=True and returns eval-mode output, train-mode output, loss and every
// parameter's gradient; kiln compares, then loads a torch-initialised twin's
// state_dict strictly by name and checks the values arrive bit for bit.
// Tolerance (float32): |kiln - torch| <= 1e-5 + 1e-4 * |torch| elementwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/gpt.h"
#include "kiln/models/vit.h"
#include "kiln/nn/functional.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"
#include "twin_check.h"

using namespace kiln;

namespace {

using test::check_against_twin;
using test::LossFn;
using test::keys;
using test::mismatch;

Tensor gpt_loss(const Tensor& logits, const Tensor& targets) {
  return nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

Tensor class_loss(const Tensor& logits, const Tensor& targets) { return nn::functional::cross_entropy(logits, targets); }

}  // namespace

TEST(ModelsGPT, NamesShapesAndTiedHead) {
  manual_seed(21);
  models::GPT m({.vocab_size = 256, .block_size = 128, .n_layer = 4, .n_head = 4, .n_embd = 256, .d_ff = 1024});
  EXPECT_TRUE(m.lm_head->weight.is_same(m.wte->weight));
  auto sd = keys(m.state_dict());
  ASSERT_EQ(sd.size(), 2 + 4 * 12 + 2 + 1u);
  EXPECT_EQ(sd.front(), "transformer.wte.weight");
  EXPECT_EQ(sd[1], "transformer.wpe.weight");
  EXPECT_EQ(sd[2], "transformer.h.0.ln_1.weight");
  EXPECT_EQ(sd[5], "transformer.h.0.attn.c_attn.bias");
  EXPECT_EQ(sd[13], "transformer.h.0.mlp.c_proj.bias");
  EXPECT_EQ(sd.back(), "lm_head.weight");
  auto named = keys(m.named_parameters());
  EXPECT_EQ(named.size(), sd.size() - 1);  // the tied weight once
  EXPECT_EQ(std::count(named.begin(), named.end(), "lm_head.weight"), 0);
  // 256*256 + 128*256 + 4 * (12 d^2 + 13 d) + 2 d, d = 256 (d_ff = 4d): nanoGPT's count with the tie.
  const int64_t d = 256;
  EXPECT_EQ(m.num_parameters(), 256 * d + 128 * d + 4 * (12 * d * d + 13 * d) + 2 * d);
  // nanoGPT init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(8)), zero biases, unit LayerNorm.
  auto std_of = [](const Tensor& t) {
    auto v = test::to_doubles(t);
    double s = 0, s2 = 0;
    for (double e : v) s += e, s2 += e * e;
    double mean = s / v.size();
    return std::sqrt(s2 / v.size() - mean * mean);
  };
  auto* b0 = static_cast<nn::TransformerBlock*>((*m.h)[0].get());
  EXPECT_NEAR(std_of(m.wte->weight), 0.02, 0.001);
  EXPECT_NEAR(std_of(b0->attn->c_attn->weight), 0.02, 0.001);
  EXPECT_NEAR(std_of(b0->mlp->c_proj->weight), 0.02 / std::sqrt(8.0), 0.0005);
  EXPECT_NEAR(std_of(b0->attn->c_proj->weight), 0.02 / std::sqrt(8.0), 0.0005);
  EXPECT_EQ(test::to_doubles(b0->attn->c_attn->bias), std::vector<double>(768, 0.0));
  EXPECT_EQ(test::to_doubles(m.ln_f->weight), std::vector<double>(256, 1.0));
}

TEST(ModelsGPT, WorkloadMatchesTorch) {
  manual_seed(22);
  models::GPT m({.vocab_size = 256, .block_size = 128, .n_layer = 4, .n_head = 4, .n_embd = 256, .d_ff = 1024});
  Tensor idx = randint(0, 256, {2, 24}, TensorOptions(kInt64));
  Tensor targets = randint(0, 256, {2, 24}, TensorOptions(kInt64));
  check_against_twin(m, "models_twins_gpt.py", "gpt",
                     R"({"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256, "d_ff": 1024})",
                     idx, targets, gpt_loss);
  // The loss helper is the same flattened cross-entropy.
  m.eval();
  NoGradGuard g;
  EXPECT_EQ(mismatch(m.loss(idx, targets).reshape({1}), gpt_loss(m(idx), targets).reshape({1})), "");
}

TEST(ModelsGPT, SmallConfigurationAtFullContextMatchesTorch) {
  manual_seed(23);
  models::GPT m({.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 12});
  check_against_twin(m, "models_twins_gpt.py", "gpt", R"({"vocab_size": 11, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 12})",
                     randint(0, 11, {3, 8}, TensorOptions(kInt64)), randint(0, 11, {3, 8}, TensorOptions(kInt64)),
                     gpt_loss);
}

TEST(ModelsGPT, TiedWeightGetsTheSumOfBothGradients) {
  manual_seed(24);
  models::GPT m({.vocab_size = 13, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 8});
  Tensor idx = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  Tensor targets = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  m.loss(idx, targets).backward();
  Tensor tied = m.wte->weight.grad().clone();
  // Untie: lm_head gets its own copy of the same values; each use now has its own gradient.
  m.zero_grad();
  m.lm_head->register_parameter("weight", m.wte->weight.detach().clone());
  EXPECT_FALSE(m.lm_head->weight.is_same(m.wte->weight));
  m.loss(idx, targets).backward();
  Tensor emb_grad = m.wte->weight.grad(), head_grad = m.lm_head->weight.grad();
  ASSERT_TRUE(emb_grad.defined() && head_grad.defined());
  EXPECT_GT(test::to_doubles(head_grad.abs().sum())[0], 0.0);
  EXPECT_GT(test::to_doubles(emb_grad.abs().sum())[0], 0.0);
  EXPECT_EQ(mismatch(tied, emb_grad + head_grad), "");
}

namespace {

// The gpt workload's optimiser (AdamW lr 3e-4, weight decay 0.1) for `steps` steps on one
// batch, in kiln and in the twin: the loss before each step agrees within the float32
// tolerance above, and the final parameters within 1e-3 (see below).
void check_training_against_twin(nn::Module& m, const std::string& name, const std::string& config, const Tensor& x,
                                 const Tensor& target, const LossFn& loss_fn, int steps) {
  ASSERT_EQ(test::python_problem(), "");
  test::TempDir dir;
  auto sd = m.state_dict();
  sd.emplace_back("__input__", x);
  sd.emplace_back("__target__", target);
  io::save_safetensors(dir.file("in.safetensors"), sd,
                       {{"model", name}, {"config", config}, {"steps", std::to_string(steps)}});
  std::string out;
  int rc = test::run_command(test::shell_quote(test::python()) + " " +
                                 test::shell_quote(test::source_dir() + "/tests/parity/models_twins_gpt.py") + " " +
                                 test::shell_quote(dir.file("in.safetensors")) + " " +
                                 test::shell_quote(dir.file("out.safetensors")),
                             out);
  ASSERT_EQ(rc, 0) << out;
  ASSERT_NE(out.find("OK"), std::string::npos) << out;
  auto ref = io::load_safetensors(dir.file("out.safetensors"));

  optim::AdamW opt(m.named_parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  m.train();
  std::vector<float> losses;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    Tensor loss = loss_fn(m(x), target);
    loss.backward();
    opt.step();
    losses.push_back(static_cast<float>(test::to_doubles(loss.detach())[0]));
  }
  EXPECT_EQ(mismatch(tensor(losses), ref.at("losses")), "") << "per-step losses";
  EXPECT_LT(losses.back(), losses.front() - 0.1f);  // it learns the batch
  // Parameters are compared loosely: Adam divides by sqrt(v), so an element whose true
  // gradient is ~0 (the key biases of c_attn: softmax ignores a per-row constant) moves
  // by up to lr per step in a direction set by float rounding, in torch as in kiln.
  // Observed worst difference for gpt: 2.5e-4 (steps * lr = 6e-3 bounds it); the check is 1e-3.
  // Those key-bias elements (the middle third of c_attn.bias) are held to that bound
  // itself: their direction is rounding noise, so any change of summation order moves them
  // (1.04e-3 seen for vit once LayerNorm and Linear's bias became fused kernels).
  const double noise_bound = steps * 3e-4;
  for (auto& [n, p] : m.named_parameters()) {
    auto a = test::to_doubles(p.detach()), b = test::to_doubles(ref.at("final." + n));
    ASSERT_EQ(a.size(), b.size()) << n;
    const bool qkv_bias = n.size() >= 16 && n.compare(n.size() - 16, 16, "attn.c_attn.bias") == 0;
    double worst = 0, worst_key = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const bool key = qkv_bias && i >= a.size() / 3 && i < 2 * a.size() / 3;
      (key ? worst_key : worst) = std::max(key ? worst_key : worst, std::abs(a[i] - b[i]));
    }
    EXPECT_LE(worst, 1e-3) << "parameter " << n << " after training";
    EXPECT_LE(worst_key, noise_bound) << "key bias of " << n << " after training";
  }
}

}  // namespace

// 20 steps of the gpt workload on one batch of 2 x 32 tokens.
TEST(ModelsGPT, TwentyAdamWStepsMatchTorch) {
  manual_seed(25);
  models::GPT m({.vocab_size = 256, .block_size = 128, .n_layer = 4, .n_head = 4, .n_embd = 256, .d_ff = 1024});
  Tensor idx = randint(0, 256, {2, 32}, TensorOptions(kInt64));
  Tensor targets = randint(0, 256, {2, 32}, TensorOptions(kInt64));
  check_training_against_twin(
      m, "gpt", R"({"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256, "d_ff": 1024})",
      idx, targets, gpt_loss, 20);
}

TEST(ModelsGPT, RejectsSequencesLongerThanBlockSize) {
  models::GPT m({.vocab_size = 10, .block_size = 4, .n_layer = 1, .n_head = 1, .n_embd = 4});
  EXPECT_EQ(m(zeros({1, 4}, TensorOptions(kInt64))).sizes(), (std::vector<int64_t>{1, 4, 10}));
  try {
    m(zeros({1, 5}, TensorOptions(kInt64)));
    ADD_FAILURE() << "T > block_size accepted";
  } catch (const ShapeError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("T = 5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("block_size is only 4"), std::string::npos) << msg;
  }
  EXPECT_THROW(m(zeros({1, 4})), ShapeError);                            // float ids
  EXPECT_THROW(m.loss(zeros({1, 4}, TensorOptions(kInt64)), zeros({1, 3}, TensorOptions(kInt64))), ShapeError);
  EXPECT_THROW(models::GPT({.n_head = 3}), ValueError);                  // 256 % 3
  EXPECT_THROW(models::GPT({.vocab_size = 0}), ValueError);
}

TEST(ModelsViT, NamesAndShapes) {
  manual_seed(31);
  models::ViT m({.image_size = 28, .patch_size = 7, .in_channels = 1, .num_classes = 10, .dim = 64, .depth = 2,
                 .heads = 4, .mlp_dim = 128});
  auto sd = keys(m.state_dict());
  EXPECT_EQ(sd[0], "cls_token");
  EXPECT_EQ(sd[1], "pos_embed");
  EXPECT_EQ(sd[2], "patch_embed.weight");
  EXPECT_EQ(sd[4], "blocks.0.ln_1.weight");
  EXPECT_EQ(sd.back(), "head.bias");
  EXPECT_EQ(m.pos_embed.sizes(), (std::vector<int64_t>{1, 17, 64}));
  EXPECT_EQ(m.patch_embed->weight.sizes(), (std::vector<int64_t>{64, 1, 7, 7}));
  EXPECT_FALSE(static_cast<nn::TransformerBlock*>((*m.blocks)[0].get())->attn->causal);
  EXPECT_THROW(m(randn({2, 1, 27, 28})), ShapeError);
  EXPECT_THROW(models::ViT({.image_size = 28, .patch_size = 5}), ValueError);
  EXPECT_THROW(models::ViT({.dim = 64, .heads = 5}), ValueError);
}

TEST(ModelsViT, DefaultMatchesTorch) {
  manual_seed(32);
  models::ViT m({.image_size = 28, .patch_size = 7, .in_channels = 1, .num_classes = 10, .dim = 64, .depth = 2,
                 .heads = 4, .mlp_dim = 128});
  check_against_twin(m, "models_twins_gpt.py", "vit",
                     R"({"image_size": 28, "patch_size": 7, "in_channels": 1, "num_classes": 10, "dim": 64,
                         "depth": 2, "heads": 4, "mlp_dim": 128})",
                     randn({4, 1, 28, 28}), randint(0, 10, {4}, TensorOptions(kInt64)), class_loss);
}

TEST(ModelsViT, ConfiguredMatchesTorch) {
  manual_seed(33);
  models::ViT m({.image_size = 8, .patch_size = 4, .in_channels = 3, .num_classes = 5, .dim = 12, .depth = 3,
                 .heads = 3, .mlp_dim = 20});
  check_against_twin(m, "models_twins_gpt.py", "vit",
                     R"({"image_size": 8, "patch_size": 4, "in_channels": 3, "num_classes": 5, "dim": 12,
                         "depth": 3, "heads": 3, "mlp_dim": 20})",
                     randn({3, 3, 8, 8}), randint(0, 5, {3}, TensorOptions(kInt64)), class_loss);
}

// 20 AdamW steps of the default ViT on a batch of 8 images.
TEST(ModelsViT, TwentyAdamWStepsMatchTorch) {
  manual_seed(34);
  models::ViT m({.image_size = 28, .patch_size = 7, .in_channels = 1, .num_classes = 10, .dim = 64, .depth = 2,
                 .heads = 4, .mlp_dim = 128});
  check_training_against_twin(m, "vit",
                              R"({"image_size": 28, "patch_size": 7, "in_channels": 1, "num_classes": 10, "dim": 64,
                                  "depth": 2, "heads": 4, "mlp_dim": 128})",
                              randn({8, 1, 28, 28}), randint(0, 10, {8}, TensorOptions(kInt64)), class_loss, 20);
}
