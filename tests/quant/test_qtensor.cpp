// quant::quantize_per_tensor / quantize_per_channel / dequantize and the
// observers against torch 1.13 (the oracle, /usr/bin/python3) on the same data
// and scales. Integers are compared exactly; dequantized values to 1e-6
// relative (torch's vectorised dequantize fuses scale · zero point); scales to
// 1e-6 relative (float32 arithmetic, possibly contracted into FMAs here), zero
// points exactly. The histogram observer's search runs on torch's float32
// tensors and here in double: its range must agree to within one bin.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/generator.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/observer.h"
#include "kiln/quant/qtensor.h"
#include "support/oracle.h"

using namespace kiln;
using quant::QDType;

namespace {

std::vector<int64_t> ints(const Tensor& t) {
  const Tensor c = t.to(kInt64).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::vector<float> floats(const Tensor& t) {
  const Tensor c = t.to(kFloat32).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

void expect_rel(const std::vector<float>& got, const std::vector<float>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::fabs(got[i] - want[i]), rel * std::max(1.0f, std::fabs(want[i]))) << what << " at " << i;
}

// Values with exact halves after scaling (ties to even), outliers for the clamp, and noise.
Tensor data(int64_t rows, int64_t cols, uint64_t seed) {
  Generator g(seed);
  Tensor x = randn({rows, cols}, TensorOptions(kFloat32), &g).mul(3.0);
  float* p = x.data_ptr<float>();
  const float ties[] = {0.25f, 0.75f, -0.25f, -0.75f, 1.25f, -1.25f, 100.0f, -100.0f, 0.0f};
  for (size_t i = 0; i < std::size(ties) && static_cast<int64_t>(i) < x.numel(); ++i) p[i] = ties[i];
  return x;
}

}  // namespace

TEST(QTensor, PerTensorMatchesTorch) {
  const Tensor x = data(16, 33, 1);
  struct Case {
    double scale;
    int64_t zp;
    QDType t;
    const char* torch_t;
  };
  const Case cases[] = {{0.5, 0, QDType::QUInt8, "torch.quint8"},
                        {0.5, 128, QDType::QUInt8, "torch.quint8"},
                        {0.037, 91, QDType::QUInt8, "torch.quint8"},
                        {0.5, 0, QDType::QInt8, "torch.qint8"},
                        {0.021, -7, QDType::QInt8, "torch.qint8"}};
  test::OracleBatch b;
  for (const Case& c : cases) {
    std::ostringstream e;
    e.precision(17);
    e << "(lambda q: (q.int_repr().to(torch.int64), q.dequantize()))(torch.quantize_per_tensor(x0, " << c.scale << ", "
      << c.zp << ", " << c.torch_t << "))";
    b.add("qpt_" + std::to_string(b.size()), e.str(), {x});
  }
  b.run();
  for (size_t i = 0; i < std::size(cases); ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << r.error;
    const quant::QTensor q = quant::quantize_per_tensor(x, cases[i].scale, cases[i].zp, cases[i].t);
    EXPECT_EQ(ints(q.int_repr()), ints(r.outputs[0])) << "case " << i;
    expect_rel(floats(quant::dequantize(q)), floats(r.outputs[1]), 1e-6, "dequantize case " + std::to_string(i));
  }
}

TEST(QTensor, PerChannelMatchesTorch) {
  const Tensor x = data(6, 20, 2).reshape({6, 5, 4});
  Generator g(3);
  const Tensor scales0 = rand({6}, TensorOptions(kFloat32), &g).mul(0.1).add(0.01);
  const Tensor scales1 = rand({5}, TensorOptions(kFloat32), &g).mul(0.1).add(0.01);
  const Tensor zp_u8 = tensor<int64_t>({0, 3, 128, 255, 17, 60}, {6});
  const Tensor zp_s8 = tensor<int64_t>({0, -3, 5, 127, -128}, {5});
  test::OracleBatch b;
  b.add("qpc_axis0_u8",
        "(lambda q: (q.int_repr().to(torch.int64), q.dequantize()))(torch.quantize_per_channel(x0, x1.double(), x2, 0, "
        "torch.quint8))",
        {x, scales0, zp_u8});
  b.add("qpc_axis1_s8",
        "(lambda q: (q.int_repr().to(torch.int64), q.dequantize()))(torch.quantize_per_channel(x0, x1.double(), x2, 1, "
        "torch.qint8))",
        {x, scales1, zp_s8});
  b.run();
  const quant::QTensor q0 = quant::quantize_per_channel(x, scales0, zp_u8, 0, QDType::QUInt8);
  const quant::QTensor q1 = quant::quantize_per_channel(x, scales1, zp_s8, 1, QDType::QInt8);
  const quant::QTensor* qs[] = {&q0, &q1};
  for (size_t i = 0; i < 2; ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(ints(qs[i]->int_repr()), ints(r.outputs[0])) << "case " << i;
    expect_rel(floats(quant::dequantize(*qs[i])), floats(r.outputs[1]), 1e-6, "dequantize case " + std::to_string(i));
  }
}

TEST(QTensor, RejectsBadParameters) {
  const Tensor x = zeros({3});
  EXPECT_THROW(quant::quantize_per_tensor(x, 0.0, 0, QDType::QUInt8), ValueError);
  EXPECT_THROW(quant::quantize_per_tensor(x, 0.1, 256, QDType::QUInt8), ValueError);
  EXPECT_THROW(quant::quantize_per_tensor(x, 0.1, -129, QDType::QInt8), ValueError);
  EXPECT_THROW(quant::quantize_per_tensor(tensor<int64_t>({1, 2}, {2}), 0.1, 0, QDType::QInt8), DTypeError);
  EXPECT_THROW(quant::quantize_per_channel(zeros({3, 2}), full({2}, 0.1f), zeros({2}, TensorOptions(kInt64)), 0,
                                           QDType::QInt8),
               ShapeError);
}

namespace {

struct ObsCase {
  std::string id, torch_observer;
  std::function<std::unique_ptr<quant::Observer>()> make;
};

}  // namespace

TEST(Observers, MatchTorch) {
  const Tensor b0 = data(32, 40, 4), b1 = data(32, 40, 5).mul(1.7).add(0.4), b2 = data(32, 40, 6).relu();
  const std::vector<ObsCase> cases = {
      {"minmax_u8", "torch.ao.quantization.MinMaxObserver()",
       [] { return std::make_unique<quant::MinMaxObserver>(); }},
      {"minmax_s8_sym",
       "torch.ao.quantization.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)",
       [] { return std::make_unique<quant::MinMaxObserver>(quant::ObserverOptions{QDType::QInt8, true}); }},
      {"minmax_u8_sym", "torch.ao.quantization.MinMaxObserver(qscheme=torch.per_tensor_symmetric)",
       [] { return std::make_unique<quant::MinMaxObserver>(quant::ObserverOptions{QDType::QUInt8, true}); }},
      {"moving_u8", "torch.ao.quantization.MovingAverageMinMaxObserver()",
       [] { return std::make_unique<quant::MovingAverageMinMaxObserver>(); }},
      {"moving_s8_c02",
       "torch.ao.quantization.MovingAverageMinMaxObserver(averaging_constant=0.2, dtype=torch.qint8)",
       [] {
         return std::make_unique<quant::MovingAverageMinMaxObserver>(quant::ObserverOptions{QDType::QInt8, false},
                                                                     0.2f);
       }},
      {"per_channel_w", "torch.ao.quantization.PerChannelMinMaxObserver(dtype=torch.qint8, "
                        "qscheme=torch.per_channel_symmetric)",
       [] { return std::make_unique<quant::PerChannelMinMaxObserver>(); }},
  };
  test::OracleBatch b;
  for (const auto& c : cases)
    b.add("obs_" + c.id, "(lambda o: [o(x0), o(x1), o(x2), o.calculate_qparams()][-1])(" + c.torch_observer + ")",
          {b0, b1, b2});
  b.run();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << cases[i].id << ": " << r.error;
    auto o = cases[i].make();
    for (const Tensor& t : {b0, b1, b2}) o->observe(t);
    const quant::QParams p = o->qparams();
    expect_rel(p.scales, floats(r.outputs[0]), 1e-6, cases[i].id + " scale");
    EXPECT_EQ(p.zero_points, ints(r.outputs[1])) << cases[i].id;
  }
}

