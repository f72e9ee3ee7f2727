// AccumulateGrad's buffer handling (torch's AccumulateGrad::accumulateGrad):
// a gradient nothing else can see becomes .grad without a copy; a gradient
// that is shared, a view, or kept by a hook is copied; accumulation into an
// existing .grad writes in place, so a .grad that is a view into a bucket
// (DDP's gradient_as_bucket_view) keeps working. Pointer identity is what
// these tests check: the values are checked everywhere else.
#include <gtest/gtest.h>

#include "kiln/autograd/custom_function.h"
#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

Tensor leaf(IntArrayRef sizes, double start = 1.0) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  Tensor t = (arange(n, TensorOptions().dtype(kFloat32)) * 0.25 + start).view(sizes);
  t.requires_grad_();
  return t;
}

using test::ArrivalProbe;

TEST(AccumulateGrad, StealsASoleOwnedGradient) {
  Tensor x = leaf({4, 3});
  ArrivalProbe probe(x);
  Tensor w = leaf({4, 3}, -2.0).detach();
  (x * w).sum().backward();  // MulBackward's d/dx = g * w: a fresh, contiguous, sole-owned tensor
  ASSERT_TRUE(x.grad().defined());
  ASSERT_NE(probe.ptr, nullptr);
  EXPECT_EQ(x.grad().data_ptr(), probe.ptr) << "the incoming gradient was copied instead of taken";
  EXPECT_TRUE(x.grad().allclose(w));
  EXPECT_FALSE(x.grad().requires_grad());
}

TEST(AccumulateGrad, StealsLinearWeightAndBiasGradients) {
  Tensor x = leaf({5, 3}).detach();
  Tensor w = leaf({4, 3}, 0.5), b = leaf({4}, 0.1);
  ArrivalProbe pw(w), pb(b);
  (linear(x, w, b) * leaf({5, 4}, 0.3).detach()).sum().backward();
  ASSERT_TRUE(w.grad().defined() && b.grad().defined());
  EXPECT_TRUE(w.grad().is_contiguous());
  EXPECT_TRUE(b.grad().is_contiguous());
  EXPECT_EQ(w.grad().data_ptr(), pw.ptr);
  EXPECT_EQ(b.grad().data_ptr(), pb.ptr);
}

TEST(AccumulateGrad, StealsTheWeightGradientOfMatmulWithATransposedWeight) {
  // nn::Linear's x.matmul(W.t()): mm's backward gives W.t() a column-major
  // gradient, so t()'s backward hands W a contiguous one, taken without a copy.
  Tensor x = leaf({5, 3}).detach();
  Tensor w = leaf({4, 3}, 0.5);
  Tensor c = leaf({5, 4}, 0.3).detach();
  ArrivalProbe pw(w);
  (x.matmul(w.t()) * c).sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(w.grad().is_contiguous());
  EXPECT_EQ(w.grad().data_ptr(), pw.ptr);
  EXPECT_TRUE(w.grad().allclose(c.t().mm(x)));
}

TEST(AccumulateGrad, ColumnMajorOperandsDifferentiateTwice) {
  // Both operands of mm column-major (transposed views), float64: the
  // column-major formulas of mm's backward against finite differences.
  Tensor a = leaf({3, 4}).detach().to(kFloat64).requires_grad_();
  Tensor b = leaf({5, 3}, -1.0).detach().to(kFloat64).requires_grad_();
  const auto fn = [](const TensorList& in) { return TensorList{in[0].t().mm(in[1].t()).sin()}; };
  EXPECT_TRUE(autograd::gradcheck(fn, {a, b}));
  EXPECT_TRUE(autograd::gradgradcheck(fn, {a, b}));
  Tensor g = leaf({4, 5}, 0.2).detach().to(kFloat64);
  TensorList got = autograd::grad({a.t().mm(b.t())}, {a, b}, {g});
  // C = aᵀ bᵀ: d aᵀ = g · b, so d a = (g · b)ᵀ; d bᵀ = a · g, so d b = (a · g)ᵀ.
  EXPECT_TRUE(got[0].allclose(g.mm(b.detach()).t()));
  EXPECT_TRUE(got[1].allclose(a.detach().mm(g).t()));
}

