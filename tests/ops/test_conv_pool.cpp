// conv2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d: values against
// PyTorch 1.13, oneDNN against a direct float64 convolution and against our
// torch-exact pooling loops, float64/integer/float16 paths, NaN propagation,
// the primitive cache, and error messages.
//
// Pinned inputs are seq(shape, a, b)[i] = (((i * a + b) % 11) - 5) * 0.25 in
// row-major order, built the same way in Python; the expected values were
// printed by /usr/bin/python3 with torch 1.13 (torch.set_num_threads(1)) from
// the torch.nn.functional expression named beside each case.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kiln/kernels/dnnl.h"
#include "dense_test_util.h"
#include "support/test_util.h"
#include "kiln/kiln.h"
#include "kiln/ops/conv.h"

using namespace kiln;

namespace {

using test::expect_close;
using test::Expected;
using test::seq;
using test::to_doubles;


using test::error_message;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// clang-format off
// Conv: shape [1, 3, 3, 4]
const Expected kConv{{1, 3, 3, 4},
    {2.875, -4.25, 2.375, 2.8125, -0.6875, -0.9375, -3.25, -0.0625, -4.25, 2.375, 2.8125, -2.9375, -1, 2.375, -3.1875,
     0.1875, 0.6875, 3.375, 4, 2.5625, 2.375, -3.1875, 0.1875, 4.9375, 2.6875, -4.0625, 2.9375, 3.75, -0.6875,
     -0.5625, -2.5, 1.0625, -4.0625, 2.9375, 3.75, -1.625}};
// ConvStridePad: shape [1, 3, 3, 3]
const Expected kConvStridePad{{1, 3, 3, 3},
    {-0.4375, 1.375, -4.5625, -2.75, -0.9375, -0.0625, -2.4375, 0.5625, -2.875, 2.1875, -2.25, 5.125, 2.8125, 3.375,
     2.5625, 4.4375, 4.6875, -0.5625, -3.4375, 0.3125, -1, -0.5625, -0.5625, 1.0625, -1.0625, -3.5625, 4.5}};
// ConvDilation: shape [1, 3, 5, 4]
const Expected kConvDilation{{1, 3, 5, 4},
    {-4.5625, -1.8125, 7.25, 2.5, 3.8125, -4.5, -6.4375, 1.3125, 2.625, 7.6875, -1.5, -3.25, -3.4375, -0.9375, 6.625,
     0.625, -1.0625, -2.3125, -2.3125, -1.0625, 2.875, -4.75, -5.1875, 4.75, 0.0625, 7.75, -3.6875, -4.875, -5.75,
     -4.875, 11.5625, 4.3125, 3.8125, -4.5, -6.4375, 1.3125, 0.5, 7.25, -0.1875, -3.3125, -0.6875, 4, -1.8125,
     -3.3125, -4.375, -4.0625, 9.375, 1.3125, 2.375, -5.75, -7, 4.3125, 0.0625, 7.75, -3.6875, -4.875, -4.125,
     -5.1875, 10.1875, 4.75}};
// ConvGroups: shape [1, 4, 5, 6]
const Expected kConvGroups{{1, 4, 5, 6},
    {-1.0625, -1.5, -1.625, -1.75, -1.875, 1.75, -1.875, 1.6875, -1.8125, 1.5625, 0.125, 1.125, 2.75, -3.5, -1.5,
     -0.875, 2.5, -4, 0.5, -1.8125, 1.5625, 0.125, -2.6875, -0.1875, -3.0625, -0.25, 1.625, -0.625, -3.5625, 3.6875,
     5.4375, -0.6875, 0.9375, 2.5625, 2.8125, -0.375, -4.25, 4.0625, 1.8125, -1.125, -1.3125, 3, 5.375, -1.1875,
     2.0625, 3.9375, 1, 0.125, 1.9375, 1.8125, -1.125, -1.3125, 4.6875, 0, -1.6875, 1.125, 3.375, 1.5, -2.4375,
     4.6875, 1.375, -2.9375, 0.4375, 1.0625, -2.4375, 0.3125, 3.5, -2.6875, 2.5, -0.5625, 2.5625, -1.375, -1.125,
     0.25, -0.75, -2.4375, -1.375, 4.1875, -1.625, 2.5, -0.5625, 2.5625, 0.875, 1.5, 0.375, -0.875, -1, -1.125, 2.875,
     -2.25, -3.25, 1.125, -3.375, 3.125, -0.6875, -2.625, -0.4375, -3, 1.375, -2.5, -0.1875, 0.3125, 2.6875, -3.5625,
     2.1875, -0.3125, -0.0625, -2.875, -5.1875, 1.375, -2.5, -0.1875, -2.6875, -0.5625, 0.25, -1.0625, 0.5625, 0.8125,
     -1, 0}};
// ConvDepthwise: shape [1, 8, 5, 6]
const Expected kConvDepthwise{{1, 8, 5, 6},
    {-0.1875, 0.8125, -1.875, -1.125, 0.3125, 1.3125, -0.625, 2.6875, -0.9375, 2.3125, -2.6875, 1.875, 1.75, -2.5625,
     -0.6875, -0.1875, 2.375, -3.375, 2.0625, -0.9375, 2.3125, -2.6875, -0.125, 1.6875, -0.75, -1, 0.75, 1.125,
     -1.9375, 2.375, -0.625, -1.6875, 1.5625, 0.6875, -0.1875, -1.625, -1, 3.3125, -2.0625, -0.5625, -0.4375, 1.875,
     1.25, 0.625, 0.75, -0.5, -0.375, -0.75, 2.125, -2.0625, -0.5625, -0.4375, -0.3125, -0.625, -0.75, -1.125, 1.0625,
     1.1875, -2.125, 1.9375, 1.75, -1.5, -1.25, 3.125, -0.75, 0.5625, -3.125, 2.625, 0.3125, -2, -0.1875, -0.1875,
     1.75, -2.3125, 2.9375, 0.625, -0.3125, -0.1875, 1.8125, 0.3125, -2, -0.1875, 0.25, -0.875, -2, 1.1875, 1.0625,
     -1.125, -1.25, 1.875, 1.8125, -1.1875, -1.1875, 2.9375, -1.1875, 0.1875, -2.75, 3, 0.3125, -2.375, -0.25, -0.125,
     2, -2.125, 2.75, 0.0625, -0.5625, -0.25, 1.9375, 0.3125, -2.375, -0.25, 0.5, -0.375, -2.1875, 1.125, 0.75, -1,
     -1.375, 1.9375, 0.1875, -1.5, 0.3125, 0.0625, -0.875, 0.4375, 1.5, -2.5625, 2.625, -0.4375, 2.6875, -3.375,
     -0.75, 0.375, -0.625, -2.3125, 0.125, 1.875, -0.9375, 2.625, -0.4375, 2.6875, -2.4375, 1.625, 0.125, -1.875,
     -1.125, 0.3125, 1.0625, -2.125, 0.0625, -1.8125, -1.625, 3.375, 0.8125, -0.125, 1.25, -0.375, 3.0625, -1.75,
     -0.375, -1.1875, -1.125, -1.75, 3.0625, -0.375, -0.375, -0.875, -1.4375, 3.0625, -1.75, -0.375, -0.375, 1.5,
     -0.25, 1.5625, 0.6875, -0.1875, -1.75, 0.5, -2.125, 0.8125, 0.0625, -1.375, 1.3125, -0.4375, 1.5625, -2.5625,
     2.5625, 0.125, -2.3125, 1.25, 1.8125, 0, -2.4375, 2.6875, -0.4375, 2.125, -3.4375, 2.5625, 0.125, -2.3125,
     -0.625, -0.4375, 0.125, -1.25, 3.125, -0.75, 0.875, 0, -0.375, 0.5625, -2.5, 1.3125, 1.6875, -1.875, -1.375,
     0.0625, 2.75, -2.125, 0.5625, 2.125, 1.5, -2.375, 0.3125, 3, -1.875, -1.25, -1.125, 2.75, -2.125, 0.5625, 0.5,
     -1.1875, 0.25, -1.1875, 2.9375, -1.1875, 0.875, 0.375}};
// ConvUnbatched: shape [3, 5, 4]
const Expected kConvUnbatched{{3, 5, 4},
    {-3.5625, 1.375, -2.625, -4.5625, 2.875, -4.25, 2.375, 2.8125, -0.6875, -0.9375, -3.25, -0.0625, -4.25, 2.375,
     2.8125, -2.9375, 0.5625, 0.5625, -2.1875, -2.875, 2.3125, -2.25, 4.1875, 5.125, -1, 2.375, -3.1875, 0.1875,
     0.6875, 3.375, 4, 2.5625, 2.375, -3.1875, 0.1875, 4.9375, -0.9375, 4.6875, 4.8125, -0.5625, 2.6875, 0.3125,
     -1.375, -1, 2.6875, -4.0625, 2.9375, 3.75, -0.6875, -0.5625, -2.5, 1.0625, -4.0625, 2.9375, 3.75, -1.625, 0.3125,
     -3.5625, -0.5625, 4.5}};
// ConvSame: shape [1, 3, 5, 6]
const Expected kConvSame{{1, 3, 5, 6},
    {-6.625, 3, -3.0625, 6, -1.9375, -1.1875, 0.9375, 2.375, 2.5, -6.3125, 5.375, -5.5625, 3.6875, -3.0625, 6,
     -4.1875, 0.3125, 1.75, -0.4375, 2.5, -6.3125, 6.875, -8.1875, 0.8125, -3.625, 2.0625, -1.75, 1.3125, 0.5625,
     0.6875, 2.3125, -6.5, 4.1875, -0.25, 1.375, 3.375, 1.375, 3.3125, -6.625, 5.4375, -7.375, 1.8125, -4.375, 4.1875,
     -0.25, 2.875, 1.75, 0.9375, 1.5625, -6.625, 5.4375, -10, 3.3125, -1.3125, 1.4375, 1.3125, 3.125, 0.125, -1.3125,
     1.1875, -3.1875, 3.9375, -0.9375, 1.75, 2.625, -3.75, 2.5, -3.3125, 4.875, -9.625, 3.25, -2.5, 3.375, -0.9375,
     1.75, 1, -0.9375, 3.5625, -3.3125, 4.875, -9.625, 4.75, -1.6875, 0, -0.375, 3.3125, -2.3125, -1.75, 3, 1}};
// ConvRect: shape [1, 3, 4, 3]
const Expected kConvRect{{1, 3, 4, 3},
    {0.4375, -0.875, -5.375, -2.75, 0.0625, 1.75, 2.3125, 2.375, 1.3125, 0.5, -2.875, -4.625, 4.375, -1.5625, 2.8125,
     -1.6875, 1.9375, 4.25, 0.5, 6.125, -1.875, 4.0625, -4.8125, 2.3125, 2.8125, -2.9375, 2.75, -8.875, 3.125, -1.5,
     2.8125, 1.625, 1.8125, 1.4375, 0.125, 1}};
// ConvInt: shape [1, 3, 5, 6]
const Expected kConvInt{{1, 3, 5, 6},
    {-1, -51, 28, -36, -67, 66, 42, 52, -62, 44, 51, -12, -38, -5, -9, -46, 5, -30, 80, -62, 44, 51, -41, -15, -33,
     15, 15, -29, -40, 83, 20, 22, -51, 52, 67, -58, -12, -31, 23, -66, -12, 85, 30, -4, 39, 49, 26, -9, -49, 23, -66,
     -12, 64, -70, 56, -30, 60, 62, -24, 5, -58, 40, 2, -25, -19, 60, -11, 40, -68, 44, 57, -82, -12, -14, -12, -43,
     14, 67, 31, -68, 44, 57, -29, 7, -20, 2, -60, -12, 69, -51}};
// MaxPool: shape [1, 2, 3, 3]
const Expected kMaxPool{{1, 2, 3, 3},
    {0.75, 1.25, 1, 0.5, 1.25, 0.75, 1.25, 1, 0.75, 1, 0.75, 1.25, 1, 0.5, 1.25, 0.75, 1.25, 1}};
// MaxPoolPad: shape [1, 2, 4, 3]
const Expected kMaxPoolPad{{1, 2, 4, 3},
    {0.75, 1.25, 1.25, 0.75, 1.25, 1, 1.25, 1.25, 1, 1.25, 1, 0.75, 1, 1, 1.25, 1, 0.75, 1.25, 0.75, 1.25, 1.25, 0.75,
     1.25, 1}};
// MaxPoolDil: shape [1, 2, 7, 6]
const Expected kMaxPoolDil{{1, 2, 7, 6},
    {-1.25, 0.75, 0.25, 1, 0.25, 1, 0.5, 1.25, 1.25, 1.25, 1.25, 0, -0.5, 0.75, 1, 1, 1, 1, 1.25, 1.25, 1.25, 1.25,
     0.75, 0.75, 0.25, 1, 1, 1, 1, -0.25, 1.25, 1.25, 1.25, 0.75, 0.75, 0.75, 0.25, 1, 0.25, 1, 0.5, -0.25, 0, 0.75,
     0, 0.75, 0.25, -0.5, 1, 1, 1, 1.25, 1.25, 1.25, 0.75, 0.75, 0.75, 0.75, 1, 0.25, -0.25, 1, 1.25, 1.25, 1.25,
     1.25, 0.75, 0.75, 0.75, 1, 1, 1, 0.5, 1.25, 1.25, 1.25, 1.25, 0, -1.25, 0.75, 0.25, 1, 0.25, 1}};
// MaxPoolCeil: shape [1, 2, 3, 3]
const Expected kMaxPoolCeil{{1, 2, 3, 3},
    {1.25, 1.25, 1, 1.25, 1.25, 0.75, 1.25, 1, 0.75, 1, 1.25, 1.25, 1, 1.25, 1.25, 1.25, 1.25, 1}};
// MaxPoolIdxV: shape [1, 2, 4, 4]
const Expected kMaxPoolIdxV{{1, 2, 4, 4},
    {0.75, 1.25, 1.25, 0, 0.75, 1.25, 1, 0.75, 1.25, 1.25, 1, 0.5, 1.25, 1, 0.75, 0.5, 1, 1, 1.25, 1.25, 1, 0.75,
     1.25, 1, 0.75, 1.25, 1.25, 1, 0.75, 1.25, 1, 0.75}};
// MaxPoolIdxI: shape [1, 2, 4, 4]
const Expected kMaxPoolIdxI{{1, 2, 4, 4},
    {6, 3, 3, 5, 6, 14, 10, 17, 25, 25, 21, 35, 36, 32, 39, 35, 1, 1, 5, 5, 12, 8, 16, 23, 19, 27, 27, 23, 30, 38, 34,
     41}};
// AvgPool: shape [1, 2, 3, 3]
const Expected kAvgPool{{1, 2, 3, 3},
    {-0.4375, 0.375, -0.1875, -0.375, 0.4375, -0.125, 0.375, -0.1875, -0.0625, 0.125, -0.4375, 0.375, 0.1875, -0.375,
     0.4375, -0.4375, 0.375, -0.1875}};
// AvgPoolPadIncl: shape [1, 2, 4, 3]
const Expected kAvgPoolPadIncl{{1, 2, 4, 3},
    {-0.194444444, 0, 0.0833333333, -0.222222222, 0.0277777778, 0, -0.0277777778, 0.166666667, -0.166666667,
     0.0277777778, 0.0277777778, -0.194444444, 0.0555555556, -0.0833333333, 0, 0, -0.25, 0.0277777778, -0.111111111,
     -0.111111111, 0.166666667, -0.0277777778, -0.0555555556, 0.0277777778}};
// AvgPoolPadExcl: shape [1, 2, 4, 3]
const Expected kAvgPoolPadExcl{{1, 2, 4, 3},
    {-0.4375, 0, 0.125, -0.333333333, 0.0277777778, 0, -0.0416666667, 0.166666667, -0.166666667, 0.0625, 0.0416666667,
     -0.291666667, 0.125, -0.125, 0, 0, -0.25, 0.0277777778, -0.166666667, -0.111111111, 0.166666667, -0.0625,
     -0.0833333333, 0.0416666667}};
// AvgPoolCeilIncl: shape [1, 2, 4, 4]
const Expected kAvgPoolCeilIncl{{1, 2, 4, 4},
    {-0.25, 0.0625, 0.125, 0, 0.125, 0, 0.125, -0.0625, -0.1875, 0.0625, 0.1875, -0.375, 0.1875, 0.125, -0.4375, 0,
     0.0625, 0, 0.0625, 0.3125, 0.0625, -0.125, 0, -0.125, -0.25, -0.0625, 0.0625, 0.25, 0.125, 0, 0.125, -0.0625}};
// AvgPoolCeilExcl: shape [1, 2, 4, 4]
const Expected kAvgPoolCeilExcl{{1, 2, 4, 4},
    {-1, 0.125, 0.25, 0, 0.25, 0, 0.125, -0.125, -0.375, 0.0625, 0.1875, -0.75, 0.375, 0.125, -0.4375, 0, 0.25, 0,
     0.125, 1.25, 0.125, -0.125, 0, -0.25, -0.5, -0.0625, 0.0625, 0.5, 0.25, 0, 0.125, -0.125}};
// AvgPoolCeil3: shape [1, 2, 3, 3]
const Expected kAvgPoolCeil3{{1, 2, 3, 3},
    {-0.0277777778, 0.25, 0, 0.111111111, 0.0833333333, -0.166666667, 0.25, -0.0833333333, -0.333333333, 0,
     -0.0277777778, 0.333333333, -0.166666667, 0.111111111, 0.166666667, -0.0277777778, 0.25, 0}};
// AvgPoolDivisor: shape [1, 2, 3, 3]
const Expected kAvgPoolDivisor{{1, 2, 3, 3},
    {-0.583333333, 0.5, -0.25, -0.5, 0.583333333, -0.166666667, 0.5, -0.25, -0.0833333333, 0.166666667, -0.583333333,
     0.5, 0.25, -0.5, 0.583333333, -0.583333333, 0.5, -0.25}};
// AvgPoolInt: shape [1, 2, 6, 5]
const Expected kAvgPoolInt{{1, 2, 6, 5},
    {-1, -1, 1, 1, 0, 0, 0, 0, 0, 0, -1, 1, 1, 0, 0, 0, 0, 0, 0, -1, 1, 1, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, -1, -1, 1,
     0, 0, 0, 0, 0, 0, -1, -1, 1, 1, 0, 0, 0, 0, 0, -1, -1, 1, 1, 0, 0, 0, 0, 0, 0}};
// AdaptiveUniform: shape [1, 2, 3, 2]
const Expected kAdaptiveUniform{{1, 2, 3, 2},
    {-0.5, 0.3125, 0, 0.125, 0.5, -0.75, 0.3125, -0.25, 0.125, 0.25, -0.75, 0.75}};
// AdaptiveNonUniform: shape [1, 2, 3, 4]
const Expected kAdaptiveNonUniform{{1, 2, 3, 4},
    {-0.25, 0.0416666667, 0.166666667, 0, 0.0416666667, 0.333333333, 0, -0.166666667, 0.333333333, 0.166666667,
     -0.166666667, -0.333333333, 0.0833333333, -0.0833333333, 0.0416666667, 0.333333333, -0.0833333333, -0.25,
     0.333333333, 0.166666667, -0.25, 0.0416666667, 0.166666667, 0}};
// AdaptiveGlobal: shape [1, 2, 1, 1]
const Expected kAdaptiveGlobal{{1, 2, 1, 1}, {-0.0297619048, 0.0416666667}};
// clang-format on

double rtol_for(DType dt) { return dt == kBFloat16 ? 1.6e-2 : dt == kFloat16 ? 1e-3 : 1e-6; }
double atol_for(DType dt) { return dt == kBFloat16 ? 2e-2 : dt == kFloat16 ? 2e-3 : 1e-6; }

// Direct convolution in float64, the textbook loop: an independent reference.
struct ConvCase {
  int64_t n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, groups;
  bool bias;
};

std::vector<double> reference_conv(const ConvCase& k, const std::vector<double>& x, const std::vector<double>& wt,
                                   const std::vector<double>& b, int64_t oh, int64_t ow) {
  std::vector<double> out(static_cast<size_t>(k.n * k.o * oh * ow));
  const int64_t cg = k.c / k.groups, og = k.o / k.groups;
  for (int64_t ni = 0; ni < k.n; ++ni)
    for (int64_t oc = 0; oc < k.o; ++oc)
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t xo = 0; xo < ow; ++xo) {
          double acc = k.bias ? b[oc] : 0.0;
          const int64_t g = oc / og;
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t i = 0; i < k.kh; ++i)
              for (int64_t j = 0; j < k.kw; ++j) {
                const int64_t iy = y * k.sh - k.ph + i * k.dh, ix = xo * k.sw - k.pw + j * k.dw;
                if (iy < 0 || iy >= k.h || ix < 0 || ix >= k.w) continue;
                acc += x[((ni * k.c + g * cg + ci) * k.h + iy) * k.w + ix] * wt[((oc * cg + ci) * k.kh + i) * k.kw + j];
              }
          out[((ni * k.o + oc) * oh + y) * ow + xo] = acc;
        }
  return out;
}

}  // namespace

