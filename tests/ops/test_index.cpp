// Direct tests of the index family: index_select, gather, scatter(_add),
// masked_fill, where, cat, stack, repeat, embedding, one_hot. Expected values
// were computed with PyTorch 1.13 (/usr/bin/python3) on the same inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kiln/kiln.h"
#include "kiln/ops/index.h"

using namespace kiln;

namespace {

void expect_tensor(const Tensor& t, std::vector<int64_t> shape, DType dt, const std::vector<double>& vals) {
  ASSERT_EQ(t.sizes(), IntArrayRef(shape)) << "shape " << t.sizes();
  ASSERT_EQ(t.dtype(), dt) << dtype_name(t.dtype());
  ASSERT_EQ(t.numel(), static_cast<int64_t>(vals.size()));
  Tensor c = t.to(kFloat64, /*copy=*/true);
  const double* p = c.data_ptr<double>();
  for (size_t i = 0; i < vals.size(); ++i) EXPECT_EQ(p[i], vals[i]) << "element " << i;
}

template <typename E, typename F>
void expect_error(F&& f, const std::string& substr) {
  try {
    f();
    ADD_FAILURE() << "expected an exception containing '" << substr << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << e.what();
  }
}

Tensor x34() { return arange(12, kFloat32).view({3, 4}); }

// tensor<int>(...) gives int64, as torch.tensor does; these are int32 on purpose.
Tensor i32(std::vector<int64_t> v, std::vector<int64_t> shape = {}) { return tensor<int64_t>(v, shape).to(kInt32); }

}  // namespace

// ---- index_select ----

TEST(IndexSelect, Values) {
  Tensor x = x34();
  expect_tensor(x.index_select(0, tensor<int64_t>({2, 0, 2})), {3, 4}, kFloat32,
                {8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11});
  expect_tensor(x.index_select(1, i32({3, 1})), {3, 2}, kFloat32, {3, 1, 7, 5, 11, 9});
  expect_tensor(x.index_select(-1, scalar_tensor(2, kInt64)), {3, 1}, kFloat32, {2, 6, 10});
  Tensor y = arange(24, kFloat32).view({2, 3, 4});
  expect_tensor(index_select(y, 1, tensor<int64_t>({1, 1, 0, 2})), {2, 4, 4}, kFloat32,
                {4, 5, 6, 7, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 16, 17, 18, 19, 12, 13, 14, 15,
                 20, 21, 22, 23});
}

TEST(IndexSelect, NonContiguous) {
  Tensor x = x34();
  expect_tensor(x.t().index_select(1, tensor<int64_t>({2, 0})), {4, 2}, kFloat32, {8, 0, 9, 1, 10, 2, 11, 3});
  expect_tensor(x.t().index_select(0, tensor<int64_t>({3, 3, 0})), {3, 3}, kFloat32, {3, 7, 11, 3, 7, 11, 0, 4, 8});
  Tensor y = arange(24, kFloat32).view({2, 3, 4}).slice(2, 0, std::nullopt, 2);
  expect_tensor(y.index_select(2, tensor<int64_t>({1, 0})), {2, 3, 2}, kFloat32,
                {2, 0, 6, 4, 10, 8, 14, 12, 18, 16, 22, 20});
  // A strided index.
  Tensor idx = tensor<int64_t>({2, 9, 0, 9}).slice(0, 0, std::nullopt, 2);
  expect_tensor(x.index_select(0, idx), {2, 4}, kFloat32, {8, 9, 10, 11, 0, 1, 2, 3});
}

TEST(IndexSelect, ZeroDimAndEmpty) {
  // torch: a 0-dim self stays 0-dim; every index must be 0.
  expect_tensor(scalar_tensor(5.0, kFloat32).index_select(0, tensor<int64_t>({0, 0})), {}, kFloat32, {5});
  expect_error<IndexError>([] { scalar_tensor(5.0).index_select(0, tensor<int64_t>({1})); }, "index 1");
  expect_tensor(x34().index_select(1, empty({0}, kInt64)), {3, 0}, kFloat32, {});
  expect_tensor(empty({0, 4}).index_select(1, tensor<int64_t>({3})), {0, 1}, kFloat32, {});
}

