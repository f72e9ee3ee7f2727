// nn::lora: LoRA adapters on GPT and ViT against a PyTorch twin of PEFT's LoRA
// layer (tests/parity/lora_twin.py, one python run for both models), merge /
// unmerge, named adapters, what trains, and PEFT adapter files.
// Float32 tolerance against torch: |kiln - torch| <= 1e-5 + 1e-4 |torch| (twin_check.h).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/peft_adapter.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/gpt.h"
#include "kiln/models/vit.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/lora.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"
#include "support/hostile.h"
#include "support/test_util.h"
#include "twin_check.h"

using namespace kiln;
using test::mismatch;

namespace {

const models::GPTOptions kGPT{.vocab_size = 13, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8, .activation_checkpointing = {}};
const char* kGPTConfig = R"({"vocab_size": 13, "block_size": 6, "n_layer": 2, "n_head": 2, "n_embd": 8})";
const models::ViTOptions kViT{
    .image_size = 8, .patch_size = 4, .in_channels = 1, .num_classes = 3, .dim = 8, .depth = 1, .heads = 2, .mlp_dim = 16, .activation_checkpointing = {}};
const char* kViTConfig =
    R"({"image_size": 8, "patch_size": 4, "in_channels": 1, "num_classes": 3, "dim": 8, "depth": 1, "heads": 2, "mlp_dim": 16})";

Tensor gpt_loss(const Tensor& logits, const Tensor& targets) {
  return nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : test::to_doubles(t)) m = std::max(m, std::abs(v));
  return m;
}

// Gives every adapter's B non-zero values, so that the adapter's term is not trivially zero.
void randomise_b(nn::lora::Lora& lora, double scale = 0.1) {
  NoGradGuard g;
  for (auto& [n, t] : lora.trainable_parameters())
    if (n.find(".lora_B.") != std::string::npos) t.copy_(randn(t.shape()).mul(scale));
}

const nn::lora::Options kTargets{.targets = {"attn.c_attn", "attn.c_proj", "mlp.*"}, .rank = 4, .alpha = 8};

}  // namespace

TEST(Lora, PatternsMatchPathSuffixesComponentWise) {
  using nn::lora::matches;
  EXPECT_TRUE(matches("c_attn", "transformer.h.0.attn.c_attn"));
  EXPECT_TRUE(matches("attn.c_attn", "transformer.h.0.attn.c_attn"));
  EXPECT_TRUE(matches("mlp.*", "transformer.h.1.mlp.c_fc"));
  EXPECT_TRUE(matches("h.?.mlp.c_proj", "transformer.h.1.mlp.c_proj"));
  EXPECT_TRUE(matches("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_attn"));
  EXPECT_FALSE(matches("attn", "transformer.h.0.attn.c_attn"));
  EXPECT_FALSE(matches("c_att", "transformer.h.0.attn.c_attn"));    // whole components only
  EXPECT_FALSE(matches("mlp.*", "transformer.h.1.mlp.c_fc.lora_A"));  // the suffix, not a prefix
  EXPECT_FALSE(matches("a.b.c", "b.c"));
}

