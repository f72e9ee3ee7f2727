// Reductions, softmax, log_softmax: values checked against torch 1.13
// (/usr/bin/python3, noted beside each case), PyTorch's rules for ties, NaN,
// empty dims and dtypes, the layouts the kernels special-case (rows, columns,
// strided, expanded) against a float64 reference written here, determinism
// across thread counts, and the accuracy of long float32 sums.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kiln/kernels/reduce.h"
#include "kiln/kiln.h"
#include "kiln/ops/reduce.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::bitwise_equal;
using kiln::test::to_doubles;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

void expect_values(const Tensor& t, const std::vector<double>& want, double tol = 1e-5) {
  const std::vector<double> got = to_doubles(t);
  ASSERT_EQ(got.size(), want.size()) << "shape " << t.shape_string();
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "element " << i << ": got " << got[i] << ", want nan";
    } else if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], want[i]) << "element " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << "element " << i;
    }
  }
}

// Same shape and |a - b| <= atol + rtol |b| everywhere (NaN matches NaN); written
// here so the tests do not lean on the elementwise ops.
void expect_close(const Tensor& a, const Tensor& b, double rtol, double atol) {
  ASSERT_EQ(a.sizes().vec(), b.sizes().vec());
  const std::vector<double> x = to_doubles(a), y = to_doubles(b);
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) && std::isnan(y[i])) continue;
    if (x[i] == y[i]) continue;
    EXPECT_LE(std::abs(x[i] - y[i]), atol + rtol * std::abs(y[i])) << "element " << i << ": " << x[i] << " vs " << y[i];
  }
}

void expect_shape(const Tensor& t, std::vector<int64_t> shape) { EXPECT_EQ(t.sizes().vec(), shape); }

Tensor from(std::vector<double> v, std::vector<int64_t> shape, DType dt = kFloat32) {
  return tensor<double>(v, shape).to(dt);
}

// Runs f with n threads, then restores the previous setting.
template <typename F>
auto with_threads(int n, F f) {
  const int before = get_num_threads();
  set_num_threads(n);
  auto r = f();
  set_num_threads(before);
  return r;
}

enum class Kind { Sum, Max, Var };

// float64 reference over `dims` of x, outputs in row-major order of the kept dims.
std::vector<double> naive_reduce(const Tensor& x, const std::vector<int64_t>& dims, Kind kind) {
  const std::vector<double> v = to_doubles(x);
  const auto sizes = x.sizes().vec();
  const int64_t nd = static_cast<int64_t>(sizes.size());
  std::vector<bool> red(nd, false);
  for (int64_t d : dims) red[d < 0 ? d + nd : d] = true;
  int64_t nout = 1;
  for (int64_t d = 0; d < nd; ++d)
    if (!red[d]) nout *= sizes[d];
  std::vector<std::vector<double>> groups(nout);
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t rem = static_cast<int64_t>(i), o = 0, mul = 1;
    for (int64_t d = nd - 1; d >= 0; --d) {
      const int64_t idx = rem % sizes[d];
      rem /= sizes[d];
      if (!red[d]) {
        o += idx * mul;
        mul *= sizes[d];
      }
    }
    groups[o].push_back(v[i]);
  }
  std::vector<double> out;
  for (const auto& g : groups) {
    double s = 0, m = -kInf;
    for (double e : g) {
      s += e;
      m = std::max(m, e);
    }
    if (kind == Kind::Sum) out.push_back(s);
    if (kind == Kind::Max) out.push_back(m);
    if (kind == Kind::Var) {
      const double mean = s / g.size();
      double q = 0;
      for (double e : g) q += (e - mean) * (e - mean);
      out.push_back(q / (g.size() - 1));
    }
  }
  return out;
}

}  // namespace

// ---- sum / mean / prod ----

