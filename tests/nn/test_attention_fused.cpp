// The fused scaled_dot_product_attention against the composite form (values and
// q/k/v gradients), float64 gradcheck, double backward, dispatch, and memory:
// after forward the graph holds O(T) extra bytes, not a T x T matrix.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kiln/autograd/engine.h"
#include "kiln/kernels/attention.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/autograd/node.h"
#include "kiln/core/allocator.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/nn/attention.h"

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

struct Case {
  std::string id;
  std::vector<int64_t> qs, ks, vs;
  Tensor mask;
  bool causal = false;
  int64_t block = 64;
};

std::vector<Case> cases(DType dt) {
  TensorOptions o(dt);
  std::vector<Case> cs;
  cs.push_back({"unmasked_batch_heads", {2, 3, 70, 8}, {2, 3, 70, 8}, {2, 3, 70, 5}, {}, false, 64});
  cs.push_back({"causal_T_not_multiple", {2, 3, 70, 8}, {2, 3, 70, 8}, {2, 3, 70, 8}, {}, true, 16});
  // One sequence: the blocks' products write the heads-major output in place (matmul_into).
  cs.push_back({"causal_one_sequence_heads", {1, 3, 70, 8}, {1, 3, 70, 8}, {1, 3, 70, 6}, {}, true, 16});
  cs.push_back({"causal_L_lt_S", {2, 20, 4}, {2, 33, 4}, {2, 33, 6}, {}, true, 7});
  cs.push_back({"causal_L_gt_S", {1, 2, 33, 4}, {1, 2, 20, 4}, {1, 2, 20, 4}, {}, true, 8});
  Tensor b = rand({45, 50}, o).lt(0.7);
  for (int64_t i = 0; i < 45; ++i) b.select(0, i).select(0, i % 50).fill_(true);  // no row fully masked
  cs.push_back({"bool_mask", {2, 2, 45, 8}, {2, 2, 50, 8}, {2, 2, 50, 8}, b, false, 16});
  cs.push_back({"float_mask_batched", {2, 3, 45, 8}, {2, 3, 50, 8}, {2, 3, 50, 4}, randn({2, 1, 45, 50}, o), false, 32});
  cs.push_back({"float_mask_row", {3, 45, 8}, {3, 50, 8}, {3, 50, 4}, randn({1, 50}, o), false, 10});
  cs.push_back({"broadcast_kv", {2, 4, 30, 8}, {30, 8}, {30, 8}, {}, true, 8});
  cs.push_back({"single_block", {2, 3, 40, 8}, {2, 3, 40, 8}, {2, 3, 40, 8}, {}, false, 64});
  cs.push_back({"single_block_causal_broadcast", {2, 3, 40, 8}, {3, 40, 8}, {1, 40, 8}, {}, true, 40});
  cs.push_back({"single_block_mask", {3, 40, 8}, {3, 50, 8}, {3, 50, 8}, randn({3, 40, 50}, o), false, 40});
  // bf16 training's one block of up to 128 rows (Note [Query blocks for bf16 training]).
  cs.push_back({"causal_one_block_of_128", {2, 2, 100, 16}, {2, 2, 100, 16}, {2, 2, 100, 16}, {}, true, 128});
  return cs;
}

void compare_paths(DType dt, double tol) {
  manual_seed(11);
  TensorOptions o(dt);
  for (auto& c : cases(dt)) {
    Tensor q0 = randn(c.qs, o), k0 = randn(c.ks, o), v0 = randn(c.vs, o);
    Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    Tensor qc = q0.clone().requires_grad_(), kc = k0.clone().requires_grad_(), vc = v0.clone().requires_grad_();
    Tensor out = F::detail::sdpa_fused(q, k, v, c.mask, c.causal, c.block);
    Tensor ref = F::detail::sdpa_composite(qc, kc, vc, c.mask, 0.0, c.causal, true);
    ASSERT_EQ(out.sizes(), ref.sizes()) << c.id;
    EXPECT_TRUE(out.allclose(ref, tol, tol)) << c.id;
    EXPECT_STREQ(out.grad_fn()->name(), "FusedSdpaBackward") << c.id;
    Tensor g = randn(out.sizes(), o);
    out.backward(g);
    ref.backward(g);
    EXPECT_TRUE(q.grad().allclose(qc.grad(), tol, tol)) << c.id << " dq";
    EXPECT_TRUE(k.grad().allclose(kc.grad(), tol, tol)) << c.id << " dk";
    EXPECT_TRUE(v.grad().allclose(vc.grad(), tol, tol)) << c.id << " dv";
  }
}

}  // namespace

