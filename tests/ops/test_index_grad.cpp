// Backward of the indexing and joining ops (src/ops/gather_scatter.cpp,
// where.cpp, join.cpp, repeat.cpp): float64 gradcheck of every op (repeated
// indices, negative dims, non-contiguous and broadcast inputs), gradgradcheck
// where the formula uses only these ops, embedding's weight gradient with
// repeated indices against values computed by torch 1.13, bitwise
// determinism of the duplicate-index accumulations across thread counts, and
// in-place scatter_/masked_fill_ rewriting history.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;
using autograd::gradcheck;
using autograd::gradgradcheck;

namespace {

Tensor leaf(std::vector<int64_t> sizes, uint64_t seed) {
  Generator g(seed);
  return randn(sizes, kFloat64, &g).requires_grad_();
}

Tensor noncontig_leaf(std::vector<int64_t> sizes, uint64_t seed) {
  Generator g(seed);
  Tensor t = randn({sizes[1], sizes[0]}, kFloat64, &g).t();
  return t.requires_grad_();
}

Tensor idx(std::vector<int64_t> v, std::vector<int64_t> shape = {}) { return tensor<int64_t>(v, shape); }

Tensor rand_index(int64_t hi, std::vector<int64_t> shape, uint64_t seed) {
  Generator g(seed);
  return randint(0, hi, shape, kInt64, &g);
}

using Fn = std::function<Tensor(const TensorList&)>;

void check(const TensorList& inputs, const Fn& f, bool second_order = true) {
  auto fn = [&](const TensorList& in) { return TensorList{f(in)}; };
  try {
    EXPECT_TRUE(gradcheck(fn, inputs));
    if (second_order) {
      EXPECT_TRUE(gradgradcheck(fn, inputs));
    }
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
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

// Runs f with n threads, restoring the previous setting.
template <typename F>
Tensor with_threads(int n, F&& f) {
  const int prev = get_num_threads();
  set_num_threads(n);
  Tensor r = f();
  set_num_threads(prev);
  return r;
}

}  // namespace

TEST(IndexGrad, IndexSelect) {
  check({leaf({5, 3}, 1)}, [](const TensorList& x) { return x[0].index_select(0, idx({4, 0, 4, 2, 4})); });
  check({leaf({3, 5}, 2)}, [](const TensorList& x) { return index_select(x[0], -1, idx({4, 1}).to(kInt32)); });
  check({noncontig_leaf({4, 5}, 3)},
        [](const TensorList& x) { return x[0].index_select(1, idx({0, 9, 2, 9, 4}).slice(0, 0, std::nullopt, 2)); });
  check({leaf({2, 3, 4}, 4)}, [](const TensorList& x) { return x[0].index_select(1, scalar_tensor(2, kInt64)); });
  check({leaf({3, 4}, 5)}, [](const TensorList& x) { return x[0].index_select(0, empty({0}, kInt64)); });
  Tensor x = leaf({4, 2}, 6);
  Tensor y = x.index_select(0, idx({1, 1, 3}));
  EXPECT_STREQ(y.grad_fn()->name(), "IndexSelectBackward0");
  y.backward(ones({3, 2}, kFloat64));
  EXPECT_TRUE(x.grad().equal(tensor<double>({0, 0, 2, 2, 0, 0, 1, 1}, {4, 2})));  // repeated rows sum
}

TEST(IndexGrad, Gather) {
  check({leaf({3, 5}, 11)}, [](const TensorList& x) { return x[0].gather(1, rand_index(5, {3, 7}, 12)); });
  check({leaf({3, 5}, 13)}, [](const TensorList& x) { return gather(x[0], 0, rand_index(3, {6, 5}, 14)); });
  check({noncontig_leaf({4, 3}, 15)}, [](const TensorList& x) { return x[0].gather(0, rand_index(4, {2, 3}, 16).t()); });
  check({leaf({2, 3, 4}, 17)}, [](const TensorList& x) { return x[0].gather(-1, rand_index(4, {2, 2, 6}, 18)); });
  check({leaf({}, 19)}, [](const TensorList& x) { return x[0].gather(0, idx({0, 0})); });
  Tensor x = leaf({2, 3}, 20);
  Tensor y = x.gather(1, idx({2, 2, 0, 1, 1, 1}, {2, 3}));
  EXPECT_STREQ(y.grad_fn()->name(), "GatherBackward0");
  y.backward(ones({2, 3}, kFloat64));
  EXPECT_TRUE(x.grad().equal(tensor<double>({1, 0, 2, 0, 3, 0}, {2, 3})));
}

TEST(IndexGrad, Scatter) {
  // Distinct positions per column (with duplicates, "last write wins" has no
  // useful derivative in src; torch's formula assumes distinct indices too).
  const Tensor i0 = idx({2, 0, 1, 1, 2, 0}, {2, 3});
  check({leaf({3, 3}, 21), leaf({2, 3}, 22)}, [&](const TensorList& x) { return x[0].scatter(0, i0, x[1]); });
  // src larger than index: the unused part of src gets a zero gradient
  // (torch 1.13 raises for this case).
  check({leaf({3, 5}, 23), leaf({3, 4}, 24)},
        [](const TensorList& x) { return scatter(x[0], -1, idx({4, 0, 2, 1, 3, 0}, {2, 3}), x[1]); });
  check({noncontig_leaf({4, 3}, 25), noncontig_leaf({2, 3}, 26)},
        [](const TensorList& x) { return x[0].scatter(0, idx({3, 0, 1, 2, 1, 3}, {3, 2}).t(), x[1]); });
  check({leaf({}, 27), leaf({}, 28)}, [](const TensorList& x) { return x[0].scatter(0, idx({0}), x[1]); });
  check({leaf({3, 4}, 29)}, [](const TensorList& x) { return x[0].scatter(1, idx({0, 3, 1}, {3, 1}), 2.5); });
  Tensor self = leaf({2, 3}, 30), src = leaf({1, 3}, 31);
  Tensor y = self.scatter(0, idx({1, 0, 1}, {1, 3}), src);
  EXPECT_STREQ(y.grad_fn()->name(), "ScatterBackward0");
  y.backward(ones({2, 3}, kFloat64));
  EXPECT_TRUE(self.grad().equal(tensor<double>({1, 0, 1, 0, 1, 0}, {2, 3})));  // overwritten positions: zero
  EXPECT_TRUE(src.grad().equal(ones({1, 3}, kFloat64)));
  EXPECT_STREQ(leaf({2}, 32).scatter(0, idx({0}), 1.0).grad_fn()->name(), "ScatterBackward1");
}

TEST(IndexGrad, ScatterAdd) {
  check({leaf({3, 4}, 41), leaf({6, 4}, 42)},
        [](const TensorList& x) { return x[0].scatter_add(0, rand_index(3, {6, 4}, 43), x[1]); });
  check({noncontig_leaf({3, 4}, 44), noncontig_leaf({3, 7}, 45)},
        [](const TensorList& x) { return scatter_add(x[0], -1, rand_index(4, {3, 7}, 46), x[1]); });
  check({leaf({3, 4}, 47), leaf({3, 5}, 48)},  // src larger than index
        [](const TensorList& x) { return x[0].scatter_add(1, rand_index(4, {2, 3}, 49), x[1]); });
  Tensor self = leaf({2, 2}, 50), src = leaf({3, 2}, 51);
  Tensor y = self.scatter_add(0, idx({1, 1, 1, 0, 0, 1}, {3, 2}), src);
  EXPECT_STREQ(y.grad_fn()->name(), "ScatterAddBackward0");
  y.backward(tensor<double>({1, 2, 3, 4}, {2, 2}));
  EXPECT_TRUE(self.grad().equal(tensor<double>({1, 2, 3, 4}, {2, 2})));
  EXPECT_TRUE(src.grad().equal(tensor<double>({3, 4, 3, 2, 1, 4}, {3, 2})));
}

TEST(IndexGrad, InPlaceScatterRewritesHistory) {
  const Tensor i0 = idx({2, 0, 1, 1, 2, 0}, {2, 3});
  check({leaf({3, 3}, 61), leaf({2, 3}, 62)}, [&](const TensorList& x) {
    Tensor s = x[0].clone();
    s.scatter_(0, i0, x[1]);
    return s;
  });
  check({leaf({3, 3}, 63), leaf({4, 3}, 64)}, [](const TensorList& x) {
    Tensor s = x[0].t().clone();
    s.scatter_add_(1, rand_index(3, {3, 4}, 65), x[1].t());
    return s;
  });
  check({leaf({3, 4}, 66)}, [](const TensorList& x) {
    Tensor s = x[0].clone();
    s.scatter_(1, idx({1, 1, 0}, {3, 1}), -1.0);
    return s;
  });
  Tensor x = leaf({2, 3}, 67), src = leaf({1, 3}, 68);
  Tensor s = x.clone();
  s.scatter_(0, idx({0, 1, 0}, {1, 3}), src);
  EXPECT_STREQ(s.grad_fn()->name(), "ScatterBackward0");
  EXPECT_STREQ(s.grad_fn()->next_edges()[0].function->name(), "CloneBackward0");
  // A leaf cannot be scattered into; a fresh buffer's view can (the buffer gets the history).
  EXPECT_TRUE(contains(error_of<ValueError>([&] { x.scatter_(0, idx({0}, {1, 1}), 1.0); }), "is a leaf"));
  Tensor buf = zeros({2, 3}, kFloat64);
  buf[0].scatter_add_(0, idx({0}), src[0].narrow(0, 0, 1));
  EXPECT_STREQ(buf.grad_fn()->name(), "CopySlices");
  // A plain buffer can: it becomes part of the graph.
  Tensor out = zeros({2, 3}, kFloat64);
  out.scatter_add_(0, idx({1, 1, 1}, {1, 3}), src);
  out.backward(ones({2, 3}, kFloat64));
  EXPECT_TRUE(src.grad().equal(ones({1, 3}, kFloat64)));
}

TEST(IndexGrad, MaskedFill) {
  const Tensor m34 = tensor<bool>({true, false, false, true}), m31 = tensor<bool>({false, true, true}, {3, 1});
  check({leaf({3, 4}, 71)}, [&](const TensorList& x) { return x[0].masked_fill(m34, 1.5); });
  check({leaf({4}, 72)}, [&](const TensorList& x) { return masked_fill(x[0], m31, -2); }, false);  // self broadcast up
  check({noncontig_leaf({3, 4}, 73)}, [&](const TensorList& x) { return x[0].masked_fill(m34.expand({3, 4}), 0); });
  // A 0-dim Tensor value gets the gradient summed over the filled positions.
  check({leaf({2, 3}, 74), leaf({}, 75)}, [](const TensorList& x) {
    return masked_fill(x[0], tensor<bool>({true, false, true, true, false, false}, {2, 3}), x[1]);
  }, false);
  check({leaf({3, 4}, 76)}, [&](const TensorList& x) {
    Tensor s = x[0].clone();
    s.masked_fill_(m34, 7.0);
    return s;
  });
  Tensor x = leaf({2, 3}, 77), v = leaf({}, 78);
  Tensor y = masked_fill(x, tensor<bool>({true, false, true}), v);
  EXPECT_STREQ(y.grad_fn()->name(), "MaskedFillBackward1");
  y.backward(tensor<double>({1, 2, 3, 4, 5, 6}, {2, 3}));
  EXPECT_TRUE(x.grad().equal(tensor<double>({0, 2, 0, 0, 5, 0}, {2, 3})));
  EXPECT_DOUBLE_EQ(v.grad().item<double>(), 1 + 3 + 4 + 6);
  EXPECT_STREQ(x.masked_fill(tensor<bool>({true, false, true}), 0).grad_fn()->name(), "MaskedFillBackward0");
}

TEST(IndexGrad, Where) {
  const Tensor c = tensor<bool>({true, false, true}, {3, 1});
  // Broadcast: a [4] and b [2, 1, 1] get gradients summed to their shapes.
  check({leaf({4}, 81), leaf({2, 1, 1}, 82)}, [&](const TensorList& x) { return where(c, x[0], x[1]); }, false);
  check({noncontig_leaf({3, 4}, 83), leaf({3, 4}, 84)},
        [&](const TensorList& x) { return where(c.expand({3, 4}), x[0], x[1]); });
  check({leaf({3, 4}, 85)}, [&](const TensorList& x) { return where(c.expand({3, 4}), x[0], 2.5); });
  check({leaf({3, 4}, 86)}, [&](const TensorList& x) { return where(c.expand({3, 4}), -1, x[0]); });
  // Only one operand requires grad; the other is float32 (promoted in forward).
  check({leaf({3, 2}, 87)}, [&](const TensorList& x) { return where(c, ones({3, 2}, kFloat32), x[0]); });
  Tensor a = leaf({3}, 88), b = tensor<float>({1.f, 2.f, 3.f}).requires_grad_();
  Tensor y = where(tensor<bool>({true, false, false}), a, b);
  EXPECT_STREQ(y.grad_fn()->name(), "WhereBackward0");
  y.backward(ones({3}, kFloat64));
  EXPECT_TRUE(a.grad().equal(tensor<double>({1, 0, 0})));
  EXPECT_EQ(b.grad().dtype(), kFloat32);  // cast back to b's dtype
  EXPECT_TRUE(b.grad().equal(tensor<float>({0.f, 1.f, 1.f})));
}

TEST(IndexGrad, CatStack) {
  check({noncontig_leaf({3, 2}, 91), leaf({3, 4}, 92), noncontig_leaf({3, 1}, 93)},
        [](const TensorList& x) { return cat({x[0], x[1], x[2]}, -1); });
  check({leaf({2, 3}, 94), leaf({0, 3}, 95), leaf({0}, 96), leaf({1, 3}, 97)},  // empty and legacy empty inputs
        [](const TensorList& x) { return cat({x[0], x[1], x[2], x[3]}); });
  check({leaf({2, 3}, 98), leaf({2, 3}, 99), leaf({2, 3}, 100)},
        [](const TensorList& x) { return stack({x[0], x[1], x[2]}, -1); });
  check({leaf({}, 101), leaf({}, 102)}, [](const TensorList& x) { return stack({x[0], x[1]}); });
  // Mixed dtypes: each input's gradient comes back in its own dtype.
  Tensor a = leaf({2}, 103), b = tensor<float>({1.f, 2.f, 3.f}).requires_grad_();
  Tensor y = cat({a, b});
  EXPECT_EQ(y.dtype(), kFloat64);
  EXPECT_STREQ(y.grad_fn()->name(), "CatBackward0");
  y.backward(tensor<double>({1, 2, 3, 4, 5}));
  EXPECT_TRUE(a.grad().equal(tensor<double>({1, 2})));
  EXPECT_EQ(b.grad().dtype(), kFloat32);
  EXPECT_TRUE(b.grad().equal(tensor<float>({3.f, 4.f, 5.f})));
  Tensor s = stack({a, a.narrow(0, 0, 2)}, 1);
  EXPECT_STREQ(s.grad_fn()->name(), "StackBackward0");
  // Integer inputs take no part.
  EXPECT_FALSE(cat({idx({1}), idx({2})}).requires_grad());
}

TEST(IndexGrad, Repeat) {
  // The backward sums over the tiles (a reduction): first order here.
  check({leaf({2, 3}, 111)}, [](const TensorList& x) { return x[0].repeat({2, 1, 2}); }, false);
  check({noncontig_leaf({3, 2}, 112)}, [](const TensorList& x) { return x[0].repeat({1, 3}); }, false);
  check({leaf({}, 113)}, [](const TensorList& x) { return x[0].repeat({3}); }, false);
  check({leaf({2, 3}, 114)}, [](const TensorList& x) { return x[0].repeat({0, 2}); }, false);
  check({leaf({2, 3}, 115)}, [](const TensorList& x) { return x[0].repeat({1, 1}); });
  Tensor x = leaf({2}, 116);
  Tensor y = x.repeat({2, 3});
  EXPECT_STREQ(y.grad_fn()->name(), "RepeatBackward0");
  y.backward(arange(12, kFloat64).view({2, 6}));
  // x[0] is read at columns 0, 2, 4 of both rows; x[1] at 1, 3, 5.
  EXPECT_TRUE(x.grad().equal(tensor<double>({0 + 2 + 4 + 6 + 8 + 10, 1 + 3 + 5 + 7 + 9 + 11})));
}

TEST(IndexGrad, Embedding) {
  check({leaf({6, 4}, 121)}, [](const TensorList& x) { return embedding(x[0], rand_index(6, {2, 3}, 122)); });
  check({noncontig_leaf({5, 3}, 123)},
        [](const TensorList& x) { return embedding(x[0], rand_index(5, {7}, 124).to(kInt32)); });
  check({leaf({5, 3}, 125)}, [](const TensorList& x) { return embedding(x[0], scalar_tensor(4, kInt64)); });
  EXPECT_FALSE(one_hot(idx({0, 2})).requires_grad());  // integer result: not differentiable
}

TEST(IndexGrad, EmbeddingRepeatedIndicesMatchTorch) {
  // torch 1.13 (/usr/bin/python3):
  //   w = (torch.arange(15, dtype=torch.float64) * 0.1 - 0.7).reshape(5, 3).to(dt).requires_grad_()
  //   idx = torch.tensor([[1, 3, 1], [0, 1, 3]])
  //   g = (torch.arange(18, dtype=torch.float64) * 0.37 - 2.9).reshape(2, 3, 3).to(dt)
  //   F.embedding(idx, w).backward(g); w.grad
  const std::vector<double> f64 = {0.43000000000000016, 0.8000000000000003, 1.1700000000000004, -2.0400000000000005,
                                   -0.9300000000000002, 0.17999999999999972, 0, 0, 0, 0.8599999999999999, 1.6,
                                   2.3400000000000003, 0, 0, 0};
  const std::vector<double> f32 = {0.4300000071525574, 0.800000011920929, 1.1699999570846558, -2.0400002002716064,
                                   -0.9299999475479126, 0.17999982833862305, 0, 0, 0, 0.8600001335144043,
                                   1.600000023841858, 2.3400001525878906, 0, 0, 0};
  // torch accumulates bfloat16 rounding after each add; kiln sums each row in
  // float and rounds once, so bfloat16 agrees to bfloat16 precision.
  const std::vector<double> bf16 = {0.4296875, 0.80078125, 1.171875, -2.0625, -0.9375, 0.1875, 0, 0, 0,
                                    0.8671875, 1.59375, 2.34375, 0, 0, 0};
  const Tensor indices = idx({1, 3, 1, 0, 1, 3}, {2, 3});
  struct Case {
    DType dt;
    const std::vector<double>* expected;
    double tol;
  };
  for (const Case& c : {Case{kFloat64, &f64, 1e-15}, Case{kFloat32, &f32, 1e-6}, Case{kBFloat16, &bf16, 2e-2}}) {
    Tensor w = (arange(15, kFloat64) * 0.1 - 0.7).view({5, 3}).to(c.dt).requires_grad_();
    Tensor g = (arange(18, kFloat64) * 0.37 - 2.9).view({2, 3, 3}).to(c.dt);
    Tensor out = embedding(w, indices);
    EXPECT_STREQ(out.grad_fn()->name(), "EmbeddingBackward0");
    out.backward(g);
    ASSERT_EQ(w.grad().dtype(), c.dt);
    const std::vector<double> got = test::to_doubles(w.grad());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], (*c.expected)[i], c.tol * (1 + std::abs((*c.expected)[i]))) << dtype_name(c.dt) << " " << i;
    }
  }
}

