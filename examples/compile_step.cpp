// kiln::compile on a small classifier's training step (docs/compile.md): the
// replayed step against the eager one, a recompile when the batch size
// changes, and a graph break from logging the loss inside the step, each with
// what explain() says about it.
//
//   build/release/examples/compile_step        (KILN_COMPILE_LOG=1 also logs each capture)
#include <chrono>
#include <cstdio>
#include <iostream>

#include "kiln/export/compile.h"
#include "kiln/kiln.h"

namespace F = kiln::nn::F;

namespace {

double us_per_call(const std::function<void()>& f, int n) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}

}  // namespace

int main() {
  kiln::set_num_threads(1);
  kiln::manual_seed(0);
  auto model = std::make_shared<kiln::models::MLP>(kiln::models::MLPOptions{.in_features = 32, .hidden = {64, 64}});
  kiln::optim::SGD opt(*model, {.lr = 0.01, .momentum = 0.9});
  auto train_step = [&](const std::vector<kiln::Tensor>& in) {
    opt.zero_grad();
    kiln::Tensor loss = F::cross_entropy((*model)(in[0]), in[1]);
    loss.backward();
    opt.step();
    return std::vector<kiln::Tensor>{loss};
  };
  const std::vector<kiln::Tensor> batch = {kiln::randn({8, 32}), kiln::randint(0, 10, {8})};

  // 1. The same step, eager and replayed.
  auto step = kiln::compile(train_step, {.name = "train_step", .modules = {model.get()}});
  const double eager_us = us_per_call([&] { train_step(batch); }, 2000);
  step(batch);  // captures
  const double compiled_us = us_per_call([&] { step(batch); }, 2000);
  std::printf("eager %.1f us/step, compiled %.1f us/step (%.2fx); loss now %.4f\n", eager_us, compiled_us,
              compiled_us / eager_us, step(batch)[0].item<float>());

  // 2. A new batch size fails the input guard: a second capture (a recompile).
  step({kiln::randn({16, 32}), kiln::randint(0, 10, {16})});
  std::cout << "\n" << step.explain();

  // 3. Reading the loss inside the step is a graph break: the step then runs eagerly.
  auto logged = kiln::compile(
      [&](const std::vector<kiln::Tensor>& in) {
        auto out = train_step(in);
        std::printf("  (inside the step: loss %.4f)\n", out[0].item<float>());
        return out;
      },
      {.name = "logged_step", .modules = {model.get()}});
  for (int i = 0; i < 2; ++i) logged(batch);
  std::cout << "\n" << logged.explain();
  return 0;
}
