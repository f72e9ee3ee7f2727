// `kiln quantize --method int4`: a tiny GPT trained on a few lines of text,
// quantized by round-to-nearest and by GPTQ; bits/char before and after, the
// weight bytes and the timing are printed, the int4 file is written and
// reloads into a float model with the same loss; a non-GPT run, a group size
// that does not divide the layers and a bad option exit with a message.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/io/safetensors.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

TEST(CliQuantizeInt4, TinyGptRtnAndGptq) {
  TempDir dir;
  write_text(dir.path() / "moby.txt", tiny_text());
  std::string cfg = tiny_gpt_config(dir.file("moby.txt"));
  cfg.replace(cfg.find("n_embd = 32"), 11, "n_embd = 64");
  cfg.replace(cfg.find("steps = 30"), 10, "steps = 20");
  write_text(dir.path() / "gpt.toml", cfg);
  const std::string run = dir.file("run");
  auto r = kiln_cli("train " + dir.file("gpt.toml") + " --out " + run);
  ASSERT_EQ(r.rc, 0) << r.output;

  r = kiln_cli("quantize " + run + " --method int4 --group-size 64 --bench-batch 2 --bench-iters 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("float32: validation"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("round-to-nearest, group size 64: 4 linears"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("int4:    validation"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("weight bytes of the quantized linears"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("forward at 1 thread, batch 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", as the int4 model"), std::string::npos) << r.output;
  const auto sd = io::load_safetensors((fs::path(run) / "model.int4.safetensors").string());
  EXPECT_EQ(sd.metadata.at("kiln.quantized"), "int4-weight-only");
  EXPECT_EQ(sd.metadata.at("method"), "rtn");
  bool found = false;
  for (const auto& [name, t] : sd.tensors)
    found |= name == "transformer.h.0.mlp.c_fc.weight_int4" && t.dtype() == kUInt8 && t.size(1) == 32;
  EXPECT_TRUE(found);

  r = kiln_cli("quantize " + run + " --method int4 --gptq --calib-batches 2 --group-size 64 --bench-batch 2 " +
               "--bench-iters 1 --out " + dir.file("g.safetensors"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("GPTQ, group size 64"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("calibration: 2 batches"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", as the int4 model"), std::string::npos) << r.output;
  EXPECT_EQ(io::load_safetensors(dir.file("g.safetensors")).metadata.at("method"), "gptq");

  // int8 with per-token activation scales: bits/char and timing, no file.
  r = kiln_cli("quantize " + run + " --method int8-dynamic --bench-batch 2 --bench-iters 1");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("quantized per token at run time: 4 linears"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("int8:    validation"), std::string::npos) << r.output;

  // 64 wide: group 128 divides no layer input.
  r = kiln_cli("quantize " + run + " --method int4 --bench-iters 1 --out " + dir.file("x.safetensors"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("expected a divisor of the linears' inputs (n_embd 64, d_ff 256)"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir.file("x.safetensors")));
  r = kiln_cli("quantize " + run + " --method int4 --group-size 3");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("--group-size"), std::string::npos) << r.output;
}

TEST(CliQuantizeInt4, ImageModelIsRefused) {
  TempDir dir;
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  const std::string run = dir.file("run");
  auto r = kiln_cli("train " + dir.file("mlp.toml") + " --out " + run);
  ASSERT_EQ(r.rc, 0) << r.output;
  r = kiln_cli("quantize " + run + " --method int4");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("not a GPT"), std::string::npos) << r.output;
}
