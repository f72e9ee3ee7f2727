// Checkpoints: 2N steps straight equal N steps + save + load into fresh
// objects + N steps, bitwise (losses and parameters), with a shuffled loader
// (resumed mid-epoch), dropout, SGD momentum and StepLR; a corrupted byte fails the
// checksum; a different architecture is rejected by name and changes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/data/dataset.h"
#include "kiln/data/loader.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/train/checkpoint.h"
#include "support/record_collector.h"
#include "support/test_util.h"

namespace kiln {
namespace {

using data::DataLoader;
using data::SyntheticDataset;

struct TrainRun {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::SGD> opt;
  std::unique_ptr<optim::StepLR> sched;
  std::unique_ptr<DataLoader<>> loader;
  DataLoader<>::Iterator it;
  bool started = false;  // `it` holds a delivered batch; advance before the next
};

std::shared_ptr<nn::Module> make_mlp(int64_t hidden) {
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 12, .out_features = hidden}),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Dropout>(0.3),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = hidden, .out_features = 3})});
}

// The same construction every time: weights from seed 5, then the default generator reseeded to 77.
void build(TrainRun& r, int64_t hidden = 16) {
  manual_seed(5);
  r.model = make_mlp(hidden);
  r.opt = std::make_unique<optim::SGD>(r.model->named_parameters(),
                                       optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
  r.sched = std::make_unique<optim::StepLR>(*r.opt, optim::StepLROptions{.step_size = 4, .gamma = 0.5});
  auto ds = std::make_shared<SyntheticDataset>(
      data::SyntheticOptions{.size = 40, .sample_shape = {3, 4}, .num_classes = 3, .seed = 1});
  r.loader = std::make_unique<DataLoader<>>(ds, DataLoader<>::Options{.batch_size = 8, .shuffle = true, .seed = 3});
  manual_seed(77);
}

// n training steps (5 batches per epoch, so epochs end inside); losses appended.
void train(TrainRun& r, int n, std::vector<float>& losses) {
  for (int i = 0; i < n; ++i) {
    if (r.started) ++r.it;
    if (!r.started || r.it == r.loader->end()) {
      r.it = DataLoader<>::Iterator();
      r.it = r.loader->begin();
    }
    r.started = true;
    const data::Example b = *r.it;
    Tensor loss = nn::F::cross_entropy((*r.model)(b.data), b.target);
    r.opt->zero_grad();
    loss.backward();
    r.opt->step();
    r.sched->step();
    losses.push_back(loss.item<float>());
  }
}

void expect_same_params(const nn::Module& a, const nn::Module& b) {
  auto pa = a.state_dict(), pb = b.state_dict();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_TRUE(test::bitwise_equal(pa[i].second, pb[i].second)) << pa[i].first;
  }
}

TEST(Checkpoint, ResumeMidEpochIsBitwiseIdentical) {
  test::TempDir dir;
  const int n = 7;  // mid-epoch: 7 = 5 + 2
  TrainRun straight;
  build(straight);
  std::vector<float> want;
  train(straight, 2 * n, want);

  TrainRun first;
  build(first);
  std::vector<float> got;
  train(first, n, got);
  const std::string path = dir.file("ckpt.safetensors");
  train::save_checkpoint(path, {.model = first.model.get(), .optimizer = first.opt.get(), .scheduler = first.sched.get()},
                         {.step = n, .loader = first.loader->state(), .config = "lr=0.05"});
  EXPECT_EQ(first.loader->state().epoch, 1);
  EXPECT_EQ(first.loader->state().position, 2);

  TrainRun resumed;
  build(resumed);
  manual_seed(12345);  // the checkpoint must restore the default generator
  const train::CheckpointInfo info =
      train::load_checkpoint(path, {.model = resumed.model.get(), .optimizer = resumed.opt.get(), .scheduler = resumed.sched.get()});
  EXPECT_EQ(resumed.sched->last_epoch(), first.sched->last_epoch());
  EXPECT_EQ(resumed.sched->get_last_lr(), first.sched->get_last_lr());
  EXPECT_EQ(info.step, n);
  EXPECT_EQ(info.config, "lr=0.05");
  ASSERT_TRUE(info.loader.has_value());
  resumed.loader->load_state(*info.loader);
  train(resumed, n, got);

  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0) << "step " << i << ": " << got[i] << " vs " << want[i];
  expect_same_params(*resumed.model, *straight.model);
}

