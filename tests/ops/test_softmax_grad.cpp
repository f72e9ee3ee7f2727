// Backward of softmax and log_softmax: float64 gradcheck and gradgradcheck
// (the create_graph path), the fused backward kernel against the composite
// formula on [64, 1000] rows and columns, bfloat16 computed in float, and the
// layouts the kernel takes (non-contiguous and expanded incoming gradients).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "ops/specs/op_spec.h"
#include "kiln/ops/reduce.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::to_doubles;

namespace {

using Fn = std::function<Tensor(const Tensor&)>;

Tensor rnd(std::vector<int64_t> shape, uint64_t seed) { return ops::sample_tensor(shape, kFloat64, seed).requires_grad_(); }

Tensor apply(const Tensor& x, int64_t dim, bool log) { return log ? x.log_softmax(dim) : x.softmax(dim); }

void gradcheck(const Fn& f, const Tensor& x, const std::string& what, bool second) {
  try {
    auto fn = [&](const TensorList& in) { return TensorList{f(in[0])}; };
    if (second) autograd::gradgradcheck(fn, {x});
    else autograd::gradcheck(fn, {x});
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

// The composite formula from y and g, in float64 doubles computed here (no kiln ops).
std::vector<double> reference(const std::vector<double>& y, const std::vector<double>& g, int64_t outer, int64_t n,
                              int64_t inner, bool log) {
  std::vector<double> out(y.size());
  for (int64_t q = 0; q < outer; ++q) {
    for (int64_t j = 0; j < inner; ++j) {
      double s = 0;
      auto at = [&](int64_t r) { return (q * n + r) * inner + j; };
      for (int64_t r = 0; r < n; ++r) s += log ? g[at(r)] : g[at(r)] * y[at(r)];
      for (int64_t r = 0; r < n; ++r) out[at(r)] = log ? g[at(r)] - std::exp(y[at(r)]) * s : y[at(r)] * (g[at(r)] - s);
    }
  }
  return out;
}

// |a - b| <= atol + rtol |b| element by element.
void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < a.size() && bad < 5; ++i) {
    if (std::abs(a[i] - b[i]) > atol + rtol * std::abs(b[i])) {
      ++bad;
      ADD_FAILURE() << what << " element " << i << ": " << a[i] << " vs " << b[i];
    }
  }
}

}  // namespace

// First derivatives run the fused kernel; second derivatives the tensor formula.
void check_all(bool second) {
  for (bool log : {false, true}) {
    const std::string n = std::string(log ? "log_softmax" : "softmax") + (second ? " gradgrad" : "");
    gradcheck([log](const Tensor& x) { return apply(x, -1, log); }, rnd({3, 5}, 1), n + " dim=-1", second);
    gradcheck([log](const Tensor& x) { return apply(x, 0, log); }, rnd({3, 5}, 2), n + " dim=0", second);
    gradcheck([log](const Tensor& x) { return apply(x, 1, log); }, rnd({2, 3, 4}, 3), n + " middle dim", second);
    gradcheck([log](const Tensor& x) { return apply(x, 1, log); },
              ops::sample_noncontig({4, 6}, kFloat64, 4).requires_grad_(), n + " noncontig", second);
    gradcheck([log](const Tensor& x) { return apply(x, 0, log); }, rnd({}, 5), n + " 0-dim", second);
  }
}

TEST(SoftmaxGrad, Gradcheck) { check_all(false); }
TEST(SoftmaxGrad, GradGrad) { check_all(true); }

TEST(SoftmaxGrad, KernelMatchesCompositeFormula) {
  // Rows (dim=-1, the training case) and columns (dim=0) of [64, 1000]; the
  // kernel runs when create_graph is off, the composite tensor formula when on.
  for (bool log : {false, true}) {
    for (int64_t dim : {1, 0}) {
      const std::string what = std::string(log ? "log_softmax" : "softmax") + " dim=" + std::to_string(dim);
      Tensor x = ops::sample_tensor({64, 1000}, kFloat32, 10 + dim).requires_grad_();
      const Tensor g = ops::sample_tensor({64, 1000}, kFloat32, 20 + dim);
      Tensor y = apply(x, dim, log);
      const Tensor fused = autograd::grad({y}, {x}, {g}, /*retain_graph=*/true)[0];
      const Tensor composite = autograd::grad({y}, {x}, {g}, true, /*create_graph=*/true)[0];
      expect_close(to_doubles(fused), to_doubles(composite), 1e-5, 1e-6, what + " kernel vs composite");
      const int64_t outer = dim == 1 ? 64 : 1, n = dim == 1 ? 1000 : 64, inner = dim == 1 ? 1 : 1000;
      expect_close(to_doubles(fused), reference(to_doubles(y), to_doubles(g), outer, n, inner, log), 1e-5, 1e-6,
                   what + " kernel vs float64");
    }
  }
}

