// Transforms: exact values of normalize/crop/flip, per-sample randomness from
// the sample generator, and bitwise-identical augmented Fashion-MNIST batches
// for num_workers in {0, 1, 2, 4}; batches/s at 0, 1, 2 workers is printed.
#include <gtest/gtest.h>

#include <iostream>
#include <set>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/data/loader.h"
#include "kiln/data/transforms.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

namespace {
Tensor image() {  // [1, 3, 4] with values 0..11
  return arange(12, TensorOptions().dtype(kFloat32)).reshape({1, 3, 4});
}
}  // namespace

TEST(DataTransforms, NormalizeValues) {
  Tensor x = arange(8, TensorOptions().dtype(kFloat32)).reshape({2, 2, 2});
  auto out = test::to_doubles(transforms::normalize({1.0, 2.0}, {2.0, 4.0})(x));
  EXPECT_EQ(out, (std::vector<double>{-0.5, 0, 0.5, 1, 0.5, 0.75, 1, 1.25}));
  EXPECT_THROW(transforms::normalize({1.0, 2.0, 3.0}, {1.0, 1.0, 1.0})(x), ShapeError);
  EXPECT_THROW(transforms::normalize({0.0}, {0.0}), ValueError);
  EXPECT_THROW(transforms::normalize({0.0}, {1.0})(zeros({2, 2})), ShapeError);
}

TEST(DataTransforms, CropIsAWindowOfThePaddedImage) {
  Tensor x = image();
  Generator gen(3);
  SampleGeneratorGuard guard(&gen);
  EXPECT_TRUE(test::bitwise_equal(transforms::random_crop(3, 0)(arange(9, TensorOptions().dtype(kFloat32)).reshape({1, 3, 3})),
                                  arange(9, TensorOptions().dtype(kFloat32)).reshape({1, 3, 3})));
  std::set<std::pair<int, int>> offsets;
  for (int trial = 0; trial < 40; ++trial) {
    auto out = test::to_doubles(transforms::random_crop(3, 1)(x));
    ASSERT_EQ(out.size(), 9u);
    // Find the (top, left) in the padded 5 x 6 image that reproduces `out`.
    bool found = false;
    for (int top = 0; top <= 2 && !found; ++top)
      for (int left = 0; left <= 3 && !found; ++left) {
        bool same = true;
        for (int y = 0; y < 3; ++y)
          for (int c = 0; c < 3; ++c) {
            int sy = top + y - 1, sx = left + c - 1;
            double v = (sy >= 0 && sy < 3 && sx >= 0 && sx < 4) ? sy * 4 + sx : 0;
            same = same && out[static_cast<size_t>(y * 3 + c)] == v;
          }
        if (same) {
          found = true;
          offsets.insert({top, left});
        }
      }
    EXPECT_TRUE(found) << "trial " << trial;
  }
  EXPECT_GT(offsets.size(), 4u) << "the crop offset should vary";
  EXPECT_THROW(transforms::random_crop(7, 1)(x), ShapeError);
}

TEST(DataTransforms, FlipAndComposeFollowTheSampleGenerator) {
  Tensor x = image();
  auto flipped = test::to_doubles(transforms::random_horizontal_flip(1.0)(x));
  EXPECT_EQ(std::vector<double>(flipped.begin(), flipped.begin() + 4), (std::vector<double>{3, 2, 1, 0}));
  EXPECT_TRUE(test::bitwise_equal(transforms::random_horizontal_flip(0.0)(x), x));

  auto aug = transforms::compose({transforms::random_crop(3, 1), transforms::random_horizontal_flip(0.5),
                                  transforms::normalize({0.5}, {0.25})});
  Tensor a, b, c;
  {
    Generator g(77);
    SampleGeneratorGuard guard(&g);
    a = aug(x);
  }
  {
    Generator g(77);
    SampleGeneratorGuard guard(&g);
    b = aug(x);
  }
  EXPECT_TRUE(test::bitwise_equal(a, b)) << "same sample generator, same result";
  int differ = 0;
  for (uint64_t s = 0; s < 10; ++s) {
    Generator g(1000 + s);
    SampleGeneratorGuard guard(&g);
    c = aug(x);
    differ += !test::bitwise_equal(a, c);
  }
  EXPECT_GT(differ, 5);
}

TEST(DataTransforms, AugmentedFashionMnistIdenticalAcrossNumWorkers) {
  auto aug = transforms::compose({transforms::random_crop(28, 4), transforms::random_horizontal_flip(0.5),
                                  transforms::normalize({0.2860}, {0.3530})});
  auto ds = std::make_shared<FashionMNIST>(FashionMNISTOptions{.train = true, .transform = aug});
  std::vector<Example> ref;
  for (int64_t workers : {0, 1, 2, 4}) {
    DataLoader<> loader(ds, {.batch_size = 64, .shuffle = true, .num_workers = workers, .seed = 2024});
    std::vector<Example> got;
    for (auto& b : loader) {
      got.push_back(b);
      if (got.size() == 12) break;
    }
    if (ref.empty()) {
      ref = got;
      EXPECT_EQ(ref[0].data.shape_string(), "[64, 1, 28, 28]");
      continue;
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(test::bitwise_equal(got[i].data, ref[i].data)) << workers << " workers, batch " << i;
      EXPECT_TRUE(test::bitwise_equal(got[i].target, ref[i].target)) << workers << " workers, batch " << i;
    }
  }
}

TEST(DataTransforms, FashionMnistThroughputAtZeroOneTwoWorkers) {
  auto aug = transforms::compose({transforms::random_crop(28, 4), transforms::random_horizontal_flip(0.5)});
  auto ds = std::make_shared<FashionMNIST>(FashionMNISTOptions{.train = true, .transform = aug});
  for (int64_t workers : {0, 1, 2}) {
    DataLoader<> loader(ds, {.batch_size = 64, .shuffle = true, .num_workers = workers, .seed = 1});
    int64_t n = 0;
    for (auto& b : loader) {
      (void)b;
      if (++n == 150) break;
    }
    LoaderStats s = loader.stats();
    EXPECT_EQ(s.batches, 150);
    EXPECT_GT(s.batches_per_s, 0.0);
    std::cout << "[ figures  ] Fashion-MNIST batch 64, crop+flip, " << workers << " workers: " << s.batches_per_s
              << " batches/s, wait fraction " << s.wait_fraction << "\n";
  }
}