TEST(Checkpoint, CorruptedByteFailsTheChecksum) {
  test::TempDir dir;
  TrainRun r;
  build(r);
  std::vector<float> losses;
  train(r, 3, losses);
  const std::string path = dir.file("ckpt.safetensors");
  train::save_checkpoint(path, {.model = r.model.get(), .optimizer = r.opt.get(), .scheduler = nullptr}, {.step = 3, .loader = std::nullopt, .config = ""});
  const io::SafetensorsHeader h = io::read_safetensors_header(path);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(h.data_start + h.data_size / 2));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(static_cast<std::streamoff>(h.data_start + h.data_size / 2));
    f.write(&c, 1);
  }
  TrainRun fresh;
  build(fresh);
  const auto before = fresh.model->state_dict()[0].second.clone();
  try {
    train::load_checkpoint(path, {.model = fresh.model.get(), .optimizer = fresh.opt.get(), .scheduler = nullptr});
    FAIL() << "expected FormatError";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::bitwise_equal(fresh.model->state_dict()[0].second, before));
}

TEST(Checkpoint, OtherArchitectureIsRejectedByNameAndChangesNothing) {
  test::TempDir dir;
  TrainRun small;
  build(small, 16);
  const std::string path = dir.file("ckpt.safetensors");
  train::save_checkpoint(path, {.model = small.model.get(), .optimizer = nullptr, .scheduler = nullptr}, {.step = 0, .loader = std::nullopt, .config = ""});

  manual_seed(9);
  auto other = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 12, .out_features = 32}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 32, .out_features = 3, .bias = false})});
  std::vector<Tensor> before;
  for (const auto& [name, t] : other->state_dict()) before.push_back(t.clone());
  try {
    train::load_checkpoint(path, {.model = other.get(), .optimizer = nullptr, .scheduler = nullptr});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    // Every problem, by name: 1.weight and 1.bias have other shapes; the file's last Linear is
    // "4" (after Dropout), other's is "3" without bias, so 3.weight is missing and 4.* unexpected.
    for (const char* key : {"'1.weight'", "'1.bias'", "missing key '3.weight'", "unexpected key '4.weight'",
                            "unexpected key '4.bias'"})
      EXPECT_NE(msg.find(key), std::string::npos) << key << " not in: " << msg;
  }
  auto after = other->state_dict();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(test::bitwise_equal(after[i].second, before[i]));
}

}  // namespace
// A profile sees each save and load as a Checkpoint scope with the file's size.
TEST(Checkpoint, SaveAndLoadAreRecordedWithTheFileSize) {
  test::TempDir dir;
  TrainRun r;
  build(r);
  const std::string path = dir.file("ckpt.safetensors");
  test::RecordCollector rec;
  train::save_checkpoint(path, {.model = r.model.get(), .optimizer = r.opt.get(), .scheduler = nullptr},
                         {.step = 1, .loader = std::nullopt, .config = ""});
  train::load_checkpoint(path, {.model = r.model.get(), .optimizer = r.opt.get(), .scheduler = nullptr});
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
  const auto saves = rec.events(record::Kind::Checkpoint, "checkpoint.save");
  const auto loads = rec.events(record::Kind::Checkpoint, "checkpoint.load");
  ASSERT_EQ(saves.size(), 1u);
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(saves[0].bytes, size);
  EXPECT_EQ(loads[0].bytes, size);
  EXPECT_LE(saves[0].end_ns, loads[0].start_ns);
}

}  // namespace kiln