TEST(Lora, WrapsTheTargetsFreezesTheRestAndStartsAtTheBaseModel) {
  manual_seed(1);
  models::GPT m(kGPT);
  m.eval();
  Tensor idx = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  // The reference is the base model's forward through the same (unfused) path: a hook
  // that changes nothing makes TransformerBlock call its Linears one by one, as LoRA's hooks do.
  for (auto& [p, mod] : m.named_modules())
    if (dynamic_cast<nn::Linear*>(mod)) mod->register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) {
        return Tensor();
      });
  Tensor before = m(idx);
  auto lora = nn::lora::apply(m, kTargets);
  EXPECT_EQ(lora.target_paths(),
            (std::vector<std::string>{"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                      "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                                      "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj",
                                      "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"}));
  // B = 0: exactly the base model's output, bit for bit.
  EXPECT_TRUE(test::to_doubles(m(idx)) == test::to_doubles(before));
  // Only A and B train: r (in + out) per layer.
  const int64_t per_block = 4 * (8 + 24) + 4 * (8 + 8) + 4 * (8 + 32) + 4 * (32 + 8);
  EXPECT_EQ(m.num_parameters(/*trainable_only=*/true), 2 * per_block);
  EXPECT_EQ(lora.num_parameters(), 2 * per_block);
  auto trainable = nn::lora::trainable_parameters(m);
  ASSERT_EQ(trainable.size(), 16u);
  EXPECT_EQ(trainable[0].first, "transformer.h.0.attn.c_attn.lora_A.default.weight");
  EXPECT_EQ(trainable[1].first, "transformer.h.0.attn.c_attn.lora_B.default.weight");
  EXPECT_EQ(test::keys(lora.trainable_parameters()), test::keys(trainable));
  // A is Kaiming-uniform (a = sqrt 5): |A| <= 1/sqrt(in); B is zeros.
  for (auto& [n, t] : m.named_parameters()) {
    if (n == "transformer.h.0.mlp.c_fc.lora_A.default.weight") {
      EXPECT_LE(max_abs(t), 1.0 / std::sqrt(8.0) + 1e-7);
      EXPECT_GT(max_abs(t), 0.0);
    }
    if (n.find(".lora_B.") != std::string::npos) {
      EXPECT_EQ(max_abs(t), 0.0) << n;
    }
  }
}

// Forward and backward against the torch twin, on GPT and on the ViT.
TEST(Lora, ForwardAndBackwardMatchTorchTwinOnGPTAndViT) {
  ASSERT_EQ(test::python_problem(), "");
  test::TempDir dir;
  struct Case {
    std::string kind, config;
    std::shared_ptr<nn::Module> model;
    Tensor x, target;
    std::function<Tensor(const Tensor&, const Tensor&)> loss;
    std::vector<std::string> targets;
  };
  std::vector<Case> cases;
  manual_seed(2);
  cases.push_back({"gpt", kGPTConfig, std::make_shared<models::GPT>(kGPT), randint(0, 13, {2, 6}, TensorOptions(kInt64)),
                   randint(0, 13, {2, 6}, TensorOptions(kInt64)), gpt_loss, {}});
  cases.push_back({"vit", kViTConfig, std::make_shared<models::ViT>(kViT), randn({2, 1, 8, 8}),
                   randint(0, 3, {2}, TensorOptions(kInt64)),
                   [](const Tensor& y, const Tensor& t) { return nn::functional::cross_entropy(y, t); }, {}});
  std::string args;
  std::vector<nn::lora::Lora> loras;
  for (auto& c : cases) {
    // The ViT also gets its classifier head: a Linear outside the blocks.
    auto opts = kTargets;
    if (c.kind == "vit") opts.targets.push_back("head");
    auto lora = nn::lora::apply(*c.model, opts);
    randomise_b(lora);
    c.targets = lora.target_paths();
    auto sd = c.model->state_dict();
    sd.emplace_back("__input__", c.x);
    sd.emplace_back("__target__", c.target);
    nlohmann::json t = c.targets;
    io::save_safetensors(dir.file(c.kind + "_in.safetensors"), sd,
                         {{"model", c.kind}, {"config", c.config}, {"targets", t.dump()}, {"adapter", "default"},
                          {"r", "4"}, {"alpha", "8"}});
    args += " " + test::shell_quote(dir.file(c.kind + "_in.safetensors")) + " " +
            test::shell_quote(dir.file(c.kind + "_out.safetensors"));
    loras.push_back(lora);
  }
  std::string out;
  int rc = test::run_command(test::shell_quote(test::python()) + " " +
                                 test::shell_quote(test::source_dir() + "/tests/parity/lora_twin.py") + args,
                             out);
  ASSERT_EQ(rc, 0) << out;
  ASSERT_NE(out.find("OK"), std::string::npos) << out;
  for (auto& c : cases) {
    SCOPED_TRACE(c.kind);
    auto ref = io::load_safetensors(dir.file(c.kind + "_out.safetensors"));
    c.model->train();
    Tensor y = (*c.model)(c.x);
    Tensor loss = c.loss(y, c.target);
    loss.backward();
    EXPECT_EQ(mismatch(y.detach(), ref.at("out")), "");
    EXPECT_EQ(mismatch(loss.detach().reshape({1}), ref.at("loss")), "");
    int with_grad = 0;
    for (auto& [n, p] : c.model->named_parameters()) {
      const bool adapter = n.find(".lora_A.") != std::string::npos || n.find(".lora_B.") != std::string::npos;
      EXPECT_EQ(p.grad().defined(), adapter) << n;
      EXPECT_EQ(ref.contains("grad." + n), adapter) << n;
      if (adapter && p.grad().defined() && ref.contains("grad." + n)) {
        EXPECT_EQ(mismatch(p.grad(), ref.at("grad." + n)), "") << n;
        ++with_grad;
      }
    }
    EXPECT_EQ(with_grad, 2 * static_cast<int>(c.targets.size()));
  }
}

