// Tensor core: factories' shapes, dtypes and defaults as in PyTorch,
// from_blob ownership, item(), typed access, error messages of size() and
// wrap_dim, DimVector, and printing compared with torch 1.13's repr.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "nothing thrown";
}

std::vector<double> values(const Tensor& t) { return test::to_doubles(t); }

}  // namespace

TEST(Factories, DTypesAndShapesAsTorch) {
  EXPECT_EQ(zeros({2, 3}).dtype(), kFloat32);
  EXPECT_EQ(zeros({2, 3}).sizes(), IntArrayRef({2, 3}));
  EXPECT_EQ(ones({}).dim(), 0);
  EXPECT_EQ(ones({}).numel(), 1);
  EXPECT_EQ(empty({0, 5}).numel(), 0);
  EXPECT_EQ(full({2}, 3).dtype(), kInt64);        // torch.full((2,), 3)
  EXPECT_EQ(full({2}, 2.5).dtype(), kFloat32);    // torch.full((2,), 2.5)
  EXPECT_EQ(full({2}, true).dtype(), kBool);      // torch.full((2,), True)
  EXPECT_EQ(full({2}, 3, kFloat64).dtype(), kFloat64);
  EXPECT_EQ(scalar_tensor(4).dim(), 0);
  EXPECT_EQ(scalar_tensor(4).dtype(), kInt64);
  EXPECT_EQ(scalar_tensor(4.5).item<double>(), 4.5);
  EXPECT_EQ(arange(5).dtype(), kInt64);
  EXPECT_EQ(arange(0, 1, 0.25).dtype(), kFloat32);
  EXPECT_EQ(values(arange(0, 1, 0.25)), (std::vector<double>{0, 0.25, 0.5, 0.75}));
  EXPECT_EQ(values(arange(5, 0, -2)), (std::vector<double>{5, 3, 1}));
  EXPECT_EQ(values(arange(1.5, kInt64)), (std::vector<double>{0}));     // torch: start/end truncate first
  EXPECT_EQ(values(arange(1.5, kInt32)), (std::vector<double>{0, 1}));  // torch: size from the doubles
  EXPECT_EQ(linspace(0, 1, 5).dtype(), kFloat32);
  const auto ls = values(linspace(-1, 1, 7));
  EXPECT_EQ(ls.front(), -1.0);
  EXPECT_EQ(ls.back(), 1.0);
  EXPECT_EQ(values(linspace(3, 5, 1)), (std::vector<double>{3}));
  EXPECT_EQ(linspace(3, 5, 0).numel(), 0);
  EXPECT_EQ(values(linspace(-1, 1, 3, kUInt8)), (std::vector<double>{255, 128, 1}));  // torch wraps -1 first
  EXPECT_EQ(values(eye(3)), (std::vector<double>{1, 0, 0, 0, 1, 0, 0, 0, 1}));
  EXPECT_EQ(eye(2, 3).sizes(), IntArrayRef({2, 3}));
  EXPECT_EQ(values(eye(2, 3, kBool)), (std::vector<double>{1, 0, 0, 0, 1, 0}));
  EXPECT_EQ(eye(0).sizes(), IntArrayRef({0, 0}));
}

TEST(Factories, LikeFormsAndOptions) {
  const Tensor x = ones({2, 3}, kBFloat16).t();
  EXPECT_EQ(zeros_like(x).dtype(), kBFloat16);
  EXPECT_EQ(zeros_like(x).sizes(), IntArrayRef({3, 2}));
  EXPECT_TRUE(zeros_like(x).is_contiguous());
  EXPECT_EQ(ones_like(x, kInt32).dtype(), kInt32);
  EXPECT_EQ(values(full_like(x, 7)), std::vector<double>(6, 7.0));
  EXPECT_EQ(empty_like(x).dtype(), kBFloat16);
  EXPECT_TRUE(zeros({2}, TensorOptions().requires_grad(true)).requires_grad());
  EXPECT_NE(error_of<DTypeError>([] { zeros({2}, TensorOptions(kInt64).requires_grad(true)); })
                .find("only floating-point tensors can require gradients"),
            std::string::npos);
  const Tensor s = empty_strided({2, 3}, {1, 2});
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(s.strides(), IntArrayRef({1, 2}));
  {
    InferenceModeGuard g;
    EXPECT_TRUE(zeros({1}).impl()->is_inference());
  }
  EXPECT_FALSE(zeros({1}).impl()->is_inference());
}