TEST(Reduce, SumValuesDimsAndKeepdim) {
  const Tensor a = arange(24, kFloat32).view({2, 3, 4});
  // torch: a.sum([0, 2]) = [60, 92, 124]
  expect_values(a.sum({0, 2}), {60, 92, 124});
  expect_values(a.sum({-1, 0}), {60, 92, 124});
  expect_shape(a.sum({0, 2}, true), {1, 3, 1});
  expect_shape(a.sum({1}), {2, 4});
  expect_values(a.sum(), {276});
  // torch 1.13: sum(dim=[]) reduces every dim
  expect_shape(a.sum(IntArrayRef{}, true), {1, 1, 1});
  expect_values(a.sum(IntArrayRef{}), {276});
  // torch: a.mean([1]) = [[4..7], [16..19]]
  expect_values(a.mean({1}), {4, 5, 6, 7, 16, 17, 18, 19});
  // torch: a.prod(2) = [[0, 840, 7920], [32760, 93024, 212520]]
  expect_values(a.prod(2), {0, 840, 7920, 32760, 93024, 212520});
  expect_shape(a.prod(-1, true), {2, 3, 1});
}

TEST(Reduce, SumDTypes) {
  const Tensor i = arange(6).view({2, 3});
  EXPECT_EQ(i.sum().dtype(), kInt64);
  EXPECT_EQ(i.to(kInt32).sum({0}).dtype(), kInt64);
  EXPECT_EQ(i.to(kUInt8).prod().dtype(), kInt64);
  const Tensor b = tensor<bool>({true, false, true, true});
  EXPECT_EQ(b.sum().dtype(), kInt64);
  EXPECT_EQ(b.sum().item<int64_t>(), 3);
  // torch.sum(x, dtype=...) converts first: 0.5 + 0.7 in int64 is 0 + 0.
  EXPECT_EQ(tensor<float>({0.5f, 0.7f}).sum(kInt64).item<int64_t>(), 0);
  EXPECT_EQ(tensor<float>({1.5f, 2.0f}).sum(kFloat64).dtype(), kFloat64);
  // torch: xi.sum(dtype=torch.bool) = True
  EXPECT_EQ(i.sum(kBool).dtype(), kBool);
  EXPECT_TRUE(i.sum(kBool).item<bool>());
  // 16-bit floats accumulate in float: 1000 x bf16(0.1) = 100.0977 rounds to 100 (torch: 100.)
  EXPECT_EQ(full({1000}, 0.1, kBFloat16).sum().item<double>(), 100.0);
  EXPECT_EQ(full({1000}, 0.1, kBFloat16).sum().dtype(), kBFloat16);
  // torch: torch.full((10000,), 0.1, dtype=torch.float16).sum() = 1000.
  EXPECT_EQ(full({10000}, 0.1, kFloat16).sum().item<double>(), 1000.0);
  EXPECT_NEAR(full({10000}, 0.1, kFloat16).mean().item<double>(), 0.1, 1e-4);
  // int64 accumulation wraps as torch does.
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(tensor<int64_t>({big, 1}).sum().item<int64_t>(), std::numeric_limits<int64_t>::min());
}

TEST(Reduce, EmptyAndZeroDim) {
  const Tensor e = zeros({0, 3});
  expect_values(e.sum({0}), {0, 0, 0});
  expect_values(e.prod(0), {1, 1, 1});
  expect_values(e.mean({0}), {kNaN, kNaN, kNaN});
  expect_values(e.var({0}), {kNaN, kNaN, kNaN});
  expect_values(e.logsumexp({0}), {-kInf, -kInf, -kInf});
  expect_values(e.norm(2.0, {0}), {0, 0, 0});
  expect_values(e.norm(-kInf, {0}), {0, 0, 0});
  expect_shape(e.sum({1}), {0});
  expect_shape(e.amax({1}), {0});
  expect_values(e.sum(), {0});
  expect_values(e.mean(), {kNaN});
  EXPECT_TRUE(e.all().item<bool>());
  EXPECT_FALSE(e.any().item<bool>());
  // A 0-dim tensor accepts dim 0 and -1.
  const Tensor s = scalar_tensor(3.0);
  expect_shape(s.sum({0}), {});
  expect_shape(s.sum({-1}, true), {});
  auto [v, i] = s.max(0);
  EXPECT_EQ(v.item<double>(), 3.0);
  EXPECT_EQ(i.item<int64_t>(), 0);
  EXPECT_EQ(s.argmax().item<int64_t>(), 0);
  EXPECT_EQ(s.softmax(0).item<double>(), 1.0);
  // torch: tensor(3.).var() = nan; correction=0 gives 0.
  EXPECT_TRUE(std::isnan(s.var().item<double>()));
  EXPECT_EQ(s.var({}, 0).item<double>(), 0.0);
  EXPECT_THROW(s.sum({1}), IndexError);
}

