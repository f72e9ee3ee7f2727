// Pinned-value helpers shared by test_linalg.cpp and test_conv_pool.cpp:
// deterministic inputs (multiples of 1/4, so float32 results are exact) and a
// comparison that reports the first element out of tolerance.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kiln/kiln.h"
#include "support/test_util.h"

namespace kiln::test {

struct Expected {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

// scale 1 gives the integers torch's (seq * 4).long() holds.
inline Tensor seq(IntArrayRef shape, int a, int b, DType dt = kFloat32, double scale = 0.25) {
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = (static_cast<double>((i * a + b) % 11) - 5.0) * scale;
  return tensor<double>(v).reshape(shape).to(dt);
}

inline void expect_close(const Tensor& got, IntArrayRef shape, const std::vector<double>& want, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(got.sizes().vec(), shape.vec()) << what;
  const auto v = to_doubles(got);
  ASSERT_EQ(v.size(), want.size()) << what;
  for (size_t i = 0; i < v.size(); ++i) {
    const bool both_nan = std::isnan(v[i]) && std::isnan(want[i]);
    ASSERT_TRUE(both_nan || std::abs(v[i] - want[i]) <= atol + rtol * std::abs(want[i]))
        << what << ": element " << i << " is " << v[i] << ", expected " << want[i];
  }
}

inline void expect_close(const Tensor& got, const Expected& e, double rtol, double atol, const std::string& what) {
  expect_close(got, e.shape, e.values, rtol, atol, what);
}

inline void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  expect_close(got, want.sizes(), to_doubles(want), rtol, atol, what);
}

}  // namespace kiln::test
