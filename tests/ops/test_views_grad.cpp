// Backward of the view and copy ops (src/ops/view.cpp, copy.cpp): float64
// gradcheck of every op (negative dims, non-contiguous inputs, step slices,
// overlapping as_strided), gradgradcheck where the formula uses only these
// ops, chains of views, node names (as torch 1.13 prints them), views of
// tensors that need no grad recording no node, and a few in-place writes
// into views (the sweep against torch is tests/autograd/test_inplace_views.cpp). The registry driver adds kiln-vs-torch
// gradient comparisons for the samples in src/ops/view_spec.cpp.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/autograd/autograd_meta.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"

using namespace kiln;
using autograd::gradcheck;
using autograd::gradgradcheck;

namespace {

Tensor leaf(std::vector<int64_t> sizes, uint64_t seed) {
  Generator g(seed);
  return randn(sizes, kFloat64, &g).requires_grad_();
}

// A non-contiguous leaf of `sizes`: the transpose of a fresh [.., b, a] tensor.
Tensor noncontig_leaf(std::vector<int64_t> sizes, uint64_t seed) {
  std::vector<int64_t> rev(sizes.rbegin(), sizes.rend());
  Generator g(seed);
  std::vector<int64_t> perm;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) perm.push_back(i);
  Tensor t = randn(rev, kFloat64, &g).permute(perm);
  EXPECT_FALSE(t.is_contiguous());
  return t.requires_grad_();
}

// A non-contiguous leaf of `sizes`: every other element of the last dim of a fresh tensor.
Tensor strided_leaf(std::vector<int64_t> sizes, uint64_t seed) {
  std::vector<int64_t> wide = sizes;
  wide.back() *= 2;
  Generator g(seed);
  Tensor t = randn(wide, kFloat64, &g).slice(-1, 0, std::nullopt, 2);
  EXPECT_FALSE(t.is_contiguous());
  return t.requires_grad_();
}

using Fn = std::function<Tensor(const Tensor&)>;

void check(const Tensor& x, const Fn& f, bool second_order = true) {
  auto fn = [&](const TensorList& in) { return TensorList{f(in[0])}; };
  try {
    EXPECT_TRUE(gradcheck(fn, {x}));
    if (second_order) {
      EXPECT_TRUE(gradgradcheck(fn, {x}));
    }
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
}

// The outputs of a multi-output op as one tensor (gradcheck then checks the
// Jacobian of every output).
Tensor flat_cat(const std::vector<Tensor>& outs) {
  std::vector<Tensor> parts;
  for (const Tensor& t : outs) parts.push_back(t.reshape({-1}));
  return cat(parts);
}

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

}  // namespace

TEST(ViewsGrad, ViewReshapeFlatten) {
  check(leaf({2, 3, 4}, 1), [](const Tensor& x) { return x.view({4, -1}); });
  check(noncontig_leaf({4, 6}, 2), [](const Tensor& x) { return x.view({2, 2, 6}); });  // splits the strided dim
  check(leaf({2, 3, 4}, 3), [](const Tensor& x) { return x.reshape({-1, 2}); });
  check(noncontig_leaf({3, 4}, 4), [](const Tensor& x) { return x.reshape({12}); });  // the copy path
  check(leaf({2, 3, 4, 2}, 5), [](const Tensor& x) { return x.flatten(1, 2); });
  check(noncontig_leaf({3, 4}, 6), [](const Tensor& x) { return x.flatten(); });
  check(leaf({2, 6}, 7), [](const Tensor& x) { return x.unflatten(-1, {2, -1}); });
  check(leaf({}, 8), [](const Tensor& x) { return x.reshape({1, 1}); });
}

TEST(ViewsGrad, TransposePermuteT) {
  check(leaf({2, 3, 4}, 11), [](const Tensor& x) { return x.transpose(-1, 0); });
  check(noncontig_leaf({3, 5}, 12), [](const Tensor& x) { return x.transpose(0, 1); });
  check(leaf({2, 3, 4}, 13), [](const Tensor& x) { return x.permute({-1, 0, -2}); });
  check(noncontig_leaf({2, 3, 4}, 14), [](const Tensor& x) { return x.permute({1, 2, 0}); });
  check(leaf({3, 5}, 15), [](const Tensor& x) { return x.t(); });
  check(leaf({4}, 16), [](const Tensor& x) { return x.t(); });
}