TEST(AttentionFused, MatchesCompositeFloat32) { compare_paths(kFloat32, 1e-5); }

TEST(AttentionFused, MatchesCompositeFloat64) { compare_paths(kFloat64, 1e-10); }

TEST(AttentionFused, GradcheckFloat64) {
  manual_seed(5);
  TensorOptions f64(kFloat64);
  Tensor q = randn({2, 7, 3}, f64).requires_grad_(), k = randn({2, 9, 3}, f64).requires_grad_(),
         v = randn({2, 9, 4}, f64).requires_grad_();
  Tensor fmask = randn({7, 9}, f64);
  Tensor bmask = rand({7, 9}, f64).lt(0.6);
  for (int64_t i = 0; i < 7; ++i) bmask.select(0, i).select(0, i).fill_(true);
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& x) { return TensorList{F::detail::sdpa_fused(x[0], x[1], x[2], {}, false, 3)}; },
      {q, k, v}));
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& x) { return TensorList{F::detail::sdpa_fused(x[0], x[1], x[2], {}, true, 3)}; }, {q, k, v}));
  // 4-D heads of one sequence: the output is written heads-major in place.
  Tensor q4 = randn({1, 2, 7, 3}, f64).requires_grad_(), k4 = randn({1, 2, 7, 3}, f64).requires_grad_(),
         v4 = randn({1, 2, 7, 4}, f64).requires_grad_();
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& x) { return TensorList{F::detail::sdpa_fused(x[0], x[1], x[2], {}, true, 3)}; },
      {q4, k4, v4}));
  EXPECT_TRUE(autograd::gradcheck(
      [bmask](const TensorList& x) { return TensorList{F::detail::sdpa_fused(x[0], x[1], x[2], bmask, false, 4)}; },
      {q, k, v}));
  EXPECT_TRUE(autograd::gradcheck(
      [fmask](const TensorList& x) { return TensorList{F::detail::sdpa_fused(x[0], x[1], x[2], fmask, false, 2)}; },
      {q, k, v}));
}

TEST(AttentionFused, DoubleBackwardMatchesComposite) {
  manual_seed(6);
  TensorOptions f64(kFloat64);
  Tensor q0 = randn({2, 6, 3}, f64), k0 = randn({2, 6, 3}, f64), v0 = randn({2, 6, 3}, f64);
  auto second = [&](bool fused) {
    Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    Tensor o = fused ? F::detail::sdpa_fused(q, k, v, {}, true, 4) : F::detail::sdpa_composite(q, k, v, {}, 0.0, true, true);
    TensorList g = autograd::grad({o.pow(2).sum()}, {q, k, v}, {}, std::nullopt, /*create_graph=*/true);
    (g[0].sum() + g[1].pow(2).sum() + g[2].sum()).backward();
    return TensorList{q.grad(), k.grad(), v.grad()};
  };
  TensorList a = second(true), b = second(false);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(a[i].allclose(b[i], 1e-10, 1e-10)) << i;
}

// The fused node (a custom Function inside kiln) records its caller's line, as the
// built-in ops' nodes do: anomaly mode, the memory history and the compile profile name it.
TEST(AttentionFused, TheNodeRecordsTheCallersLine) {
  manual_seed(7);
  Tensor q = randn({1, 5, 4}).requires_grad_(), k = randn({1, 5, 4}), v = randn({1, 5, 4});
  const int line = __LINE__ + 1;
  const Tensor out = F::scaled_dot_product_attention(q, k, v);
  ASSERT_STREQ(out.grad_fn()->name(), "FusedSdpaBackward");
  EXPECT_EQ(out.grad_fn()->site().line, static_cast<uint32_t>(line));
  EXPECT_TRUE(out.grad_fn()->site().str().find("test_attention_fused.cpp") != std::string::npos)
      << out.grad_fn()->site().str();
}

