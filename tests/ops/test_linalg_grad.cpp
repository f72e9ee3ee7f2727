// Backward of mm, bmm, matmul, linear: float64 gradcheck for every
// torch.matmul case (dot, vector-matrix, broadcast batches, transposed and
// strided operands), gradgradcheck where the formula is made of products
// alone, float32 (oneDNN) and bfloat16 gradients against the float64 path,
// node names, call sites, saved-tensor errors, and the primitive cache.
#include <gtest/gtest.h>

#include <string>

#include "dense_grad_util.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/ops/linalg.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::expect_gradcheck;
using kiln::test::expect_gradgradcheck;
using kiln::test::expect_grads_match_float64;
using kiln::test::leaf;
using kiln::test::transposed_leaf;

namespace {

Tensor mm2(const TensorList& x) { return mm(x[0], x[1]); }
Tensor bmm2(const TensorList& x) { return bmm(x[0], x[1]); }
Tensor matmul2(const TensorList& x) { return matmul(x[0], x[1]); }
Tensor linear3(const TensorList& x) { return linear(x[0], x[1], x[2]); }
Tensor linear2(const TensorList& x) { return linear(x[0], x[1]); }

struct MatmulCase {
  const char* label;
  std::vector<int64_t> a, b;
};

// Every torch.matmul shape rule: 1-D operands, folding, broadcasting.
const MatmulCase kMatmulCases[] = {
    {"1d x 1d", {5}, {5}},
    {"1d x 2d", {4}, {4, 3}},
    {"2d x 1d", {3, 4}, {4}},
    {"2d x 2d", {3, 4}, {4, 2}},
    {"3d x 2d (folded)", {2, 3, 4}, {4, 5}},
    {"2d x 3d (broadcast)", {3, 4}, {2, 4, 5}},
    {"1d x 3d", {4}, {2, 4, 3}},
    {"3d x 1d", {2, 3, 4}, {4}},
    {"3d x 3d", {2, 3, 4}, {2, 4, 2}},
    {"broadcast 4d x 3d", {2, 1, 3, 4}, {5, 4, 2}},
    {"broadcast both", {3, 1, 2, 4}, {1, 4, 4, 3}},
    {"batch of 1 x 3d", {1, 3, 4}, {2, 4, 2}},
    {"4d x 1d", {2, 2, 3, 4}, {4}},
};

}  // namespace

TEST(LinalgGrad, MmGradcheck) {
  expect_gradcheck(mm2, {leaf({3, 4}, 1), leaf({4, 5}, 2)}, "mm");
  // Transposed operands reach the kernel as strides, without a copy.
  expect_gradcheck(mm2, {transposed_leaf({4, 3}, 3), transposed_leaf({5, 4}, 4)}, "mm of transposed operands");
  expect_gradcheck(mm2, {leaf({3, 4}, 5), leaf({4, 2}, 6).detach()}, "mm, only self requires grad");
  expect_gradcheck(mm2, {leaf({3, 4}, 7).detach(), leaf({4, 2}, 8)}, "mm, only mat2 requires grad");
  expect_gradcheck(mm2, {leaf({3, 0}, 9), leaf({0, 2}, 10)}, "mm, empty inner dim");
}

TEST(LinalgGrad, BmmGradcheck) {
  expect_gradcheck(bmm2, {leaf({2, 3, 4}, 11), leaf({2, 4, 2}, 12)}, "bmm");
  expect_gradcheck(bmm2, {transposed_leaf({2, 4, 3}, 13, 1, 2), transposed_leaf({2, 2, 4}, 14, 1, 2)},
                   "bmm of transposed operands");
}

TEST(LinalgGrad, MatmulGradcheckEveryShapeRule) {
  uint64_t seed = 20;
  for (const MatmulCase& c : kMatmulCases) {
    expect_gradcheck(matmul2, {leaf(c.a, seed), leaf(c.b, seed + 1)}, c.label);
    expect_gradcheck(matmul2, {leaf(c.a, seed + 2), leaf(c.b, seed + 3).detach()},
                     std::string(c.label) + ", self only");
    expect_gradcheck(matmul2, {leaf(c.a, seed + 4).detach(), leaf(c.b, seed + 5)},
                     std::string(c.label) + ", other only");
    seed += 6;
  }
}

