// The fused attention's row kernels (kiln/kernels/attention.h) against a
// float64 reference written out here, over row lengths around the 16-lane
// vector width (shorter than a vector, exact multiples, a partial last vector
// inside the row and at the end of the block), causal offsets and dtypes; and
// the no-grad path of sdpa_fused (no node, no log-sum-exp) against the
// composite form, on the strided head views the GPT block makes.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/attention.h"
#include "kiln/nn/attention.h"

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

struct Shape {
  int64_t batch, rows, cols, row0;
  bool causal;
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {
      {2, 5, 7, 0, false},    {2, 5, 7, 0, true},     {3, 16, 16, 0, true},  {1, 64, 128, 64, true},
      {4, 64, 64, 0, true},   {2, 9, 37, 20, true},   {2, 9, 37, 0, false},  {1, 33, 50, 3, true},
      {2, 20, 130, 110, true}, {1, 3, 300, 0, false}, {2, 40, 33, 0, true},
  };
  return s;
}

// Scaled, masked softmax of one row in float64; returns the log-sum-exp.
double reference_row(const std::vector<double>& x, int64_t visible, double scale, std::vector<double>& p) {
  double m = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) m = std::max(m, x[j] * scale);
  double sum = 0.0;
  for (int64_t j = 0; j < visible; ++j) sum += std::exp(x[j] * scale - m);
  p.assign(x.size(), 0.0);
  for (int64_t j = 0; j < visible; ++j) p[j] = std::exp(x[j] * scale - m) / sum;
  return m + std::log(sum);
}

void check_kernels(DType dt, double tol) {
  manual_seed(21);
  for (const Shape& sh : shapes()) {
    const double scale = 0.37;
    const Tensor raw = (randn({sh.batch, sh.rows, sh.cols}, TensorOptions(kFloat64)) * 3.0).to(dt);
    const Tensor raw64 = raw.to(kFloat64);
    const Tensor dp0 = randn({sh.batch, sh.rows, sh.cols}, TensorOptions(kFloat64)).to(dt);
    const Tensor D = randn({sh.batch, sh.rows + 2}, TensorOptions(kFloat64)).to(dt);  // row stride rows + 2
    const kernels::AttentionBlock blk{.dtype = dt, .batch = sh.batch, .rows = sh.rows, .cols = sh.cols,
                                      .scale = scale, .causal = sh.causal, .row0 = sh.row0,
                                      .row_batch_stride = sh.rows + 2};
    Tensor w = raw.clone(), lse = zeros({sh.batch, sh.rows + 2}, TensorOptions(dt));
    kernels::attention_weights(blk, w.data_ptr(), lse.data_ptr());
    Tensor rec = raw.clone();
    kernels::attention_recompute_weights(blk, rec.data_ptr(), lse.data_ptr());
    Tensor ds = dp0.clone();
    kernels::attention_scores_grad(blk, ds.data_ptr(), w.data_ptr(), D.data_ptr());
    const Tensor w64 = w.to(kFloat64), lse64 = lse.to(kFloat64), rec64 = rec.to(kFloat64), ds64 = ds.to(kFloat64);
    const Tensor dp64 = dp0.to(kFloat64), D64 = D.to(kFloat64);
    for (int64_t b = 0; b < sh.batch; ++b) {
      for (int64_t i = 0; i < sh.rows; ++i) {
        const int64_t visible = sh.causal ? std::min(sh.cols, sh.row0 + i + 1) : sh.cols;
        std::vector<double> x(sh.cols), p;
        for (int64_t j = 0; j < sh.cols; ++j) x[j] = raw64[b][i][j].item<double>();
        const double l = reference_row(x, visible, scale, p);
        EXPECT_NEAR(lse64[b][i].item<double>(), l, tol * (1 + std::abs(l))) << sh.cols << " row " << i;
        const double d = D64[b][i].item<double>();
        for (int64_t j = 0; j < sh.cols; ++j) {
          const double got = w64[b][i][j].item<double>();
          if (j >= visible) {
            EXPECT_EQ(got, 0.0) << "hidden key " << j << " of row " << i;
            EXPECT_EQ(rec64[b][i][j].item<double>(), 0.0);
            EXPECT_EQ(ds64[b][i][j].item<double>(), 0.0);
            continue;
          }
          EXPECT_NEAR(got, p[j], tol) << "cols " << sh.cols << " row " << i << " key " << j;
          EXPECT_NEAR(rec64[b][i][j].item<double>(), p[j], tol) << "recomputed, key " << j;
          // dS uses the kernel's own weights, so only its arithmetic is under test here.
          const double want = got * (dp64[b][i][j].item<double>() - d) * scale;
          EXPECT_NEAR(ds64[b][i][j].item<double>(), want, tol * (1 + std::abs(want))) << "dS, key " << j;
        }
      }
    }
  }
}

}  // namespace