TEST(Observers, HistogramMatchesTorchOnOneBatch) {
  // Heavy tails, so the L2 search clips: a normal body with a few large values.
  Tensor x = data(64, 64, 7);
  float* p = x.data_ptr<float>();
  p[100] = 40.0f;
  p[200] = -25.0f;
  const Tensor relu = x.relu();
  test::OracleBatch b;
  const std::string expr =
      "(lambda o: [o(x0), (lambda r: (r[0].reshape(1), r[1].reshape(1)))(o._non_linear_param_search()), "
      "o.calculate_qparams()])(torch.ao.quantization.HistogramObserver())";
  b.add("hist_signed", "(lambda v: (v[1][0], v[1][1], v[2][0], v[2][1]))" + std::string("(") + expr + ")", {x});
  b.add("hist_relu", "(lambda v: (v[1][0], v[1][1], v[2][0], v[2][1]))" + std::string("(") + expr + ")", {relu});
  b.run();
  const Tensor* inputs[] = {&x, &relu};
  for (size_t i = 0; i < 2; ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << r.error;
    quant::HistogramObserver o;
    o.observe(*inputs[i]);
    const auto [lo, hi] = o.range();
    const double bin = (static_cast<double>(o.hist_max()) - o.hist_min()) / 2048;
    const float tlo = floats(r.outputs[0])[0], thi = floats(r.outputs[1])[0];
    EXPECT_LE(std::fabs(lo - tlo), bin * 1.01) << "case " << i << ": " << lo << " vs torch " << tlo;
    EXPECT_LE(std::fabs(hi - thi), bin * 1.01) << "case " << i << ": " << hi << " vs torch " << thi;
    // It clipped the outliers (the point of the method).
    EXPECT_LT(hi - lo, o.hist_max() - o.hist_min());
    const quant::QParams q = o.qparams();
    EXPECT_NEAR(q.scales[0], floats(r.outputs[2])[0], bin / 255 * 2.1) << "case " << i;
    EXPECT_LE(std::abs(q.zero_points[0] - ints(r.outputs[3])[0]), 1) << "case " << i;
  }
}

