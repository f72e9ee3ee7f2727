// A data-parallel program built against an installed kiln with
// find_package(kiln COMPONENTS dist): without mpirun it is a world of one.
#include <kiln/kiln.h>

#include <iostream>

int main() {
  kiln::dist::init();
  auto t = kiln::ones({3});
  kiln::dist::world()->allreduce(t)->wait();
  std::cout << "world " << kiln::dist::world_size() << ": " << t << "\n";
  return kiln::dist::world_size() == 1 && t.allclose(kiln::ones({3})) ? 0 : 1;
}