TEST(ViewsGrad, SqueezeUnsqueezeExpand) {
  check(leaf({1, 3, 1, 2}, 21), [](const Tensor& x) { return x.squeeze(); });
  check(leaf({1, 3, 1, 2}, 22), [](const Tensor& x) { return x.squeeze(-2); });
  check(leaf({1, 3, 1, 2}, 23), [](const Tensor& x) { return x.squeeze(1); });  // not size 1: no-op
  check(noncontig_leaf({3, 2}, 24), [](const Tensor& x) { return x.unsqueeze(-1); });
  check(leaf({}, 25), [](const Tensor& x) { return x.unsqueeze(0); });
  // expand's backward sums (a reduction): first order only here.
  check(leaf({3, 1}, 26), [](const Tensor& x) { return x.expand({2, 3, 4}); }, false);
  check(strided_leaf({1, 3}, 27), [](const Tensor& x) { return x.expand({2, -1}); }, false);
  check(leaf({}, 28), [](const Tensor& x) { return x.expand({2, 2}); }, false);
}

TEST(ViewsGrad, NarrowSliceSelectDiagonal) {
  check(leaf({3, 5}, 31), [](const Tensor& x) { return x.narrow(1, 1, 3); });
  check(noncontig_leaf({4, 3}, 32), [](const Tensor& x) { return x.narrow(0, -3, 2); });
  check(leaf({4, 7}, 33), [](const Tensor& x) { return x.slice(-1, 1, std::nullopt, 2); });
  check(leaf({10}, 34), [](const Tensor& x) { return x.slice(0, -8, 100, 3); });
  check(noncontig_leaf({5, 6}, 35), [](const Tensor& x) { return x.slice(1, 1, -1, 2); });
  check(leaf({10}, 36), [](const Tensor& x) { return x.slice(0, 7, 2); });  // empty
  check(leaf({3, 4, 2}, 37), [](const Tensor& x) { return x.select(1, -1); });
  check(noncontig_leaf({3, 4}, 38), [](const Tensor& x) { return x.select(0, 2); });
  check(leaf({5}, 39), [](const Tensor& x) { return x.select(0, 3); });
  check(leaf({3, 4}, 40), [](const Tensor& x) { return x.diagonal(); });
  check(leaf({3, 4, 5}, 41), [](const Tensor& x) { return x.diagonal(1, 0, 2); });
  check(leaf({3, 4, 5}, 42), [](const Tensor& x) { return x.diagonal(-1, -1, 1); });
  check(noncontig_leaf({4, 3}, 43), [](const Tensor& x) { return x.diagonal(-1); });
}

TEST(ViewsGrad, SplitChunkUnbind) {
  check(leaf({3, 5}, 51), [](const Tensor& x) { return flat_cat(x.split(2, -1)); });
  check(noncontig_leaf({4, 3}, 52), [](const Tensor& x) { return flat_cat(x.split(3)); });
  check(leaf({3, 5}, 53), [](const Tensor& x) { return flat_cat(x.split_with_sizes({1, 0, 4}, 1)); });
  check(leaf({5, 2}, 54), [](const Tensor& x) { return flat_cat(x.chunk(3)); });
  check(leaf({2, 3}, 55), [](const Tensor& x) { return flat_cat(x.unbind(1)); });
  check(noncontig_leaf({3, 2}, 56), [](const Tensor& x) { return flat_cat(x.unbind(-2)); });
  // Only some pieces used: the others' gradients are zeros.
  check(leaf({6, 2}, 57), [](const Tensor& x) { return x.chunk(3)[1]; });
  check(leaf({3, 2}, 58), [](const Tensor& x) { return x.unbind(0)[2]; });
  Tensor x = leaf({4, 2}, 59);
  auto pieces = x.split(3);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_STREQ(pieces[0].grad_fn()->name(), "SplitBackward0");
  EXPECT_EQ(pieces[0].grad_fn(), pieces[1].grad_fn());  // one node, one output per piece
  EXPECT_EQ(pieces[1].output_nr(), 1);
  pieces[1].clone().backward(ones({1, 2}, kFloat64));
  EXPECT_TRUE(x.grad().equal(tensor<double>({0, 0, 0, 0, 0, 0, 1, 1}, {4, 2})));
}