// ---- var / std ----

TEST(Reduce, VarStdCorrection) {
  const Tensor x = from({1, 2, 3, 4, 2, 4, 6, 8}, {2, 4});
  // torch: var(x, 1) = [1.6667, 6.6667]; correction=0: [1.25, 5.0]; std(x, 1) = [1.2910, 2.5820]
  expect_values(x.var({1}), {5.0 / 3, 20.0 / 3});
  expect_values(x.var({1}, 0), {1.25, 5.0});
  expect_values(x.std({1}), {1.2909944, 2.5819889});
  // torch: std(x, dim=None, correction=0) = 2.1651
  expect_values(x.std({}, 0), {2.1650635});
  // torch: var(x, dim=[0], correction=2) = [inf, inf, inf, inf] (dof clamps at 0)
  expect_values(x.var({0}, 2), {kInf, kInf, kInf, kInf});
  expect_shape(x.var({1}, 1, true), {2, 1});
  // A large mean with a small spread keeps its digits (double accumulation, two passes).
  const Tensor y = from({1e4 + 1, 1e4 + 2, 1e4 + 3}, {3});
  expect_values(y.var(), {1.0}, 1e-6);
  EXPECT_THROW(arange(4).var(), DTypeError);
}

// ---- max / min / argmax: ties and NaN ----

TEST(Reduce, MaxMinTiesAndNaN) {
  const Tensor x = from({1, kNaN, 3, kNaN, 2, 5, 5, 1, kInf, -kInf, kInf, 0}, {3, 4});
  // torch: x.max(1) = ([nan, 5, inf], [1, 1, 0]); x.min(1) = ([nan, 1, -inf], [1, 3, 1])
  auto [mv, mi] = x.max(1);
  expect_values(mv, {kNaN, 5, kInf});
  expect_values(mi, {1, 1, 0});
  auto [nv, ni] = x.min(1);
  expect_values(nv, {kNaN, 1, -kInf});
  expect_values(ni, {1, 3, 1});
  // torch: x.max(0) = ([inf, nan, inf, nan], [2, 0, 2, 0]); x.min(0) = ([1, nan, 3, nan], [0, 0, 0, 0])
  auto [cv, ci] = x.max(0);
  expect_values(cv, {kInf, kNaN, kInf, kNaN});
  expect_values(ci, {2, 0, 2, 0});
  auto [dv, di] = x.min(0);
  expect_values(dv, {1, kNaN, 3, kNaN});
  expect_values(di, {0, 0, 0, 0});
  // torch: x.argmax() = 1 (the first NaN), x.max() = nan, x.amax(1) = [nan, 5, inf]
  EXPECT_EQ(x.argmax().item<int64_t>(), 1);
  EXPECT_TRUE(std::isnan(x.max().item<double>()));
  expect_values(x.amax({1}), {kNaN, 5, kInf});
  // Ties give the first index: torch tensor([3,1,3]).argmax() = 0, tensor([1,0,0]).argmin() = 1.
  EXPECT_EQ(tensor<int64_t>({3, 1, 3}).argmax().item<int64_t>(), 0);
  EXPECT_EQ(tensor<int64_t>({1, 0, 0}).argmin().item<int64_t>(), 1);
  auto [tv, ti] = tensor<int64_t>({1, 2, 1, 2}, {2, 2}).max(0);
  expect_values(ti, {0, 0});
  // bool: torch xb.min(1) = ([False, True], [1, 0])
  auto [bv, bi] = tensor<bool>({true, false, true, true, true, true}, {2, 3}).min(1);
  EXPECT_EQ(bv.dtype(), kBool);
  expect_values(bi, {1, 0});
}