TEST(LinalgGrad, MatmulGradcheckStridedOperands) {
  // A transposed batch (no merge: the batched path) and transposed matrices.
  expect_gradcheck(matmul2, {transposed_leaf({3, 2, 4}, 101, 0, 1), transposed_leaf({2, 5, 4}, 102, 1, 2)},
                   "matmul of a transposed batch and transposed matrices");
  const Tensor narrowed = leaf({2, 5, 4}, 103).detach().narrow(1, 1, 3).requires_grad_();
  expect_gradcheck(matmul2, {narrowed, leaf({4, 3}, 104)}, "matmul of a narrowed 3-D operand");
  expect_gradcheck(matmul2, {transposed_leaf({4, 3}, 105), leaf({2, 4, 2}, 106)}, "matmul transposed x 3-D");
}

TEST(LinalgGrad, MatmulGradcheckAttentionHeadViews) {
  // [B, nh, T, hs] heads viewed out of [B, T, 3C]: batch dims that do not merge (the per-slice path).
  const Tensor base = leaf({2, 3, 3 * 2 * 4}, 121).detach();
  auto heads = [&](int64_t i) { return base.narrow(2, i * 8, 8).view({2, 3, 2, 4}).transpose(1, 2); };
  const Tensor q = heads(0).requires_grad_(), kt = heads(1).transpose(-2, -1).requires_grad_();
  const Tensor v = heads(2).requires_grad_();
  expect_gradcheck(matmul2, {q, kt}, "q . k^T of head views");
  expect_gradcheck(matmul2, {leaf({2, 2, 3, 3}, 122), v}, "P . v of head views");
}

TEST(LinalgGrad, LinearGradcheck) {
  expect_gradcheck(linear3, {leaf({3, 4}, 201), leaf({5, 4}, 202), leaf({5}, 203)}, "linear");
  expect_gradcheck(linear2, {leaf({3, 4}, 204), leaf({5, 4}, 205)}, "linear without bias");
  expect_gradcheck(linear3, {leaf({2, 3, 4}, 206), leaf({5, 4}, 207), leaf({5}, 208)}, "linear 3-D input");
  expect_gradcheck(linear3, {leaf({4}, 209), leaf({3, 4}, 210), leaf({3}, 211)}, "linear 1-D input");
  expect_gradcheck(linear3, {leaf({3, 4}, 212), leaf({5, 4}, 213), leaf({3, 5}, 214)}, "linear, 2-D bias");
  expect_gradcheck(linear3, {leaf({3, 4}, 215), leaf({5, 4}, 216), leaf({1}, 217)}, "linear, one-element bias");
  expect_gradcheck(linear3, {transposed_leaf({4, 3}, 218), transposed_leaf({4, 5}, 219), leaf({5}, 220)},
                   "linear of transposed operands");
  expect_gradcheck(linear3, {transposed_leaf({2, 4, 3}, 230, 1, 2), leaf({5, 4}, 231), leaf({5}, 232)},
                   "linear of a 3-D input whose rows do not merge");
  expect_gradcheck(linear3, {leaf({3, 4}, 221).detach(), leaf({5, 4}, 222), leaf({5}, 223).detach()},
                   "linear, weight only");
  expect_gradcheck(linear3, {leaf({3, 4}, 224), leaf({5, 4}, 225).detach(), leaf({5}, 226)},
                   "linear, input and bias");
  expect_gradcheck(linear3, {leaf({0, 4}, 227), leaf({5, 4}, 228), leaf({5}, 229)}, "linear, empty batch");
}

