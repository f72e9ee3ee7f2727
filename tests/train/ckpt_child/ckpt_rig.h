// The training run that the separate-process checkpoint tests share: the
// child program (ckpt_child.cpp) trains it, and test_optim rebuilds it in
// process to load what a killed child left. An MLP with dropout on a shuffled
// DataLoader (5 batches an epoch), AdamW with cosine annealing, input noise
// from a named generator and a Stateful loss average, so that every kind of
// checkpointed state has to come back for the losses to match bit for bit.
#pragma once

#include <cstdint>
#include <memory>

#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/data/dataset.h"
#include "kiln/data/loader.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/train/checkpoint.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"

namespace kiln::ckpt_test {

// An exponential average of the loss: a non-module, non-optimizer piece of state.
class LossAverage : public io::Stateful {
 public:
  Tensor value = zeros({1});
  int64_t count = 0;
  double decay = 0.9;

  void update(const Tensor& loss) {
    value = value * decay + loss.detach().reshape({1}) * (1.0 - decay);
    ++count;
  }
  io::ObjectState state_dict() const override {
    return {.tensors = {{"value", value.clone()}}, .values = {{"count", count}, {"decay", decay}}};
  }
  void load_state_dict(const io::ObjectState& s) override {
    value = s.tensors.at("value").clone();
    count = std::get<int64_t>(s.values.at("count"));
    decay = std::get<double>(s.values.at("decay"));
  }
};

struct Rig {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::CosineAnnealingLR> sched;
  std::unique_ptr<data::DataLoader<>> loader;
  data::DataLoader<>::Iterator it;
  bool started = false;  // `it` holds a delivered batch; advance before the next
  Generator noise{2024};
  LossAverage average;
  int64_t step = 0;

  // Always the same construction: weights from seed 5, then the default generator at seed 77.
  Rig() {
    manual_seed(5);
    model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Flatten>(),
        std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 12, .out_features = 32}),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Dropout>(0.25),
        std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 32, .out_features = 3})});
    opt = std::make_unique<optim::AdamW>(model->named_parameters(), optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.05});
    sched = std::make_unique<optim::CosineAnnealingLR>(*opt, optim::CosineAnnealingLROptions{.T_max = 11, .eta_min = 1e-4});
    auto ds = std::make_shared<data::SyntheticDataset>(
        data::SyntheticOptions{.size = 40, .sample_shape = {3, 4}, .num_classes = 3, .seed = 1});
    loader = std::make_unique<data::DataLoader<>>(ds, data::DataLoader<>::Options{.batch_size = 8, .shuffle = true, .seed = 3});
    manual_seed(77);
  }

  train::CheckpointRefs refs() {
    return {.model = model.get(), .optimizer = opt.get(), .scheduler = sched.get(),
            .generators = {{"noise", &noise}}, .objects = {{"loss_average", &average}}};
  }
  train::CheckpointInfo info() const { return {.step = step, .loader = loader->state(), .config = "ckpt_rig v1"}; }
  void resume(const train::CheckpointInfo& i) {
    loader->load_state(*i.loader);
    step = i.step;
  }

  // One optimisation step; returns the loss.
  float train_step() {
    if (started) ++it;
    if (!started || it == loader->end()) {
      it = data::DataLoader<>::Iterator();
      it = loader->begin();
    }
    started = true;
    const data::Example b = *it;
    const Tensor x = b.data + randn(b.data.sizes(), {}, &noise) * 0.05;
    Tensor loss = nn::F::cross_entropy((*model)(x), b.target);
    opt->zero_grad();
    loss.backward();
    opt->step();
    sched->step();
    average.update(loss);
    ++step;
    return loss.item<float>();
  }

  // What the tests compare bit for bit besides the losses.
  io::NamedTensors final_state() const {
    io::NamedTensors out = model->state_dict();
    out.emplace_back("loss_average.value", average.value);
    return out;
  }
};

}  // namespace kiln::ckpt_test