TEST(Conv2d, MatchesTorchOnPinnedCases) {
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    const std::string d(dtype_name(dt));
    const double rt = rtol_for(dt), at = atol_for(dt);
    auto s = [&](IntArrayRef shape, int a, int b) { return seq(shape, a, b, dt); };
    const Tensor x = s({1, 4, 5, 6}, 3, 1), w = s({3, 4, 3, 3}, 5, 2), b = s({3}, 7, 3);
    expect_close(conv2d(x, w, b), kConv, rt, at, "conv " + d);
    expect_close(conv2d(x, w, b, 2, 1), kConvStridePad, rt, at, "conv stride 2 pad 1 " + d);
    expect_close(conv2d(x, w, {}, 1, {2, 1}, 2), kConvDilation, rt, at, "conv dilation " + d);
    expect_close(conv2d(x, s({4, 2, 3, 3}, 5, 2), s({4}, 7, 3), 1, 1, 1, 2), kConvGroups, rt, at, "conv groups " + d);
    expect_close(conv2d(x, s({8, 1, 3, 3}, 5, 2), {}, 1, 1, 1, 4), kConvDepthwise, rt, at, "depthwise " + d);
    expect_close(conv2d(s({4, 5, 6}, 3, 1), w, b, 1, {1, 0}), kConvUnbatched, rt, at, "unbatched " + d);
    expect_close(conv2d(x, s({3, 4, 2, 4}, 5, 2), {}, 1, PaddingMode::Same), kConvSame, rt, at, "same " + d);
    expect_close(conv2d(x, s({3, 4, 2, 3}, 5, 2), s({3}, 7, 3), {1, 2}, {0, 1}), kConvRect, rt, at,
                 "rectangular " + d);
    // A non-contiguous input (channels-last storage viewed as NCHW).
    const Tensor x_cl = x.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});
    EXPECT_FALSE(x_cl.is_contiguous());
    expect_close(conv2d(x_cl, w, b), kConv, rt, at, "channels-last input " + d);
  }
  // torch: F.conv2d((x*4).long(), (w*4).long(), (b*4).long(), padding=1)
  const Tensor xi = seq({1, 4, 5, 6}, 3, 1, kInt64, 1.0), wi = seq({3, 4, 3, 3}, 5, 2, kInt64, 1.0);
  const Tensor y = conv2d(xi, wi, seq({3}, 7, 3, kInt64, 1.0), 1, 1);
  EXPECT_EQ(y.dtype(), kInt64);
  expect_close(y, kConvInt, 0, 0, "int64 conv");
}