// mm, bmm, 2-D matmul and 2-D linear without bias differentiate through
// products alone (Note [Products with transposed operands]), so their
// second derivatives need no other op's backward.
TEST(LinalgGrad, GradientsMatchTorch) {
  std::vector<kiln::test::TorchGradCase> cases;
  uint64_t seed = 1000;
  for (const MatmulCase& c : kMatmulCases) {
    cases.push_back({c.label, matmul2, {leaf(c.a, seed), leaf(c.b, seed + 1)}, "torch.matmul(x0, x1)"});
    seed += 2;
  }
  cases.push_back({"mm transposed", mm2, {transposed_leaf({4, 3}, 1100), transposed_leaf({5, 4}, 1101)},
                   "torch.mm(x0, x1)"});
  cases.push_back({"bmm", bmm2, {leaf({2, 3, 4}, 1102), leaf({2, 4, 5}, 1103)}, "torch.bmm(x0, x1)"});
  cases.push_back({"linear", linear3, {leaf({3, 4}, 1104), leaf({5, 4}, 1105), leaf({5}, 1106)},
                   "F.linear(x0, x1, x2)"});
  cases.push_back({"linear 3-D", linear3, {leaf({2, 3, 4}, 1107), leaf({5, 4}, 1108), leaf({5}, 1109)},
                   "F.linear(x0, x1, x2)"});
  cases.push_back({"linear 1-D", linear3, {leaf({4}, 1110), leaf({5, 4}, 1111), leaf({5}, 1112)},
                   "F.linear(x0, x1, x2)"});
  cases.push_back({"linear 2-D bias", linear3, {leaf({3, 4}, 1113), leaf({5, 4}, 1114), leaf({3, 5}, 1115)},
                   "F.linear(x0, x1, x2)"});
  kiln::test::expect_grads_match_torch(cases, 1e-10, 1e-12);
}

TEST(LinalgGrad, SecondDerivativesOfProducts) {
  expect_gradgradcheck(mm2, {leaf({3, 4}, 301), leaf({4, 2}, 302)}, "mm");
  expect_gradgradcheck(mm2, {transposed_leaf({4, 3}, 303), transposed_leaf({2, 4}, 304)}, "mm transposed");
  expect_gradgradcheck(bmm2, {leaf({2, 3, 4}, 305), leaf({2, 4, 2}, 306)}, "bmm");
  expect_gradgradcheck(matmul2, {leaf({3, 4}, 307), leaf({4, 2}, 308)}, "matmul 2-D");
  expect_gradgradcheck(linear2, {leaf({3, 4}, 309), leaf({5, 4}, 310)}, "linear 2-D");
}

// matmul's 1-D and batched cases and linear's leading dims add views
// (unsqueeze, squeeze, reshape, transpose), the dot product a mul, and
// broadcast batches and linear's bias a sum to the formula; their second
// derivatives go through those ops' own backward.
TEST(LinalgGrad, SecondDerivativesOfEveryCase) {
  uint64_t seed = 350;
  for (const MatmulCase& c : kMatmulCases) {
    expect_gradgradcheck(matmul2, {leaf(c.a, seed), leaf(c.b, seed + 1)}, c.label);
    seed += 2;
  }
  expect_gradgradcheck(linear3, {leaf({3, 4}, 380), leaf({5, 4}, 381), leaf({5}, 382)}, "linear");
  expect_gradgradcheck(linear3, {leaf({2, 3, 4}, 383), leaf({5, 4}, 384), leaf({5}, 385)}, "linear 3-D input");
  expect_gradgradcheck(linear3, {leaf({4}, 386), leaf({5, 4}, 387), leaf({5}, 388)}, "linear 1-D input");
  expect_gradgradcheck(linear3, {leaf({3, 4}, 389), leaf({5, 4}, 390), leaf({3, 5}, 391)}, "linear 2-D bias");
  expect_gradgradcheck([](const TensorList& x) { return mm(x[0].t(), x[1].t()); }, {leaf({4, 3}, 392), leaf({2, 4}, 393)},
                       "mm of transposed views");
  expect_gradgradcheck([](const TensorList& x) { return bmm(x[0].transpose(1, 2), x[1]); },
                       {leaf({2, 4, 3}, 394), leaf({2, 4, 2}, 395)}, "bmm of a transposed view");
}