TEST(ViewsGrad, AsStrided) {
  // Non-overlapping, with an offset and a transposed layout.
  check(leaf({12}, 61), [](const Tensor& x) { return x.as_strided({4, 2}, {1, 4}, 1); });
  // Overlapping windows: each location's gradient sums over the windows reading it.
  check(leaf({12}, 62), [](const Tensor& x) { return x.as_strided({3, 4}, {2, 1}, 1); });
  check(leaf({6}, 63), [](const Tensor& x) { return x.as_strided({3, 3}, {0, 1}); });
  // A view of a view: geometry on the storage, input non-contiguous.
  check(noncontig_leaf({3, 4}, 64), [](const Tensor& x) { return x.as_strided({2, 2}, {1, 3}, 1); });
  // The input itself overlaps (an expanded tensor): the gradient is shared among its aliases.
  check(leaf({3}, 65), [](const Tensor& x) { return x.expand({2, 3}).as_strided({2, 2}, {1, 1}); }, false);
  Tensor x = leaf({12}, 66);
  Tensor y = x.as_strided({3, 4}, {2, 1}, 1);
  EXPECT_STREQ(y.grad_fn()->name(), "AsStridedBackward0");
  y.backward(ones({3, 4}, kFloat64));
  // Location p is read by the windows r with 0 <= p - 1 - 2r < 4.
  EXPECT_TRUE(x.grad().equal(tensor<double>({0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 0}))) << x.grad();
}

TEST(ViewsGrad, AsStridedOfAViewReadingItsBaseIsAnError) {
  Tensor base = leaf({8}, 67);
  Tensor v = base.narrow(0, 2, 3);
  Tensor y = v.as_strided({4}, {1}, 0);  // reads base[0], base[1] through v's storage
  const std::string msg = error_of<ValueError>([&] { y.backward(ones({4}, kFloat64)); });
  EXPECT_TRUE(contains(msg, "reads memory outside its input")) << msg;
  EXPECT_TRUE(contains(msg, "Call as_strided on the base")) << msg;
}

TEST(ViewsGrad, ChainsOfViews) {
  check(leaf({3, 4}, 71), [](const Tensor& x) { return x.t().reshape({2, 6}).narrow(1, 1, 4); });
  check(noncontig_leaf({2, 3, 4}, 72), [](const Tensor& x) {
    return x.permute({2, 0, 1}).select(1, 1).unsqueeze(0).transpose(0, 2).slice(0, 0, std::nullopt, 2).flatten();
  });
  check(leaf({4, 4}, 73), [](const Tensor& x) { return x.diagonal().unsqueeze(1).expand({4, 3}); }, false);
  // The same leaf reached through two views: the gradients add.
  Tensor x = leaf({2, 3}, 74);
  Tensor y = cat({x.t().reshape({-1}), x.select(0, 1)});
  y.backward(ones({9}, kFloat64));
  EXPECT_TRUE(x.grad().equal(tensor<double>({1, 1, 1, 2, 2, 2}, {2, 3})));
}

TEST(ViewsGrad, NodeNamesFollowTorch) {
  Tensor x = leaf({3, 4}, 81);
  auto name = [](const Tensor& t) { return std::string(t.grad_fn()->name()); };
  EXPECT_EQ(name(x.view({12})), "ViewBackward0");
  EXPECT_EQ(name(x.reshape({12})), "ReshapeAliasBackward0");
  EXPECT_EQ(name(x.t().reshape({12})), "UnsafeViewBackward0");
  EXPECT_EQ(name(x.t()), "TBackward0");
  EXPECT_EQ(name(x.transpose(0, 1)), "TransposeBackward0");
  EXPECT_EQ(name(x.permute({1, 0})), "PermuteBackward0");
  EXPECT_EQ(name(x.squeeze()), "SqueezeBackward0");
  EXPECT_EQ(name(x.squeeze(0)), "SqueezeBackward1");
  EXPECT_EQ(name(x.unsqueeze(0)), "UnsqueezeBackward0");
  EXPECT_EQ(name(x.narrow(0, 1, 1)), "SliceBackward0");
  EXPECT_EQ(name(x.select(0, 1)), "SelectBackward0");
  EXPECT_EQ(name(x.split_with_sizes({1, 2})[0]), "SplitWithSizesBackward0");
  EXPECT_EQ(name(x.chunk(2)[0]), "SplitBackward0");
  EXPECT_EQ(name(x.unbind()[0]), "UnbindBackward0");
  EXPECT_EQ(name(x.diagonal()), "DiagonalBackward0");
  EXPECT_EQ(name(x.narrow(0, 0, 1).expand({3, 4})), "ExpandBackward0");
  EXPECT_EQ(name(x.to(kFloat32)), "ToCopyBackward0");
  EXPECT_EQ(name(x.t().contiguous()), "CloneBackward0");
  EXPECT_EQ(name(x.clone()), "CloneBackward0");
  // The reshape copy path is not a view of its input; the view path is.
  EXPECT_FALSE(autograd::get_meta(x.t().reshape({12}))->is_view);
  EXPECT_TRUE(autograd::get_meta(x.reshape({12}))->is_view);
}