TEST(AttentionFused, DispatchSelectsPathAtCallTime) {
  manual_seed(7);
  Tensor q = randn({1, 5, 4}).requires_grad_(), k = randn({1, 5, 4}), v = randn({1, 5, 4});
  EXPECT_STREQ(F::scaled_dot_product_attention(q, k, v).grad_fn()->name(), "FusedSdpaBackward");
  EXPECT_STREQ(F::scaled_dot_product_attention(q, k, v, {}, 0.5, false, /*training=*/false).grad_fn()->name(),
               "FusedSdpaBackward");
  EXPECT_STRNE(F::scaled_dot_product_attention(q, k, v, {}, 0.5, false, /*training=*/true).grad_fn()->name(),
               "FusedSdpaBackward");
  Tensor fmask = randn({5, 5}).requires_grad_();
  EXPECT_STRNE(F::scaled_dot_product_attention(q, k, v, fmask).grad_fn()->name(), "FusedSdpaBackward");
  EXPECT_THROW(F::detail::sdpa_fused(q, k, v, fmask, false), ValueError);
}

// Note [Query blocks for bf16 training]: bf16 with a gradient to compute and
// at most 128 query rows runs one block of all of them; float32, inference
// and longer sequences keep blocks of 64. Each call's bits are those of
// sdpa_fused with that block size.
TEST(AttentionFused, DispatchTakesOneBlockOfRowsForBf16Training) {
  manual_seed(8);
  struct Want {
    DType dt;
    int64_t T;
    bool grad;
    int64_t block;
  };
  for (const Want w : {Want{kBFloat16, 128, true, 128}, Want{kBFloat16, 100, true, 128}, Want{kBFloat16, 64, true, 64},
                       Want{kBFloat16, 200, true, 64}, Want{kBFloat16, 128, false, 64}, Want{kFloat32, 128, true, 64}}) {
    const std::string id = std::string(dtype_name(w.dt)) + " T=" + std::to_string(w.T) + (w.grad ? " grad" : "");
    const TensorOptions o(w.dt);
    const Tensor q0 = randn({2, 3, w.T, 16}, o), k0 = randn({2, 3, w.T, 16}, o), v0 = randn({2, 3, w.T, 16}, o);
    const Tensor g = randn({2, 3, w.T, 16}, o);
    auto run = [&](int64_t block) {  // 0: the dispatch's choice
      Tensor q = q0.clone().requires_grad_(w.grad), k = k0.clone().requires_grad_(w.grad),
             v = v0.clone().requires_grad_(w.grad);
      const Tensor out = block == 0 ? F::scaled_dot_product_attention(q, k, v, {}, 0.0, true)
                                    : F::detail::sdpa_fused(q, k, v, {}, true, block);
      if (!w.grad) return TensorList{out};
      out.backward(g);
      return TensorList{out, q.grad(), k.grad(), v.grad()};
    };
    const TensorList got = run(0), want = run(w.block);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i].equal(want[i])) << id << " tensor " << i;
    if (w.block == 128) {  // the choice shows: 64-row blocks sum the key gradients in another order
      const TensorList other = run(64);
      bool differs = false;
      for (size_t i = 0; i < got.size(); ++i) differs = differs || !got[i].equal(other[i]);
      EXPECT_TRUE(differs) << id;
    }
  }
}

TEST(AttentionFused, GraphHoldsOrderTNotTSquared) {
  const int64_t T = 1024, E = 64;
  manual_seed(8);
  Tensor q = randn({1, 1, T, E}).requires_grad_(), k = randn({1, 1, T, E}).requires_grad_(),
         v = randn({1, 1, T, E}).requires_grad_();
  auto held_after_forward = [&](bool fused) {
    const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
    Tensor out = fused ? F::detail::sdpa_fused(q, k, v, {}, true) : F::detail::sdpa_composite(q, k, v, {}, 0.0, true, true);
    const int64_t held = memory::stats()[MemoryCategory::Activation].live_bytes - before;
    out.sum().backward();
    return held;
  };
  const int64_t fused = held_after_forward(true), composite = held_after_forward(false);
  // Output (T*E floats) and log-sum-exp (T floats) only: far below T*T floats.
  EXPECT_LT(fused, T * T * 4 / 4) << "fused held " << fused << " bytes";
  EXPECT_GE(composite, T * T * 4) << "composite held " << composite << " bytes";
  EXPECT_GT(fused, 0);
  RecordProperty("fused_bytes", std::to_string(fused));
  RecordProperty("composite_bytes", std::to_string(composite));
}

