// A user's program built against an installed kiln (find_package(kiln)):
// scripts/test.sh installs kiln to a temporary prefix and builds this.
#include <kiln/kiln.h>

#include <iostream>

int main() {
  kiln::manual_seed(0);
  auto x = kiln::randn({4, 8});
  auto y = kiln::linear(x, kiln::randn({16, 8}), kiln::zeros({16})).relu();
  auto total = y.softmax(-1).sum(-1);
  std::cout << total << "\n";
  return total.allclose(kiln::ones({4})) ? 0 : 1;
}
