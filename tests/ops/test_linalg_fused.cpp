// The inference forms of linear (kiln/ops/linalg.h): linear_gelu (GELU
// inside the product when nothing is differentiated: a oneDNN post-op, or for
// float32 tanh kiln's GELU rows over the product's output)
// against the two ops it stands for, and the cases that must run as the two
// ops; WeightPack (the weight kept in oneDNN's layout) against plain linear,
// and its repacking when the weight changes.
#include <gtest/gtest.h>

#include <string>

#include "kiln/core/allocator.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/linalg.h"

using namespace kiln;

namespace {

Tensor composite(const Tensor& x, const Tensor& w, const Tensor& b, const std::string& approximate) {
  return linear(x, w, b).gelu(approximate);
}

}  // namespace

TEST(LinearGelu, InferenceMatchesLinearThenGelu) {
  manual_seed(31);
  for (const std::string approximate : {"tanh", "none"}) {
    for (bool with_bias : {true, false}) {
      const Tensor x = randn({2, 64, 96}) * 2.0, w = randn({200, 96}) * 0.2;
      const Tensor b = with_bias ? randn({200}) * 0.5 : Tensor();
      const NoGradGuard no_grad;
      const Tensor fused = linear_gelu(x, w, b, approximate);
      const Tensor ref = composite(x, w, b, approximate);
      ASSERT_EQ(fused.sizes(), ref.sizes());
#if defined(__AVX512F__)
      // Note [GELU after the product]: float32 tanh GELU runs kiln's own rows over the plain product.
      if (approximate == "tanh") {
        EXPECT_TRUE(fused.equal(ref)) << "bias " << with_bias << ": max diff "
                                      << (fused - ref).abs().max().item<float>();
        continue;
      }
#endif
      // oneDNN's GELU post-op and kiln's GELU differ in their last bits (a few ulp of the result).
      EXPECT_TRUE(fused.allclose(ref, 1e-5, 1e-6)) << approximate << " bias " << with_bias << ": max diff "
                                                  << (fused - ref).abs().max().item<float>();
    }
  }
}

TEST(LinearGelu, BFloat16InferenceMatches) {
  manual_seed(32);
  const Tensor x = randn({40, 64}).to(kBFloat16), w = (randn({48, 64}) * 0.2).to(kBFloat16);
  const Tensor b = (randn({48}) * 0.5).to(kBFloat16);
  const NoGradGuard no_grad;
  const Tensor fused = linear_gelu(x, w, b, "tanh").to(kFloat32);
  const Tensor ref = composite(x, w, b, "tanh").to(kFloat32);
  EXPECT_TRUE(fused.allclose(ref, 2e-2, 2e-2));
}

TEST(LinearGelu, DifferentiatesAsTheTwoOps) {
  manual_seed(33);
  const Tensor x0 = randn({5, 7}), w0 = randn({3, 7}), b0 = randn({3});
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor xr = x0.clone().requires_grad_(), wr = w0.clone().requires_grad_(), br = b0.clone().requires_grad_();
  const Tensor y = linear_gelu(x, w, b, "tanh");
  const Tensor yr = composite(xr, wr, br, "tanh");
  EXPECT_TRUE(y.equal(yr));
  ASSERT_TRUE(y.grad_fn());
  EXPECT_STREQ(y.grad_fn()->name(), yr.grad_fn()->name());
  y.sum().backward();
  yr.sum().backward();
  EXPECT_TRUE(x.grad().equal(xr.grad()));
  EXPECT_TRUE(w.grad().equal(wr.grad()));
  EXPECT_TRUE(b.grad().equal(br.grad()));
}

TEST(LinearGelu, UnfusableCasesAreTheTwoOpsExactly) {
  manual_seed(34);
  const NoGradGuard no_grad;
  const Tensor x64 = randn({6, 5}, TensorOptions(kFloat64)), w64 = randn({4, 5}, TensorOptions(kFloat64));
  EXPECT_TRUE(linear_gelu(x64, w64, {}, "tanh").equal(composite(x64, w64, {}, "tanh")));
  const Tensor x = randn({6, 5}), w = randn({4, 5}), b2 = randn({6, 4});  // a bias that is not [out_features]
  EXPECT_TRUE(linear_gelu(x, w, b2, "none").equal(composite(x, w, b2, "none")));
  EXPECT_THROW(linear_gelu(x, w, {}, "sigmoid"), ValueError);  // gelu's own error
}

