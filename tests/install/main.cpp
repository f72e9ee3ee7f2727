// A user's program built against an installed kiln (find_package(kiln)):
// scripts/test.sh installs kiln to a temporary prefix and builds this.
#include <kiln/kiln.h>

#include <iostream>

int main() {
  kiln::manual_seed(0);
  // The profiler is part of kiln::kiln: a range shows up in its table.
  kiln::profiler::Profiler prof;
  prof.start();
  kiln::Tensor total;
  {
    kiln::profiler::Range r("consumer_forward");
    auto x = kiln::randn({4, 8});
    auto y = kiln::linear(x, kiln::randn({16, 8}), kiln::zeros({16})).relu();
    total = y.softmax(-1).sum(-1);
  }
  prof.stop();
  std::cout << total << "\n";
  bool profiled = false;
  for (const auto& row : prof.key_averages()) profiled = profiled || (row.name == "consumer_forward" && row.calls == 1);
  if (!profiled) std::cerr << "the profiler did not record the range:\n" << prof.table();
  return total.allclose(kiln::ones({4})) && profiled ? 0 : 1;
}