TEST(SoftmaxGrad, KernelHandlesAnyIncomingGradientLayout) {
  // y.sum() sends an expanded (stride-0) gradient; a transposed one arrives through a view.
  for (bool log : {false, true}) {
    Tensor x = ops::sample_tensor({5, 7}, kFloat32, 30).requires_grad_();
    Tensor y = apply(x, 1, log);
    const Tensor g_sum = autograd::grad({y.sum()}, {x}, {}, true)[0];
    const Tensor g_ones = autograd::grad({y}, {x}, {ones({5, 7})}, true)[0];
    EXPECT_TRUE(test::bitwise_equal(g_sum, g_ones));
    const Tensor gt = ops::sample_tensor({7, 5}, kFloat32, 31).t();
    const Tensor g_t = autograd::grad({y}, {x}, {gt}, true)[0];
    const Tensor g_c = autograd::grad({y}, {x}, {gt.contiguous()}, true)[0];
    EXPECT_TRUE(test::bitwise_equal(g_t, g_c));
    // Three dims, the middle one reduced: the kernel's column path with outer > 1.
    Tensor x3 = ops::sample_tensor({3, 4, 300}, kFloat32, 32).requires_grad_();
    const Tensor g3 = ops::sample_tensor({3, 4, 300}, kFloat32, 33);
    Tensor y3 = apply(x3, 1, log);
    const Tensor fused = autograd::grad({y3}, {x3}, {g3}, true)[0];
    expect_close(to_doubles(fused), reference(to_doubles(y3), to_doubles(g3), 3, 4, 300, log), 1e-5, 1e-6,
                 "3-d middle dim");
  }
}

TEST(SoftmaxGrad, BFloat16ComputesInFloat) {
  // The reference is the formula in float64 over the same bfloat16 y and g;
  // the kernel rounds once, so each element is within bfloat16's half ulp
  // (2^-9 relative) of it, plus a little for float accumulation.
  for (bool log : {false, true}) {
    for (int64_t dim : {1, 0}) {
      const std::string what = std::string(log ? "log_softmax" : "softmax") + " bf16 dim=" + std::to_string(dim);
      Tensor x = ops::sample_tensor({16, 300}, kBFloat16, 40 + dim).requires_grad_();
      const Tensor g = ops::sample_tensor({16, 300}, kBFloat16, 50 + dim);
      Tensor y = apply(x, dim, log);
      const Tensor fused = autograd::grad({y}, {x}, {g})[0];
      EXPECT_EQ(fused.dtype(), kBFloat16);
      const int64_t outer = dim == 1 ? 16 : 1, n = dim == 1 ? 300 : 16, inner = dim == 1 ? 1 : 300;
      const std::vector<double> ref = reference(to_doubles(y), to_doubles(g), outer, n, inner, log);
      double scale = 0;
      for (double v : ref) scale = std::max(scale, std::abs(v));
      expect_close(to_doubles(fused), ref, 1.0 / 256, 1e-6 * scale, what);
    }
  }
}

TEST(SoftmaxGrad, MatchesTorch) {
  // torch: x = [[1, 2, 3], [-1, 0, 4]] (float64), g = [[1, -1, 0.5], [2, 0, -3]]:
  //   torch.autograd.grad(x.softmax(1), x, g) and the same for log_softmax.
  const Tensor x0 = tensor<double>({1, 2, 3, -1, 0, 4}, {2, 3});
  const Tensor g = tensor<double>({1, -1, 0.5, 2, 0, -3}, {2, 3});
  const std::vector<std::vector<double>> want = {
      {0.074012101313, -0.288271192025, 0.214259090712, 0.03229792414, 0.052058896545, -0.084356820685},
      {0.954984713415, -1.122364235527, 0.167379522113, 2.006573263185, 0.01786798187, -2.024441245056}};
  for (bool log : {false, true}) {
    Tensor x = x0.clone().requires_grad_();
    const Tensor got = autograd::grad({apply(x, 1, log)}, {x}, {g})[0];
    expect_close(to_doubles(got), want[log], 1e-9, 1e-12, log ? "log_softmax" : "softmax");
  }
}