TEST(Reduce, ArgOverLongRowsFindsFirst) {
  // Rows longer than a piece are split across threads; the first max/NaN must still win.
  Tensor x = zeros({200000});
  float* p = x.data_ptr<float>();
  p[150000] = 5;
  p[40000] = 5;
  p[190000] = 5;
  EXPECT_EQ(x.argmax().item<int64_t>(), 40000);
  auto [v, i] = x.view({1, 200000}).max(1);
  EXPECT_EQ(i.item<int64_t>(), 40000);
  EXPECT_EQ(v.item<double>(), 5.0);
  p[170000] = std::numeric_limits<float>::quiet_NaN();
  p[120000] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(x.argmax().item<int64_t>(), 120000);
  EXPECT_EQ(x.argmin().item<int64_t>(), 120000);
  EXPECT_TRUE(std::isnan(x.max().item<double>()));
}

TEST(Reduce, KeepdimShapes) {
  const Tensor x = randn({2, 3, 4});
  expect_shape(std::get<0>(x.max(1, true)), {2, 1, 4});
  expect_shape(std::get<1>(x.min(-1, true)), {2, 3, 1});
  expect_shape(std::get<0>(x.max(0)), {3, 4});
  expect_shape(x.argmax(2), {2, 3});
  expect_shape(x.argmax(2, true), {2, 3, 1});
  // torch: argmax(None, keepdim=True) keeps every dim as 1
  expect_shape(x.argmax(std::nullopt, true), {1, 1, 1});
  expect_shape(x.argmax(), {});
  expect_shape(x.amax({0, 2}, true), {1, 3, 1});
  expect_shape(x.amin({0, 2}), {3});
  expect_shape(x.logsumexp({1}, true), {2, 1, 4});
  expect_shape(x.norm(2.0, {0, 1}, true), {1, 1, 4});
  expect_shape(x.std({2}, 1, true), {2, 3, 1});
  expect_shape(x.mean({0, 1, 2}, true), {1, 1, 1});
  expect_shape(x.max(), {});
  // The indices agree with the values.
  auto [v, i] = x.max(1);
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t c = 0; c < 4; ++c)
      EXPECT_EQ(v[a][c].item<float>(), x[a][i[a][c].item<int64_t>()][c].item<float>());
}

// ---- logsumexp / norm ----

TEST(Reduce, LogSumExpStable) {
  // torch: logsumexp([[1e4, 1e4], [-1e4, 0]], 1) = [10000.6934, 0]
  expect_values(from({1e4, 1e4, -1e4, 0}, {2, 2}).logsumexp({1}), {10000.693359375, 0.0});
  // all -inf gives -inf, an inf gives inf, NaN propagates (torch agrees)
  expect_values(from({-kInf, -kInf, kInf, -kInf, kNaN, 1}, {3, 2}).logsumexp({1}), {-kInf, kInf, kNaN});
  // torch: logsumexp([1, 2, 3]) in float64 = 3.4076059644443806
  EXPECT_NEAR(from({1, 2, 3}, {3}, kFloat64).logsumexp({0}).item<double>(), 3.4076059644443806, 1e-14);
  // integers compute in the default float dtype
  EXPECT_EQ(arange(6).logsumexp({0}).dtype(), kFloat32);
  expect_shape(arange(6, kFloat32).view({2, 3}).logsumexp({0, 1}, true), {1, 1});
}

