// Trains the WORKLOADS.md CNN on Fashion-MNIST with the C++ API, as a user
// would until the `kiln` command exists: DataLoader with worker threads and
// random crops, Adam, cross-entropy, then test accuracy. scripts/demo.sh runs
// it after the tour. Usage: train_fashion [epochs (default 5)]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "kiln/kiln.h"
#include "kiln/optim/optimizer.h"

using namespace kiln;

namespace {

std::shared_ptr<nn::Sequential> make_cnn() {
  auto conv = [](int64_t in, int64_t out) {
    return std::make_shared<nn::Conv2d>(
        nn::Conv2dOptions{.in_channels = in, .out_channels = out, .kernel_size = {3}, .padding = {1}});
  };
  auto pool = [] { return std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{.kernel_size = {2}}); };
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      conv(1, 32), std::make_shared<nn::ReLU>(), pool(), conv(32, 64), std::make_shared<nn::ReLU>(), pool(),
      std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 3136, .out_features = 128}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 128, .out_features = 10})});
}

double accuracy(nn::Module& model, data::DataLoader<>& loader) {
  NoGradGuard no_grad;
  model.eval();
  int64_t correct = 0, total = 0;
  for (auto& batch : loader) {
    Tensor pred = model(batch.data).argmax(1);
    correct += pred.eq(batch.target).sum().item<int64_t>();
    total += batch.target.numel();
  }
  model.train();
  return static_cast<double>(correct) / static_cast<double>(total);
}

}  // namespace

int main(int argc, char** argv) {
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 5;
  manual_seed(0);
  auto train_set = std::make_shared<data::FashionMNIST>(
      data::FashionMNISTOptions{.train = true, .transform = data::transforms::random_crop(28, 2)});
  auto test_set = std::make_shared<data::FashionMNIST>(data::FashionMNISTOptions{.train = false});
  data::DataLoader<> train(train_set,
                           {.batch_size = 64, .shuffle = true, .num_workers = 1, .drop_last = true, .seed = 0});
  data::DataLoader<> test(test_set, {.batch_size = 500});

  auto model = make_cnn();
  std::cout << model->to_string() << "\n" << model->summary() << "\n";
  optim::Adam opt(model->named_parameters(), {.lr = 1e-3});

  const auto t0 = std::chrono::steady_clock::now();
  int64_t step = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    double running = 0;
    int64_t n = 0;
    for (auto& batch : train) {
      opt.zero_grad();
      Tensor loss = nn::functional::cross_entropy((*model)(batch.data), batch.target);
      loss.backward();
      opt.step();
      running += loss.item<double>();
      ++n;
      if (++step % 200 == 0) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("epoch %d step %5lld  loss %.4f  %.0f samples/s\n", epoch, static_cast<long long>(step),
                    running / n, step * 64 / s);
        running = 0;
        n = 0;
      }
    }
    const auto st = train.stats();
    std::printf("epoch %d done: test accuracy %.2f%%, data-wait %.1f%% of wall time\n", epoch,
                100.0 * accuracy(*model, test), 100.0 * st.wait_fraction);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("trained %lld steps in %.1f s\n\n", static_cast<long long>(step), s);
  std::cout << memory::summary();
  return 0;
}
