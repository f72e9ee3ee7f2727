// `kiln quantize`: a tiny CNN and a tiny ResNet trained on synthetic images,
// quantized to int8 after training; the report names every layer, the test
// accuracy and the timing are printed, the int8 state_dict is written; what it
// does not cover (an unknown method, a missing run) exits with a message. The written file
// reloads into a fresh float model with the int8 model's accuracy and loss.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/int8.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

TEST(CliQuantize, CnnAndResnetToInt8) {
  TempDir dir;
  write_text(dir.path() / "cnn.toml", tiny_image_config("cnn"));
  write_text(dir.path() / "resnet.toml", tiny_image_config("resnet"));
  for (const char* m : {"cnn", "resnet"}) {
    SCOPED_TRACE(m);
    const std::string run = dir.file(std::string("run_") + m);
    auto r = kiln_cli(std::string("train ") + dir.file(std::string(m) + ".toml") + " --out " + run);
    ASSERT_EQ(r.rc, 0) << r.output;
    r = kiln_cli("quantize " + run + " --observer minmax --calib-batches 2 --bench-batch 4 --bench-iters 2");
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("float32: test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("int8:    test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("inference at 1 thread, batch 4"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("kept in float"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("into a float model: test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", as the int8 model"), std::string::npos) << r.output;
    if (std::string(m) == "resnet") {
      EXPECT_NE(r.output.find("layer1.0.conv1"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("fc "), std::string::npos) << r.output;
    }
    const auto sd = io::load_safetensors((fs::path(run) / "model.int8.safetensors").string());
    EXPECT_EQ(sd.metadata.at("kiln.quantized"), "int8-ptq");
    bool found = false;
    for (const auto& [name, t] : sd.tensors) found |= name == "conv1.weight_int8" && t.dtype() == kUInt8;
    EXPECT_TRUE(found);
  }
  // BatchNorm folded first: every conv still quantized, and the file reloads into a folded model.
  {
    auto r = kiln_cli("quantize " + dir.file("run_resnet") +
                      " --fuse-bn --calib-batches 2 --bench-iters 1 --out " + dir.file("f.safetensors"));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_EQ(r.output.find("kept in float"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", as the int8 model"), std::string::npos) << r.output;
    const auto sd = io::load_safetensors(dir.file("f.safetensors"));
    EXPECT_EQ(sd.metadata.at("fuse_bn"), "true");
    for (const auto& [name, t] : sd.tensors) EXPECT_EQ(name.find("running_mean"), std::string::npos) << name;
  }
  // keep_float by name.
  auto r = kiln_cli("quantize " + dir.file("run_cnn") + " --calib-batches 1 --bench-iters 1 --keep-float fc2 --out " +
                    dir.file("k.safetensors"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("kept in float (keep_float)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", as the int8 model"), std::string::npos) << r.output;
}

// Where int8 products sum in float32 (no VNNI oneDNN may use; ONEDNN_MAX_CPU_ISA=AVX512_CORE stands
// in for such a CPU here), int8 runs slower than float32, and the command says why under its timing.
TEST(CliQuantize, SaysWhenInt8SumsInFloat32) {
  TempDir dir;
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  const std::string run = dir.file("run");
  auto r = kiln_cli("train " + dir.file("mlp.toml") + " --out " + run);
  ASSERT_EQ(r.rc, 0) << r.output;
  const std::string quantize = " quantize " + run + " --calib-batches 1 --bench-batch 4 --bench-iters 1 --out ";
  const std::string said = "int8 products sum in float32 on this CPU";
  CliResult capped;
  capped.rc = run_command("ONEDNN_MAX_CPU_ISA=AVX512_CORE OMP_NUM_THREADS=2 " + std::string(KILN_CLI_BINARY) +
                              quantize + dir.file("capped.safetensors"),
                          capped.output);
  ASSERT_EQ(capped.rc, 0) << capped.output;
  EXPECT_NE(capped.output.find("kiln float32 sums (no VNNI)"), std::string::npos) << capped.output;
  EXPECT_NE(capped.output.find(said), std::string::npos) << capped.output;

  r = kiln_cli(quantize + dir.file("plain.safetensors"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find(said) != std::string::npos, !ops::int8_products_native()) << r.output;
  EXPECT_EQ(r.output.find("no VNNI") != std::string::npos, !ops::int8_products_native()) << r.output;
}

TEST(CliQuantize, WhatItDoesNotCoverExitsWithAMessage) {
  TempDir dir;
  auto r = kiln_cli("quantize " + dir.file("nothing") + " --method bogus");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("expected ptq (post-training quantization), qat (quantization-aware training), int4 (GPT weight-only) or int8-dynamic"), std::string::npos) << r.output;
  r = kiln_cli("quantize " + dir.file("nothing"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("no such file or run directory"), std::string::npos) << r.output;
}