TEST(AttentionKernels, MatchFloat64ReferenceFloat32) { check_kernels(kFloat32, 2e-6); }
TEST(AttentionKernels, MatchFloat64ReferenceFloat64) { check_kernels(kFloat64, 1e-13); }
TEST(AttentionKernels, MatchFloat64ReferenceBFloat16) { check_kernels(kBFloat16, 1e-2); }

// bf16 rows run in registers, NV vectors per row and two rows at a time
// (attention_softmax.cpp), with a shortcut in exp for lanes in [-86, 88]; each
// must give the bits of the float32 kernels on the widened row, rounded once.
// Spread scores (x 60) put some vectors' exp below the shortcut's range and
// into the subnormals; the shapes pair rows of different lengths and rows of
// two batches, and rows shorter than a vector.
TEST(AttentionKernels, BFloat16RowsGiveTheRoundedFloat32Bits) {
  manual_seed(23);
  for (const double spread : {3.0, 60.0})
    for (const Shape& sh : shapes()) {
      SCOPED_TRACE(::testing::Message() << "cols " << sh.cols << " row0 " << sh.row0 << " spread " << spread);
      const Tensor raw = (randn({sh.batch, sh.rows, sh.cols}, TensorOptions(kFloat64)) * spread).to(kBFloat16);
      const Tensor dp0 = randn({sh.batch, sh.rows, sh.cols}).to(kBFloat16);
      const Tensor D = randn({sh.batch, sh.rows}).to(kBFloat16);
      auto block = [&](DType dt) {
        return kernels::AttentionBlock{.dtype = dt, .batch = sh.batch, .rows = sh.rows, .cols = sh.cols,
                                       .scale = 0.37, .causal = sh.causal, .row0 = sh.row0,
                                       .row_batch_stride = sh.rows};
      };
      Tensor w16 = raw.clone(), l16 = zeros({sh.batch, sh.rows}, TensorOptions(kBFloat16));
      Tensor w32 = raw.to(kFloat32), l32 = zeros({sh.batch, sh.rows});
      kernels::attention_weights(block(kBFloat16), w16.data_ptr(), l16.data_ptr());
      kernels::attention_weights(block(kFloat32), w32.data_ptr(), l32.data_ptr());
      EXPECT_TRUE(w16.equal(w32.to(kBFloat16))) << "weights";
      EXPECT_TRUE(l16.equal(l32.to(kBFloat16))) << "log-sum-exp";
      // Recomputed from the bf16 log-sum-exp, and the score gradient from the bf16 weights.
      const Tensor l = l16.to(kFloat32);
      Tensor r16 = raw.clone(), r32 = raw.to(kFloat32);
      kernels::attention_recompute_weights(block(kBFloat16), r16.data_ptr(), l16.data_ptr());
      kernels::attention_recompute_weights(block(kFloat32), r32.data_ptr(), l.data_ptr());
      EXPECT_TRUE(r16.equal(r32.to(kBFloat16))) << "recomputed weights";
      const Tensor w = w16.to(kFloat32), d = D.to(kFloat32);
      Tensor g16 = dp0.clone(), g32 = dp0.to(kFloat32);
      kernels::attention_scores_grad(block(kBFloat16), g16.data_ptr(), w16.data_ptr(), D.data_ptr());
      kernels::attention_scores_grad(block(kFloat32), g32.data_ptr(), w.data_ptr(), d.data_ptr());
      EXPECT_TRUE(g16.equal(g32.to(kBFloat16))) << "score gradient";
    }
}