TEST(Conv2d, MatchesDirectLoopOverParameterSweep) {
  const ConvCase cases[] = {
      {2, 3, 9, 11, 5, 3, 3, 1, 1, 0, 0, 1, 1, 1, true},    // plain
      {2, 8, 10, 10, 16, 3, 3, 2, 2, 1, 1, 1, 1, 1, true},  // stride + pad
      {1, 6, 12, 9, 6, 3, 2, 1, 2, 2, 1, 2, 3, 3, false},   // dilation, groups, rectangular
      {3, 16, 7, 7, 16, 3, 3, 1, 1, 1, 1, 1, 1, 16, true},  // depthwise
      {2, 12, 6, 5, 24, 1, 1, 1, 1, 0, 0, 1, 1, 1, true},   // 1x1 (direct gemm for f64)
      {1, 4, 13, 13, 4, 5, 5, 3, 3, 2, 2, 1, 1, 2, false},  // large kernel, grouped
  };
  Generator g(5);
  for (const ConvCase& k : cases) {
    const Tensor x = randn({k.n, k.c, k.h, k.w}, kFloat64, &g);
    const Tensor w = randn({k.o, k.c / k.groups, k.kh, k.kw}, kFloat64, &g);
    const Tensor b = randn({k.o}, kFloat64, &g);
    const int64_t oh = (k.h + 2 * k.ph - k.dh * (k.kh - 1) - 1) / k.sh + 1;
    const int64_t ow = (k.w + 2 * k.pw - k.dw * (k.kw - 1) - 1) / k.sw + 1;
    for (DType dt : {kFloat64, kFloat32, kBFloat16}) {
      // The reference sees the inputs rounded to dt, so only the arithmetic differs.
      const Tensor xd = x.to(dt), wd = w.to(dt), bd = b.to(dt);
      const auto want = reference_conv(k, to_doubles(xd), to_doubles(wd), to_doubles(bd), oh, ow);
      const Tensor y = conv2d(xd, wd, k.bias ? bd : Tensor(), {k.sh, k.sw}, {k.ph, k.pw}, {k.dh, k.dw}, k.groups);
      ASSERT_EQ(y.dtype(), dt);
      const double tol = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-4 : 2e-2;
      expect_close(y, {k.n, k.o, oh, ow}, want, tol, tol,
                   "conv sweep c=" + std::to_string(k.c) + " groups=" + std::to_string(k.groups) + " " +
                       std::string(dtype_name(dt)));
    }
  }
}

