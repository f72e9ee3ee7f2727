// Memory forensics as a user meets them (docs/memory.md): who holds the
// memory, what an out-of-memory error says, and a leak named by its line.
//   1. A training loop with the classic bug — `total += loss` keeps every
//      step's autograd graph — and a train::LeakWatch that names the line.
//   2. The same model asked for a batch that does not fit under a memory
//      limit: OutOfMemory lists the call sites holding the memory and the lever.
//   3. memory::snapshot(): live bytes by call site.
#include <cstdio>
#include <iostream>

#include "kiln/kiln.h"

using namespace kiln;

namespace {

struct Mlp {
  Mlp() : fc1({.in_features = 256, .out_features = 512}), fc2({.in_features = 512, .out_features = 10}) {}
  Tensor operator()(const Tensor& x) { return fc2(fc1(x).relu()); }
  optim::NamedParams params() {
    return {{"fc1.weight", fc1.weight}, {"fc1.bias", fc1.bias}, {"fc2.weight", fc2.weight}, {"fc2.bias", fc2.bias}};
  }
  nn::Linear fc1, fc2;
};

}  // namespace

int main() {
  manual_seed(0);
  set_num_threads(1);
  memory::record_history();  // every live tensor remembers the line that made it
  Mlp model;
  optim::Adam opt(model.params(), optim::AdamOptions{.lr = 1e-3});

  std::puts("== 1. a loss summed with its graph");
  std::fflush(stdout);  // the watch writes to stderr
  {
    train::LeakWatch watch;  // prints "kiln warning: ..." once
    Tensor total = zeros({});
    for (int step = 0; step < 12; ++step) {
      opt.zero_grad();
      Tensor loss = nn::functional::cross_entropy(model(randn({64, 256})), randint(0, 10, {64}));
      loss.backward();
      opt.step();
      total += loss;  // the bug: use `total += loss.item<double>()` (a double) or loss.detach()
      if (watch.step()) break;
    }
  }

  std::puts("\n== 2. out of memory under a limit");
  memory::set_limit(memory::stats().live_bytes + (int64_t{24} << 20));  // 24 MiB more than what is live
  try {
    Tensor x = randn({8192, 256});
    Tensor loss = nn::functional::cross_entropy(model(x), randint(0, 10, {8192}));
    loss.backward();
  } catch (const OutOfMemory& e) {
    std::cout << e.what() << "\n";
  }
  memory::set_limit(0);

  std::puts("\n== 3. what is live now");
  std::cout << memory::summary() << memory::format_sites(memory::snapshot(), 6);
  return 0;
}