TEST(Lora, MergeAndUnmergeRoundTrip) {
  manual_seed(3);
  models::GPT m(kGPT);
  m.eval();
  auto lora = nn::lora::apply(m, kTargets);
  randomise_b(lora, 0.5);
  Tensor idx = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  std::vector<Tensor> w0;
  for (auto& [n, p] : m.named_parameters()) w0.push_back(p.detach().clone());
  Tensor unmerged = m(idx);
  lora.merge();
  EXPECT_TRUE(lora.merged());
  Tensor merged = m(idx);
  // Merged and unmerged are the same function; they differ by float32 rounding
  // (W x + B (A x) s against (W + s B A) x): within 1e-5 + 1e-4 |y|.
  EXPECT_EQ(mismatch(merged, unmerged), "");
  EXPECT_GT(max_abs(merged), 0.1);
  lora.unmerge();
  EXPECT_EQ(mismatch(m(idx), unmerged), "");
  // W + d - d: each element back within one float32 rounding of |W| + |d| (|d| < 2 here):
  // |error| <= 2^-23 * 4.
  size_t i = 0;
  double worst = 0;
  for (auto& [n, p] : m.named_parameters()) {
    auto a = test::to_doubles(p.detach()), b = test::to_doubles(w0[i++]);
    for (size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::abs(a[k] - b[k]));
  }
  EXPECT_LE(worst, 4.0 * std::ldexp(1.0, -23));
  EXPECT_THROW(lora.unmerge(), ValueError);
  // The tied lm_head is refused by name: merging would change the embedding too.
  manual_seed(3);
  models::GPT tied(kGPT);
  auto head = nn::lora::apply(tied, {.targets = {"lm_head"}, .rank = 2, .alpha = 2});
  std::string msg = test::error_message([&] { head.merge(); });
  EXPECT_NE(msg.find("'lm_head': its weight is tied to 'transformer.wte.weight'"), std::string::npos) << msg;
}

TEST(Lora, OnlyAdapterParametersGetGradientsAndOptimizerState) {
  manual_seed(4);
  models::GPT m(kGPT);
  auto lora = nn::lora::apply(m, kTargets);
  Tensor idx = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  Tensor tgt = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  std::map<std::string, Tensor> base;
  for (auto& [n, p] : m.named_parameters())
    if (n.find(".lora_") == std::string::npos) base[n] = p.detach().clone();
  optim::AdamW opt(lora.trainable_parameters(), {.lr = 1e-2});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    m.loss(idx, tgt).backward();
    opt.step();
  }
  std::vector<std::string> with_state;
  for (auto& [n, st] : opt.state()) with_state.push_back(n);
  EXPECT_EQ(with_state.size(), 16u);
  for (auto& n : with_state) EXPECT_NE(n.find(".lora_"), std::string::npos) << n;
  for (auto& [n, p] : m.named_parameters()) {
    if (base.count(n)) {
      EXPECT_FALSE(p.grad().defined()) << n;
      EXPECT_TRUE(test::to_doubles(p.detach()) == test::to_doubles(base[n])) << n << " moved";
    }
  }
  // B moved away from zero: the adapter learned something.
  double b_norm = 0;
  for (auto& [n, p] : lora.trainable_parameters())
    if (n.find(".lora_B.") != std::string::npos) b_norm += max_abs(p);
  EXPECT_GT(b_norm, 0.0);
}