// TransformerMLP uses linear_gelu, but a hook on c_fc or gelu must still see its module run.
TEST(LinearGelu, MlpHooksStillRun) {
  manual_seed(35);
  nn::TransformerBlockOptions o{.d_model = 16, .n_head = 2};
  o.d_ff = 64;
  nn::TransformerMLP mlp(o);
  mlp.eval();
  const Tensor x = randn({2, 3, 16});
  const NoGradGuard no_grad;
  const Tensor fused = mlp(x);
  int calls = 0;
  auto handle = mlp.gelu->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) {
    ++calls;
    return out;
  });
  const Tensor hooked = mlp(x);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(fused.allclose(hooked, 1e-5, 1e-6));
}

// ---- WeightPack: linear reading the weight in oneDNN's own layout ----

TEST(WeightPack, InferenceMatchesPlainLinear) {
  manual_seed(41);
  struct Shape {
    int64_t rows, in, out;
  };
  for (const Shape s : {Shape{128, 256, 768}, Shape{128, 1024, 256}, Shape{7, 33, 65}, Shape{1, 256, 256}}) {
    for (bool with_bias : {true, false}) {
      const Tensor x = randn({s.rows, s.in}), w = randn({s.out, s.in}) * 0.1;
      const Tensor b = with_bias ? randn({s.out}) : Tensor();
      WeightPack pack;
      const NoGradGuard no_grad;
      const Tensor ref = linear(x, w, b);
      // Whether oneDNN wants b in a layout of its own here (it does for the first
      // shapes on AVX-512 machines); if so, the pack must hold that many bytes.
      kernels::MatmulArgs g;
      g.m = s.rows;
      g.k = s.in;
      g.n = s.out;
      g.a.stride[1] = s.in;
      g.b.stride[1] = 1;
      g.b.stride[2] = s.in;  // Wᵀ read in place
      g.bias = with_bias ? b.data_ptr() : nullptr;
      const size_t packed_bytes = kernels::matmul_packed_layout(g).bytes;
      const int64_t buffers = memory::stats()[MemoryCategory::Buffer].live_bytes;
      for (int call = 0; call < 2; ++call) {  // packs on the first call, reuses on the second
        const Tensor y = linear(x, w, b, pack);
        EXPECT_TRUE(y.allclose(ref, 1e-5, 1e-5)) << s.rows << "x" << s.in << "->" << s.out << " call " << call;
        EXPECT_GE(memory::stats()[MemoryCategory::Buffer].live_bytes - buffers, static_cast<int64_t>(packed_bytes));
      }
      const Tensor y3 = linear(x.view({1, s.rows, s.in}), w, b, pack);  // leading dims
      EXPECT_TRUE(y3.view({s.rows, s.out}).allclose(ref, 1e-5, 1e-5));
    }
  }
}

TEST(WeightPack, FollowsTheWeightWhenItChanges) {
  manual_seed(42);
  const Tensor x = randn({128, 64});
  Tensor w = randn({96, 64}) * 0.1;
  const Tensor b = randn({96});
  WeightPack pack;
  const NoGradGuard no_grad;
  const Tensor before = linear(x, w, b, pack);
  w.mul_(2.0);  // in place: a new version of the same tensor
  EXPECT_TRUE(linear(x, w, b, pack).allclose(linear(x, w, b), 1e-5, 1e-5));
  EXPECT_FALSE(linear(x, w, b, pack).allclose(before, 1e-5, 1e-5));
  const Tensor w2 = randn({96, 64}) * 0.1;  // another tensor of the same shape
  EXPECT_TRUE(linear(x, w2, b, pack).allclose(linear(x, w2, b), 1e-5, 1e-5));
  EXPECT_TRUE(linear(x, w, b, pack).allclose(linear(x, w, b), 1e-5, 1e-5));  // and back
  const int before_threads = get_num_threads();
  set_num_threads(before_threads == 1 ? 2 : 1);  // oneDNN may choose another layout
  EXPECT_TRUE(linear(x, w, b, pack).allclose(linear(x, w, b), 1e-5, 1e-5));
  set_num_threads(before_threads);
}

