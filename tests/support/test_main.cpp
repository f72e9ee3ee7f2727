// Test entry point: fixes the thread count so results are reproducible
// (DESIGN.md §2: same seed, same thread count => identical results).
#include <gtest/gtest.h>

#include <cstdlib>

#include "kiln/core/threads.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!std::getenv("OMP_NUM_THREADS")) kiln::set_num_threads(2);
  return RUN_ALL_TESTS();
}
