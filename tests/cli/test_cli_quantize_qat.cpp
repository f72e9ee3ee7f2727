// `kiln quantize --method qat`: a tiny CNN and a tiny ResNet trained on
// synthetic images, fine-tuned a few steps with fake quantization, converted
// to int8; the steps, the freeze, the accuracies, the per-layer report and
// the timing are printed, the int8 file reloads into a fresh float model with
// the int8 model's accuracy and loss; the control run (fake quant off) says so;
// bad options exit 2 naming what was expected.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/io/safetensors.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

TEST(CliQuantizeQat, CnnAndResnetFineTuneToInt8) {
  TempDir dir;
  write_text(dir.path() / "cnn.toml", tiny_image_config("cnn"));
  write_text(dir.path() / "resnet.toml", tiny_image_config("resnet"));
  for (const char* m : {"cnn", "resnet"}) {
    SCOPED_TRACE(m);
    const std::string run = dir.file(std::string("run_") + m);
    auto r = kiln_cli(std::string("train ") + dir.file(std::string(m) + ".toml") + " --out " + run);
    ASSERT_EQ(r.rc, 0) << r.output;
    // 20 steps over a 16-batch split of 256: more than one epoch.
    r = kiln_cli("quantize " + run +
                 " --method qat --qat-steps 20 --freeze-after 12 --qat-lr 1e-4 --bench-batch 4 --bench-iters 2");
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("float32: test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("qat step 20/20"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(observers frozen)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fake-quantized model after 20 steps"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("int8 quantization-aware training, observer moving_average"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("int8:    test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("inference at 1 thread, batch 4"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("kept in float"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", as the int8 model"), std::string::npos) << r.output;
    if (std::string(m) == "resnet") {
      EXPECT_NE(r.output.find("BatchNorm folded"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("layer2.0.downsample.0"), std::string::npos) << r.output;
    }
    const auto sd = io::load_safetensors((fs::path(run) / "model.int8.safetensors").string());
    EXPECT_EQ(sd.metadata.at("kiln.quantized"), "int8-ptq");
    EXPECT_EQ(sd.metadata.at("method"), "qat");
    EXPECT_EQ(sd.metadata.at("qat_steps"), "20");
    bool found = false;
    for (const auto& [name, t] : sd.tensors) {
      found |= name == "conv1.weight_int8" && t.dtype() == kUInt8;
      EXPECT_EQ(name.find("fake_quant"), std::string::npos) << name;
    }
    EXPECT_TRUE(found);
  }
  // The control: the same steps with fake quantization off, another observer.
  auto r = kiln_cli("quantize " + dir.file("run_cnn") +
                    " --method qat --qat-control --qat-steps 5 --freeze-after 1 --qat-observer minmax "
                    "--bench-iters 1 --out " +
                    dir.file("c.safetensors"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("float32 fine-tuned (control, fake quant off) after 5 steps"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("int8 from float fine-tuning (control), observer minmax"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", as the int8 model"), std::string::npos) << r.output;
  EXPECT_EQ(io::load_safetensors(dir.file("c.safetensors")).metadata.at("method"), "qat-control");
}

TEST(CliQuantizeQat, BadOptionsExitTwo) {
  TempDir dir;
  auto r = kiln_cli("quantize " + dir.file("nothing") + " --method bogus");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("--method bogus: expected ptq"), std::string::npos) << r.output;
  r = kiln_cli("quantize " + dir.file("nothing") + " --method qat --qat-steps 0");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("--qat-steps expects at least 1"), std::string::npos) << r.output;
  r = kiln_cli("quantize " + dir.file("nothing") + " --method qat --freeze-after 0");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("--freeze-after expects at least 1"), std::string::npos) << r.output;
  r = kiln_cli("quantize " + dir.file("nothing") + " --method qat --qat-observer kl");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("--qat-observer kl: expected one of"), std::string::npos) << r.output;
  r = kiln_cli("quantize " + dir.file("nothing") + " --method qat");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("no such file or run directory"), std::string::npos) << r.output;
}
