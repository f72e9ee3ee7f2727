// Input-pipeline figures (issue 5): Fashion-MNIST batches/s with random crop
// and flip at 0, 1 and 2 workers, and the stall fraction a deliberately slow
// transform produces under a simulated 5 ms training step.
#include <benchmark/benchmark.h>

#include <chrono>
#include <thread>

#include "kiln/data/idx.h"
#include "kiln/data/loader.h"
#include "kiln/data/transforms.h"

using namespace kiln;

namespace {

// One epoch prefix of `batches` batches; reports batches/s and the fraction of wall time spent waiting.
void run_loader(benchmark::State& state, data::Transform transform, int64_t batches, double step_ms) {
  auto ds = std::make_shared<data::FashionMNIST>(data::FashionMNISTOptions{.transform = std::move(transform)});
  data::DataLoader<> loader(ds, {.batch_size = 64, .shuffle = true, .num_workers = state.range(0), .seed = 1});
  double wait = 0, bps = 0;
  for (auto _ : state) {
    int64_t n = 0;
    for (auto& b : loader) {
      benchmark::DoNotOptimize(b.data.data_ptr());
      if (step_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(step_ms));
      if (++n == batches) break;
    }
    const auto s = loader.stats();
    wait = s.wait_fraction;
    bps = s.batches_per_s;
  }
  state.counters["batches_per_s"] = bps;
  state.counters["wait_fraction"] = wait;
}

void BM_FashionCropFlip(benchmark::State& state) {
  run_loader(
      state,
      data::transforms::compose({data::transforms::random_crop(28, 2), data::transforms::random_horizontal_flip()}),
      150, 0.0);
}

// 2 ms of "work" per sample in the transform against a 5 ms training step per batch of 64.
void BM_SlowTransformStall(benchmark::State& state) {
  auto slow = [](const Tensor& x) {
    std::this_thread::sleep_for(std::chrono::microseconds(2000));
    return x;
  };
  run_loader(state, slow, 10, 5.0);
}

}  // namespace

BENCHMARK(BM_FashionCropFlip)->Arg(0)->Arg(1)->Arg(2)->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SlowTransformStall)->Arg(0)->Arg(2)->Iterations(1)->Unit(benchmark::kMillisecond);
