// The fixed training state the checkpoint fuzzer loads into, shared with the
// seed generator so that its seed checkpoints match the model exactly.
#pragma once

#include <fstream>
#include <iterator>
#include <memory>

#include "fuzz_util.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"
#include "kiln/train/checkpoint.h"

namespace kiln::fuzz {

inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// Linear 3 -> 2, Adam after one step, StepLR; `base` is its valid checkpoint.
struct CheckpointFixture {
  std::shared_ptr<nn::Linear> model;
  std::unique_ptr<optim::Adam> opt;
  std::unique_ptr<optim::StepLR> sched;
  ShmFile base_file{"ckpt-base"}, input_file{"ckpt-input"}, snapshot_file{"ckpt-snapshot"};
  io::SafetensorsFile base;  // the valid checkpoint mode 1 edits

  CheckpointFixture() {
    manual_seed(3);
    model = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 3, .out_features = 2});
    opt = std::make_unique<optim::Adam>(model->named_parameters(), optim::AdamOptions{.lr = 0.01});
    sched = std::make_unique<optim::StepLR>(*opt, optim::StepLROptions{.step_size = 2, .gamma = 0.5});
    Tensor loss = (*model)(ones({4, 3})).sum();
    loss.backward();
    opt->step();
    sched->step();
    train::save_checkpoint(base_file.path(), refs(), {.step = 1, .loader = data::LoaderState{1, 2, 3}, .config = "lr=0.01"});
    base = io::load_safetensors(base_file.path());
  }
  train::CheckpointRefs refs() { return {.model = model.get(), .optimizer = opt.get(), .scheduler = sched.get()}; }
  std::string snapshot() {
    train::save_checkpoint(snapshot_file.path(), refs(), {.step = 0});
    return slurp(snapshot_file.path());
  }
};

}  // namespace kiln::fuzz