TEST(WeightPack, GradientsTakeThePlainPath) {
  manual_seed(43);
  const Tensor x = randn({16, 8}), w = randn({4, 8}).requires_grad_(), b = randn({4});
  WeightPack pack;
  const Tensor y = linear(x, w, b, pack);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_STREQ(y.grad_fn()->name(), "LinearBackward0");
  EXPECT_TRUE(y.equal(linear(x, w, b)));
}

TEST(WeightPack, LinearModuleRepacksAfterLoadStateDict) {
  manual_seed(44);
  nn::Linear a({.in_features = 32, .out_features = 48}), b({.in_features = 32, .out_features = 48});
  const Tensor x = randn({128, 32});
  const NoGradGuard no_grad;
  const Tensor ya = a(x);
  EXPECT_TRUE(ya.allclose(linear(x, a.weight, a.bias), 1e-5, 1e-5));
  a.load_state_dict(b.state_dict());
  EXPECT_TRUE(a(x).allclose(linear(x, b.weight, b.bias), 1e-5, 1e-5));
}

// ---- linear_add: a residual added inside the product ----

TEST(LinearAdd, InferenceMatchesAddendPlusLinear) {
  manual_seed(51);
  const Tensor x = randn({1, 128, 256}), w = randn({256, 256}) * 0.05, b = randn({256}), r = randn({1, 128, 256});
  const NoGradGuard no_grad;
  const Tensor ref = r + linear(x, w, b);
  // Each element is (x·w + b) rounded, then + r rounded: the same two roundings as the two ops.
  EXPECT_TRUE(linear_add(x, w, b, r).allclose(ref, 1e-6, 1e-6));
  WeightPack pack;
  EXPECT_TRUE(linear_add(x, w, b, r, &pack).allclose(ref, 1e-5, 1e-5));
  EXPECT_TRUE(linear_add(x, w, {}, r, &pack).allclose(r + linear(x, w), 1e-5, 1e-5));
}

TEST(LinearAdd, OtherCasesAreTheTwoOps) {
  manual_seed(52);
  const Tensor x = randn({6, 8}), w = randn({5, 8}), b = randn({5});
  {
    const NoGradGuard no_grad;
    const Tensor row = randn({5});  // broadcasts: not the output's shape
    EXPECT_TRUE(linear_add(x, w, b, row).equal(row + linear(x, w, b)));
    const Tensor strided = randn({5, 6}).t();  // the output's shape, not contiguous
    EXPECT_TRUE(linear_add(x, w, b, strided).equal(strided + linear(x, w, b)));
  }
  const Tensor r = randn({6, 5}).requires_grad_();
  const Tensor y = linear_add(x, w, b, r);
  ASSERT_TRUE(y.grad_fn());
  y.sum().backward();
  EXPECT_TRUE(r.grad().equal(ones({6, 5})));
}

// The block's inference path (residuals inside c_proj, GELU inside c_fc, packed
// weights) against the same block run module by module (a hook on each forces that).
TEST(LinearAdd, TransformerBlockInferenceMatchesModuleByModule) {
  manual_seed(53);
  nn::TransformerBlock block({.d_model = 64, .n_head = 4});
  block.eval();
  const Tensor x = randn({2, 40, 64});
  const NoGradGuard no_grad;
  const Tensor fused = block(x);
  auto keep = [](nn::Module&, const Tensor&, const Tensor& out) { return out; };
  auto h1 = block.attn->register_forward_hook(keep);
  auto h2 = block.mlp->register_forward_hook(keep);
  auto h3 = block.mlp->gelu->register_forward_hook(keep);
  const Tensor plain = block(x);
  EXPECT_TRUE(fused.allclose(plain, 1e-5, 1e-5)) << (fused - plain).abs().max().item<float>();
}

// ---- matmul_into: a product written into a strided view ----

