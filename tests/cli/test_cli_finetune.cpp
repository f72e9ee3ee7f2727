// Fine-tuning in `kiln train` (src/cli/finetune.h): gradient accumulation
// against one big batch, init_from (run directory, strict and non-strict key
// reports), LoRA and QLoRA runs (what trains, optimizer state, the PEFT
// adapter directory, eval and resume of the run), and their config errors.
#include <gtest/gtest.h>

#include <cmath>

#include "cli_util.h"
#include "kiln/io/safetensors.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

namespace {

// The tiny GPT without dropout (micro-batches and one batch then see the same function).
std::string gpt_config(const std::string& text, const std::string& extra = "") {
  std::string c = tiny_gpt_config(text);
  const std::string drop = "dropout = 0.1";
  c.replace(c.find(drop), drop.size(), "dropout = 0.0");
  return c + extra;
}

}  // namespace

// k micro-batches of b give the update of one batch of k·b: the loader draws the
// same permutation (it depends on the seed and the set's size only), so steps see
// the same samples. The gradients differ only in summation order (four partial
// means added, against one mean); over 6 AdamW steps the losses agree within
// 1e-6 relative (observed: at most 5e-8), and the learning rates are the same
// doubles: the schedule counts optimizer steps.
TEST(CliFinetune, GradAccumulationEqualsOneBigBatch) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", gpt_config(dir.file("moby.txt")));
  const fs::path big = dir.path() / "big", acc = dir.path() / "acc";
  auto a = kiln_cli("train " + dir.file("gpt.toml") + " --out " + big.string() +
                    " --set train.steps=6 --set data.batch_size=16");
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = kiln_cli("train " + dir.file("gpt.toml") + " --out " + acc.string() +
                    " --set train.steps=6 --set data.batch_size=4 --set train.grad_accum_steps=4");
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("4 batches per step"), std::string::npos) << b.output;
  const auto la = metrics_lines(big, "train"), lb = metrics_lines(acc, "train");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  for (size_t i = 0; i < la.size(); ++i) {
    const double x = la[i]["loss"], y = lb[i]["loss"];
    EXPECT_LE(std::abs(x - y), 1e-6 * std::abs(x)) << "step " << i + 1 << ": " << x << " vs " << y;
    EXPECT_EQ(la[i]["lr"], lb[i]["lr"]) << "step " << i + 1;
  }
  // A run of epochs: the horizon is the epoch's batches over k.
  auto e = kiln_cli("train " + dir.file("gpt.toml") + " --out " + (dir.path() / "ep").string() +
                    " --set train.steps=0 --set train.epochs=1 --set data.batch_size=4 --set train.grad_accum_steps=4" +
                    " --set train.eval_every=0");
  ASSERT_EQ(e.rc, 0) << e.output;
  const auto s = read_json(dir.path() / "ep" / "summary.json");
  const size_t at = e.output.find(" batches of 4 per epoch");
  ASSERT_NE(at, std::string::npos) << e.output;
  const int64_t batches = std::stoll(e.output.substr(e.output.rfind(' ', at - 1) + 1));
  EXPECT_GT(batches, 8);
  EXPECT_EQ(s["total_steps"], batches / 4) << e.output;
}

