#include <gtest/gtest.h>

#include "kiln/kiln.h"
#include "kiln/ops/reduce.h"

using namespace kiln;

TEST(Reduce, Smoke) {
  Tensor x = arange(6, kFloat32).view({2, 3});
  EXPECT_EQ(x.sum().item<double>(), 15.0);
}