// bf16: the row kernels run 16-bit rows of 16 or more visible keys on a float copy (the float vector
// code) and round once. Against the float32 fused path on the same (bf16-exact) inputs: the bf16 path
// also rounds the scores, the weights and the products to bf16 (8 bits of mantissa, 4e-3 relative),
// so the bound is a few of those roundings. Each case has rows on both sides of 16 keys.
TEST(AttentionFused, BFloat16FollowsFloat32) {
  manual_seed(12);
  for (auto& c : cases(kFloat32)) {
    const TensorOptions o(kBFloat16);
    const Tensor q0 = randn(c.qs, o), k0 = randn(c.ks, o), v0 = randn(c.vs, o);
    const Tensor mask = c.mask.defined() && c.mask.is_floating_point() ? c.mask.to(kBFloat16) : c.mask;
    Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    Tensor qf = q0.to(kFloat32).requires_grad_(), kf = k0.to(kFloat32).requires_grad_(),
           vf = v0.to(kFloat32).requires_grad_();
    Tensor out = F::detail::sdpa_fused(q, k, v, mask, c.causal, c.block);
    Tensor ref = F::detail::sdpa_fused(qf, kf, vf, c.mask, c.causal, c.block);
    ASSERT_EQ(out.dtype(), kBFloat16) << c.id;
    EXPECT_TRUE(out.to(kFloat32).allclose(ref, 3e-2, 3e-2)) << c.id;
    const Tensor g = randn(out.sizes(), o);
    out.backward(g);
    ref.backward(g.to(kFloat32));
    EXPECT_TRUE(q.grad().to(kFloat32).allclose(qf.grad(), 1e-1, 1e-1)) << c.id << " dq";
    EXPECT_TRUE(k.grad().to(kFloat32).allclose(kf.grad(), 1e-1, 1e-1)) << c.id << " dk";
    EXPECT_TRUE(v.grad().to(kFloat32).allclose(vf.grad(), 3e-2, 3e-2)) << c.id << " dv";
  }
}

// q, k, v as heads of one [B, T, 3C] projection (the GPT block): backward writes
// their gradients side by side into one buffer, and split's backward hands that
// buffer on instead of a cat. Gradients against the composite form, causal and
// full, with a sequence that is not a multiple of the block; q's gradient must
// reach the split as a view of the very tensor the split passes on.
TEST(AttentionFused, HeadsOfOneProjectionGetOneGradientBuffer) {
  manual_seed(31);
  const int64_t B = 2, T = 70, H = 3, E = 8, C = H * E;
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const Tensor x0 = randn({B, T, 3 * C});
    Tensor dq_seen;
    auto run = [&](bool fused, Tensor* seen) {
      Tensor x = x0.clone().requires_grad_();
      Tensor qkv = x * 1.0;  // an interior tensor, as a linear's output
      if (seen) qkv.register_hook([seen](const Tensor& g) { *seen = g; return Tensor(); });
      auto parts = qkv.split(C, 2);
      if (seen) parts[0].register_hook([&dq_seen](const Tensor& g) { dq_seen = g; return Tensor(); });
      auto heads = [&](const Tensor& t) { return t.view({B, T, H, E}).transpose(1, 2); };
      Tensor y = fused ? F::detail::sdpa_fused(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, causal, 16)
                       : F::detail::sdpa_composite(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, 0.0, causal, false);
      y.backward(y.detach() * 0.5 + 1.0);
      return x.grad();
    };
    Tensor joined;
    const Tensor g_fused = run(true, &joined), g_ref = run(false, nullptr);
    EXPECT_TRUE(g_fused.allclose(g_ref, 1e-5, 1e-6));
    ASSERT_TRUE(joined.defined());
    EXPECT_EQ(joined.sizes(), IntArrayRef({B, T, 3 * C}));
    EXPECT_TRUE(joined.is_contiguous()) << "the three gradients fill one [B, T, 3C] buffer";
    ASSERT_TRUE(dq_seen.defined());
    EXPECT_TRUE(dq_seen.is_alias_of(joined)) << "split's backward passed on q's gradient buffer, not a copy";
  }
}