TEST(Observers, PercentileMatchesTorchQuantile) {
  // Dense enough around both percentiles that torch's interpolation between
  // sorted values and the histogram's within a bin agree to a bin.
  Generator g(8);
  const Tensor x = randn({256, 64}, TensorOptions(kFloat32), &g);
  const auto r = test::torch_eval("(torch.quantile(x0.flatten(), 0.001).reshape(1), "
                                  "torch.quantile(x0.flatten(), 0.999).reshape(1))",
                                  {x});
  ASSERT_TRUE(r.ok) << r.error;
  quant::PercentileObserver o(99.9);
  o.observe(x);
  const auto [lo, hi] = o.range();
  const double bin = (static_cast<double>(o.hist_max()) - o.hist_min()) / 2048;
  EXPECT_LE(std::fabs(lo - floats(r.outputs[0])[0]), bin);
  EXPECT_LE(std::fabs(hi - floats(r.outputs[1])[0]), bin);
}

TEST(Observers, EntropyClipsOutliersAndKeepsABoundedRange) {
  // A ReLU-like activation: exponential body with a handful of huge values.
  Generator g(9);
  Tensor x = rand({20000}, TensorOptions(kFloat32), &g).log().neg();  // Exp(1)
  x.data_ptr<float>()[0] = 60.0f;
  quant::EntropyObserver o;
  o.observe(x);
  const auto [lo, hi] = o.range();
  EXPECT_EQ(lo, 0.0f);
  // Exp(1)'s 99.9th percentile is 6.9: the threshold lies far below the outlier and above the body.
  EXPECT_GT(hi, 4.0f);
  EXPECT_LT(hi, 30.0f);
  // Uniform data has nothing to clip: the threshold stays at the top.
  quant::EntropyObserver u;
  u.observe(rand({20000}, TensorOptions(kFloat32), &g));
  EXPECT_GT(u.range().second, 0.97f);
}

TEST(Observers, ErrorsNameWhatWasExpected) {
  quant::MinMaxObserver o;
  EXPECT_THROW(o.qparams(), ValueError);
  EXPECT_THROW(quant::make_observer("kl"), ValueError);
  for (const auto& n : quant::observer_names()) EXPECT_EQ(quant::make_observer(n)->name(), n);
}