TEST(MatmulInto, WritesRowsOfALargerTensorInPlace) {
  manual_seed(61);
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat32 ? 1e-5 : 1e-12;
    // [1, H, n, E] rows r0.. of a [1, L, H, E] buffer seen as [1, H, L, E] (attention's heads).
    const int64_t H = 3, L = 10, E = 5, K = 7, r0 = 4, n = 5;
    const Tensor a = randn({1, H, n, K}, TensorOptions(dt)), b = randn({1, H, K, E}, TensorOptions(dt));
    const Tensor buf = zeros({1, L, H, E}, TensorOptions(dt));
    const Tensor view = buf.transpose(1, 2).narrow(2, r0, n);
    const uint32_t version = buf.version();
    matmul_into(a, b, view);
    EXPECT_GT(buf.version(), version);
    EXPECT_TRUE(view.allclose(a.matmul(b), tol, tol));
    EXPECT_EQ(buf.transpose(1, 2).narrow(2, 0, r0).abs().sum().item<double>(), 0.0);  // other rows untouched
    EXPECT_EQ(buf.transpose(1, 2).narrow(2, r0 + n, L - r0 - n).abs().sum().item<double>(), 0.0);
    // 2-D into a column block of a wider matrix.
    const Tensor a2 = randn({4, K}, TensorOptions(dt)), b2 = randn({K, 3}, TensorOptions(dt));
    const Tensor wide = zeros({4, 9}, TensorOptions(dt));
    matmul_into(a2, b2, wide.narrow(1, 2, 3));
    EXPECT_TRUE(wide.narrow(1, 2, 3).allclose(a2.matmul(b2), tol, tol));
    EXPECT_EQ(wide.narrow(1, 0, 2).abs().sum().item<double>(), 0.0);
  }
}

TEST(MatmulInto, BatchDimsThatDoNotMergeAreWrittenInPlace) {
  // Two batch dims with their own strides: one kernel call (oneDNN for
  // float32/bf16, a loop over the outer dim for float64 and integers).
  manual_seed(62);
  for (DType dt : {kFloat32, kBFloat16, kFloat64, kInt64}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor a = (randn({2, 3, 4, 5}) * 4).to(dt), b = (randn({2, 3, 5, 6}) * 4).to(dt);
    const Tensor buf = zeros({2, 4, 3, 6}, TensorOptions(dt));
    const Tensor out = buf.transpose(1, 2);  // batch dims [2, 3] with strides that do not merge
    const uint32_t version = buf.version();
    matmul_into(a, b, out);
    EXPECT_GT(buf.version(), version);
    // The same products on contiguous operands; bf16 rounds each result once, so they agree to its ulp.
    const double tol = dt == kBFloat16 ? 1.0 / 128 : 1e-5;
    EXPECT_TRUE(out.to(kFloat64).allclose(a.matmul(b).to(kFloat64), tol, tol));
    // One row per product (decoding's single query): the row dim's stride is then arbitrary.
    const Tensor a1 = a.narrow(2, 0, 1).contiguous();
    const Tensor buf1 = zeros({2, 4, 3, 6}, TensorOptions(dt));
    const Tensor out1 = buf1.transpose(1, 2).narrow(2, 1, 1);  // [2, 3, 1, 6], batch dims still apart
    matmul_into(a1, b, out1);
    EXPECT_TRUE(out1.to(kFloat64).allclose(a1.matmul(b).to(kFloat64), tol, tol));
    EXPECT_EQ(buf1.transpose(1, 2).narrow(2, 0, 1).abs().sum().item<double>(), 0.0);  // other rows untouched
  }
}

TEST(MatmulInto, ErrorsNameTheProblem) {
  const Tensor a = randn({2, 4, 5}), b = randn({2, 5, 6});
  EXPECT_THROW(matmul_into(a, b, zeros({2, 4, 7})), ShapeError);
  EXPECT_THROW(matmul_into(a, randn({3, 5, 6}), zeros({2, 4, 6})), ShapeError);
  EXPECT_THROW(matmul_into(a, b, zeros({2, 4, 6}, TensorOptions(kFloat64))), DTypeError);
  EXPECT_THROW(matmul_into(a.clone().requires_grad_(), b, zeros({2, 4, 6})), ValueError);
}