TEST(IndexGrad, DuplicateIndexAccumulationIsDeterministic) {
  // Large enough to run on several threads; many duplicates per target.
  Generator gen(131);
  const Tensor tokens = randint(0, 50, {40000}, kInt64, &gen);
  const Tensor grad_rows = randn({40000, 16}, kFloat32, &gen);
  auto embedding_grad = [&] {
    Tensor w = zeros({50, 16}, kFloat32).requires_grad_();
    embedding(w, tokens).backward(grad_rows);
    return w.grad();
  };
  const Tensor e1 = with_threads(1, embedding_grad), e2 = with_threads(2, embedding_grad);
  EXPECT_TRUE(test::bitwise_equal(e1, e2));
  // The same sums in float64 agree to float32 rounding.
  Tensor ref = zeros({50, 16}, kFloat64).requires_grad_();
  embedding(ref, tokens).backward(grad_rows.to(kFloat64));
  EXPECT_TRUE(e1.to(kFloat64).allclose(ref.grad(), 1e-4, 1e-4));

  const Tensor index = randint(0, 8, {8, 60000}, kInt64, &gen);
  const Tensor g = randn({8, 60000}, kFloat32, &gen);
  auto gather_grad = [&](int64_t dim, const Tensor& ix) {
    return [&, dim, ix] {
      Tensor x = zeros({8, 60000}, kFloat32).requires_grad_();
      x.gather(dim, ix).backward(g);
      return x.grad();
    };
  };
  EXPECT_TRUE(test::bitwise_equal(with_threads(1, gather_grad(0, index)), with_threads(2, gather_grad(0, index))));
  const Tensor index1 = randint(0, 60000, {8, 60000}, kInt64, &gen);
  EXPECT_TRUE(test::bitwise_equal(with_threads(1, gather_grad(1, index1)), with_threads(2, gather_grad(1, index1))));

  const Tensor g_select = randn({8, 30000}, kFloat32, &gen);
  auto select_grad = [&] {
    Tensor x = zeros({8, 50}, kFloat32).requires_grad_();
    x.index_select(1, tokens.narrow(0, 0, 30000)).backward(g_select);
    return x.grad();
  };
  EXPECT_TRUE(test::bitwise_equal(with_threads(1, select_grad), with_threads(2, select_grad)));
}
