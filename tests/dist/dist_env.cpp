// Initialises MPI once for test_dist when it runs under mpirun (ctest's
// dist_2 and dist_4). The DistJob and DistLaunch cases run without mpirun:
// they start their own jobs as children.
#include <gtest/gtest.h>

#include "kiln/dist/dist.h"

namespace {

class DistEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (kiln::dist::launched_by_mpi()) kiln::dist::init();
  }
};

[[maybe_unused]] auto* const g_env = ::testing::AddGlobalTestEnvironment(new DistEnvironment);

}  // namespace