TEST(Conv2d, EmptyBatchAndCacheReuse) {
  const Tensor w = seq({3, 4, 3, 3}, 5, 2);
  EXPECT_EQ(conv2d(zeros({0, 4, 5, 6}), w).sizes().vec(), (std::vector<int64_t>{0, 3, 3, 4}));
  const Tensor x = seq({2, 4, 9, 9}, 3, 1), b = seq({3}, 7, 3);
  const Tensor y1 = conv2d(x, w, b, 1, 1);
  const int64_t created = kernels::dnnl_primitives_created();
  const Tensor y2 = conv2d(seq({2, 4, 9, 9}, 4, 2), w, b, 1, 1);
  const Tensor y3 = conv2d(x, w, b, 1, 1);
  EXPECT_EQ(kernels::dnnl_primitives_created(), created) << "same shapes must reuse the conv and its reorders";
  expect_close(y3, y1, 0, 0, "cached conv");
  (void)y2;
  (void)max_pool2d(x, 2);
  const int64_t with_pool = kernels::dnnl_primitives_created();
  (void)max_pool2d(x, 2);
  (void)adaptive_avg_pool2d(x, 3);  // uniform bins: an avg pool primitive
  (void)adaptive_avg_pool2d(x, 3);
  EXPECT_EQ(kernels::dnnl_primitives_created(), with_pool + 1);
}