TEST(Factories, HugeSizesAreRefusedNotWrapped) {
  const int64_t big = int64_t{1} << 40;
  EXPECT_NE(error_of<ValueError>([&] { empty({big, big}); }).find("more elements than int64 can count"),
            std::string::npos);
  EXPECT_NE(error_of<ValueError>([&] { zeros({big, big, 0}); }).find("more elements than int64"), std::string::npos)
      << "an empty tensor with huge other dims would still overflow its strides";
  EXPECT_NE(error_of<ValueError>([] { empty({int64_t{1} << 62}, kFloat64); }).find("needs more bytes"),
            std::string::npos);
  EXPECT_NE(error_of<OutOfMemory>([] { empty({int64_t{1} << 58}, kUInt8); }).find("out of memory"), std::string::npos);
  EXPECT_NE(error_of<ShapeError>([] { empty_strided({2, 2}, {2, -1}); }).find("negative strides"), std::string::npos);
  int64_t data[4] = {};
  EXPECT_THROW(from_blob(data, {2, 2}, {-1, 1}, kInt64), ShapeError);
  EXPECT_THROW(from_blob(nullptr, {2}, kInt64), ValueError);
  EXPECT_EQ(empty({big, 0}).numel(), 0);
}

TEST(Factories, FromValues) {
  EXPECT_EQ(tensor<int>({1, 2}).dtype(), kInt64);  // torch.tensor([1, 2])
  EXPECT_EQ(tensor<float>({1.0f}).dtype(), kFloat32);
  EXPECT_EQ(tensor<double>({1.0}).dtype(), kFloat64);
  EXPECT_EQ(tensor<bool>({true, false}).dtype(), kBool);
  EXPECT_EQ(tensor<float>({1, 2, 3, 4, 5, 6}, {2, 3}).sizes(), IntArrayRef({2, 3}));
  EXPECT_NE(error_of<ShapeError>([] { tensor<float>({1, 2, 3}, {2, 2}); }).find("holds 4 elements but 3 values"),
            std::string::npos);
}

TEST(Factories, SizeErrorsNameTheOp) {
  for (auto [op, f] : std::initializer_list<std::pair<const char*, std::function<void()>>>{
           {"zeros", [] { zeros({2, -1}); }},
           {"ones", [] { ones({-3}); }},
           {"empty", [] { empty({-1}); }},
           {"full", [] { full({-1}, 1.0); }}}) {
    const std::string msg = error_of<ShapeError>(f);
    EXPECT_NE(msg.find(std::string(op) + ": expected non-negative sizes"), std::string::npos) << msg;
  }
}

TEST(FromBlob, WithoutDeleterSharesMemory) {
  float data[6] = {1, 2, 3, 4, 5, 6};
  Tensor t = from_blob(data, {2, 3}, kFloat32);
  EXPECT_EQ(t.data_ptr<float>(), data);
  EXPECT_FALSE(t.storage()->owns_memory());
  data[4] = 50;
  EXPECT_EQ(t.data_ptr<float>()[4], 50.0f);
  t.fill_(0.5f);
  EXPECT_EQ(data[0], 0.5f);
  Tensor strided = from_blob(data, {3, 2}, {1, 3}, kFloat32);
  EXPECT_FALSE(strided.is_contiguous());
  EXPECT_EQ(values(strided.contiguous()), std::vector<double>(6, 0.5));
}