TEST(IndexSelect, Errors) {
  Tensor x = x34();
  expect_error<IndexError>([&] { x.index_select(1, tensor<int64_t>({0, 4})); },
                           "index 4 is out of bounds for dimension 1 with size 4");
  expect_error<IndexError>([&] { x.index_select(0, i32({-1})); },
                           "index -1 is out of bounds for dimension 0 with size 3");
  expect_error<DTypeError>([&] { x.index_select(0, tensor<float>({0.f})); }, "Expected dtype int32 or int64");
  expect_error<IndexError>([&] { x.index_select(0, tensor<int64_t>({0}, {1, 1})); }, "supposed to be a vector");
  expect_error<IndexError>([&] { x.index_select(2, tensor<int64_t>({0})); }, "index_select");
}

TEST(IndexSelect, LargeParallelMatchesNaive) {
  const int64_t rows = 4096, cols = 37, k = 3000;
  Tensor x = arange(rows * cols, kFloat32).view({rows, cols});
  Generator g(7);
  Tensor idx = randint(0, rows, {k}, kInt64, &g);
  for (const Tensor& src : {x, x.t().contiguous().t()}) {  // contiguous and column-major
    Tensor out = src.index_select(0, idx);
    const int64_t* ip = idx.data_ptr<int64_t>();
    Tensor oc = out.contiguous();
    const float* o = oc.data_ptr<float>();
    bool ok = true;
    for (int64_t i = 0; i < k && ok; ++i) {
      for (int64_t j = 0; j < cols; ++j) ok = ok && o[i * cols + j] == static_cast<float>(ip[i] * cols + j);
    }
    EXPECT_TRUE(ok);
  }
}

// ---- gather ----

TEST(Gather, Values) {
  Tensor x = x34();
  expect_tensor(x.gather(0, tensor<int64_t>({0, 2, 1, 0, 2, 2, 0, 1}, {2, 4})), {2, 4}, kFloat32,
                {0, 9, 6, 3, 8, 9, 2, 7});
  expect_tensor(gather(x, 1, tensor<int64_t>({3, 0, 1, 1, 0, 2}, {3, 2})), {3, 2}, kFloat32, {3, 0, 5, 5, 8, 10});
  Tensor y = arange(24, kFloat32).view({2, 3, 4});
  expect_tensor(y.gather(2, tensor<int64_t>({3, 0, 1, 1, 0, 2, 3, 3}, {2, 2, 2})), {2, 2, 2}, kFloat32,
                {3, 0, 5, 5, 12, 14, 19, 19});
  // Index larger than self along dim is fine.
  expect_tensor(x.gather(1, tensor<int64_t>({0, 0, 3, 3, 1}, {1, 5})), {1, 5}, kFloat32, {0, 0, 3, 3, 1});
}

TEST(Gather, NonContiguous) {
  Tensor x = x34();
  expect_tensor(x.t().gather(1, tensor<int64_t>({0, 2, 1, 1, 2, 0, 0, 0}, {4, 2})), {4, 2}, kFloat32,
                {0, 8, 5, 5, 10, 2, 3, 3});
  Tensor idx = tensor<int64_t>({3, 0, 1, 1, 1, 2}, {2, 3}).t();
  expect_tensor(x.gather(1, idx), {3, 2}, kFloat32, {3, 1, 4, 5, 9, 10});
}