TEST(Reduce, NormOrders) {
  const Tensor v = from({3, -4, 0}, {3});
  expect_values(v.norm(), {5});
  expect_values(v.norm(1), {7});
  expect_values(v.norm(kInf), {4});
  expect_values(v.norm(-kInf), {0});
  expect_values(v.norm(0), {2});
  expect_values(v.norm(3), {4.4979414});  // torch: tensor([3., -4, 0]).norm(3) = 4.4979
  expect_values(v.norm(0.5), {std::pow(std::sqrt(3.0) + 2.0, 2.0)});
  const Tensor m = from({3, 4, 6, 8}, {2, 2});
  expect_values(m.norm(2.0, {1}), {5, 10});
  expect_shape(m.norm(2.0, {1}, true), {2, 1});
  expect_values(from({kNaN, 1}, {2}).norm(kInf), {kNaN});
  EXPECT_THROW(arange(3).norm(), DTypeError);
}

// ---- softmax / log_softmax ----

TEST(Reduce, SoftmaxValues) {
  // torch: softmax([1, 2, 3]) = [0.09003057, 0.24472848, 0.66524094]
  expect_values(from({1, 2, 3}, {3}).softmax(0), {0.09003057, 0.24472848, 0.66524094}, 1e-6);
  // torch (float64): log_softmax([1, 2, 3]) = [-2.4076059644443806, -1.4076059644443804, -0.4076059644443804]
  expect_values(from({1, 2, 3}, {3}, kFloat64).log_softmax(0),
                {-2.4076059644443806, -1.4076059644443804, -0.4076059644443804}, 1e-14);
  // Over dim 0 and a middle dim (the column kernel) the rows of the transpose agree.
  const Tensor x = randn({6, 5, 7});
  for (int64_t d : {0, 1, 2}) {
    const Tensor y = x.softmax(d);
    const Tensor ref = x.transpose(d, 2).contiguous().softmax(2).transpose(d, 2);
    SCOPED_TRACE("dim " + std::to_string(d));
    expect_close(y, ref, 1e-6, 1e-7);
    expect_close(x.log_softmax(d), x.transpose(d, 2).contiguous().log_softmax(2).transpose(d, 2), 1e-6, 1e-6);
    expect_values(y.sum({d}), std::vector<double>(x.numel() / x.size(d), 1.0), 1e-6);
  }
  // As torch, the result is contiguous whatever the input's layout.
  EXPECT_TRUE(x.transpose(0, 2).softmax(1).is_contiguous());
  expect_close(x.transpose(0, 2).softmax(1), x.transpose(0, 2).contiguous().softmax(1), 1e-6, 1e-7);
}

TEST(Reduce, SoftmaxExtremeRowsStayFinite) {
  // torch: softmax([[1e4, -1e4, 0, -inf], [-inf, 1, 2, -inf]], 1) = [[1, 0, 0, 0], [0, 0.26894143, 0.7310586, 0]]
  const Tensor x = from({1e4, -1e4, 0, -kInf, -kInf, 1, 2, -kInf}, {2, 4});
  expect_values(x.softmax(1), {1, 0, 0, 0, 0, 0.26894143, 0.7310586, 0}, 1e-6);
  // torch: log_softmax = [[0, -20000, -10000, -inf], [-inf, -1.3132616, -0.31326166, -inf]]
  expect_values(x.log_softmax(1), {0, -20000, -10000, -kInf, -kInf, -1.3132616, -0.31326166, -kInf}, 1e-6);
  // Long rows of large values with masked (-inf) entries, rows and columns.
  Tensor big = randn({8, 3000});
  for (int64_t i = 0; i < big.numel(); ++i) big.data_ptr<float>()[i] *= 1e4f;
  big.select(1, 7).fill_(-kInf);
  big.select(1, 2999).fill_(-kInf);
  for (int64_t d : {0, 1}) {
    const Tensor in = d == 1 ? big : big.t().contiguous();
    const std::vector<double> s = to_doubles(in.softmax(d));
    for (double e : s) ASSERT_TRUE(std::isfinite(e));
    expect_values(in.softmax(d).sum({d}), std::vector<double>(8, 1.0), 1e-5);
  }
  // An all -inf row is NaN, as torch (0/0).
  EXPECT_TRUE(std::isnan(from({-kInf, -kInf}, {2}).softmax(0)[0].item<double>()));
  // 16-bit inputs compute in float and keep their dtype.
  EXPECT_EQ(x.to(kBFloat16).softmax(1).dtype(), kBFloat16);
  EXPECT_EQ(x.to(kFloat16).log_softmax(1).dtype(), kFloat16);
  EXPECT_THROW(arange(4).softmax(0), DTypeError);
}