// Note [Attention by head]: heads of one projection run one head at a time
// (kernels::attention_heads_*), the same values as separate 3-D tensors run
// block by block over all heads; the outputs and the q, k, v gradients must
// be the same bits, in float32 and bf16, causal or not.
TEST(AttentionFused, OneHeadAtATimeGivesTheBitsOfAllHeadsAtOnce) {
  manual_seed(37);
  struct Shape {
    int64_t B, T, H, E, block_rows;
  };
  for (const Shape sh : {Shape{2, 70, 3, 8, 16}, Shape{2, 128, 4, 64, 64}, Shape{1, 33, 2, 7, 8}})
    for (const DType dt : {kFloat32, kBFloat16})
      for (const bool causal : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "T " << sh.T << " E " << sh.E << " " << dtype_name(dt)
                                          << (causal ? " causal" : " full"));
        const int64_t B = sh.B, T = sh.T, H = sh.H, E = sh.E, C = H * E;
        const Tensor x = randn({B, T, 3 * C}).to(dt), dy = randn({B, H, T, E}).to(dt);
        // By head: views of the projection.
        auto heads = [&](const Tensor& t) { return t.view({B, T, H, E}).transpose(1, 2); };
        const Tensor xg = x.clone().requires_grad_();
        auto parts = (xg * 1.0).split(C, 2);
        const Tensor y_heads = F::detail::sdpa_fused(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, causal,
                                                     sh.block_rows);
        const auto g_heads = autograd::grad({y_heads}, {xg}, {dy});
        // All heads at once: the same values as dense [B * H, T, E] tensors.
        auto flat = [&](int64_t i) {
          return heads(x.narrow(2, i * C, C)).contiguous().view({B * H, T, E}).requires_grad_();
        };
        const Tensor q = flat(0), k = flat(1), v = flat(2);
        const Tensor y_all = F::detail::sdpa_fused(q, k, v, {}, causal, sh.block_rows);
        const auto g_all = autograd::grad({y_all}, {q, k, v}, {dy.contiguous().view({B * H, T, E})});
        EXPECT_TRUE(y_heads.contiguous().view({B * H, T, E}).equal(y_all)) << "outputs";
        for (int64_t i = 0; i < 3; ++i)
          EXPECT_TRUE(heads(g_heads[0].narrow(2, i * C, C)).contiguous().view({B * H, T, E}).equal(g_all[i]))
              << "gradient " << i;
      }
}

// Note [Kept weights]: the blocks' weights are saved for backward while they
// take no more than q, k, v and out together, and recomputed from the
// log-sum-exp beyond. Both against the composite form, on the heads path
// (4-D heads) and the block path (3-D), with what the graph holds after the
// forward: the weights' bytes on top when kept, less than them when not.
TEST(AttentionFused, KeepsTheWeightsOfShortSequencesAndRecomputesLongOnes) {
  manual_seed(43);
  struct Shape {
    std::vector<int64_t> q, v;
    int64_t block;
    bool keep;
  };
  const std::vector<Shape> shapes = {{{2, 3, 40, 32}, {2, 3, 40, 24}, 16, true},
                                     {{6, 40, 32}, {6, 40, 24}, 16, true},
                                     {{1, 2, 200, 4}, {1, 2, 200, 4}, 16, false},
                                     {{2, 200, 4}, {2, 200, 4}, 16, false}};
  for (const DType dt : {kFloat32, kFloat64})  // float64: the block path's row kernels (no heads kernel)
    for (const Shape& sh : shapes)
      for (const bool causal : {true, false}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << ", " << sh.q.size() << "-D, T "
                                          << sh.q[sh.q.size() - 2] << (causal ? " causal" : " full"));
        const TensorOptions o(dt);
        const int64_t es = dt == kFloat32 ? 4 : 8;
        const double tol = dt == kFloat32 ? 1e-5 : 1e-10;
        const int64_t L = sh.q[sh.q.size() - 2], E = sh.q.back(), Ev = sh.v.back();
        ASSERT_EQ(kernels::attention_keeps_weights(L, L, E, Ev, causal, sh.block), sh.keep);
        int64_t batch = 1;
        for (size_t d = 0; d + 2 < sh.q.size(); ++d) batch *= sh.q[d];
        const int64_t weight_bytes = batch * kernels::attention_weights_per_head(L, L, causal, sh.block) * es;
        const Tensor q0 = randn(sh.q, o), k0 = randn(sh.q, o), v0 = randn(sh.v, o);
        Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
        const int64_t before = memory::stats()[MemoryCategory::Activation].live_bytes;
        Tensor out = F::detail::sdpa_fused(q, k, v, {}, causal, sh.block);
        const int64_t held = memory::stats()[MemoryCategory::Activation].live_bytes - before;
        const int64_t io = (q0.numel() + k0.numel() + v0.numel() + out.numel()) * es;
        if (sh.keep) {
          EXPECT_GE(held, weight_bytes + out.numel() * es) << "the weights are held with the output";
          EXPECT_LE(weight_bytes, io) << "kept weights never exceed q, k, v and out";
        } else {
          EXPECT_LT(held, weight_bytes) << "no weights held";
        }
        Tensor qc = q0.clone().requires_grad_(), kc = k0.clone().requires_grad_(), vc = v0.clone().requires_grad_();
        Tensor ref = F::detail::sdpa_composite(qc, kc, vc, {}, 0.0, causal, true);
        const Tensor g = randn(out.sizes(), o);
        out.backward(g);
        ref.backward(g);
        EXPECT_TRUE(out.allclose(ref, tol, tol));
        EXPECT_TRUE(q.grad().allclose(qc.grad(), tol, tol)) << "dq";
        EXPECT_TRUE(k.grad().allclose(kc.grad(), tol, tol)) << "dk";
        EXPECT_TRUE(v.grad().allclose(vc.grad(), tol, tol)) << "dv";
      }
}

