// A PyTorch-style training loop in C++ with kiln's optimizers and schedulers,
// on plain tensors (a two-layer tanh MLP fitting y = sin(3x) + noise), in the
// correct order: zero_grad -> forward -> loss / accumulation_steps -> backward
// (accumulating over micro-batches) -> clip_grad_norm_ -> optimizer.step ->
// scheduler.step. AdamW decays the weight matrices only (split_decay), and the
// learning rate warms up linearly for 20 steps, then follows a cosine.
#include <cmath>
#include <cstdio>
#include <memory>

#include "kiln/kiln.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"

using namespace kiln;

int main() {
  manual_seed(0);
  constexpr int64_t kHidden = 64, kMicroBatch = 32;
  constexpr int kSteps = 200, kAccumulation = 4;

  // Parameters as named leaf tensors (nn::Module::named_parameters() gives the same shape of list).
  Tensor w1 = (randn({1, kHidden}) * 1.0).requires_grad_();
  Tensor b1 = zeros({kHidden}).requires_grad_();
  Tensor w2 = (randn({kHidden, 1}) * (1.0 / std::sqrt(double(kHidden)))).requires_grad_();
  Tensor b2 = zeros({1}).requires_grad_();
  const optim::NamedParams params{{"fc1.weight", w1}, {"fc1.bias", b1}, {"fc2.weight", w2}, {"fc2.bias", b2}};

  optim::AdamW opt(optim::split_decay(params, /*weight_decay=*/0.01), {.lr = 3e-2});
  auto warmup = std::make_shared<optim::LinearLR>(opt, optim::LinearLROptions{.start_factor = 0.05, .total_iters = 20});
  auto cosine = std::make_shared<optim::CosineAnnealingLR>(
      opt, optim::CosineAnnealingLROptions{.T_max = kSteps - 20, .eta_min = 1e-4});
  optim::SequentialLR sched(opt, {warmup, cosine}, {20});

  auto batch = [&] {
    Tensor x = rand({kMicroBatch, 1}) * 2.0 - 1.0;
    Tensor y = (x * 3.0).sin() + randn({kMicroBatch, 1}) * 0.05;
    return std::make_pair(x, y);
  };

  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    double step_loss = 0;
    for (int micro = 0; micro < kAccumulation; ++micro) {
      auto [x, y] = batch();
      Tensor h = (x.matmul(w1) + b1).tanh();
      Tensor pred = h.matmul(w2) + b2;
      Tensor loss = (pred - y).pow(2).mean() / double(kAccumulation);  // the mean over the accumulated batches
      loss.backward();
      step_loss += loss.item<float>();
    }
    const double grad_norm = optim::clip_grad_norm_(params, /*max_norm=*/1.0);
    opt.step();
    sched.step();
    if (step % 20 == 0 || step == kSteps - 1)
      std::printf("step %3d  loss %.5f  grad norm %.4f  lr %.5f\n", step, step_loss, grad_norm, sched.get_last_lr()[0]);
  }
  return 0;
}