// ---- all / any ----

TEST(Reduce, AllAny) {
  EXPECT_FALSE(arange(6).all().item<bool>());
  EXPECT_TRUE(arange(6).any().item<bool>());
  EXPECT_EQ(arange(6).all().dtype(), kBool);
  // torch: uint8 all/any keep uint8
  EXPECT_EQ(arange(6).to(kUInt8).all().dtype(), kUInt8);
  EXPECT_EQ(arange(6).to(kUInt8).any().item<int64_t>(), 1);
  EXPECT_TRUE(from({kNaN, 1}, {2}).all().item<bool>());
  EXPECT_FALSE(zeros({3, 4}, kBool).any().item<bool>());
  EXPECT_TRUE(ones({300, 400}, kBool).all().item<bool>());
}

// ---- errors ----

TEST(Reduce, Errors) {
  const Tensor x = zeros({2, 3});
  EXPECT_THROW(x.sum({2}), IndexError);
  EXPECT_THROW(x.sum({-3}), IndexError);
  EXPECT_THROW(x.sum({0, -2}), ValueError);
  EXPECT_THROW(x.amax({1, 1}), ValueError);
  EXPECT_THROW(arange(4).mean(), DTypeError);
  EXPECT_THROW(zeros({0, 3}).max(), IndexError);
  EXPECT_THROW(zeros({0, 3}).max(0), IndexError);
  EXPECT_THROW(zeros({0, 3}).amin({0}), IndexError);
  EXPECT_THROW(zeros({0}).argmax(), IndexError);
  EXPECT_NO_THROW(zeros({0, 3}).max(1));
  try {
    (void)arange(4).mean();
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("mean(): could not infer output dtype"), std::string::npos) << e.what();
  }
}

// ---- free functions mirror the methods ----

TEST(Reduce, FreeFunctions) {
  const Tensor x = randn({4, 5});
  EXPECT_TRUE(bitwise_equal(kiln::sum(x, {1}, true), x.sum({1}, true)));
  EXPECT_TRUE(bitwise_equal(kiln::mean(x), x.mean()));
  EXPECT_TRUE(bitwise_equal(kiln::softmax(x, -1), x.softmax(-1)));
  EXPECT_TRUE(bitwise_equal(kiln::log_softmax(x, 0), x.log_softmax(0)));
  EXPECT_TRUE(bitwise_equal(kiln::logsumexp(x, {1}), x.logsumexp({1})));
  EXPECT_TRUE(bitwise_equal(kiln::var(x, {0}, 0), x.var({0}, 0)));
  EXPECT_TRUE(bitwise_equal(kiln::std(x), x.std()));
  EXPECT_TRUE(bitwise_equal(kiln::norm(x, 3.0, {1}), x.norm(3.0, {1})));
  EXPECT_TRUE(bitwise_equal(std::get<1>(kiln::max(x, 1)), x.argmax(1)));
  EXPECT_TRUE(bitwise_equal(std::get<1>(kiln::min(x, 0, true)), x.argmin(0, true)));
  EXPECT_TRUE(bitwise_equal(kiln::amax(x, {0}), std::get<0>(x.max(0))));
  EXPECT_TRUE(bitwise_equal(kiln::max(x), x.amax({})));
  EXPECT_TRUE(bitwise_equal(kiln::prod(x, 1), x.prod(1)));
  EXPECT_TRUE(bitwise_equal(kiln::all(x), x.all()));
}

