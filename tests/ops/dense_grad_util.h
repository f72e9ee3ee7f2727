// Helpers shared by test_linalg_grad.cpp and test_conv_pool_grad.cpp:
// random float64 leaves, gradcheck wrappers, and the gradients of one
// function at another dtype compared with the float64 ones.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kiln/kiln.h"
#include "support/oracle.h"

namespace kiln::test {

using Fn = std::function<Tensor(const TensorList&)>;

/// A float64 leaf that requires grad, normal(0, 1) from a fixed seed.
inline Tensor leaf(IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, kFloat64, &g).requires_grad_();
}

/// A non-contiguous float64 leaf: leaf(base_shape) transposed in dims d0, d1
/// (the leaf itself is the strided tensor, so its gradient needs no view's backward).
inline Tensor transposed_leaf(IntArrayRef base_shape, uint64_t seed, int64_t d0 = 0, int64_t d1 = 1) {
  return leaf(base_shape, seed).detach().transpose(d0, d1).requires_grad_();
}

inline autograd::DifferentiableFn as_list_fn(const Fn& f) {
  return [f](const TensorList& xs) { return TensorList{f(xs)}; };
}

inline void expect_gradcheck(const Fn& f, const TensorList& xs, const std::string& what) {
  try {
    EXPECT_TRUE(autograd::gradcheck(as_list_fn(f), xs)) << what;
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

inline void expect_gradgradcheck(const Fn& f, const TensorList& xs, const std::string& what) {
  try {
    EXPECT_TRUE(autograd::gradgradcheck(as_list_fn(f), xs)) << what;
  } catch (const Error& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

/// The float64 values of `t`, row-major.
inline std::vector<double> values(const Tensor& t) {
  const Tensor c = t.detach().to(kFloat64, /*copy=*/true).contiguous();
  const double* p = c.data_ptr<double>();
  return {p, p + c.numel()};
}

/// `x` converted to `dt` with its dims laid out in the same order (a
/// transposed x gives a transposed result), as a new leaf that requires grad.
inline Tensor same_layout_leaf(const Tensor& x, DType dt) {
  std::vector<int64_t> perm(static_cast<size_t>(x.dim()));
  for (int64_t d = 0; d < x.dim(); ++d) perm[static_cast<size_t>(d)] = d;
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  return x.detach().permute(perm).to(dt).contiguous().permute(inverse).requires_grad_();
}

/// Gradients of sum(f(xs) * gy) w.r.t. every x, computed with xs and gy in `dt`.
inline TensorList grads_in(const Fn& f, const TensorList& xs, const Tensor& gy, DType dt) {
  TensorList in;
  for (const Tensor& x : xs) in.push_back(same_layout_leaf(x, dt));
  const Tensor y = f(in);
  return autograd::grad({y}, in, {gy.detach().to(dt)});
}

/// Compares the gradients of f computed in `dt` (oneDNN for float32 and
/// bfloat16) with those computed in float64 from the same values (xs and gy
/// rounded to `dt` first; each x keeps its layout, so a transposed x reaches
/// the kernel transposed): |got - want| <= tol * max(1, max |want|) per input.
inline void expect_grads_match_float64(const Fn& f, const TensorList& xs, uint64_t seed, DType dt, double tol,
                                       const std::string& what) {
  TensorList rounded;
  for (const Tensor& x : xs) rounded.push_back(same_layout_leaf(same_layout_leaf(x, dt), kFloat64));
  Tensor gy;
  {
    const NoGradGuard ng;
    TensorList probe;
    for (const Tensor& x : rounded) probe.push_back(x.detach());
    Generator g(seed);
    gy = randn(f(probe).sizes(), kFloat64, &g).to(dt).to(kFloat64);
  }
  const TensorList want = grads_in(f, rounded, gy, kFloat64);
  const TensorList got = grads_in(f, rounded, gy, dt);
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].dtype(), dt) << what << " input " << i;
    ASSERT_EQ(got[i].sizes().vec(), want[i].sizes().vec()) << what << " input " << i;
    const auto a = values(got[i]), b = values(want[i]);
    double scale = 1;
    for (double v : b) scale = std::max(scale, std::abs(v));
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_LE(std::abs(a[k] - b[k]), tol * scale)
          << what << " (" << dtype_name(dt) << "): gradient of input " << i << " element " << k << " is " << a[k]
          << ", float64 gives " << b[k];
    }
  }
}

/// One gradient comparison with PyTorch: kiln's f and torch's `expr` over
/// x0, x1, ... (the same math), differentiated w.r.t. every input for the
/// same random grad_output.
struct TorchGradCase {
  std::string label;
  Fn f;
  TensorList xs;
  std::string expr;
};

/// Runs every case's torch gradients in one oracle batch and compares them
/// with kiln's: |kiln - torch| <= atol + rtol * |torch| element by element.
inline void expect_grads_match_torch(const std::vector<TorchGradCase>& cases, double rtol, double atol) {
  OracleBatch batch;
  std::vector<Tensor> gys;
  uint64_t seed = 77;
  for (const TorchGradCase& c : cases) {
    TensorList probe;
    for (const Tensor& x : c.xs) probe.push_back(x.detach());
    Generator g(seed++);
    Tensor gy;
    {
      const NoGradGuard ng;
      const Tensor y = c.f(probe);
      gy = randn(y.sizes(), y.dtype(), &g);
    }
    gys.push_back(gy);
    // x0..x{n-1} become leaves that require grad (the same objects the tuple then names); x{n} is the grad_output.
    std::string names;
    for (size_t i = 0; i < c.xs.size(); ++i) names += (i ? ", x" : "x") + std::to_string(i);
    const std::string expr = "torch.autograd.grad((lambda " + names + ": " + c.expr +
                             ")(*[t.requires_grad_() for t in (" + names + ",)]), (" + names + ",), x" +
                             std::to_string(c.xs.size()) + ")";
    TensorList in = probe;
    in.push_back(gy);
    batch.add(c.label, expr, in);
  }
  batch.run();
  for (size_t k = 0; k < cases.size(); ++k) {
    const TorchGradCase& c = cases[k];
    const OracleOutcome& r = batch.outcome(k);
    ASSERT_TRUE(r.ok) << c.label << ": torch raised " << r.error;
    const TensorList got = grads_in(c.f, c.xs, gys[k], c.xs[0].dtype());
    ASSERT_EQ(got.size(), r.outputs.size()) << c.label;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].sizes().vec(), r.outputs[i].sizes().vec()) << c.label << " input " << i;
      const auto a = values(got[i]), b = values(r.outputs[i]);
      for (size_t e = 0; e < a.size(); ++e) {
        ASSERT_LE(std::abs(a[e] - b[e]), atol + rtol * std::abs(b[e]))
            << c.label << ": gradient of x" << i << " element " << e << " is " << a[e] << ", torch gives " << b[e];
      }
    }
  }
}

}  // namespace kiln::test