TEST(Lora, NamedAdaptersSwitch) {
  manual_seed(5);
  models::GPT m(kGPT);
  m.eval();
  Tensor idx = randint(0, 13, {1, 6}, TensorOptions(kInt64));
  auto lora = nn::lora::apply(m, kTargets);
  randomise_b(lora);
  Tensor y_default = m(idx);
  lora.add_adapter({.targets = {"c_attn"}, .rank = 2, .alpha = 4, .name = "second"});
  EXPECT_EQ(lora.adapter_names(), (std::vector<std::string>{"default", "second"}));
  EXPECT_EQ(lora.active_adapter(), "default");
  EXPECT_TRUE(test::to_doubles(m(idx)) == test::to_doubles(y_default));  // adding does not switch
  lora.set_adapter("second");
  auto tp = lora.trainable_parameters();
  ASSERT_EQ(tp.size(), 4u);
  EXPECT_EQ(tp[0].first, "transformer.h.0.attn.c_attn.lora_A.second.weight");
  EXPECT_EQ(test::keys(nn::lora::trainable_parameters(m)), test::keys(tp));
  randomise_b(lora);
  Tensor y_second = m(idx);
  EXPECT_GT(max_abs(y_second - y_default), 1e-4);
  lora.set_enabled(false);
  Tensor y_base = m(idx);
  lora.set_enabled(true);
  EXPECT_GT(max_abs(y_base - y_second), 1e-4);
  lora.set_adapter("default");
  EXPECT_TRUE(test::to_doubles(m(idx)) == test::to_doubles(y_default));
  std::string msg = test::error_message([&] { lora.set_adapter("third"); });
  EXPECT_NE(msg.find("no adapter called 'third'; the model has 'default', 'second'"), std::string::npos) << msg;
  lora.merge();
  EXPECT_THROW(lora.set_adapter("second"), ValueError);
  EXPECT_THROW(lora.add_adapter({.targets = {"c_fc"}, .name = "default"}), ValueError);
}

