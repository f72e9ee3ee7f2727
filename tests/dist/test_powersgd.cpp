// PowerSGD's steps (src/dist/ddp_powersgd.h) against torch's powerSGD_hook
// (tests/parity/powersgd_twin.py: gloo, world size 1, the same bucket, the same
// first Q placed where torch's warm start reads it). Two steps per case, so
// warm start and error feedback are both compared; ranks 1 and 2 (torch's
// Gram-Schmidt range), with and without error feedback. kiln sums the
// Gram-Schmidt dots in double and runs a second pass at rank 2, torch one pass
// in float32: the buckets agree within 1e-6 of the largest gradient value (a
// few float32 ulps; 1e-7 fails by one ulp).
// Also Gram-Schmidt on its own: orthonormal columns, a zero column kept zero.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dist/ddp_powersgd.h"
#include "dist/fake_group.h"
#include "kiln/ops/factory.h"
#include "support/test_util.h"

namespace kiln {
namespace {

const std::vector<std::vector<int64_t>> kShapes{{8, 6}, {8}, {5, 8}, {5}};
const double kScales[] = {1.0, 0.5, 2.0, 0.25};

// The twin's bucket at `step`, laid out flat, and parameter-shaped views of it.
Tensor bucket_at(int step) {
  std::vector<float> v;
  for (size_t k = 0; k < kShapes.size(); ++k) {
    int64_t n = 1;
    for (int64_t d : kShapes[k]) n *= d;
    for (int64_t i = 0; i < n; ++i)
      v.push_back(static_cast<float>(kScales[k] * std::sin(0.37 * static_cast<double>(i) + static_cast<double>(k) +
                                                           1.3 * step)));
  }
  return tensor<float>(v, {static_cast<int64_t>(v.size())});
}

std::vector<Tensor> views_of(const Tensor& flat) {
  std::vector<Tensor> out;
  int64_t at = 0;
  for (const auto& s : kShapes) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    out.push_back(flat.narrow(0, at, n).view(s));
    at += n;
  }
  return out;
}

TEST(PowerSgd, TwoStepsMatchTorchsHook) {
  static const auto torch_out = test::run_python_table("powersgd_twin.py");
  auto world = std::make_shared<test::FakeWorld>(1);
  auto group = std::make_shared<test::FakeGroup>(world, 0);
  for (int64_t rank : {1, 2}) {
    for (bool feedback : {true, false}) {
      const std::string name = "r" + std::to_string(rank) + (feedback ? "_ef" : "_noef");
      SCOPED_TRACE(name);
      const dist::PowerSGDOptions o{.matrix_approximation_rank = rank,
                                    .start_powerSGD_iter = 0,
                                    .min_compression_rate = 0,
                                    .use_error_feedback = feedback};
      Tensor flat = bucket_at(0);
      auto views = views_of(flat);
      auto b = dist::detail::plan_powersgd(flat, views, o);
      ASSERT_EQ(b.matrices.size(), kShapes.size()) << "min_compression_rate 0 compresses every gradient";
      // The twin's first Q: q[i] = cos(0.11 i + k) over each matrix's [m, r].
      for (size_t k = 0; k < b.matrices.size(); ++k) {
        auto& mt = b.matrices[k];
        float* q = b.q.data_ptr<float>() + mt.q_off;
        for (int64_t i = 0; i < mt.m * mt.r; ++i)
          q[i] = static_cast<float>(std::cos(0.11 * static_cast<double>(i) + static_cast<double>(k)));
        mt.has_q = true;
      }
      Generator unused(0);
      for (int step = 0; step < 2; ++step) {
        if (step > 0) {
          flat.copy_(bucket_at(step));
        }
        int64_t bytes = 0;
        dist::detail::powersgd_launch(b, flat, *group, o, unused, bytes);
        dist::detail::powersgd_exchange_q(b, flat, *group, o, bytes);
        dist::detail::powersgd_finish(b, flat, o);
        const auto& want = torch_out.at(name + "_step" + std::to_string(step));
        ASSERT_EQ(static_cast<int64_t>(want.size()), flat.numel());
        double top = 0;
        for (double w : want) top = std::max(top, std::fabs(w));
        const float* got = flat.data_ptr<float>();
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 1e-6 * top) << "step " << step << " value " << i;
      }
    }
  }
}

TEST(PowerSgd, GramSchmidtGivesOrthonormalColumnsAndKeepsAZeroColumnZero) {
  // [6, 3]: the second column is twice the first, so after removing the
  // first nothing but rounding is left of it; the third is independent.
  std::vector<float> a(18);
  for (int k = 0; k < 6; ++k) {
    a[k * 3 + 0] = static_cast<float>(k + 1);
    a[k * 3 + 1] = static_cast<float>(2 * (k + 1));
    a[k * 3 + 2] = static_cast<float>(std::cos(k));
  }
  dist::detail::orthogonalize_columns(a.data(), 6, 3, 0.0);
  auto dot = [&](int i, int j) {
    double s = 0;
    for (int k = 0; k < 6; ++k) s += static_cast<double>(a[k * 3 + i]) * a[k * 3 + j];
    return s;
  };
  EXPECT_NEAR(dot(0, 0), 1.0, 1e-6);
  EXPECT_NEAR(dot(2, 2), 1.0, 1e-6);
  EXPECT_NEAR(dot(0, 2), 0.0, 1e-6);
  // The dependent column is rounding noise made unit length, or zero; either way orthogonal to the rest.
  EXPECT_NEAR(dot(0, 1), 0.0, 1e-6);
  EXPECT_NEAR(dot(1, 2), 0.0, 1e-6);
  for (float x : a) EXPECT_TRUE(std::isfinite(x));

  std::vector<float> z(8, 0.0f);  // [4, 2] of zeros: no NaN from 0 / 0
  dist::detail::orthogonalize_columns(z.data(), 4, 2, 0.0);
  for (float x : z) EXPECT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace kiln