TEST(LinalgGrad, Float32AndBFloat16MatchFloat64) {
  // float32: oneDNN sums k products in another order than BLAS's dgemm; 1e-5
  // of the largest gradient covers k <= 64 here. bfloat16: every gradient is
  // rounded to 8 bits after a float32 sum, so 1.6e-2 of the largest.
  struct Tol {
    DType dt;
    double tol;
  };
  for (const Tol t : {Tol{kFloat32, 1e-5}, Tol{kBFloat16, 1.6e-2}}) {
    expect_grads_match_float64(mm2, {leaf({16, 64}, 401), leaf({64, 24}, 402)}, 403, t.dt, t.tol, "mm");
    expect_grads_match_float64(mm2, {transposed_leaf({64, 16}, 404), transposed_leaf({24, 64}, 405)}, 406, t.dt,
                               t.tol, "mm transposed");
    expect_grads_match_float64(linear2, {transposed_leaf({48, 10}, 423), transposed_leaf({48, 20}, 424)}, 425, t.dt,
                               t.tol, "linear transposed");
    expect_grads_match_float64(bmm2, {leaf({3, 8, 32}, 407), leaf({3, 32, 5}, 408)}, 409, t.dt, t.tol, "bmm");
    expect_grads_match_float64(matmul2, {leaf({2, 1, 6, 32}, 410), leaf({3, 32, 4}, 411)}, 412, t.dt, t.tol,
                               "matmul broadcast");
    expect_grads_match_float64(matmul2, {leaf({4, 6, 32}, 413), leaf({32, 7}, 414)}, 415, t.dt, t.tol,
                               "matmul folded");
    expect_grads_match_float64(matmul2, {leaf({32}, 416), leaf({32}, 417)}, 418, t.dt, t.tol, "dot");
    expect_grads_match_float64(linear3, {leaf({2, 9, 48}, 419), leaf({20, 48}, 420), leaf({20}, 421)}, 422, t.dt,
                               t.tol, "linear");
  }
}

TEST(LinalgGrad, Float16GradientsComputeInFloat32) {
  const Tensor a = leaf({3, 4}, 501).detach().to(kFloat16).requires_grad_();
  const Tensor b = leaf({4, 2}, 502).detach().to(kFloat16).requires_grad_();
  const TensorList g = autograd::grad({mm(a, b)}, {a, b}, {ones({3, 2}, kFloat16)});
  EXPECT_EQ(g[0].dtype(), kFloat16);
  const Tensor want = ones({3, 2}).mm(b.detach().to(kFloat32).t());
  EXPECT_TRUE(g[0].to(kFloat32).allclose(want, 1e-3, 1e-3));
}

TEST(LinalgGrad, NodesAreNamedAndRecordTheCallSite) {
  const Tensor a = leaf({3, 4}, 601), b = leaf({4, 2}, 602);
  const int line = __LINE__ + 1;
  const Tensor y = mm(a, b);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "MmBackward0");
  EXPECT_EQ(y.grad_fn()->site().line, static_cast<uint32_t>(line));
  EXPECT_NE(std::string(y.grad_fn()->site().file).find("test_linalg_grad.cpp"), std::string::npos);
  const int mline = __LINE__ + 1;
  const Tensor z = a.matmul(b);
  EXPECT_EQ(z.grad_fn()->site().line, static_cast<uint32_t>(mline));
  EXPECT_STREQ(bmm(leaf({2, 3, 4}, 603), leaf({2, 4, 2}, 604)).grad_fn()->name(), "BmmBackward0");
  EXPECT_STREQ(matmul(leaf({2, 3, 4}, 605), leaf({4}, 606)).grad_fn()->name(), "MatmulBackward0");
  // As torch 1.13 names them: type(torch.matmul(a, b).grad_fn).__name__ for 1-D @ 1-D and 2-D @ 1-D.
  EXPECT_STREQ(matmul(leaf({4}, 609), leaf({4}, 610)).grad_fn()->name(), "DotBackward0");
  EXPECT_STREQ(matmul(leaf({3, 4}, 611), leaf({4}, 612)).grad_fn()->name(), "MvBackward0");
  EXPECT_STREQ(linear(leaf({3, 4}, 607), leaf({5, 4}, 608)).grad_fn()->name(), "LinearBackward0");
}