// Rows of up to 128 keys take the register kernels (and exp_v's one-step
// scaling); wider rows take softmax_row, the float copies and the plain
// loops with scalar exp_vec (rows shorter than a vector). A causal block
// from row 0 shows each row the same visible keys at 130 columns as at 64,
// so the two must give the same bits on every visible key, spread scores
// included (exp's slow path and its subnormals).
TEST(AttentionKernels, RegisterRowsGiveTheBitsOfTheWideRowPaths) {
  manual_seed(24);
  for (const DType dt : {kFloat32, kBFloat16})
    for (const double spread : {3.0, 60.0}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " spread " << spread);
      const int64_t batch = 2, rows = 40;
      const Tensor wide = (randn({batch, rows, 130}, TensorOptions(kFloat64)) * spread).to(dt);
      const Tensor dp_wide = randn({batch, rows, 130}).to(dt);
      const Tensor D = randn({batch, rows}).to(dt);
      auto narrow64 = [](const Tensor& t) { return t.narrow(2, 0, 64).contiguous(); };
      auto block = [&](int64_t cols) {
        return kernels::AttentionBlock{.dtype = dt, .batch = batch, .rows = rows, .cols = cols, .scale = 0.37,
                                       .causal = true, .row0 = 0, .row_batch_stride = rows};
      };
      Tensor w130 = wide.clone(), l130 = zeros({batch, rows}, TensorOptions(dt));
      Tensor w64 = narrow64(wide), l64 = zeros({batch, rows}, TensorOptions(dt));
      kernels::attention_weights(block(130), w130.data_ptr(), l130.data_ptr());
      kernels::attention_weights(block(64), w64.data_ptr(), l64.data_ptr());
      EXPECT_TRUE(narrow64(w130).equal(w64)) << "weights";
      EXPECT_TRUE(l130.equal(l64)) << "log-sum-exp";
      Tensor r130 = wide.clone(), r64 = narrow64(wide);
      kernels::attention_recompute_weights(block(130), r130.data_ptr(), l64.data_ptr());
      kernels::attention_recompute_weights(block(64), r64.data_ptr(), l64.data_ptr());
      EXPECT_TRUE(narrow64(r130).equal(r64)) << "recomputed weights";
      Tensor g130 = dp_wide.clone(), g64 = narrow64(dp_wide);
      kernels::attention_scores_grad(block(130), g130.data_ptr(), w130.data_ptr(), D.data_ptr());
      kernels::attention_scores_grad(block(64), g64.data_ptr(), w64.data_ptr(), D.data_ptr());
      EXPECT_TRUE(narrow64(g130).equal(g64)) << "score gradient";
    }
}

TEST(AttentionKernels, ThreadCountDoesNotChangeBits) {
  manual_seed(22);
  const Tensor raw = randn({8, 64, 128});
  const kernels::AttentionBlock blk{.dtype = kFloat32, .batch = 8, .rows = 64, .cols = 128, .scale = 0.125,
                                    .causal = true, .row0 = 64, .row_batch_stride = 64};
  auto run = [&](int threads) {
    const int before = get_num_threads();
    set_num_threads(threads);
    Tensor w = raw.clone(), lse = empty({8, 64});
    kernels::attention_weights(blk, w.data_ptr(), lse.data_ptr());
    set_num_threads(before);
    return std::make_pair(w, lse);
  };
  auto [w1, l1] = run(1);
  auto [w2, l2] = run(2);
  EXPECT_TRUE(w1.equal(w2));
  EXPECT_TRUE(l1.equal(l2));
}

// Under no-grad sdpa_fused records nothing and computes no log-sum-exp; its
// output is the same function. The heads are strided views of one [B, T, 3C]
// projection, as CausalSelfAttention makes them.
TEST(AttentionKernels, NoGradPathMatchesComposite) {
  manual_seed(23);
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat32 ? 1e-5 : 1e-12;
    for (int64_t B : {1, 3}) {
      const int64_t T = 70, H = 2, hs = 24, C = H * hs;
      const Tensor qkv = randn({B, T, 3 * C}, TensorOptions(dt)).requires_grad_();
      auto heads = [&](int64_t i) { return qkv.narrow(2, i * C, C).view({B, T, H, hs}).transpose(1, 2); };
      for (bool causal : {false, true}) {
        for (int64_t block : {16, 64, 128}) {
          Tensor ref = F::detail::sdpa_composite(heads(0), heads(1), heads(2), {}, 0.0, causal, false);
          const NoGradGuard no_grad;
          Tensor out = F::detail::sdpa_fused(heads(0), heads(1), heads(2), {}, causal, block);
          EXPECT_FALSE(out.grad_fn()) << "block " << block;
          EXPECT_TRUE(out.allclose(ref.detach(), tol, tol)) << "B " << B << " causal " << causal << " block " << block;
        }
      }
    }
  }
}