TEST(Gather, ZeroDimAndEmpty) {
  expect_tensor(scalar_tensor(5.0, kFloat32).gather(0, tensor<int64_t>({0, 0})), {2}, kFloat32, {5, 5});
  expect_tensor(tensor<float>({5.f, 6.f}).gather(0, scalar_tensor(1, kInt64)), {}, kFloat32, {6});
  // torch skips every index check for an empty index.
  expect_tensor(x34().gather(0, empty({0, 5, 7}, kInt32)), {0, 5, 7}, kFloat32, {});
  expect_tensor(x34().scatter(0, empty({0, 5}, kInt64), ones({0})), {3, 4}, kFloat32,
                {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  expect_error<IndexError>([] { x34().gather(5, empty({0, 5}, kInt64)); }, "gather");
}

TEST(Gather, Errors) {
  Tensor x = x34();
  expect_error<DTypeError>([&] { x.gather(0, i32({0}, {1, 1})); },
                           "gather(): Expected dtype int64 for index");
  expect_error<IndexError>([&] { x.gather(0, tensor<int64_t>({0, 1, 3}, {1, 3})); },
                           "index 3 is out of bounds for dimension 0 with size 3");
  expect_error<IndexError>([&] { x.gather(1, tensor<int64_t>({-1}, {1, 1})); },
                           "index -1 is out of bounds for dimension 1 with size 4");
  expect_error<ShapeError>([&] { x.gather(0, tensor<int64_t>({0, 1})); }, "same number of dimensions");
  expect_error<ShapeError>([&] { x.gather(0, zeros({1, 5}, kInt64)); }, "[1, 5] to be no larger than self [3, 4]");
  expect_error<IndexError>([&] { x.gather(2, zeros({1, 1}, kInt64)); }, "gather");
}

TEST(Gather, LargeReportsTheFirstBadIndexInRowMajorOrder) {
  // The bounds check runs inside the (parallel) copy; the message must still
  // name the first bad value in index order, whatever thread saw which.
  Tensor x = zeros({400, 300});
  Tensor idx = zeros({400, 300}, kInt64);
  idx.view({-1}).narrow(0, 100000, 1).fill_(999);
  idx.view({-1}).narrow(0, 100, 1).fill_(-7);
  expect_error<IndexError>([&] { x.gather(1, idx); }, "index -7 is out of bounds for dimension 1 with size 300");
  expect_error<IndexError>([&] { zeros({4, 0}).gather(1, zeros({4, 2}, kInt64)); },
                           "index 0 is out of bounds for dimension 1 with size 0");
}

TEST(Gather, LargeParallelMatchesNaive) {
  const int64_t r = 600, c = 200;
  Tensor x = arange(r * c, kFloat64).view({r, c});
  Generator g(3);
  Tensor idx = randint(0, c, {r, c}, kInt64, &g);
  Tensor out = x.gather(1, idx);
  const double* o = out.data_ptr<double>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  bool ok = true;
  for (int64_t i = 0; i < r * c && ok; ++i) ok = o[i] == static_cast<double>((i / c) * c + ip[i]);
  EXPECT_TRUE(ok);
}

// ---- scatter / scatter_add ----

TEST(Scatter, Values) {
  Tensor s = zeros({3, 4});
  expect_tensor(s.scatter(0, tensor<int64_t>({0, 1, 2, 0, 2, 0, 1, 1}, {2, 4}), arange(1, 9, 1, kFloat32).view({2, 4})),
                {3, 4}, kFloat32, {1, 6, 0, 4, 0, 2, 7, 8, 5, 0, 3, 0});
  expect_tensor(scatter(x34(), 1, tensor<int64_t>({0, 3, 1}, {3, 1}), -1.5), {3, 4}, kFloat32,
                {-1.5, 1, 2, 3, 4, 5, 6, -1.5, 8, -1.5, 10, 11});
  // Out-of-place leaves self alone.
  const uint32_t v0 = s.version();
  s.scatter(0, zeros({1, 1}, kInt64), 1.0);
  EXPECT_EQ(s.version(), v0);
  expect_tensor(s, {3, 4}, kFloat32, std::vector<double>(12, 0.0));
  // Scalar on an int tensor truncates, as torch.
  expect_tensor(zeros({3}, kInt64).scatter(0, tensor<int64_t>({1}), 2.5), {3}, kInt64, {0, 2, 0});
  // src larger than index: only index's extent is used.
  expect_tensor(x34().scatter(1, zeros({1, 3}, kInt64), arange(4, kFloat32).view({1, 4})), {3, 4}, kFloat32,
                {2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
}

TEST(Scatter, DuplicatesLastWriteWins) {
  Tensor s = zeros({3, 4});
  Tensor src = tensor<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  expect_tensor(s.scatter(1, tensor<int64_t>({0, 0, 0, 1, 2, 1}, {2, 3}), src), {3, 4}, kFloat32,
                {3, 0, 0, 0, 0, 6, 5, 0, 0, 0, 0, 0});
  expect_tensor(scalar_tensor(5.0, kFloat32).scatter(0, tensor<int64_t>({0, 0}), tensor<float>({7, 8})), {}, kFloat32,
                {8});
}

TEST(Scatter, NonContiguous) {
  Tensor src = tensor<float>({10, 20, 30, 40, 50, 60}, {2, 3});
  Tensor out = x34().t().scatter(0, tensor<int64_t>({0, 1, 3, 2}, {2, 2}), src.t());
  expect_tensor(out, {4, 3}, kFloat32, {10, 4, 8, 1, 40, 9, 2, 50, 10, 20, 7, 11});
  // In place into a transposed view: writes reach the base.
  Tensor base = x34();
  Tensor view = base.t();
  view.scatter_(0, tensor<int64_t>({0, 1, 2, 3, 2, 1}, {2, 3}), src);
  expect_tensor(view, {4, 3}, kFloat32, {10, 4, 8, 1, 20, 60, 2, 50, 30, 40, 7, 11});
  expect_tensor(base, {3, 4}, kFloat32, {10, 1, 2, 40, 4, 20, 50, 7, 8, 60, 30, 11});
}

TEST(Scatter, InPlaceBumpsVersionAndErrorsLeaveSelfUnchanged) {
  Tensor s = zeros({2, 3});
  const uint32_t v0 = s.version();
  s.scatter_(1, tensor<int64_t>({2, 0}, {2, 1}), 4.0);
  EXPECT_EQ(s.version(), v0 + 1);
  s.scatter_add_(1, tensor<int64_t>({2, 2}, {1, 2}), ones({1, 2}));
  EXPECT_EQ(s.version(), v0 + 2);
  s.scatter_(0, tensor<int64_t>({1}, {1, 1}), full({1, 1}, 9.0, kFloat32));
  EXPECT_EQ(s.version(), v0 + 3);
  expect_tensor(s, {2, 3}, kFloat32, {0, 0, 6, 9, 0, 0});
  // A bad index anywhere: nothing is written, the version is unchanged.
  expect_error<IndexError>([&] { s.scatter_(1, tensor<int64_t>({0, 1, 5}, {1, 3}), -1.0); },
                           "index 5 is out of bounds for dimension 1 with size 3");
  EXPECT_EQ(s.version(), v0 + 3);
  expect_tensor(s, {2, 3}, kFloat32, {0, 0, 6, 9, 0, 0});
}

TEST(Scatter, Errors) {
  Tensor x = x34();
  expect_error<DTypeError>([&] { x.scatter(0, i32({0}, {1, 1}), ones({1, 1})); },
                           "scatter: Expected dtype int64 for index");
  expect_error<DTypeError>([&] { x.scatter_add(0, i32({0}, {1, 1}), ones({1, 1})); },
                           "scatter_add: Expected dtype int64 for index");
  expect_error<DTypeError>([&] { x.scatter(0, zeros({1, 1}, kInt64), ones({1, 1}, kFloat64)); },
                           "Expected self.dtype to be equal to src.dtype");
  expect_error<ShapeError>([&] { x.scatter(0, zeros({1, 3}, kInt64), ones({1, 2})); },
                           "expected index [1, 3] to be no larger than self [3, 4] apart from dimension 0 and no "
                           "larger than src [1, 2]");
  expect_error<ShapeError>([&] { x.scatter(0, zeros({1, 5}, kInt64), 1.0); }, "no larger than self [3, 4]");
  expect_error<ShapeError>([&] { x.scatter(0, zeros({3}, kInt64), ones({3})); }, "same number of dimensions");
  expect_error<ShapeError>([&] { x.scatter(0, zeros({1, 1}, kInt64), scalar_tensor(1.0, kFloat32)); },
                           "same number of dimensions as src");
  Tensor expanded = zeros({3}).expand({2, 3});
  expect_error<ValueError>([&] { expanded.scatter_(0, zeros({1, 3}, kInt64), 1.0); }, "single memory location");
  // Out of place on an expanded tensor is fine (it copies first).
  expect_tensor(expanded.scatter(0, tensor<int64_t>({0, 1, 1}, {1, 3}), 1.0), {2, 3}, kFloat32, {1, 0, 0, 0, 1, 1});
}

TEST(ScatterAdd, DuplicatesSumInIndexOrder) {
  Tensor idx = tensor<int64_t>({0, 0, 2, 2, 0, 1, 2, 2, 0, 1, 2, 1}, {3, 4});
  expect_tensor(ones({3, 4}).scatter_add(0, idx, arange(1, 13, 1, kFloat32).view({3, 4})), {3, 4}, kFloat32,
                {16, 3, 1, 1, 1, 17, 1, 13, 1, 1, 22, 13});
  // bfloat16 rounds after every addition, in index order, as torch:
  // 1 + 256 -> 256 (257 is not representable), + 1 -> 256.
  Tensor src = tensor<float>({1.0f, 0.01f, 256.0f, 1.0f, 3.0f}).to(kBFloat16);
  expect_tensor(zeros({2}, kBFloat16).scatter_add(0, tensor<int64_t>({0, 1, 0, 0, 1}), src), {2}, kBFloat16,
                {256, 3.015625});
  // bool: logical or.
  expect_tensor(zeros({3}, kBool).scatter_add(0, tensor<int64_t>({0, 1, 1}), ones({3}, kBool)), {3}, kBool,
                {1, 1, 0});
}

TEST(ScatterAdd, DeterministicAcrossThreadCounts) {
  // Many duplicates along dim 0, long rows: the parallel split runs over
  // dim 1 and every thread count must give the serial index-order sum.
  const int64_t n = 3000, m = 64, targets = 5;
  Generator g(11);
  Tensor idx = randint(0, targets, {n, m}, kInt64, &g);
  Tensor src = randn({n, m}, kFloat32, &g);
  const int saved = get_num_threads();
  set_num_threads(1);
  Tensor serial = zeros({targets, m}).scatter_add(0, idx, src);
  set_num_threads(std::max(saved, 4));
  Tensor parallel = zeros({targets, m}).scatter_add(0, idx, src);
  set_num_threads(saved);
  // The naive loop in index order.
  std::vector<float> ref(targets * m, 0.0f);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* sp = src.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) ref[ip[i * m + j] * m + j] += sp[i * m + j];
  }
  const float* a = serial.data_ptr<float>();
  const float* b = parallel.data_ptr<float>();
  for (int64_t i = 0; i < targets * m; ++i) {
    ASSERT_EQ(a[i], ref[i]) << i;
    ASSERT_EQ(b[i], ref[i]) << i;
  }
}

// ---- masked_fill ----

TEST(MaskedFill, Values) {
  Tensor mask = tensor<bool>({true, false, false, true});
  expect_tensor(x34().masked_fill(mask, 7.0), {3, 4}, kFloat32, {7, 1, 2, 7, 7, 5, 6, 7, 7, 9, 10, 7});
  // Broadcasting self up to the mask's shape.
  expect_tensor(arange(4, kFloat32).masked_fill(tensor<bool>({true, false, true}, {3, 1}), -2.0), {3, 4}, kFloat32,
                {-2, -2, -2, -2, 0, 1, 2, 3, -2, -2, -2, -2});
  expect_tensor(masked_fill(x34().to(kInt64), mask, 9.7), {3, 4}, kInt64, {9, 1, 2, 9, 9, 5, 6, 9, 9, 9, 10, 9});
  expect_tensor(masked_fill(x34(), mask, scalar_tensor(9.5, kFloat64)), {3, 4}, kFloat32,
                {9.5, 1, 2, 9.5, 9.5, 5, 6, 9.5, 9.5, 9, 10, 9.5});
  expect_tensor(scalar_tensor(3.0, kFloat32).masked_fill(tensor<bool>({true, false}), 1.0), {2}, kFloat32, {1, 3});
  expect_tensor(zeros({0, 4}).masked_fill(mask, 1.0), {0, 4}, kFloat32, {});
}

TEST(MaskedFill, InPlace) {
  Tensor base = x34();
  Tensor view = base.t();  // [4, 3]
  const uint32_t v0 = base.version();
  view.masked_fill_(tensor<bool>({true, false, false}), -1.0);
  EXPECT_EQ(base.version(), v0 + 1);
  expect_tensor(base, {3, 4}, kFloat32, {-1, -1, -1, -1, 4, 5, 6, 7, 8, 9, 10, 11});
  expect_error<ShapeError>([&] { base.masked_fill_(tensor<bool>({true}, {1, 1, 1}), 0.0); },
                           "does not broadcast to self's shape [3, 4]");
  EXPECT_EQ(base.version(), v0 + 1);
}

TEST(MaskedFill, Errors) {
  expect_error<DTypeError>([] { x34().masked_fill(tensor<int64_t>({1, 0, 1, 0}), 1.0); }, "expected a bool mask");
  expect_error<DTypeError>([] { x34().masked_fill(tensor<uint8_t>({1, 0, 1, 0}), 1.0); }, "expected a bool mask");
  expect_error<ShapeError>([] { x34().masked_fill(tensor<bool>({true, false}), 1.0); }, "masked_fill");
  expect_error<ShapeError>([] { masked_fill(x34(), tensor<bool>({true}), tensor<float>({1.f})); },
                           "0-dimensional value tensor");
  // Values must fit self's dtype, as torch's checked conversion (negatives wrap into uint8).
  Tensor m = tensor<bool>({true, false});
  expect_error<ValueError>([&] { zeros({2}, kUInt8).masked_fill(m, 300); }, "masked_fill: value 300");
  expect_error<ValueError>([&] { zeros({2}, kInt64).masked_fill(m, INFINITY); }, "int64");
  expect_error<ValueError>([&] { masked_fill(zeros({2}, kInt64), m, scalar_tensor(NAN, kFloat32)); }, "int64");
  Tensor u = zeros({2}, kUInt8);
  const uint32_t v0 = u.version();
  expect_error<ValueError>([&] { u.masked_fill_(m, 256); }, "masked_fill_: value 256");
  EXPECT_EQ(u.version(), v0);
  expect_tensor(u.masked_fill(m, -1), {2}, kUInt8, {255, 0});
  expect_error<ValueError>([&] { zeros({2}, kUInt8).scatter(0, tensor<int64_t>({0}), 300); }, "scatter: value 300");
  expect_error<ValueError>([&] { where(m, zeros({2}, kFloat16), 1e10); }, "where: value");
  expect_error<ValueError>([&] { where(m, zeros({2}, kInt32), int64_t{1} << 40); }, "dtype int32");
}

// ---- where ----

TEST(Where, BroadcastAllThree) {
  Tensor c = tensor<bool>({true, false, true}, {3, 1});
  expect_tensor(where(c, arange(4, kFloat32), scalar_tensor(-1.0, kFloat32)), {3, 4}, kFloat32,
                {0, 1, 2, 3, -1, -1, -1, -1, 0, 1, 2, 3});
  expect_tensor(where(tensor<bool>({true, false, true}), x34().view({3, 1, 4}).slice(2, 0, 3), ones({1, 2, 1})),
                {3, 2, 3}, kFloat32, {0, 1, 2, 0, 1, 2, 4, 1, 6, 4, 1, 6, 8, 1, 10, 8, 1, 10});
  expect_error<ShapeError>([] { where(tensor<bool>({true, false, true}), ones({2, 3}), ones({2})); }, "where");
}

TEST(Where, DTypes) {
  Tensor c = tensor<bool>({true, false, true});
  expect_tensor(where(c, tensor<int64_t>({1, 2, 3}), tensor<double>({0.5, 1.5, 2.5})), {3}, kFloat64, {1, 1.5, 3});
  EXPECT_EQ(where(c, ones({3}, kInt64), ones({3}, kInt32)).dtype(), kInt64);
  EXPECT_EQ(where(c, ones({3}, kBFloat16), ones({3}, kFloat16)).dtype(), kFloat32);
  // 0-dim tensors and Scalars rank below dimensioned tensors of the same category.
  EXPECT_EQ(where(c, ones({3}, kBFloat16), scalar_tensor(2.5, kFloat64)).dtype(), kBFloat16);
  EXPECT_EQ(where(c, ones({3}, kInt32), scalar_tensor(2, kInt64)).dtype(), kInt32);
  EXPECT_EQ(where(c, ones({3}, kInt32), scalar_tensor(2.0, kFloat32)).dtype(), kFloat32);
  EXPECT_EQ(where(c, scalar_tensor(1.0, kFloat64), scalar_tensor(2.0, kFloat32)).dtype(), kFloat64);
  EXPECT_EQ(where(c, ones({3}, kBFloat16), 2.5).dtype(), kBFloat16);
  EXPECT_EQ(where(c, ones({3}, kInt64), 2.5).dtype(), kFloat32);
  EXPECT_EQ(where(c, ones({3}, kInt32), 2).dtype(), kInt32);
  EXPECT_EQ(where(c, ones({3}, kBool), 2).dtype(), kInt64);
  EXPECT_EQ(where(c, ones({3}, kBool), true).dtype(), kBool);
  EXPECT_EQ(where(c, scalar_tensor(true, kBool), 3).dtype(), kInt64);
  expect_tensor(where(c, 1, 0), {3}, kInt64, {1, 0, 1});
  expect_tensor(where(c, 1.0, 0), {3}, kFloat32, {1, 0, 1});
  expect_tensor(where(c, 2.5, arange(3, kInt64)), {3}, kFloat32, {2.5, 1, 2.5});
  expect_tensor(where(c, true, false), {3}, kBool, {1, 0, 1});
}

TEST(Where, Condition) {
  expect_tensor(where(tensor<uint8_t>({1, 0, 2}), ones({3}), zeros({3})), {3}, kFloat32, {1, 0, 1});
  expect_error<DTypeError>([] { where(tensor<int64_t>({1, 0}), ones({2}), zeros({2})); },
                           "where: expected condition to be a bool tensor, got a tensor of dtype int64");
  expect_error<DTypeError>([] { where(ones({2}), ones({2}), zeros({2})); }, "dtype float32");
  expect_tensor(where(zeros({2, 2}, kBool).select(1, 0), scalar_tensor(1.0, kFloat32), 3.0), {2}, kFloat32, {3, 3});
  expect_tensor(where(zeros({0}, kBool), 1.0, 3.0), {0}, kFloat32, {});
}

// ---- cat / stack ----

TEST(Cat, ValuesAndPromotion) {
  Tensor x = x34();
  expect_tensor(cat({x.slice(0, 0, 1), x.slice(0, 1)}), {3, 4}, kFloat32, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  expect_tensor(cat({x.t(), x.t().slice(1, 1, 2)}, 1), {4, 4}, kFloat32,
                {0, 4, 8, 4, 1, 5, 9, 5, 2, 6, 10, 6, 3, 7, 11, 7});
  Tensor a = arange(6, kInt64).view({2, 3});
  expect_tensor(cat({a, a.to(kBool)}, -1), {2, 6}, kInt64, {0, 1, 2, 0, 1, 1, 3, 4, 5, 1, 1, 1});
  EXPECT_EQ(cat({a, a.to(kFloat64)}).dtype(), kFloat64);
  EXPECT_EQ(cat({a.to(kBFloat16), a.to(kFloat16)}).dtype(), kFloat32);
}

TEST(Cat, LegacyEmptyAndEmpty) {
  Tensor x = arange(6, kFloat32).view({2, 3});
  // Shape [0] tensors are skipped whatever dim says, but still promote.
  expect_tensor(cat({empty({0}, kFloat64), x}, 1), {2, 3}, kFloat64, {0, 1, 2, 3, 4, 5});
  expect_tensor(cat({empty({0}), empty({0}, kInt64)}, 3), {0}, kFloat32, {});
  expect_tensor(cat({empty({0, 3}), x}, 0), {2, 3}, kFloat32, {0, 1, 2, 3, 4, 5});
  expect_tensor(cat({empty({2, 0}), x}, 1), {2, 3}, kFloat32, {0, 1, 2, 3, 4, 5});
}

TEST(Cat, Errors) {
  Tensor x = arange(6, kFloat32).view({2, 3});
  expect_error<ShapeError>([&] { cat({x, x.slice(1, 0, 2)}); },
                           "sizes of tensors must match except in dimension 0: tensor 0 has shape [2, 3] but tensor 1 "
                           "has shape [2, 2]");
  expect_error<ShapeError>([&] { cat({x, x, x[0]}); }, "tensor 2 has shape [3] (1 dims)");
  expect_error<ShapeError>([&] { cat({empty({2, 0}), x}, 0); }, "tensor 0 has shape [2, 0] but tensor 1");
  expect_error<ShapeError>([&] { cat({scalar_tensor(1.0)}); }, "zero-dimensional tensor (at position 0)");
  expect_error<ValueError>([&] { cat({}); }, "non-empty list");
  expect_error<IndexError>([&] { cat({x, x}, 2); }, "cat");
}

TEST(Stack, Values) {
  Tensor x = arange(6, kFloat32).view({2, 3});
  expect_tensor(stack({x, x.to(kFloat64)}, 1), {2, 2, 3}, kFloat64, {0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5});
  expect_tensor(stack({x, x.t().t()}, -1), {2, 3, 2}, kFloat32, {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5});
  expect_tensor(stack({x.t(), x.t()}), {2, 3, 2}, kFloat32, {0, 3, 1, 4, 2, 5, 0, 3, 1, 4, 2, 5});
  expect_tensor(stack({scalar_tensor(1.0, kFloat32), scalar_tensor(2.0, kFloat32)}), {2}, kFloat32, {1, 2});
  expect_error<ShapeError>([&] { stack({x, x.slice(1, 0, 2)}); },
                           "stack: expects each tensor to be equal size, but got [2, 3] at entry 0 and [2, 2] at entry 1");
  expect_error<IndexError>([&] { stack({x, x}, 3); }, "stack");
  expect_error<ValueError>([&] { stack({}); }, "non-empty list");
}

// ---- repeat ----

TEST(Repeat, Values) {
  Tensor x = arange(6, kFloat32).view({2, 3});
  Tensor r = x.repeat({2, 1, 2});
  expect_tensor(r, {2, 2, 6}, kFloat32,
                {0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5});
  EXPECT_FALSE(r.is_alias_of(x));
  expect_tensor(x.t().repeat({1, 2}), {3, 4}, kFloat32, {0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5});
  expect_tensor(scalar_tensor(3.5, kFloat32).repeat({3}), {3}, kFloat32, {3.5, 3.5, 3.5});
  expect_tensor(x.repeat({0, 2}), {0, 6}, kFloat32, {});
  expect_tensor(tensor<bool>({true, false}).repeat({2}), {4}, kBool, {1, 0, 1, 0});
  expect_error<ShapeError>([&] { x.repeat({2}); }, "can not be smaller than the number of dims");
  expect_error<ShapeError>([&] { x.repeat({-1, 2}); }, "non-negative");
}

// ---- embedding / one_hot ----

TEST(Embedding, Values) {
  Tensor w = arange(15, kFloat32).view({5, 3});
  expect_tensor(embedding(w, tensor<int64_t>({4, 0, 2, 2}, {2, 2})), {2, 2, 3}, kFloat32,
                {12, 13, 14, 0, 1, 2, 6, 7, 8, 6, 7, 8});
  expect_tensor(embedding(w, scalar_tensor(1, kInt32)), {3}, kFloat32, {3, 4, 5});
  expect_tensor(embedding(w.t().contiguous().t(), i32({3})), {1, 3}, kFloat32, {9, 10, 11});
  expect_tensor(embedding(w, empty({2, 0}, kInt64)), {2, 0, 3}, kFloat32, {});
}

TEST(Embedding, Errors) {
  Tensor w = arange(15, kFloat32).view({5, 3});
  expect_error<IndexError>([&] { embedding(w, tensor<int64_t>({1, 7})); },
                           "embedding: index 7 is out of range for an embedding table of 5 entries");
  expect_error<IndexError>([&] { embedding(w, tensor<int64_t>({-1})); }, "index -1 is out of range");
  expect_error<DTypeError>([&] { embedding(w, tensor<float>({1.f})); }, "int64 or int32");
  expect_error<ShapeError>([&] { embedding(w[0], tensor<int64_t>({1})); }, "'weight' must be 2-D");
}

TEST(OneHot, Values) {
  expect_tensor(one_hot(tensor<int64_t>({0, 3, 1, 1}, {2, 2})), {2, 2, 4}, kInt64,
                {1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 0});
  expect_tensor(one_hot(tensor<int64_t>({0, 2, 1}), 5), {3, 5}, kInt64, {1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0});
  expect_tensor(one_hot(scalar_tensor(2, kInt64), 3), {3}, kInt64, {0, 0, 1});
  expect_tensor(one_hot(empty({0}, kInt64), 3), {0, 3}, kInt64, {});
  expect_tensor(one_hot(tensor<int64_t>({0, 1, 2, 3}).slice(0, 0, std::nullopt, 2)), {2, 3}, kInt64,
                {1, 0, 0, 0, 0, 1});
}

TEST(OneHot, Errors) {
  expect_error<ValueError>([] { one_hot(tensor<int64_t>({0, -2, 1})); }, "non-negative, got -2");
  expect_error<ValueError>([] { one_hot(tensor<int64_t>({0, 2, 1}), 2); }, "smaller than num_classes (2)");
  expect_error<ValueError>([] { one_hot(empty({0}, kInt64)); }, "can not infer");
  expect_error<DTypeError>([] { one_hot(i32({0})); }, "int64");
}
