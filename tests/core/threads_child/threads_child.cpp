// Prints what a program linked with kiln ends up with for OpenMP's waiting
// policy, its pid and its arguments, for tests/core/test_threads.cpp: kiln may
// re-execute the program before main to bound the spin (threads.cpp), and the
// program must not notice beyond the setting.
#include <unistd.h>

#include <iostream>

#include "kiln/core/threads.h"
#include "kiln/core/openmp_policy.h"

int main(int argc, char** argv) {
  std::cout << "policy: " << kiln::openmp_wait_policy() << "\n";
  std::cout << "threads: " << kiln::get_num_threads() << "\n";
  for (int i = 1; i < argc; ++i) std::cout << "arg: " << argv[i] << "\n";
  return 0;
}