TEST(FromBlob, DeleterRunsOnceWhenTheLastViewDies) {
  int calls = 0;
  auto* buf = new int64_t[12]();
  void* seen = nullptr;
  {
    Tensor t = from_blob(buf, {3, 4}, kInt64, [&](void* p) {
      ++calls;
      seen = p;
      delete[] static_cast<int64_t*>(p);
    });
    Tensor v = t.view({12});
    Tensor w = t.t();
    t = Tensor();
    EXPECT_EQ(calls, 0);
    v = Tensor();
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(w.numel(), 12);
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, buf);
}

TEST(Access, ItemAndTypedPointers) {
  EXPECT_EQ(scalar_tensor(2.5).item<double>(), 2.5);
  EXPECT_EQ(full({1, 1}, 7).item<int64_t>(), 7);
  EXPECT_EQ(full({}, true).item<bool>(), true);
  EXPECT_EQ(full({}, 1.5, kBFloat16).item<float>(), 1.5f);
  EXPECT_EQ(full({}, -3, kInt32).item_scalar().kind(), Scalar::Kind::Integral);
  EXPECT_EQ(full({}, 1.0, kFloat16).item_scalar().kind(), Scalar::Kind::Floating);
  EXPECT_NE(error_of<ValueError>([] { zeros({2}).item(); }).find("expected a tensor with one element, got shape [2]"),
            std::string::npos);
  EXPECT_NE(error_of<ValueError>([] { Tensor().item(); }).find("undefined"), std::string::npos);
  const std::string msg = error_of<DTypeError>([] { zeros({2}).data_ptr<int64_t>(); });
  EXPECT_NE(msg.find("data_ptr<int64>"), std::string::npos) << msg;
  EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
  EXPECT_NE(zeros({2}, kBFloat16).data_ptr<BFloat16>(), nullptr);
}