TEST(Conv2d, Errors) {
  const Tensor x = zeros({1, 4, 5, 5});
  EXPECT_THROW(conv2d(x, zeros({8, 3, 3, 3})), ShapeError);
  const std::string ch = error_message([&] { conv2d(x, zeros({8, 3, 3, 3})); });
  EXPECT_TRUE(contains(ch, "[8, 3, 3, 3]") && contains(ch, "[1, 4, 5, 5]") &&
              contains(ch, "[out_channels, in_channels / groups, kH, kW]") && contains(ch, "expects input with 3 channels"))
      << ch;
  EXPECT_TRUE(contains(error_message([&] { conv2d(x, zeros({9, 2, 3, 3}), {}, 1, 0, 1, 2); }), "must divide out_channels"));
  EXPECT_TRUE(contains(error_message([&] { conv2d(x, zeros({8, 4, 3})); }), "(4-D), got [8, 4, 3]"));
  EXPECT_TRUE(contains(error_message([&] { conv2d(x, zeros({8, 4, 3, 3}), zeros({7})); }), "expected bias of shape [8]"));
  const std::string small = error_message([&] { conv2d(zeros({1, 4, 2, 2}), zeros({8, 4, 3, 3})); });
  EXPECT_TRUE(contains(small, "smaller than the kernel") && contains(small, "computed output size")) << small;
  EXPECT_THROW(conv2d(x, zeros({8, 4, 3, 3}, kFloat64)), DTypeError);
  EXPECT_TRUE(contains(error_message([&] { conv2d(x, zeros({8, 4, 3, 3}, kFloat64)); }), "float32 and float64"));
  EXPECT_THROW(conv2d(zeros({4, 5}), zeros({8, 4, 3, 3})), ShapeError);
  EXPECT_THROW(conv2d(x, zeros({8, 4, 3, 3}), {}, 2, PaddingMode::Same), ValueError);
  EXPECT_THROW(conv2d(x, zeros({8, 4, 3, 3}), {}, {1, 2, 3}), ValueError);
  EXPECT_THROW(conv2d(x, zeros({8, 4, 3, 3}), {}, 0), ValueError);
}