TEST(CliFinetune, LoRAFromARunTrainsOnlyAdaptersAndWritesAPEFTAdapter) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", gpt_config(dir.file("moby.txt")));
  const fs::path base = dir.path() / "base", lora = dir.path() / "lora", qlora = dir.path() / "qlora";
  auto b = kiln_cli("train " + dir.file("gpt.toml") + " --out " + base.string() + " --set train.steps=10");
  ASSERT_EQ(b.rc, 0) << b.output;
  const std::string ft = " --set train.steps=4 --set init_from='\"" + base.string() +
                         "\"' --set lora.rank=4 --set lora.alpha=8 --set lora.targets='\"attn.c_attn,mlp.c_fc\"'";
  auto r = kiln_cli("train " + dir.file("gpt.toml") + " --out " + lora.string() + ft);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("init_from " + (base / "checkpoints").string()), std::string::npos) << r.output;
  // One block of n_embd 32: c_attn 4 (32 + 96), c_fc 4 (32 + 128).
  EXPECT_NE(r.output.find("lora: 1152 of "), std::string::npos) << r.output;

  // The checkpoint: optimizer state for the adapters only; the base weights are init_from's.
  const auto ck = io::load_safetensors((lora / "checkpoints" / "ckpt-00000004.safetensors").string());
  const auto bk = io::load_safetensors((base / "checkpoints" / "ckpt-00000010.safetensors").string());
  int optim_tensors = 0;
  for (const auto& [name, t] : ck.tensors) {
    if (name.rfind("optim.", 0) == 0 && name.find(".exp_avg") != std::string::npos) {
      ++optim_tensors;
      EXPECT_NE(name.find(".lora_"), std::string::npos) << name << " has optimizer state but does not train";
    }
    if (name.rfind("model.", 0) == 0 && name.find(".lora_") == std::string::npos) {
      EXPECT_TRUE(test::to_doubles(t) == test::to_doubles(bk.at(name))) << name << " moved";
    }
  }
  EXPECT_EQ(optim_tensors, 2 * 4);  // exp_avg and exp_avg_sq of 2 layers' A and B
  // The adapter as PEFT stores it.
  const auto ad = io::load_safetensors((lora / "adapter" / "adapter_model.safetensors").string());
  ASSERT_EQ(ad.size(), 4u);
  EXPECT_EQ(ad.tensors[0].first, "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight");
  const auto cfg = read_json(lora / "adapter" / "adapter_config.json");
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8.0);
  // eval, sample and resume rebuild the adapters from the run's config.
  auto ev = kiln_cli("eval " + lora.string());
  ASSERT_EQ(ev.rc, 0) << ev.output;
  auto res = kiln_cli("resume " + lora.string() + " --set train.steps=6");
  ASSERT_EQ(res.rc, 0) << res.output;
  EXPECT_EQ(read_json(lora / "summary.json")["steps"], 6);
  auto refused = kiln_cli("resume " + lora.string() + " --set lora.rank=8 --set train.steps=8");
  EXPECT_EQ(refused.rc, 2) << refused.output;
  EXPECT_NE(refused.output.find("lora.rank"), std::string::npos) << refused.output;

  // QLoRA: the same adapters over an NF4 base; the parameter memory is a fraction of LoRA's.
  auto q = kiln_cli("train " + dir.file("gpt.toml") + " --out " + qlora.string() + ft +
                    " --set lora.quantize='\"nf4\"'");
  ASSERT_EQ(q.rc, 0) << q.output;
  const double lora_params = metrics_lines(lora, "train").back()["memory"]["parameter"];
  const double qlora_params = metrics_lines(qlora, "train").back()["memory"]["parameter"];
  EXPECT_LT(qlora_params, lora_params) << "the NF4 base holds less than the float one";
  auto qe = kiln_cli("eval " + qlora.string());
  ASSERT_EQ(qe.rc, 0) << qe.output;
}

// lora.bias = "all": every bias trains beside the adapters (counted, with
// optimizer state), moves, and is written into RUN/adapter with PEFT's names.
TEST(CliFinetune, LoRABiasAllTrainsTheBiasesAndWritesThemToTheAdapter) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", gpt_config(dir.file("moby.txt")));
  const fs::path base = dir.path() / "base", lora = dir.path() / "lora";
  ASSERT_EQ(kiln_cli("train " + dir.file("gpt.toml") + " --out " + base.string() + " --set train.steps=2").rc, 0);
  auto r = kiln_cli("train " + dir.file("gpt.toml") + " --out " + lora.string() + " --set train.steps=3" +
                    " --set init_from='\"" + base.string() + "\"' --set lora.rank=4" +
                    " --set lora.targets='\"attn.c_attn,mlp.c_fc\"' --set lora.bias='\"all\"'");
  ASSERT_EQ(r.rc, 0) << r.output;
  // c_attn 4 (32 + 96) + c_fc 4 (32 + 128) = 1152, and the biases: ln_1 32, c_attn 96,
  // attn.c_proj 32, ln_2 32, c_fc 128, mlp.c_proj 32, ln_f 32 = 384.
  EXPECT_NE(r.output.find("lora: 1536 of "), std::string::npos) << r.output;
  const auto ck = io::load_safetensors((lora / "checkpoints" / "ckpt-00000003.safetensors").string());
  const auto bk = io::load_safetensors((base / "checkpoints" / "ckpt-00000002.safetensors").string());
  int with_state = 0;
  for (const auto& [name, t] : ck.tensors) {
    if (name.rfind("optim.", 0) == 0 && name.find(".exp_avg_sq") != std::string::npos) ++with_state;
    if (name.rfind("model.", 0) == 0 && name.find(".lora_") == std::string::npos) {
      const bool bias = name.size() > 5 && name.substr(name.size() - 5) == ".bias";
      EXPECT_EQ(test::to_doubles(t) == test::to_doubles(bk.at(name)), !bias) << name;
    }
  }
  EXPECT_EQ(with_state, 4 + 7);
  const auto ad = io::load_safetensors((lora / "adapter" / "adapter_model.safetensors").string());
  EXPECT_EQ(ad.size(), 4u + 7u);
  EXPECT_TRUE(ad.tensors.size() == 11 && ad.tensors[4].first == "base_model.model.transformer.h.0.ln_1.bias")
      << (ad.tensors.size() > 4 ? ad.tensors[4].first : "");
  EXPECT_EQ(read_json(lora / "adapter" / "adapter_config.json")["bias"], "all");
  // Full fine-tuning trains every bias already: bias without rank is refused by name.
  auto bad = kiln_cli("train " + dir.file("gpt.toml") + " --out " + dir.file("b") + " --set lora.bias='\"all\"'");
  EXPECT_EQ(bad.rc, 2) << bad.output;
  EXPECT_NE(bad.output.find("lora.bias = \"all\""), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("needs lora.rank > 0"), std::string::npos) << bad.output;
}