TEST(ViewsGrad, ViewsOfTensorsNeedingNoGradRecordNoNode) {
  // They are marked as views of their base (an in-place write of a value that
  // requires grad must reach the base: a KV cache), but build no graph.
  Tensor a = randn({3, 4}, kFloat64);
  for (const Tensor& v : {a.view({12}), a.t(), a.narrow(0, 1, 2), a.expand({2, 3, 4}), a.diagonal(),
                          a.as_strided({2}, {5}), a.unbind()[0], a.split(2)[1]}) {
    EXPECT_FALSE(v.requires_grad());
    EXPECT_EQ(v.grad_fn(), nullptr);
    ASSERT_NE(autograd::get_meta(v), nullptr);
    EXPECT_TRUE(autograd::get_meta(v)->is_view);
  }
  // Integer tensors and inference tensors are not tracked at all.
  EXPECT_EQ(autograd::get_meta(zeros({3}, kInt64).narrow(0, 0, 1)), nullptr);
  {
    InferenceModeGuard im;
    EXPECT_EQ(autograd::get_meta(a.t()), nullptr);
  }
  Tensor x = leaf({3, 4}, 91);
  {
    NoGradGuard ng;
    Tensor v = x.t();
    EXPECT_FALSE(v.requires_grad());
    EXPECT_EQ(v.grad_fn(), nullptr);
  }
  // The one-element path (x.t() of a 1-D tensor) records too.
  EXPECT_TRUE(leaf({3}, 92).t().requires_grad());
}

TEST(ViewsGrad, InPlaceOnAViewRewritesTheBaseHistory) {
  // (The random sweep against torch is tests/autograd/test_inplace_views.cpp.)
  Tensor x = leaf({3, 4}, 101);
  Tensor y = x.clone();
  y.narrow(0, 0, 2).fill_(1.0);
  y.t().copy_(y.t() * 2.0);
  EXPECT_STREQ(y.grad_fn()->name(), "CopySlices");
  y.backward(ones({3, 4}, kFloat64));
  // Rows 0-1 were filled (no gradient), row 2 was doubled.
  EXPECT_TRUE(x.grad().equal(tensor<double>({0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2}, {3, 4})));
  // A view of the leaf itself still cannot be written with grad mode on.
  const std::string msg = error_of<ValueError>([&] { x.select(0, 1).zero_(); });
  EXPECT_TRUE(contains(msg, "zero_: output 0 of SelectBackward0 [4] float64 is a view of a leaf tensor")) << msg;
  EXPECT_TRUE(contains(msg, "test_views_grad.cpp")) << msg;  // the call site
  // Under NoGradGuard (an optimizer step) the in-place op is allowed.
  {
    NoGradGuard ng;
    x.select(0, 1).zero_();
  }
  EXPECT_EQ(x.select(0, 1).abs().sum().item<double>(), 0.0);
}

TEST(ViewsGrad, AViewUsedAfterItsBaseWasWrittenFollowsTheBase) {
  Tensor x = leaf({3, 4}, 111);
  Tensor y = x.clone();
  Tensor v = y.select(0, 1);
  y.mul_(3.0);  // v's history is rebuilt from y's new one, as torch does
  v.sum().backward();
  EXPECT_TRUE(x.grad().equal(tensor<double>({0, 0, 0, 0, 3, 3, 3, 3, 0, 0, 0, 0}, {3, 4})));
  EXPECT_STREQ(v.grad_fn()->name(), "AsStridedBackward0");
  // Its forward site is the write that made the rebuild necessary.
  EXPECT_TRUE(contains(v.grad_fn()->site().str(), "test_views_grad.cpp")) << v.grad_fn()->site().str();
}