TEST(Access, SizeAndWrapDimErrors) {
  const Tensor t = zeros({2, 3});
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.stride(0), 3);
  EXPECT_EQ(error_of<IndexError>([&] { t.size(2); }),
            "size: dimension out of range (expected to be in range of [-2, 1], but got 2)");
  EXPECT_EQ(error_of<IndexError>([&] { t.stride(-3); }),
            "stride: dimension out of range (expected to be in range of [-2, 1], but got -3)");
  EXPECT_NE(error_of<IndexError>([] { scalar_tensor(1).size(0); }).find("a 0-dim tensor has no dimensions"),
            std::string::npos);
  EXPECT_EQ(wrap_dim(-1, 0, "op"), 0);  // a 0-dim tensor accepts 0 and -1, as PyTorch
  EXPECT_EQ(wrap_dim(0, 0, "op"), 0);
  EXPECT_EQ(wrap_dim(-2, 4, "op"), 2);
  EXPECT_EQ(error_of<IndexError>([] { wrap_dim(1, 0, "sum"); }),
            "sum: dimension out of range (expected to be in range of [-1, 0], but got 1)");
  const std::string b = error_of<ShapeError>([] { broadcast_shapes({2, 3}, {4, 3}, "add"); });
  EXPECT_NE(b.find("add: shapes [2, 3] and [4, 3] cannot be broadcast"), std::string::npos) << b;
  EXPECT_EQ(broadcast_shapes({3, 1}, {4}, "x").vec(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(contiguous_strides({2, 0, 3}).vec(), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(shape_numel({}), 1);
}

TEST(Access, ConversionsAndCopies) {
  const Tensor a = arange(6, kFloat32).view({2, 3});
  EXPECT_TRUE(a.to(kFloat32).is_same(a));
  EXPECT_FALSE(a.to(kFloat32, true).is_same(a));
  EXPECT_FALSE(a.clone().is_alias_of(a));
  EXPECT_TRUE(a.contiguous().is_same(a));
  EXPECT_TRUE(a.t().contiguous().is_contiguous());
  Tensor c = a.clone();
  c.fill_(9);
  EXPECT_EQ(values(a)[0], 0.0);
  const uint32_t v = c.version();
  c.zero_();
  EXPECT_EQ(c.version(), v + 1);
}

TEST(DimVectorTest, InlineAndHeap) {
  DimVector d;
  for (int64_t i = 0; i < 10; ++i) d.push_back(i);  // spills past the inline capacity
  EXPECT_EQ(d.size(), 10u);
  EXPECT_EQ(d[9], 9);
  d.insert(0, -1);
  EXPECT_EQ(d[0], -1);
  EXPECT_EQ(d[10], 9);
  d.erase(0);
  EXPECT_EQ(d[0], 0);
  DimVector copy = d;
  DimVector moved = std::move(d);
  EXPECT_EQ(copy.vec(), moved.vec());
  DimVector small{1, 2};
  DimVector small_moved = std::move(small);
  EXPECT_EQ(small_moved.vec(), (std::vector<int64_t>{1, 2}));
  small_moved = copy;
  EXPECT_EQ(small_moved.size(), 10u);
}

// Expected strings are torch 1.13's repr() of the same tensors.
TEST(Printing, MatchesTorchRepr) {
  const double nan = std::nan(""), inf = INFINITY;
  struct Case {
    Tensor t;
    const char* want;
  };
  const Case cases[] = {
      {tensor<float>({1.0f, 2.5f}), "tensor([1.0000, 2.5000])"},
      {tensor<float>({1, 2, -3}), "tensor([ 1.,  2., -3.])"},
      {tensor<int64_t>({1, -20, 300, 4}, {2, 2}), "tensor([[  1, -20],\n        [300,   4]])"},
      {tensor<bool>({true, false, true}), "tensor([ True, False,  True])"},
      {tensor<float>({1e-5f, 1.0f, 1000.0f}), "tensor([1.0000e-05, 1.0000e+00, 1.0000e+03])"},
      {tensor<float>({1e9f, 2.5f}), "tensor([1.0000e+09, 2.5000e+00])"},
      {tensor<float>({1e9f, 2.0f}), "tensor([1.0000e+09, 2.0000e+00])"},
      {tensor<int64_t>({1, 2}).to(kInt32), "tensor([1, 2], dtype=torch.int32)"},
      {tensor<int64_t>({0, 255}, {1, 2}).to(kUInt8), "tensor([[  0, 255]], dtype=torch.uint8)"},
      {tensor<double>({0.5, -1.25}), "tensor([ 0.5000, -1.2500], dtype=torch.float64)"},
      {tensor<float>({0.1f, 1.5f}).to(kBFloat16), "tensor([0.1001, 1.5000], dtype=torch.bfloat16)"},
      {tensor<float>({0.1f, 1.5f, 2, 3}, {2, 2}).to(kFloat16),
       "tensor([[0.1000, 1.5000],\n        [2.0000, 3.0000]], dtype=torch.float16)"},
      {tensor<double>({nan, 1.5, inf, -inf}).to(kFloat32), "tensor([   nan, 1.5000,    inf,   -inf])"},
      {tensor<double>({nan, 1.0, inf}).to(kFloat32), "tensor([nan, 1., inf])"},
      {scalar_tensor(3.5), "tensor(3.5000)"},
      {scalar_tensor(7), "tensor(7)"},
      {zeros({0}), "tensor([])"},
      {zeros({2, 0}), "tensor([], size=(2, 0))"},
      {zeros({0, 3}, kInt32), "tensor([], size=(0, 3), dtype=torch.int32)"},
      {zeros({0}, kInt64), "tensor([], dtype=torch.int64)"},
      {tensor<float>({-1.5f, 2.25f}), "tensor([-1.5000,  2.2500])"},
      {tensor<float>({0.001f, 0.002f}), "tensor([0.0010, 0.0020])"},
      {tensor<float>({0.0001f, 0.5f}), "tensor([1.0000e-04, 5.0000e-01])"},
      {zeros({2, 2}), "tensor([[0., 0.],\n        [0., 0.]])"},
      {arange(8, kFloat32).view({2, 2, 2}), "tensor([[[0., 1.],\n         [2., 3.]],\n\n        [[4., 5.],\n         [6., 7.]]])"},
      {arange(2000, kFloat32).view({2, 1000}),
       "tensor([[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 9.9700e+02, 9.9800e+02,\n         9.9900e+02],\n"
       "        [1.0000e+03, 1.0010e+03, 1.0020e+03,  ..., 1.9970e+03, 1.9980e+03,\n         1.9990e+03]])"},
      {arange(1001), "tensor([   0,    1,    2,  ...,  998,  999, 1000])"},
      {tensor<float>({-0.0f, 1.0f}), "tensor([-0., 1.])"},
      {tensor<float>({1e20f, -1e-20f}), "tensor([ 1.0000e+20, -1.0000e-20])"},
      {ones({3}, TensorOptions().requires_grad(true)), "tensor([1., 1., 1.], requires_grad=True)"},
      {arange(6, kInt64).view({2, 3}).t(), "tensor([[0, 3],\n        [1, 4],\n        [2, 5]])"},
      {tensor<int64_t>({std::numeric_limits<int64_t>::min(), 1}),
       "tensor([-9223372036854775808,                    1])"},
  };
  for (const auto& c : cases) EXPECT_EQ(c.t.to_string(), c.want);
  EXPECT_EQ(Tensor().to_string(), "tensor(undefined)");
}

TEST(Printing, LongLinesWrapLikeTorch) {
  // torch.arange(30.) / 7 and torch.arange(40): 80-column lines.
  EXPECT_EQ(linspace(0, 29, 30, kFloat64).to_string(),
            "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n"
            "        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n"
            "        28., 29.], dtype=torch.float64)");
  EXPECT_EQ(arange(40).to_string(),
            "tensor([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16, 17,\n"
            "        18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,\n"
            "        36, 37, 38, 39])");
}

TEST(Printing, SummarisedThreeDims) {
  const std::string s = arange(1200).view({10, 10, 12}).to_string();
  const std::string head =
      "tensor([[[   0,    1,    2,  ...,    9,   10,   11],\n"
      "         [  12,   13,   14,  ...,   21,   22,   23],\n"
      "         [  24,   25,   26,  ...,   33,   34,   35],\n"
      "         ...,\n"
      "         [  84,   85,   86,  ...,   93,   94,   95],\n";
  EXPECT_EQ(s.substr(0, head.size()), head);
  EXPECT_NE(s.find("]],\n\n        ...,\n\n        [[ 840,  841,  842,  ...,  849,  850,  851],"), std::string::npos)
      << s;
  const std::string tail = "\n         [1188, 1189, 1190,  ..., 1197, 1198, 1199]]])";
  ASSERT_GT(s.size(), tail.size());
  EXPECT_EQ(s.substr(s.size() - tail.size()), tail);
}

// Issue 27: sizes() of a temporary is an owning copy, so a variable made from
// it does not point into a freed TensorImpl (it did, under ASan).
TEST(TensorCore, SizesOfATemporaryOwnTheirValues) {
  static_assert(std::is_same_v<decltype(kiln::ones({2, 3}).sizes()), kiln::DimVector>);
  static_assert(std::is_same_v<decltype(kiln::ones({2, 3}).strides()), kiln::DimVector>);
  kiln::Tensor named = kiln::ones({4});
  static_assert(std::is_same_v<decltype(named.sizes()), kiln::IntArrayRef>, "a named tensor's sizes stay a view");
  auto s = kiln::ones({2, 3}).sizes();
  auto st = kiln::ones({2, 3}).t().strides();
  for (int i = 0; i < 8; ++i) (void)kiln::zeros({7, 7, 7, 7});  // reuse whatever the temporaries freed
  EXPECT_EQ(s.vec(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(st.vec(), (std::vector<int64_t>{1, 3}));
}
