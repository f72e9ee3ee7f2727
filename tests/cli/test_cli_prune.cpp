// `kiln prune`: a tiny CNN and a tiny ResNet trained on synthetic images,
// pruned unstructured (per layer and global) and by channels, fine-tuned a few
// steps; the printed sparsity is the one asked, the channel-pruned file has
// smaller layers and records their counts, and `kiln eval` reads it back with
// the accuracy kiln prune printed. Bad options and a hostile
// kiln.pruned_channels exit with a message (2 for options, 1 for the file).
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/io/safetensors.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

namespace {

// "fine-tuned: test accuracy 81.25%" -> "81.25%".
std::string accuracy_after(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  if (at == std::string::npos) return "";
  const size_t from = out.find("accuracy ", at) + 9;
  return out.substr(from, out.find('%', from) - from + 1);
}

}  // namespace

TEST(CliPrune, UnstructuredAndChannelsOnCnnAndResnet) {
  TempDir dir;
  write_text(dir.path() / "cnn.toml", tiny_image_config("cnn"));
  write_text(dir.path() / "resnet.toml", tiny_image_config("resnet"));
  for (const char* m : {"cnn", "resnet"}) {
    SCOPED_TRACE(m);
    const std::string run = dir.file(std::string("run_") + m);
    auto r = kiln_cli(std::string("train ") + dir.file(std::string(m) + ".toml") + " --out " + run);
    ASSERT_EQ(r.rc, 0) << r.output;

    // Unstructured, per layer: every layer at 75 % after the fine-tune too.
    r = kiln_cli("prune " + run + " --sparsity 0.75 --finetune-steps 4 --out " + dir.file("u.safetensors"));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("dense:      test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fine-tuned: test accuracy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fine-tune step 4/4"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("conv1 "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", as the pruned model"), std::string::npos) << r.output;
    const auto sd = io::load_safetensors(dir.file("u.safetensors"));
    for (const auto& [name, t] : sd.tensors) {
      if (name.size() < 7 || name.substr(name.size() - 7) != ".weight" || t.dim() < 2) continue;
      const Tensor c = t.contiguous();
      int64_t zeros = 0;
      for (int64_t i = 0; i < c.numel(); ++i) zeros += c.data_ptr<float>()[i] == 0.0f;
      EXPECT_NEAR(static_cast<double>(zeros) / static_cast<double>(c.numel()), 0.75, 0.5 / c.numel() + 1e-9) << name;
    }
    EXPECT_EQ(sd.metadata.count("kiln.pruned_channels"), 0u);

    // Global threshold: the total is 90 %.
    r = kiln_cli("prune " + run + " --sparsity 0.9 --global --finetune-steps 2 --out " + dir.file("g.safetensors"));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("global"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("all "), std::string::npos) << r.output;

    // Channels: the layers shrink, the file says so, kiln eval builds the small model.
    r = kiln_cli("prune " + run + " --channels 0.5 --finetune-steps 4 --bench-batch 4 --bench-iters 2");
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("inference at 1 thread, batch 4"), std::string::npos) << r.output;
    const std::string file = (fs::path(run) / "model.pruned.safetensors").string();
    const auto header = io::read_safetensors_header(file);
    if (std::string(m) == "cnn") {
      EXPECT_NE(r.output.find("conv1 4->2 conv2 8->4 fc1 16->8"), std::string::npos) << r.output;
      EXPECT_EQ(header.metadata.at("kiln.pruned_channels"), "{\"conv1\":2,\"conv2\":4,\"fc1\":8}");
    } else {
      EXPECT_EQ(header.metadata.at("kiln.pruned_channels"), "{\"layer1.0\":2,\"layer2.0\":4}");
    }
    const std::string tuned = accuracy_after(r.output, "fine-tuned:");
    ASSERT_FALSE(tuned.empty()) << r.output;
    r = kiln_cli("eval " + file);
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("accuracy " + tuned), std::string::npos) << r.output << "\nexpected " << tuned;
  }
}

TEST(CliPrune, BadOptionsAndHostileMetadataExitWithAMessage) {
  TempDir dir;
  write_text(dir.path() / "cnn.toml", tiny_image_config("cnn"));
  const std::string run = dir.file("run");
  auto r = kiln_cli("train " + dir.file("cnn.toml") + " --out " + run);
  ASSERT_EQ(r.rc, 0) << r.output;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "one of --sparsity"},
      {" --sparsity 0.5 --channels 0.5", "one of --sparsity"},
      {" --sparsity 1.5", "--sparsity expects a fraction"},
      {" --channels 1", "--channels expects a fraction"},
      {" --channels 0.5 --global", "--global goes with --sparsity"},
      {" --sparsity 0.5 --finetune-steps -1", "--finetune-steps"},
  };
  for (const auto& [args, msg] : bad) {
    r = kiln_cli("prune " + run + args);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(msg), std::string::npos) << args << "\n" << r.output;
  }
  // An mlp has no channel pruning: an option problem, said before any work; --sparsity works on it.
  write_text(dir.path() / "mlp.toml", tiny_mlp_config());
  r = kiln_cli("train " + dir.file("mlp.toml") + " --out " + dir.file("mlp"));
  ASSERT_EQ(r.rc, 0) << r.output;
  r = kiln_cli("prune " + dir.file("mlp") + " --channels 0.5");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("covers kiln's cnn and resnet"), std::string::npos) << r.output;
  r = kiln_cli("prune " + dir.file("mlp") + " --sparsity 0.5 --finetune-steps 2");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find(", as the pruned model"), std::string::npos) << r.output;
  r = kiln_cli("prune " + dir.file("nothing") + " --sparsity 0.5");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("no such file or run directory"), std::string::npos) << r.output;

  // A pruned file whose channel record is hostile: kiln eval refuses it cleanly.
  r = kiln_cli("prune " + run + " --channels 0.5 --finetune-steps 0 --bench-iters 1 --out " + dir.file("p.safetensors"));
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto good = io::load_safetensors(dir.file("p.safetensors"));
  const std::vector<std::pair<std::string, std::string>> hostile = {
      {"{\"conv1\": ", "is not JSON"},
      {"[2]", "expects a JSON object"},
      {"{\"conv1\": 2.5}", "expects an integer"},
      {"{\"layer9.0\": 2}", "unit \"layer9.0\""},
      {"{\"conv1\": 0}", "expects 1 to 4"},
      {"{\"conv1\": 99999999999999}", "expects 1 to 4"},
      {"{\"conv1\": 3, \"conv2\": 4, \"fc1\": 8}", "conv1"},  // fits the model, not the tensors
      {"", "is not JSON"},
  };
  for (const auto& [value, msg] : hostile) {
    auto md = good.metadata;
    md["kiln.pruned_channels"] = value;
    io::save_safetensors(dir.file("h.safetensors"), good.tensors, md);
    r = kiln_cli("eval " + dir.file("h.safetensors"));
    EXPECT_EQ(r.rc, 1) << value << "\n" << r.output;  // a bad file: kiln::Error, exit 1 (a bad option is 2)
    EXPECT_NE(r.output.find(msg), std::string::npos) << value << "\n" << r.output;
  }
  // Without the record, the small tensors do not fit the model the config builds.
  auto md = good.metadata;
  md.erase("kiln.pruned_channels");
  io::save_safetensors(dir.file("h.safetensors"), good.tensors, md);
  r = kiln_cli("eval " + dir.file("h.safetensors"));
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("mismatch for \"conv1.weight\""), std::string::npos) << r.output;
}
