// clip_grad_norm_ (total norm and scaled gradients for norm types 2, 1, inf,
// 3, 0.5, 0, clipping and not, float32 and float64) against torch 1.13
// (tests/parity/clip_grad.py), the non-finite error naming the parameter, and
// clip_grad_value_.
#include "kiln/optim/clip_grad.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>

#include "kiln/ops/factory.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

const std::map<std::string, std::vector<double>>& torch_clip() {
  static const auto table = test::run_python_table("clip_grad.py");
  return table;
}

NamedParams make_params(DType dt) {
  const std::vector<std::vector<int64_t>> shapes{{3, 4}, {4}, {2, 2, 2}};
  const double scales[] = {1.0, 3.0, 0.5};
  NamedParams ps;
  for (int k = 0; k < 3; ++k) {
    Tensor p = zeros(shapes[k], TensorOptions(dt)).requires_grad_();
    int64_t n = 1;
    for (auto s : shapes[k]) n *= s;
    std::vector<double> g(n);
    for (int64_t i = 0; i < n; ++i) g[i] = scales[k] * std::sin(0.37 * i + k);
    Tensor gt = tensor<double>(g, shapes[k]).to(dt);
    p.mutable_grad() = gt;
    std::string name = "p";
    name += std::to_string(k);
    ps.emplace_back(std::move(name), p);
  }
  return ps;
}

}  // namespace

TEST(ClipGrad, NormMatchesTorch) {
  for (const char* tag : {"f32", "f64"}) {
    const DType dt = std::string(tag) == "f32" ? kFloat32 : kFloat64;
    // float32: the norms are float32 in both (summation order differs): 1e-6 relative; float64: 1e-13.
    const double rtol = dt == kFloat32 ? 1e-6 : 1e-13;
    for (auto [ntag, p] : std::vector<std::pair<std::string, double>>{
             {"l2", 2.0}, {"l1", 1.0}, {"inf", kInfNorm}, {"l3", 3.0}, {"l05", 0.5}, {"l0", 0.0}}) {
      for (auto [ctag, max_norm] : std::vector<std::pair<std::string, double>>{{"clip", 1.0}, {"noclip", 100.0}}) {
        const std::string name = std::string(tag) + "_" + ntag + "_" + ctag;
        SCOPED_TRACE(name);
        const auto& exp = torch_clip().at(name);
        NamedParams ps = make_params(dt);
        const double total = clip_grad_norm_(ps, max_norm, p);
        EXPECT_NEAR(total, exp[0], rtol * std::abs(exp[0]));
        size_t j = 1;
        for (auto& [n, t] : ps)
          for (double v : test::to_doubles(t.grad())) {
            EXPECT_NEAR(v, exp[j], rtol * std::abs(exp[j]) + 1e-12) << n;
            ++j;
          }
        EXPECT_EQ(j, exp.size());
      }
    }
  }
}

TEST(ClipGrad, PlainTensorsAndParamsWithoutGrad) {
  Tensor a = zeros({2}).requires_grad_(), b = zeros({2}).requires_grad_(), c = zeros({3}).requires_grad_();
  a.mutable_grad() = tensor<float>({3, 0});
  b.mutable_grad() = tensor<float>({0, 4});
  EXPECT_DOUBLE_EQ(clip_grad_norm_(std::vector<Tensor>{a, b, c}, 1.0), 5.0);
  EXPECT_FALSE(c.grad().defined());
  EXPECT_NEAR(test::to_doubles(a.grad())[0], 0.6, 1e-6);
  EXPECT_NEAR(test::to_doubles(b.grad())[1], 0.8, 1e-6);
  EXPECT_EQ(clip_grad_norm_(std::vector<Tensor>{c}, 1.0), 0.0);  // no gradients at all
}

TEST(ClipGrad, NonFiniteErrorNamesTheParameter) {
  Tensor w = zeros({3}).requires_grad_(), b = zeros({2}).requires_grad_();
  w.mutable_grad() = tensor<float>({1, 2, 3});
  b.mutable_grad() = tensor<float>({1, INFINITY});
  try {
    clip_grad_norm_({{"fc.weight", w}, {"fc.bias", b}}, 1.0, 2.0, true);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("total norm of order 2 of the gradients is non-finite (inf)"), std::string::npos) << m;
    EXPECT_NE(m.find("parameter 'fc.bias' has a non-finite gradient norm (inf)"), std::string::npos) << m;
    EXPECT_NE(m.find("error_if_nonfinite=false"), std::string::npos) << m;
  }
  EXPECT_EQ(test::to_doubles(w.grad())[2], 3.0);  // nothing scaled
  // Without the flag torch scales by the non-finite norm: coef = 1/(inf+1e-6) = 0, inf*0 = nan.
  const double total = clip_grad_norm_({{"fc.weight", w}, {"fc.bias", b}}, 1.0);
  EXPECT_TRUE(std::isinf(total));
  EXPECT_EQ(test::to_doubles(w.grad())[2], 0.0);
  EXPECT_TRUE(std::isnan(test::to_doubles(b.grad())[1]));
}

TEST(ClipGrad, ClipGradValue) {
  Tensor w = zeros({4}).requires_grad_();
  w.mutable_grad() = tensor<float>({-3, -0.5, 0.25, 2});
  clip_grad_value_({{"w", w}}, 1.0);
  EXPECT_EQ(test::to_doubles(w.grad()), (std::vector<double>{-1, -0.5, 0.25, 1}));
  clip_grad_value_(std::vector<Tensor>{w}, 0.5);
  EXPECT_EQ(test::to_doubles(w.grad()), (std::vector<double>{-0.5, -0.5, 0.25, 0.5}));
  EXPECT_THROW(clip_grad_value_({{"w", w}}, -1.0), ValueError);
  EXPECT_THROW(clip_grad_norm_({{"w", w}}, 1.0, -2.0), ValueError);
}