TEST(Pool2d, MatchesTorchOnPinnedCases) {
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    const std::string d(dtype_name(dt));
    const double rt = rtol_for(dt), at = atol_for(dt);
    const Tensor p = seq({1, 2, 7, 6}, 3, 1, dt);
    expect_close(max_pool2d(p, 2), kMaxPool, rt, at, "max_pool2d(p, 2) " + d);
    expect_close(max_pool2d(p, 3, 2, 1), kMaxPoolPad, rt, at, "max pad " + d);
    expect_close(max_pool2d(p, 2, 1, 1, 2), kMaxPoolDil, rt, at, "max dilation " + d);
    expect_close(max_pool2d(p, 3, 2, 0, 1, true), kMaxPoolCeil, rt, at, "max ceil " + d);
    expect_close(avg_pool2d(p, 2), kAvgPool, rt, at, "avg " + d);
    expect_close(avg_pool2d(p, 3, 2, 1), kAvgPoolPadIncl, rt, at, "avg pad include " + d);
    expect_close(avg_pool2d(p, 3, 2, 1, false, false), kAvgPoolPadExcl, rt, at, "avg pad exclude " + d);
    expect_close(avg_pool2d(p, 2, 2, 1, true), kAvgPoolCeilIncl, rt, at, "avg ceil include " + d);
    expect_close(avg_pool2d(p, 2, 2, 1, true, false), kAvgPoolCeilExcl, rt, at, "avg ceil exclude " + d);
    expect_close(avg_pool2d(p, 3, 2, 0, true), kAvgPoolCeil3, rt, at, "avg ceil past input " + d);
    expect_close(avg_pool2d(p, 2, {}, 0, false, true, 3), kAvgPoolDivisor, rt, at, "avg divisor_override " + d);
    expect_close(adaptive_avg_pool2d(seq({1, 2, 6, 4}, 3, 1, dt), {3, 2}), kAdaptiveUniform, rt, at,
                 "adaptive uniform " + d);
    expect_close(adaptive_avg_pool2d(p, {3, 4}), kAdaptiveNonUniform, rt, at, "adaptive non-uniform " + d);
    expect_close(adaptive_avg_pool2d(p, 1), kAdaptiveGlobal, rt, at, "adaptive global " + d);
    if (dt != kFloat16) {
      auto [v, i] = max_pool2d_with_indices(p, 3, 2, 1, 1, true);
      expect_close(v, kMaxPoolIdxV, rt, at, "max with indices (values) " + d);
      EXPECT_EQ(i.dtype(), kInt64);
      expect_close(i, kMaxPoolIdxI, 0, 0, "max with indices (indices) " + d);
    }
    // Unbatched input keeps its rank.
    expect_close(max_pool2d(p[0], 2), {2, 3, 3}, kMaxPool.values, rt, at, "unbatched " + d);
  }
  // torch: F.avg_pool2d((p*4).long(), 2, stride=1): integer division truncates.
  const Tensor pi = avg_pool2d(seq({1, 2, 7, 6}, 3, 1, kInt64, 1.0), 2, 1);
  EXPECT_EQ(pi.dtype(), kInt64);
  expect_close(pi, kAvgPoolInt, 0, 0, "int64 avg");
}