TEST(CliFinetune, InitFromErrorsAndKeyReports) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  write_text(dir.path() / "gpt.toml", gpt_config(dir.file("moby.txt")));
  auto missing = kiln_cli("train " + dir.file("gpt.toml") + " --out " + dir.file("m") +
                          " --set init_from='\"" + dir.file("nope") + "\"'");
  EXPECT_EQ(missing.rc, 2) << missing.output;
  EXPECT_NE(missing.output.find("no such file or run directory"), std::string::npos) << missing.output;
  // A state dict with one extra key and one missing: refused when strict, reported otherwise.
  const fs::path base = dir.path() / "base";
  ASSERT_EQ(kiln_cli("train " + dir.file("gpt.toml") + " --out " + base.string() + " --set train.steps=2").rc, 0);
  auto ck = io::load_safetensors((base / "checkpoints" / "ckpt-00000002.safetensors").string());
  io::NamedTensors sd;
  for (auto& [name, t] : ck.tensors)
    if (name.rfind("model.", 0) == 0 && name != "model.transformer.ln_f.bias") sd.emplace_back(name.substr(6), t);
  sd.emplace_back("extra.weight", ck.tensors[0].second);
  io::save_safetensors(dir.file("sd.safetensors"), sd);
  auto strict = kiln_cli("train " + dir.file("gpt.toml") + " --out " + dir.file("s") + " --set init_from='\"" +
                         dir.file("sd.safetensors") + "\"'");
  EXPECT_EQ(strict.rc, 2) << strict.output;
  EXPECT_NE(strict.output.find("extra.weight"), std::string::npos) << strict.output;
  EXPECT_NE(strict.output.find("transformer.ln_f.bias"), std::string::npos) << strict.output;
  auto loose = kiln_cli("train " + dir.file("gpt.toml") + " --out " + dir.file("l") + " --set init_from='\"" +
                        dir.file("sd.safetensors") + "\"' --set init_strict=false --set train.steps=1");
  ASSERT_EQ(loose.rc, 0) << loose.output;
  EXPECT_NE(loose.output.find("1 missing (left as initialised): transformer.ln_f.bias"), std::string::npos)
      << loose.output;
  EXPECT_NE(loose.output.find("1 unexpected (ignored): extra.weight"), std::string::npos) << loose.output;
  // Config errors name the key.
  auto bad = kiln_cli("train " + dir.file("gpt.toml") + " --out " + dir.file("b") +
                      " --set lora.rank=4 --set lora.targets='\"q_proj\"'");
  EXPECT_EQ(bad.rc, 2) << bad.output;
  EXPECT_NE(bad.output.find("target 'q_proj' matches no Linear module"), std::string::npos) << bad.output;
  auto qnl = kiln_cli("train " + dir.file("gpt.toml") + " --out " + dir.file("q") + " --set lora.quantize='\"nf4\"'");
  EXPECT_EQ(qnl.rc, 2) << qnl.output;
  EXPECT_NE(qnl.output.find("needs lora.rank > 0"), std::string::npos) << qnl.output;
}