// Backward's D = Σ dO ∘ out per row (kernels::attention_output_dots) on head
// views of a [B, T, H, E] buffer: the float sum of the products, rounded to
// the dtype once, against the float64 sum (bound below).
TEST(AttentionFused, OutputDotsMatchAFloat64SumPerRow) {
  manual_seed(41);
  const int64_t B = 2, T = 37, H = 3, E = 40;
  for (const DType dt : {kFloat32, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor g = randn({B, T, H, E}).to(dt).transpose(1, 2), o = randn({B, T, H, E}).to(dt).transpose(1, 2);
    const Tensor want = (g.to(kFloat64) * o.to(kFloat64)).sum({-1}, true);
    const Tensor scale = (g.to(kFloat64) * o.to(kFloat64)).abs().sum({-1}, true);
    Tensor got = empty({B, H, T, 1}, TensorOptions(dt));
    auto heads = [](const Tensor& t) { return kernels::HeadOperand{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; };
    kernels::attention_output_dots(dt, B, H, T, E, heads(g), heads(o), got.data_ptr());
    const Tensor err = (got.to(kFloat64) - want).abs();
    // Unit roundoff u of the dtype (2^-24 float32, 2^-8 bf16) on |D|, plus the
    // float32 products' and E additions' error on Σ|products| (rounded once more).
    const double u = dt == kFloat32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
    const Tensor bound = want.abs() * u + scale * ((1 + u) * static_cast<double>(E + 1) * std::ldexp(1.0, -24)) + 1e-30;
    EXPECT_TRUE(err.le(bound).all().item<bool>()) << "worst error / bound " << (err / bound).max().item<double>();
  }
}

// split's backward returns gradients that already lie side by side as one view
// of their buffer (no copy), and joins any others with a copy as before.
TEST(AttentionFused, SplitBackwardJoinsAdjacentGradientsWithoutACopy) {
  const Tensor x = randn({2, 3, 12}).requires_grad_();
  auto parts = x.split(4, 2);
  const Tensor buf = randn({2, 3, 12});
  auto g = autograd::grad({parts[0], parts[1], parts[2]}, {x},
                          {buf.narrow(2, 0, 4), buf.narrow(2, 4, 4), buf.narrow(2, 8, 4)});
  EXPECT_TRUE(g[0].is_alias_of(buf)) << "adjacent pieces of one buffer are passed on as it";
  EXPECT_TRUE(g[0].equal(buf));
  // Out of order, or separate tensors: a copy with the same values.
  auto h = autograd::grad({parts[0], parts[1], parts[2]}, {x},
                          {buf.narrow(2, 4, 4), buf.narrow(2, 0, 4), buf.narrow(2, 8, 4)});
  EXPECT_FALSE(h[0].is_alias_of(buf));
  EXPECT_TRUE(h[0].narrow(2, 0, 4).equal(buf.narrow(2, 4, 4)));
  EXPECT_TRUE(h[0].narrow(2, 4, 4).equal(buf.narrow(2, 0, 4)));
  auto k = autograd::grad({parts[0], parts[2]}, {x}, {buf.narrow(2, 0, 4), buf.narrow(2, 8, 4)});
  EXPECT_FALSE(k[0].is_alias_of(buf));
  EXPECT_TRUE(k[0].narrow(2, 4, 4).equal(zeros({2, 3, 4}))) << "a piece without a gradient gets zeros";
}