TEST(CopyGrad, CopyRewritesHistory) {
  Tensor x = leaf({2, 3}, 121);
  Tensor z = tensor<float>({1.f, 2.f, 3.f}).requires_grad_();  // broadcast and a different dtype
  Tensor y = x.clone();
  y.copy_(z);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "CopyBackwards");
  EXPECT_EQ(y.grad_fn()->next_edges().size(), 2u);
  EXPECT_STREQ(y.grad_fn()->next_edges()[0].function->name(), "CloneBackward0");  // the previous history
  y.backward(tensor<double>({1, 2, 3, 4, 5, 6}, {2, 3}));
  // The old value of y was overwritten: nothing flows to x.
  EXPECT_TRUE(!x.grad().defined() || x.grad().abs().sum().item<double>() == 0.0);
  ASSERT_TRUE(z.grad().defined());
  EXPECT_EQ(z.grad().dtype(), kFloat32);
  EXPECT_TRUE(z.grad().equal(tensor<float>({5.f, 7.f, 9.f})));  // summed over the broadcast dim
  // gradcheck through copy_ into a fresh tensor (broadcast: the engine's
  // sum, a reduction, is not differentiated here).
  check(leaf({3}, 122), [](const Tensor& s) {
    Tensor out = empty({2, 3}, kFloat64);
    out.copy_(s);
    return out;
  }, false);
  check(strided_leaf({2, 3}, 123), [](const Tensor& s) {
    Tensor out = empty({2, 3}, kFloat64);
    out.copy_(s);
    return out;
  });
}

TEST(CopyGrad, CopyIntoALeafIsAnErrorIntoABuffersViewIsNot) {
  Tensor x = leaf({3}, 131);
  const std::string msg = error_of<ValueError>([&] { x.copy_(zeros({3}, kFloat64)); });
  EXPECT_TRUE(contains(msg, "copy_: a leaf tensor [3] float64 is a leaf that requires grad")) << msg;
  // Writing a gradient-carrying value into part of a buffer: the buffer gets the history.
  Tensor buf = zeros({2, 3}, kFloat64);
  buf[0].copy_(x);
  EXPECT_STREQ(buf.grad_fn()->name(), "CopySlices");
  (buf * 2.0).sum().backward();
  EXPECT_TRUE(x.grad().equal(full({3}, 2.0, kFloat64)));
  // An integer destination stays outside the graph.
  Tensor i = zeros({3}, kInt64);
  i.copy_(x);
  EXPECT_FALSE(i.requires_grad());
}

TEST(CopyGrad, ToContiguousClone) {
  Tensor x = leaf({2, 3}, 141);
  Tensor f = x.to(kFloat32);
  EXPECT_EQ(f.dtype(), kFloat32);
  f.backward(ones({2, 3}, kFloat32));
  EXPECT_EQ(x.grad().dtype(), kFloat64);  // cast back to the source dtype
  EXPECT_TRUE(x.grad().equal(ones({2, 3}, kFloat64)));
  EXPECT_TRUE(x.to(kFloat64).is_same(x));
  Tensor i = x.to(kInt64);  // not differentiable
  EXPECT_FALSE(i.requires_grad());
  EXPECT_EQ(i.grad_fn(), nullptr);
  EXPECT_FALSE(x.to(kBool).requires_grad());
  check(leaf({2, 3}, 142), [](const Tensor& t) { return t.to(kFloat64, /*copy=*/true); });
  check(noncontig_leaf({3, 4}, 143), [](const Tensor& t) { return t.contiguous(); });
  check(noncontig_leaf({2, 3, 4}, 144), [](const Tensor& t) { return t.clone(); });
  Tensor c = leaf({2, 2}, 145);
  EXPECT_TRUE(c.contiguous().is_same(c));  // already contiguous: no copy, no node
}

TEST(CopyGrad, FillAndZeroRewriteHistory) {
  Tensor x = leaf({2, 3}, 151);
  Tensor y = x.clone();
  y.fill_(3.0);
  EXPECT_STREQ(y.grad_fn()->name(), "FillBackward2");
  EXPECT_TRUE(y.requires_grad());
  Tensor z = x.clone();
  z.zero_();
  EXPECT_STREQ(z.grad_fn()->name(), "ZeroBackward0");
  cat({y.reshape({-1}), z.reshape({-1}), x.reshape({-1})}).backward(ones({18}, kFloat64));
  EXPECT_TRUE(x.grad().equal(ones({2, 3}, kFloat64)));  // only the untouched use of x counts
  EXPECT_TRUE(contains(error_of<ValueError>([&] { x.fill_(1.0); }), "is a leaf that requires grad"));
  Tensor plain = zeros({2});
  plain.fill_(1.0);  // needs no grad: no history
  EXPECT_EQ(plain.grad_fn(), nullptr);
}