// ---- layouts: rows, columns, strided, expanded; against a float64 reference ----

TEST(Reduce, LayoutsMatchReference) {
  const Tensor base = randn({6, 7, 40});
  const std::vector<Tensor> inputs = {
      base,                                       // contiguous
      base.permute({2, 0, 1}),                    // innermost dim strided
      base.slice(2, 0, std::nullopt, 3),          // step 3 in the last dim
      base.select(1, 2).unsqueeze(1).expand({6, 5, 40}),  // stride 0
      base.to(kFloat64).transpose(0, 1),
  };
  const std::vector<std::vector<int64_t>> dim_sets = {{0}, {1}, {2}, {-1, 0}, {1, 2}, {0, 1}, {0, 1, 2}};
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& x = inputs[k];
    for (const auto& dims : dim_sets) {
      SCOPED_TRACE("input " + std::to_string(k) + " dims " + shape_str(dims));
      expect_values(x.sum(dims), naive_reduce(x, dims, Kind::Sum), 1e-5);
      expect_values(x.amax(dims), naive_reduce(x, dims, Kind::Max), 0.0);
      expect_values(x.var(dims), naive_reduce(x, dims, Kind::Var), 1e-5);
    }
  }
}

TEST(Reduce, LargeLayoutsMatchReference) {
  // Sizes that take the parallel branches: many rows, few long rows split in
  // pieces, wide columns, and few narrow columns split in row pieces. Seeded:
  // the data must not depend on which tests ran before (a column of 100000
  // normals that cancels to 1.6 sits outside a tolerance relative to |sum|
  // with an error 1e-9 of its sum of magnitudes).
  manual_seed(2026);
  struct Case {
    std::vector<int64_t> shape, dims;
  };
  const std::vector<Case> cases = {
      {{256, 1000}, {1}}, {{2, 100000}, {1}},   {{3, 2, 40000}, {0, 2}},
      {{1000, 256}, {0}}, {{100000, 3}, {0}},   {{40, 30, 50}, {0, 2}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("shape " + shape_str(c.shape) + " dims " + shape_str(c.dims));
    const Tensor x = randn(c.shape);
    expect_values(x.sum(c.dims), naive_reduce(x, c.dims, Kind::Sum), 2e-5);
    expect_values(x.amax(c.dims), naive_reduce(x, c.dims, Kind::Max), 0.0);
    expect_values(x.var(c.dims), naive_reduce(x, c.dims, Kind::Var), 1e-5);
  }
}

// ---- determinism and accuracy ----

TEST(Reduce, BitwiseIdenticalOnOneAndTwoThreads) {
  const Tensor flat = randn({3000000});
  const Tensor rows = randn({2, 3, 200000});
  const Tensor cols = randn({4096, 1024});
  const Tensor narrow = randn({200000, 3});
  const Tensor blocks3 = randn({2048, 768}), blocks3_bf16 = blocks3.to(kBFloat16);  // 3 column blocks x 4 row pieces
  auto run = [&] {
    return std::vector<Tensor>{flat.sum(),
                               flat.mean(),
                               flat.norm(),
                               flat.var(),
                               flat.logsumexp({0}),
                               rows.sum({0, 2}),
                               rows.sum({2}),
                               cols.sum({0}),
                               cols.sum({1}),
                               cols.softmax(1),
                               cols.log_softmax(0),
                               narrow.sum({0}),
                               narrow.t().sum({1}),
                               blocks3.sum({0}),
                               blocks3_bf16.sum({0}),
                               flat.argmax(),
                               std::get<1>(cols.max(0))};
  };
  const auto one = with_threads(1, run);
  const auto two = with_threads(2, run);
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(bitwise_equal(one[i], two[i])) << "result " << i;
}

// A column sum's value is fixed by Note [Deterministic reductions]: each
// column is cut into pieces of kReduceColPiece rows and those into leaves of
// 16 rows (the engine's kColLeaf); a leaf adds its rows in order from 0, in
// float for 16-bit inputs; leaves, then pieces, combine pairwise, splitting at
// the middle. This reference follows that order, so every kernel behind the
// column path (Note [Column sums in registers]: 256 columns in registers,
// then masked blocks of 64) must give its bits, for every width, row count
// and row stride here.
TEST(Reduce, ColumnSumsFollowTheDocumentedTree) {
  constexpr int64_t kLeafRows = 16;
  auto tree = [](auto&& self, const std::vector<float>& v, size_t a, size_t b) -> float {
    if (b - a == 1) return v[a];
    const size_t mid = a + (b - a) / 2;
    return self(self, v, a, mid) + self(self, v, mid, b);
  };
  auto column = [&](const std::vector<float>& x, int64_t rows, int64_t ld, int64_t j) {
    std::vector<float> pieces;
    for (int64_t p0 = 0; p0 < rows; p0 += kernels::kReduceColPiece) {
      const int64_t p1 = std::min(rows, p0 + kernels::kReduceColPiece);
      std::vector<float> leaves;
      for (int64_t l0 = p0; l0 < p1; l0 += kLeafRows) {
        float acc = 0.0f;
        for (int64_t r = l0; r < std::min(p1, l0 + kLeafRows); ++r) acc += x[static_cast<size_t>(r * ld + j)];
        leaves.push_back(acc);
      }
      pieces.push_back(tree(tree, leaves, 0, leaves.size()));
    }
    return tree(tree, pieces, 0, pieces.size());
  };
  for (const DType dt : {kFloat32, kBFloat16, kFloat16}) {
    for (const int64_t rows : {1, 15, 17, 100, 1100}) {
      for (const int64_t width : {2, 15, 16, 17, 64, 65, 200, 256, 257, 300, 768, 1000}) {
        for (const int64_t pad : {0, 5}) {  // pad: columns past the view, so rows are further apart than width
          const Tensor wide = randn({rows, width + pad}).to(dt);
          const Tensor x = wide.narrow(1, 0, width);
          const std::vector<double> stored = to_doubles(wide);  // exact: every stored value is a float
          const std::vector<float> xs(stored.begin(), stored.end());
          std::vector<double> want(static_cast<size_t>(width));
          for (int64_t j = 0; j < width; ++j) {
            // Rounded to dt, as the op stores its float sum.
            want[static_cast<size_t>(j)] =
                to_doubles(full({1}, column(xs, rows, width + pad, j), kFloat32).to(dt))[0];
          }
          SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(rows) + " width " +
                       std::to_string(width) + " pad " + std::to_string(pad));
          const std::vector<double> got = to_doubles(x.sum({0}));
          ASSERT_EQ(got.size(), want.size());
          int64_t differ = 0;
          for (size_t j = 0; j < want.size(); ++j) differ += got[j] != want[j];
          EXPECT_EQ(differ, 0) << "columns whose sum is not the tree's";
        }
      }
    }
  }
}

TEST(Reduce, LongFloatSumIsAccurate) {
  const int64_t n = int64_t{1} << 24;  // 16M
  const Tensor x = full({n}, 0.1f, kFloat32);
  const double want = static_cast<double>(n) * static_cast<double>(0.1f);
  const double got = x.sum().item<double>();
  EXPECT_LT(std::abs(got - want) / want, 1e-6) << "got " << got << ", want " << want;
  EXPECT_LT(std::abs(x.mean().item<double>() - 0.1f) / 0.1, 1e-6);
  // Columns too: 16M values summed down an outer dim.
  const Tensor c = x.view({n / 16, 16}).sum({0});
  for (double v : to_doubles(c)) EXPECT_LT(std::abs(v - want / 16) / (want / 16), 1e-6);
}