// oneDNN (float32) against our torch-exact loops (float64) on random inputs:
// the dispatch must only send cases to oneDNN where both agree.
TEST(Pool2d, OneDnnAgreesWithLoopsOverParameterSweep) {
  struct Case {
    int64_t k, s, p, d;
    bool ceil;
  };
  const Case cases[] = {{2, 2, 0, 1, false}, {3, 2, 1, 1, false}, {3, 2, 1, 1, true}, {2, 3, 1, 1, true},
                        {3, 1, 1, 2, false}, {3, 3, 0, 1, true},  {4, 2, 2, 1, true}, {1, 1, 0, 1, false}};
  Generator g(9);
  const Tensor x = randn({2, 5, 11, 10}, kFloat32, &g);
  const Tensor x64 = x.to(kFloat64);
  for (const Case& c : cases) {
    const std::string what = "k=" + std::to_string(c.k) + " s=" + std::to_string(c.s) + " p=" + std::to_string(c.p) +
                             " d=" + std::to_string(c.d) + (c.ceil ? " ceil" : "");
    expect_close(max_pool2d(x, c.k, c.s, c.p, c.d, c.ceil), max_pool2d(x64, c.k, c.s, c.p, c.d, c.ceil), 0, 0,
                 "max " + what);
    for (bool incl : {true, false}) {
      expect_close(avg_pool2d(x, c.k, c.s, c.p, c.ceil, incl), avg_pool2d(x64, c.k, c.s, c.p, c.ceil, incl), 1e-5,
                   1e-6, "avg " + what + (incl ? " include_pad" : " exclude_pad"));
    }
  }
  for (int64_t o : {1, 2, 3, 4, 5, 7}) {
    expect_close(adaptive_avg_pool2d(x, {o, o + 1}), adaptive_avg_pool2d(x64, {o, o + 1}), 1e-5, 1e-6,
                 "adaptive " + std::to_string(o));
  }
}