TEST(Lora, BadTargetsAreNamed) {
  models::GPT m(kGPT);
  std::string msg = test::error_message([&] { nn::lora::apply(m, {.targets = {"attn.q_proj", "mlp"}}); });
  EXPECT_NE(msg.find("target 'attn.q_proj' matches no Linear module"), std::string::npos) << msg;
  EXPECT_NE(msg.find("target 'mlp' names 'transformer.h.0.mlp', a MLP, not a Linear"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("transformer.h.1.mlp.c_proj"), std::string::npos) << "lists the Linears: " << msg;
  EXPECT_THROW(nn::lora::apply(m, {.targets = {"c_fc"}, .rank = 0}), ValueError);
  EXPECT_THROW(nn::lora::apply(m, {.targets = {}}), ValueError);
  auto once = nn::lora::apply(m, {.targets = {"c_fc"}});
  msg = test::error_message([&] { nn::lora::apply(m, {.targets = {"c_fc"}}); });
  EXPECT_NE(msg.find("already carries adapters"), std::string::npos) << msg;
}

TEST(Lora, AdapterFilesRoundTripIntoAFreshBase) {
  test::TempDir dir;
  manual_seed(6);
  models::GPT m(kGPT);
  m.eval();
  auto lora = nn::lora::apply(m, {.targets = {"c_attn", "mlp.c_fc"}, .rank = 4, .alpha = 8, .dropout = 0.05});
  randomise_b(lora);
  Tensor idx = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  Tensor y = m(idx);
  lora.save(dir.file("adapter"));
  // Only the adapter tensors, under PEFT's names.
  auto f = io::load_safetensors(dir.file("adapter/adapter_model.safetensors"));
  ASSERT_EQ(f.size(), 8u);
  EXPECT_EQ(f.tensors[0].first, "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight");
  EXPECT_EQ(f.tensors[1].first, "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight");
  EXPECT_EQ(f.tensors[0].second.shape(), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(f.tensors[1].second.shape(), (std::vector<int64_t>{24, 4}));
  std::ifstream in(dir.file("adapter/adapter_config.json"));
  auto cfg = nlohmann::json::parse(in);
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8.0);
  EXPECT_EQ(cfg["lora_dropout"], 0.05);
  EXPECT_EQ(cfg["target_modules"].size(), 4u);
  EXPECT_EQ(cfg["target_modules"][0], "transformer.h.0.attn.c_attn");

  // A fresh base (same weights, as a base checkpoint would give) loads the adapter.
  manual_seed(6);
  models::GPT fresh(kGPT);
  fresh.eval();
  auto other = nn::lora::apply(fresh, {.targets = {"c_proj"}, .rank = 2, .alpha = 2, .name = "unrelated"});
  other.load(dir.file("adapter"), "sherlock");
  EXPECT_EQ(other.active_adapter(), "sherlock");
  EXPECT_EQ(other.options("sherlock").rank, 4);
  EXPECT_EQ(other.options("sherlock").alpha, 8.0);
  EXPECT_TRUE(test::to_doubles(fresh(idx)) == test::to_doubles(y)) << "identical outputs";
  EXPECT_EQ(test::keys(other.adapter_state_dict()), test::keys(lora.adapter_state_dict()));

  // A base of another shape: every mismatching tensor is named.
  models::GPT wider({.vocab_size = 13, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 12, .activation_checkpointing = {}});
  auto w = nn::lora::apply(wider, {.targets = {"c_proj"}, .rank = 2});
  std::string msg = test::error_message([&] { w.load(dir.file("adapter"), "x"); });
  EXPECT_NE(msg.find("'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight': expected shape [4, 12]"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("'base_model.model.transformer.h.0.mlp.c_fc.lora_B.weight': expected shape [48, 4]"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("target 'transformer.h.1.attn.c_attn': the model has no such module"), std::string::npos) << msg;
  EXPECT_NE(msg.find("target 'transformer.h.1.mlp.c_fc': the model has no such module"), std::string::npos) << msg;
  EXPECT_EQ(w.adapter_names(), std::vector<std::string>{"default"}) << "nothing added after a failed load";

  // load_adapter_state_dict names missing, unexpected and misshapen tensors.
  auto sd = lora.adapter_state_dict();
  sd.erase(sd.begin());
  sd.emplace_back("base_model.model.transformer.h.9.attn.c_attn.lora_A.weight", zeros({4, 8}));
  sd[0].second = zeros({3, 3});
  msg = test::error_message([&] { other.load_adapter_state_dict(sd); });
  EXPECT_NE(msg.find("missing 'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected 'base_model.model.transformer.h.9.attn.c_attn.lora_A.weight'"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("expected shape [24, 4], got [3, 3]"), std::string::npos) << msg;
}

// bias = "all" / "lora_only" (PEFT's LoraConfig.bias): exactly those biases train
// beside A and B, count in num_parameters, get optimizer state, and travel in the
// adapter file; loading it into a fresh base reproduces the outputs bitwise.
TEST(Lora, BiasOptionTrainsSavesAndLoadsExactlyThoseBiases) {
  test::TempDir dir;
  manual_seed(8);
  models::GPT m(kGPT);
  std::vector<std::string> all_biases;
  int64_t all_bias_numel = 0;
  for (auto& [n, p] : m.named_parameters())
    if (n.size() > 5 && n.substr(n.size() - 5) == ".bias") {
      all_biases.push_back(n);
      all_bias_numel += p.numel();
    }
  // Two blocks: ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj; and ln_f.
  ASSERT_EQ(all_biases.size(), 13u);
  auto lora = nn::lora::apply(m, {.targets = {"c_attn", "mlp.c_fc"}, .rank = 2, .alpha = 4, .bias = "all"});
  std::vector<std::string> trains;
  for (auto& [n, p] : m.named_parameters())
    if (p.requires_grad() && n.find(".lora_") == std::string::npos) trains.push_back(n);
  EXPECT_EQ(trains, all_biases);
  // A and B: c_attn 2 (8 + 24), c_fc 2 (8 + 32) per block.
  EXPECT_EQ(lora.num_parameters(), 2 * (64 + 80) + all_bias_numel);
  EXPECT_EQ(lora.trainable_parameters().size(), 8u + all_biases.size());

  // lora_only: the wrapped Linears' biases and nothing else.
  manual_seed(8);
  models::GPT m2(kGPT);
  auto only = nn::lora::apply(m2, {.targets = {"c_attn", "mlp.c_fc"}, .rank = 2, .alpha = 4, .bias = "lora_only"});
  std::vector<std::string> only_trains;
  for (auto& [n, p] : m2.named_parameters())
    if (p.requires_grad() && n.find(".lora_") == std::string::npos) only_trains.push_back(n);
  EXPECT_EQ(only_trains, (std::vector<std::string>{"transformer.h.0.attn.c_attn.bias", "transformer.h.0.mlp.c_fc.bias",
                                                   "transformer.h.1.attn.c_attn.bias", "transformer.h.1.mlp.c_fc.bias"}));
  // Switching to an adapter without biases freezes them again.
  only.add_adapter({.targets = {"c_proj"}, .rank = 2, .name = "plain"});
  only.set_adapter("plain");
  for (auto& [n, p] : m2.named_parameters())
    if (n.find(".lora_") == std::string::npos) EXPECT_FALSE(p.requires_grad()) << n;
  EXPECT_THROW(nn::lora::apply(m2, {.targets = {"c_fc"}, .bias = "some"}), ValueError);

  // Training moves the biases and only the trainable tensors have optimizer state.
  Tensor idx = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  Tensor tgt = randint(0, 13, {2, 6}, TensorOptions(kInt64));
  Tensor ln_f_before;
  for (auto& [n, p] : m.named_parameters())
    if (n == "transformer.ln_f.bias") ln_f_before = p.detach().clone();
  ASSERT_TRUE(ln_f_before.defined());
  optim::AdamW opt(lora.trainable_parameters(), {.lr = 1e-2});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    m.loss(idx, tgt).backward();
    opt.step();
  }
  EXPECT_EQ(opt.state().size(), 8u + all_biases.size());
  for (auto& [n, p] : m.named_parameters())
    if (n == "transformer.ln_f.bias") EXPECT_FALSE(test::to_doubles(p.detach()) == test::to_doubles(ln_f_before));

  m.eval();
  Tensor y = m(idx);
  lora.save(dir.file("adapter"));
  auto f = io::load_safetensors(dir.file("adapter/adapter_model.safetensors"));
  EXPECT_EQ(f.size(), 8u + all_biases.size());
  EXPECT_TRUE(f.tensors.size() > 8 && f.tensors[8].first == "base_model.model." + all_biases[0]);
  std::ifstream in(dir.file("adapter/adapter_config.json"));
  EXPECT_EQ(nlohmann::json::parse(in)["bias"], "all");

  // A fresh base (the weights before training) takes adapter and biases from the file.
  manual_seed(8);
  models::GPT fresh(kGPT);
  fresh.eval();
  auto other = nn::lora::apply(fresh, {.targets = {"c_proj"}, .rank = 2, .name = "unrelated"});
  EXPECT_FALSE(test::to_doubles(fresh(idx)) == test::to_doubles(y));
  other.load(dir.file("adapter"), "sherlock");
  EXPECT_EQ(other.options("sherlock").bias, "all");
  EXPECT_TRUE(test::to_doubles(fresh(idx)) == test::to_doubles(y)) << "identical outputs";

  // A file whose biases do not fit the model: each one named, nothing added.
  models::GPT one_layer({.vocab_size = 13, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 8, .activation_checkpointing = {}});
  auto w = nn::lora::apply(one_layer, {.targets = {"c_proj"}, .rank = 2});
  std::string msg = test::error_message([&] { w.load(dir.file("adapter"), "x"); });
  EXPECT_NE(msg.find("'base_model.model.transformer.h.1.ln_1.bias': the model has no parameter"), std::string::npos)
      << msg;
  EXPECT_EQ(w.adapter_names(), std::vector<std::string>{"default"});
  // A file missing one of the biases its mode trains.
  io::PeftAdapter pa = io::load_peft_adapter(dir.file("adapter"));
  pa.tensors.pop_back();
  io::save_peft_adapter(dir.file("short"), pa);
  manual_seed(8);
  models::GPT fresh2(kGPT);
  auto o2 = nn::lora::apply(fresh2, {.targets = {"c_proj"}, .rank = 2});
  msg = test::error_message([&] { o2.load(dir.file("short"), "x"); });
  EXPECT_NE(msg.find("missing 'base_model.model.transformer.ln_f.bias'"), std::string::npos) << msg;
  EXPECT_EQ(o2.adapter_names(), std::vector<std::string>{"default"});
}

TEST(Lora, HostileAdapterFilesAreRefusedByName) {
  test::TempDir dir;
  auto write = [&](const std::string& name, const std::string& config, const io::NamedTensors& tensors) {
    std::filesystem::create_directories(dir.file(name));
    std::ofstream(dir.file(name + "/adapter_config.json")) << config;
    io::save_safetensors(dir.file(name + "/adapter_model.safetensors"), tensors);
    return dir.file(name);
  };
  const std::string good = R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_fc"]})";
  const io::NamedTensors ok = {{"base_model.model.m.c_fc.lora_A.weight", zeros({2, 3})},
                               {"base_model.model.m.c_fc.lora_B.weight", zeros({5, 2})}};
  EXPECT_EQ(io::load_peft_adapter(write("ok", good, ok)).config.r, 2);
  struct Bad {
    std::string config;
    io::NamedTensors tensors;
    std::string expect;
  };
  std::vector<Bad> bad = {
      {"{not json", ok, "does not parse"},
      {"[1, 2]", ok, "expected a JSON object, got array"},
      {R"({"peft_type": "IA3", "r": 2, "lora_alpha": 4, "target_modules": []})", ok, "\"peft_type\": \"LORA\""},
      {R"({"peft_type": "LORA", "r": -1, "lora_alpha": 4, "target_modules": []})", ok, "\"r\" an integer"},
      {R"({"peft_type": "LORA", "r": 1e30, "lora_alpha": 4, "target_modules": []})", ok, "\"r\" an integer"},
      {R"({"peft_type": "LORA", "r": 2, "target_modules": []})", ok, "missing key \"lora_alpha\""},
      {R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": "c_.*"})", ok, "a list of names"},
      {R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": [3]})", ok, "a non-empty string"},
      {R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 2, "target_modules": []})", ok,
       "\"lora_dropout\""},
      {R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": [], "bias": "some"})", ok, "\"bias\""},
      {good, {ok[0], ok[1], {"base_model.model.m.c_fc.bias", zeros({5})}}, "only when adapter_config.json's \"bias\""},
      {R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_fc"], "bias": "all"})",
       {ok[0], ok[1], {"base_model.model.m.c_fc.bias", zeros({5, 1})}}, "expected a bias of 1 dim"},
      {R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_fc"], "bias": "all"})",
       {{"base_model.model.m.c_fc.bias", zeros({5})}}, "expected LoRA tensors, got none"},
      {good, {{"m.c_fc.weight", zeros({2, 3})}}, "expected a name of the form"},
      {good, {{"base_model.model.m.c_fc.lora_A.weight", zeros({3, 3})}}, "expected rank 2"},
      {good, {{"base_model.model.m.c_fc.lora_A.weight", zeros({2, 3, 1})}}, "expected 2 dims"},
      {good, {{"base_model.model.m.c_fc.lora_A.weight", zeros({2, 3}, TensorOptions(kInt64))}}, "floating-point"},
      {good, {{"base_model.model.m.c_fc.lora_A.weight", zeros({2, 3})}}, "expected one lora_A and one lora_B"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string d = write("bad" + std::to_string(i), bad[i].config, bad[i].tensors);
    test::expect_error([&] { io::load_peft_adapter(d); }, d, {bad[i].expect}, 1 << 16);
  }
  EXPECT_THROW(io::load_peft_adapter(dir.file("absent")), IOError);
}