TEST(LinalgGrad, NothingRecordedWithoutGrad) {
  const Tensor a = leaf({3, 4}, 701).detach(), b = leaf({4, 2}, 702).detach();
  EXPECT_EQ(mm(a, b).grad_fn(), nullptr);
  EXPECT_FALSE(matmul(a, b).requires_grad());
  const Tensor ag = leaf({3, 4}, 703);
  {
    const NoGradGuard ng;
    EXPECT_FALSE(linear(ag, leaf({5, 4}, 704)).requires_grad());
    EXPECT_EQ(matmul(leaf({2, 3, 4}, 705), leaf({4}, 706)).grad_fn(), nullptr);
  }
}

TEST(LinalgGrad, SavedOperandModifiedInPlaceIsNamed) {
  const Tensor a = leaf({3, 4}, 801);
  Tensor b = leaf({4, 2}, 802).detach();
  const Tensor y = mm(a, b);
  b.mul_(2);
  try {
    y.backward(ones({3, 2}, kFloat64));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("MmBackward0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("modified in place"), std::string::npos) << msg;
  }
}

TEST(LinalgGrad, BackwardReusesCachedPrimitives) {
  const Tensor x = leaf({8, 16}, 901).detach().to(kFloat32).requires_grad_();
  const Tensor w = leaf({12, 16}, 902).detach().to(kFloat32).requires_grad_();
  const Tensor bias = leaf({12}, 903).detach().to(kFloat32).requires_grad_();
  auto step = [&] {
    const TensorList g = autograd::grad({linear(x, w, bias)}, {x, w, bias}, {ones({8, 12})});
    return g[1];
  };
  const Tensor first = step();
  const int64_t created = kernels::dnnl_primitives_created();
  const Tensor second = step();
  EXPECT_EQ(kernels::dnnl_primitives_created(), created) << "a repeated backward created oneDNN primitives";
  EXPECT_TRUE(first.allclose(second, 0, 0));
}

// linear with a 1-D weight [in_features], torch.nn.functional.linear's documented form: input · weight with
// the last dim dropped, plus a 0-dim bias. torch 1.13 (the oracle) computes it without a bias, so those
// cases compare with F.linear itself; with a bias it refuses 2-D and contiguous 3-D inputs ("mat2 must be
// a matrix": its addmm fast path assumes a 2-D weight), so every biased case compares with
// torch.matmul(x, w) + b, the formula torch documents and later versions compute.
TEST(LinalgGrad, LinearWithVectorWeightMatchesTorch) {
  struct VectorWeightCase {
    const char* label;
    Tensor x;
    bool bias;
  };
  const std::vector<VectorWeightCase> cases = {
      {"1-D input", leaf({4}, 1201), false},
      {"1-D input, bias", leaf({4}, 1202), true},
      {"2-D input", leaf({3, 4}, 1203), false},
      {"2-D input, bias", leaf({3, 4}, 1204), true},
      {"3-D input", leaf({2, 3, 4}, 1205), false},
      {"3-D input, bias", leaf({2, 3, 4}, 1206), true},
      {"transposed 2-D input, bias", transposed_leaf({4, 3}, 1207), true},
  };
  std::vector<kiln::test::TorchGradCase> grads;
  kiln::test::OracleBatch values;
  struct Pending {
    size_t index;
    Tensor got;
    double tol;
    std::string what;
  };
  std::vector<Pending> pending;
  uint64_t seed = 1210;
  for (const VectorWeightCase& c : cases) {
    const Tensor w = leaf({4}, seed++), b = leaf({}, seed++);
    TensorList xs{c.x, w};
    if (c.bias) xs.push_back(b);
    const std::string expr = c.bias ? "torch.matmul(x0, x1) + x2" : "F.linear(x0, x1)";
    grads.push_back({c.label, c.bias ? linear3 : linear2, xs, expr});
    for (DType dt : {kFloat32, kFloat64}) {
      TensorList in;
      for (const Tensor& x : xs) in.push_back(x.detach().to(dt));
      const Tensor got = c.bias ? linear(in[0], in[1], in[2]) : linear(in[0], in[1]);
      pending.push_back({values.add(std::string(c.label) + " " + std::string(dtype_name(dt)), expr, in), got,
                         dt == kFloat32 ? 1e-5 : 1e-12, std::string(c.label) + " " + std::string(dtype_name(dt))});
    }
  }
  values.run();
  for (const Pending& p : pending) {
    const kiln::test::OracleOutcome& r = values.outcome(p.index);
    ASSERT_TRUE(r.ok) << p.what << ": torch raised " << r.error;
    ASSERT_EQ(p.got.sizes().vec(), r.outputs[0].sizes().vec()) << p.what;
    ASSERT_EQ(p.got.dtype(), r.outputs[0].dtype()) << p.what;
    const auto a = kiln::test::values(p.got), e = kiln::test::values(r.outputs[0]);
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_LE(std::abs(a[i] - e[i]), p.tol * (1 + std::abs(e[i]))) << p.what << " element " << i;
  }
  kiln::test::expect_grads_match_torch(grads, 1e-10, 1e-12);
}

TEST(LinalgGrad, LinearWithVectorWeightGradcheck) {
  expect_gradcheck(linear2, {leaf({3, 4}, 1301), leaf({4}, 1302)}, "linear, 1-D weight");
  expect_gradcheck(linear3, {leaf({2, 3, 4}, 1303), leaf({4}, 1304), leaf({}, 1305)}, "linear, 1-D weight, bias");
  expect_gradcheck(linear3, {leaf({4}, 1306), leaf({4}, 1307), leaf({}, 1308)}, "linear, 1-D input and weight");
  expect_gradgradcheck(linear3, {leaf({3, 4}, 1309), leaf({4}, 1310), leaf({}, 1311)}, "linear, 1-D weight, bias");
  expect_gradgradcheck(linear2, {leaf({4}, 1312), leaf({4}, 1313)}, "linear, 1-D input and weight");
}

TEST(LinalgGrad, LinearWithVectorWeightErrors) {
  auto message = [](auto f) { return kiln::test::error_message<ShapeError>(f); };
  const std::string wrong_in = message([] { linear(zeros({3, 4}), zeros({5})); });
  EXPECT_NE(wrong_in.find("input of shape [3, 4] has in_features 4 but the 1-D weight of shape [5] expects 5"),
            std::string::npos)
      << wrong_in;
  // The output of a 2-D input is [3]: a [2] bias cannot broadcast to it, nor a [1] bias to the 0-dim output of a
  // 1-D input (torch: "output with shape [] doesn't match the broadcast shape [1]").
  const std::string bad_bias = message([] { linear(zeros({3, 4}), zeros({4}), zeros({2})); });
  EXPECT_NE(bad_bias.find("bias of shape [2] does not broadcast to the output shape [3]"), std::string::npos)
      << bad_bias;
  EXPECT_NE(bad_bias.find("expected a 0-dim bias"), std::string::npos) << bad_bias;
  EXPECT_NE(message([] { linear(zeros({4}), zeros({4}), zeros({1})); }), "<no error>");
  const std::string three_d = message([] { linear(zeros({3, 4}), zeros({2, 3, 4})); });
  EXPECT_NE(three_d.find("[out_features, in_features] or [in_features], got [2, 3, 4]"), std::string::npos)
      << three_d;
  EXPECT_EQ(linear(zeros({2, 3, 4}), ones({4}), full({}, 0.5)).sizes().vec(), (std::vector<int64_t>{2, 3}));
}