// y = 2x; its backward records where each gradient it returns lives.
std::vector<const void*> scale2_outputs;
struct Scale2 : autograd::Function<Scale2> {
  static Tensor forward(autograd::AutogradContext&, const Tensor& x) { return x * 2; }
  static TensorList backward(autograd::AutogradContext&, TensorList g) {
    Tensor r = g[0] * 2;
    scale2_outputs.push_back(r.data_ptr());
    return {r};
  }
};

// h = x * c feeds two nodes (a residual-style fan-out): the engine sums their
// gradients for h's node into the first one's buffer, no fresh tensor.
void expect_fan_out_summed_in_place(Tensor x, const Tensor& c, const Tensor& w) {
  scale2_outputs.clear();
  Tensor h = x * c;
  ArrivalProbe at_h(h);
  ((Scale2::apply(h) + Scale2::apply(h)) * w).sum().backward();
  ASSERT_EQ(scale2_outputs.size(), 2u);
  EXPECT_TRUE(at_h.ptr == scale2_outputs[0] || at_h.ptr == scale2_outputs[1]);
  EXPECT_TRUE(x.grad().allclose(w * c * 4));
}

TEST(EngineBuffer, SecondGradientIsSummedInPlace) {
  expect_fan_out_summed_in_place(leaf({8}), leaf({8}, -1.0).detach(), leaf({8}, 0.5).detach());
}

TEST(EngineBuffer, ChannelsLastGradientsAreSummedInPlaceToo) {
  // A channels-last network's residual fan-out (resnet's blocks): both gradients are NHWC with the
  // same strides, so the sum goes into the first one's buffer as for row-major ones.
  auto nhwc = [](Tensor t) { return contiguous(t, MemoryFormat::ChannelsLast); };
  const Tensor c = nhwc(leaf({2, 3, 4, 5}, -1.0).detach()), w = nhwc(leaf({2, 3, 4, 5}, 0.5).detach());
  expect_fan_out_summed_in_place(nhwc(leaf({2, 3, 4, 5}).detach()).requires_grad_(), c, w);

  // Gradients in two layouts are summed into a fresh tensor, with the same values.
  scale2_outputs.clear();
  Tensor y = nhwc(leaf({2, 3, 4, 5}).detach()).requires_grad_();
  Tensor hy = y * c;
  ArrivalProbe at_hy(hy);
  ((Scale2::apply(hy) * w).sum() + (Scale2::apply(hy) * w.contiguous()).sum()).backward();
  ASSERT_EQ(scale2_outputs.size(), 2u);
  EXPECT_TRUE(at_hy.ptr != scale2_outputs[0] && at_hy.ptr != scale2_outputs[1]);
  EXPECT_TRUE(y.grad().allclose(w * c * 4));
}

TEST(EngineBuffer, SummedOutOfPlaceUnderCreateGraph) {
  Tensor x = leaf({5});
  Tensor h = x * x;
  Tensor y = (h * 3 + h * 2).sum();  // dy/dx = 10x, d2y/dx2 = 10
  TensorList g = autograd::grad({y}, {x}, {}, std::nullopt, /*create_graph=*/true);
  EXPECT_TRUE(g[0].allclose(x.detach() * 10));
  TensorList gg = autograd::grad({g[0].sum()}, {x});
  EXPECT_TRUE(gg[0].allclose(full({5}, 10.0)));
}

TEST(AccumulateGrad, SharedGradientIsNotStolen) {
  // AddBackward hands the same gradient tensor to both leaves: at most one of
  // them may take it, or an in-place update of one .grad would change the other.
  Tensor x = leaf({6}), y = leaf({6}, 3.0);
  Tensor w = leaf({6}, -1.0).detach();
  ((x + y) * w).sum().backward();
  ASSERT_TRUE(x.grad().defined() && y.grad().defined());
  EXPECT_NE(x.grad().data_ptr(), y.grad().data_ptr());
  x.mutable_grad().add_(100);
  EXPECT_TRUE(y.grad().allclose(w));
  EXPECT_TRUE(x.grad().allclose(w + 100));
}

