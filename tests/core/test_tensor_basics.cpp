#include <gtest/gtest.h>

#include "kiln/kiln.h"

using namespace kiln;

TEST(TensorBasics, ViewsShareStorageAndVersion) {
  Tensor a = arange(12, kFloat32).view({3, 4});
  Tensor b = a.transpose(0, 1);
  EXPECT_TRUE(b.is_alias_of(a));
  EXPECT_FALSE(b.is_contiguous());
  const uint32_t v0 = a.version();
  b.fill_(1.0);
  EXPECT_EQ(a.version(), v0 + 1);
  EXPECT_EQ(b.version(), a.version());
  EXPECT_EQ(a.data_ptr<float>()[5], 1.0f);
}

TEST(TensorBasics, Printing) {
  EXPECT_EQ(tensor<float>({1.0f, 2.5f}).to_string(), "tensor([1.0000, 2.5000])");
  EXPECT_EQ(tensor<float>({1.0f, 2.0f}).to_string(), "tensor([1., 2.])");
  EXPECT_EQ(arange(4).view({2, 2}).to_string(), "tensor([[0, 1],\n        [2, 3]])");
  EXPECT_EQ(ones({2}, kFloat64).to_string(), "tensor([1., 1.], dtype=torch.float64)");
}
