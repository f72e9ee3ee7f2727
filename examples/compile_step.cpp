// kiln::compile on a small classifier's training step (docs/compile.md): the
// replayed step against the eager one, a recompile when the batch size
// changes, a graph break from logging the loss inside the step (split there), and a
// normalisation written out in elementwise ops that fuse into one loop, each with
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

  // 3. Reading the loss inside the step is a graph break. From the second call the step runs
  // split there: its host code runs again (the read, the print), and the kernels before and
  // after the read run as graphs.
  bool quiet = false;
  auto logged = kiln::compile(
      [&](const std::vector<kiln::Tensor>& in) {
        auto out = train_step(in);
        const float loss = out[0].item<float>();
        if (!quiet) std::printf("  (inside the step: loss %.4f)\n", loss);
        return out;
      },
      {.name = "logged_step", .modules = {model.get()}});
  for (int i = 0; i < 2; ++i) logged(batch);
  quiet = true;
  const double split_us = us_per_call([&] { logged(batch); }, 2000);
  std::printf("split at the break %.1f us/step (eager %.1f)\n", split_us, eager_us);
  std::cout << "\n" << logged.explain();

  // 4. A normalisation and ReLU written out in elementwise ops, on a large batch: three
  // kernels that the replay runs as one tiled loop, the two temporaries kept in cache
  // instead of written to memory.
  // The tensor is read where it is (not an input, so a call copies nothing in).
  const kiln::Tensor wide = kiln::randn({256, 8192});
  auto act = [&] {
    const kiln::NoGradGuard no_grad;
    return ((wide - 0.5) * 2.0).relu();
  };
  auto fused = kiln::compile(act, {.name = "norm_relu", .modules = {}});
  auto unfused = kiln::compile(act, {.name = "norm_relu_unfused", .modules = {}, .fuse = false});
  fused();  // captures
  unfused();
  act();  // warms the eager path's cached blocks
  const double fused_us = us_per_call([&] { fused(); }, 50);
  const double unfused_us = us_per_call([&] { unfused(); }, 50);
  const double eager_act_us = us_per_call([&] { act(); }, 50);
  std::printf("\n((x - 0.5) * 2).relu() on [256, 8192]: eager %.0f us, replayed %.0f us, fused %.0f us\n", eager_act_us,
              unfused_us, fused_us);
  std::cout << fused.explain();
  return 0;
}