TEST(AccumulateGrad, GradientKeptByAHookIsNotStolen) {
  Tensor x = leaf({4});
  Tensor kept;
  HookHandle h = x.register_hook([&kept](const Tensor& g) {
    kept = g;
    return Tensor();
  });
  Tensor w = leaf({4}, 2.0).detach();
  (x * w).sum().backward();
  ASSERT_TRUE(kept.defined());
  EXPECT_NE(x.grad().data_ptr(), kept.data_ptr());
  x.mutable_grad().zero_();
  EXPECT_TRUE(kept.allclose(w)) << "the hook's tensor was aliased by .grad";
}

TEST(AccumulateGrad, NonContiguousGradientIsCopiedContiguous) {
  // t()'s backward hands the leaf a transposed view; .grad must still have the leaf's layout.
  Tensor x = leaf({3, 4});
  Tensor w = leaf({4, 3}, 0.5).detach();
  (x.t() * w).sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().is_contiguous());
  EXPECT_TRUE(x.grad().allclose(w.t()));
}

TEST(AccumulateGrad, AccumulatesInPlaceIntoAnExistingGrad) {
  Tensor x = leaf({5});
  Tensor w = leaf({5}, 1.5).detach();
  (x * w).sum().backward();
  const void* first = x.grad().data_ptr();
  (x * w).sum().backward();
  EXPECT_EQ(x.grad().data_ptr(), first);
  EXPECT_TRUE(x.grad().allclose(w * 2));
}

TEST(AccumulateGrad, AccumulationIntoAViewGradStaysInPlace) {
  // As DDP with gradient_as_bucket_view: .grad is a view into a flat bucket,
  // set before backward, and the bucket must see the gradient.
  Tensor bucket = zeros({20});
  Tensor x = leaf({2, 3});
  x.mutable_grad() = bucket.narrow(0, 4, 6).view({2, 3});
  const void* view_ptr = x.grad().data_ptr();
  int post_calls = 0;
  HookHandle h = x.register_post_accumulate_grad_hook([&](Tensor& t) {
    ++post_calls;
    EXPECT_EQ(t.grad().data_ptr(), view_ptr);
  });
  Tensor w = leaf({2, 3}, -0.5).detach();
  (x * w).sum().backward();
  (x * w).sum().backward();
  EXPECT_EQ(post_calls, 2);
  EXPECT_EQ(x.grad().data_ptr(), view_ptr);
  EXPECT_TRUE(bucket.narrow(0, 4, 6).view({2, 3}).allclose(w * 2));
  EXPECT_EQ(bucket.narrow(0, 0, 4).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(bucket.narrow(0, 10, 10).abs().sum().item<float>(), 0.0f);
}

TEST(AccumulateGrad, CreateGraphKeepsTheGradientDifferentiable) {
  Tensor x = leaf({3});
  Tensor y = (x * x * x).sum();
  y.backward({}, /*retain_graph=*/true, /*create_graph=*/true);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().requires_grad());
  Tensor g1 = x.grad();
  x.mutable_grad() = Tensor();
  g1.sum().backward();  // d/dx sum(3x^2) = 6x
  EXPECT_TRUE(x.grad().allclose(x.detach() * 6));
}

}  // namespace

// Issue 27: grad() is a handle, so libtorch's in-place use of it works and
// changes the stored gradient (it was a const reference: mul_ did not compile).
TEST(AccumulateGrad, InPlaceOpsOnGradScaleTheStoredGradient) {
  Tensor w = ones({3}).requires_grad_();
  (w * 2.0).sum().backward();
  const Tensor& p = w;  // as an optimizer or a clipping loop sees its parameters
  p.grad().mul_(0.5);
  EXPECT_TRUE(w.grad().equal(ones({3})));
  p.grad().zero_();
  EXPECT_TRUE(w.grad().equal(zeros({3})));
  EXPECT_FALSE(Tensor(ones({1})).grad().defined());
}