TEST(Pool2d, MaxPoolPropagatesNaN) {
  for (DType dt : {kFloat32, kBFloat16, kFloat64}) {
    Tensor x = zeros({1, 16, 8, 8}, dt);
    x[0][3][2].narrow(0, 5, 1).fill_(std::numeric_limits<double>::quiet_NaN());
    const auto v = to_doubles(max_pool2d(x, 2));
    int nans = 0;
    for (double e : v) nans += std::isnan(e);
    EXPECT_EQ(nans, 1) << dtype_name(dt);
    EXPECT_TRUE(std::isnan(v[3 * 16 + 1 * 4 + 2])) << dtype_name(dt);  // plane 3, row 1, col 2
  }
}

TEST(Pool2d, Errors) {
  const Tensor x = zeros({1, 1, 4, 4});
  const std::string pad = error_message([&] { max_pool2d(x, 3, {}, 2); });
  EXPECT_TRUE(contains(pad, "at most half the kernel size")) << pad;
  const std::string small = error_message([&] { max_pool2d(zeros({1, 1, 2, 2}), 3); });
  EXPECT_TRUE(contains(small, "too small") && contains(small, "computed output size 0 x 0")) << small;
  EXPECT_THROW(max_pool2d(zeros({4, 4}), 2), ShapeError);
  EXPECT_THROW(max_pool2d(zeros({1, 0, 4, 4}), 2), ShapeError);
  EXPECT_EQ(max_pool2d(zeros({0, 1, 4, 4}), 2).sizes().vec(), (std::vector<int64_t>{0, 1, 2, 2}));
  EXPECT_THROW(max_pool2d(zeros({1, 1, 4, 4}, kInt64), 2), DTypeError);
  EXPECT_THROW(adaptive_avg_pool2d(zeros({1, 1, 4, 4}, kInt64), 2), DTypeError);
  EXPECT_THROW(avg_pool2d(x, 2, {}, 0, false, true, 0), ValueError);
  EXPECT_THROW(max_pool2d(x, {2, 2, 2}), ValueError);
  EXPECT_THROW(adaptive_avg_pool2d(x, -1), ValueError);
  EXPECT_EQ(adaptive_avg_pool2d(x, {0, 2}).sizes().vec(), (std::vector<int64_t>{1, 1, 0, 2}));
}
