// Channels-last (NHWC) tensors: the memory_format predicates and copies,
// conv2d's channels-last results, and the ops that keep that layout
// (elementwise, batch norm, max pooling). Values are checked against the same
// computation on NCHW tensors (identical arithmetic where the kernels are the
// same: exact; a different summation order: stated tolerance), against
// PyTorch for conv2d, and by float64 central differences for the batch norm
// kernel's channels-last backward.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kiln/ops/gradcheck.h"
#include "kiln/ops/memory_format.h"
#include "kiln/kiln.h"
#include "kiln/ops/batch_norm.h"
#include "support/compare.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

Tensor to_cl(const Tensor& t) { return contiguous(t, MemoryFormat::ChannelsLast); }

bool is_cl(const Tensor& t) { return suggest_memory_format(t) == MemoryFormat::ChannelsLast; }

void expect_equal(const Tensor& got, const Tensor& want, double tol = 0, const std::string& what = "") {
  const test::Comparison c = test::compare_tensors(got, want, tol, tol);
  EXPECT_TRUE(c.ok) << what << ": " << c.message;
}

using test::error_message;

TEST(MemoryFormat, PredicatesFollowTorch) {
  const Tensor x = randn({2, 3, 4, 5});
  EXPECT_TRUE(is_contiguous(x, MemoryFormat::Contiguous));
  EXPECT_FALSE(is_contiguous(x, MemoryFormat::ChannelsLast));
  EXPECT_EQ(suggest_memory_format(x), MemoryFormat::Contiguous);
  const Tensor cl = to_cl(x);
  EXPECT_EQ(cl.strides(), (std::vector<int64_t>{60, 1, 15, 3}));
  EXPECT_FALSE(cl.is_contiguous());
  EXPECT_TRUE(is_contiguous(cl, MemoryFormat::ChannelsLast));
  EXPECT_EQ(suggest_memory_format(cl), MemoryFormat::ChannelsLast);
  // The same permutation torch users write by hand.
  EXPECT_TRUE(is_contiguous(x.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2}), MemoryFormat::ChannelsLast));
  // Size-1 dims do not count: [N, C, 1, 1] and [N, 1, H, W] are both formats at once.
  const Tensor pooled = to_cl(randn({2, 8, 1, 1}));
  EXPECT_TRUE(pooled.is_contiguous());
  EXPECT_EQ(suggest_memory_format(pooled), MemoryFormat::Contiguous);
  EXPECT_TRUE(is_contiguous(randn({2, 1, 3, 3}), MemoryFormat::ChannelsLast));
  EXPECT_FALSE(is_contiguous(randn({2, 3, 4}), MemoryFormat::ChannelsLast));
  EXPECT_TRUE(contiguous(cl, MemoryFormat::Preserve).is_same(cl));
  EXPECT_TRUE(contiguous(x, MemoryFormat::Preserve).is_same(x));
  EXPECT_NE(error_message([] { (void)contiguous(randn({3, 4}), MemoryFormat::ChannelsLast); }).find("4-D"),
            std::string::npos);
  EXPECT_NE(error_message([] { (void)empty({3, 4}, TensorOptions(kFloat32), MemoryFormat::ChannelsLast); })
                .find("4-D"),
            std::string::npos);
}

TEST(MemoryFormat, ConversionsKeepValuesAndGradients) {
  const Tensor x = randn({2, 3, 4, 5}, TensorOptions(kFloat64).requires_grad(true));
  const Tensor cl = to_cl(x);
  expect_equal(cl, x, 0, "values");
  const Tensor back = cl.contiguous();
  EXPECT_TRUE(back.is_contiguous());
  expect_equal(back, x, 0, "round trip");
  // clone and .to keep the format (torch's preserve_format); contiguous() does not.
  EXPECT_TRUE(is_cl(cl.clone()));
  EXPECT_TRUE(is_cl(cl.to(kFloat32)));
  const Tensor w = randn({2, 3, 4, 5}, kFloat64);
  (cl * w).sum().backward();
  expect_equal(x.grad(), w, 0, "gradient through contiguous(channels_last)");
}

// Copies between NCHW and channels-last order run as 16 x 16 block
// transposes (Note [Transposing copies] in src/kernels/cpu/copy.cpp): every
// element lands where the element-by-element copy of a float64 tensor puts
// it, bit for bit, both ways, with blocks cut short on either side, for
// float32 and int32 (any 4-byte pattern), at 1 and 2 threads.
TEST(MemoryFormat, TransposingCopiesKeepEveryBit) {
  const int saved = get_num_threads();
  const std::vector<std::vector<int64_t>> shapes = {{2, 64, 7, 7}, {3, 20, 9, 7}, {1, 8, 8, 1}, {4, 40, 30, 30}};
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (const auto& shape : shapes) {
      std::string what = "shape";
      for (int64_t d : shape) {
        what += ' ';
        what += std::to_string(d);
      }
      what += ", threads " + std::to_string(threads);
      const Tensor f = randn(shape);
      // NHWC -> NCHW, and NCHW -> NHWC, against the 8-byte element path.
      expect_equal(to_cl(f).contiguous(), to_cl(f.to(kFloat64)).contiguous().to(kFloat32), 0, what + ": to NCHW");
      const Tensor cl = to_cl(f);
      EXPECT_TRUE(is_cl(cl)) << what;
      expect_equal(cl, to_cl(f.to(kFloat64)).to(kFloat32), 0, what + ": to channels-last");
      const Tensor bits = randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), shape,
                                  TensorOptions(kInt32));
      const Tensor wide = bits.to(kInt64);
      EXPECT_TRUE(equal(to_cl(bits).contiguous(), to_cl(wide).contiguous().to(kInt32))) << what << ": int32 to NCHW";
      EXPECT_TRUE(equal(to_cl(bits).to(kInt64), to_cl(wide))) << what << ": int32 to channels-last";
    }
  }
  set_num_threads(saved);
}

TEST(ChannelsLast, Conv2dReturnsChannelsLastAndMatchesTorch) {
  manual_seed(7);
  const Tensor x = randn({4, 3, 9, 9}), w = randn({8, 3, 3, 3}), b = randn({8});
  const Tensor y = conv2d(x, w, b, {1, 1}, {1, 1});
  EXPECT_TRUE(is_cl(y)) << "strides " << y.strides();
  auto r = test::torch_eval("torch.nn.functional.conv2d(x0, x1, x2, padding=1)", {x, w, b});
  ASSERT_TRUE(r.ok) << r.error;
  expect_equal(y, r.outputs[0], 1e-5, "conv2d vs torch");
  // A channels-last input gives the same result (the primitive sees the same NHWC data).
  expect_equal(conv2d(to_cl(x), w, b, {1, 1}, {1, 1}), y, 0, "channels-last input");
  // float64 runs im2col + gemm, NCHW as before; unbatched inputs have no channels-last form.
  EXPECT_TRUE(conv2d(x.to(kFloat64), w.to(kFloat64), b.to(kFloat64), {1, 1}, {1, 1}).is_contiguous());
  EXPECT_TRUE(conv2d(x.select(0, 0), w, b, {1, 1}, {1, 1}).is_contiguous());
}

TEST(ChannelsLast, Conv2dGradientsDoNotDependOnLayouts) {
  manual_seed(8);
  const Tensor x0 = randn({3, 16, 8, 8}), w0 = randn({32, 16, 3, 3}), g = randn({3, 32, 4, 4});
  Tensor grads[2][2];
  for (int cl = 0; cl < 2; ++cl) {
    const Tensor x = (cl ? to_cl(x0) : x0).detach().requires_grad_(true);
    const Tensor w = w0.detach().requires_grad_(true);
    const Tensor y = conv2d(x, w, Tensor(), {2, 2}, {1, 1});
    EXPECT_TRUE(is_cl(y));
    y.backward(cl ? to_cl(g) : g);
    EXPECT_EQ(is_cl(x.grad()), cl == 1) << "grad_input takes the input's layout";
    grads[cl][0] = x.grad();
    grads[cl][1] = w.grad();
  }
  expect_equal(grads[1][0], grads[0][0], 0, "grad input");
  expect_equal(grads[1][1], grads[0][1], 0, "grad weight");
  auto r = test::OracleBatch();
  const size_t i = r.add_grad("conv", "torch.nn.functional.conv2d(x0, x1, stride=2, padding=1)", {x0, w0}, {0, 1},
                              {g});
  r.run();
  const auto& o = r.outcome(i);
  ASSERT_TRUE(o.ok) << o.error;
  expect_equal(grads[1][0], o.outputs[0], 1e-4, "grad input vs torch");
  expect_equal(grads[1][1], o.outputs[1], 1e-4, "grad weight vs torch");
}

// oneDNN's 1x1 backward-weights kernel writes past its scratchpad for a
// strided conv with an NHWC source of fewer than 16 channels (dnnl_conv.cpp,
// nhwc_bwd_weights_safe): with 2 threads this corrupted the heap (the resnet
// shortcut 4 -> 8, stride 2). Repeated, then compared with torch.
TEST(ChannelsLast, StridedOneByOneWeightGradientWithFewChannels) {
  const int saved = get_num_threads();
  set_num_threads(2);
  manual_seed(13);
  for (int64_t c : {4, 8}) {
    const Tensor x0 = to_cl(randn({3, c, 10, 10})), w0 = randn({2 * c, c, 1, 1}), g = to_cl(randn({3, 2 * c, 5, 5}));
    Tensor gw;
    for (int rep = 0; rep < 20; ++rep) {
      const Tensor x = x0.detach().requires_grad_(true), w = w0.detach().requires_grad_(true);
      conv2d(x, w, Tensor(), {2, 2}).backward(g);
      gw = w.grad();
    }
    // torch gets the same values in NCHW: on an AVX2-only CPU its own
    // channels-last call of that oneDNN kernel crashes the oracle (SIGSEGV).
    auto r = test::OracleBatch();
    const size_t i = r.add_grad("conv1x1", "torch.nn.functional.conv2d(x0, x1, stride=2)", {x0.contiguous(), w0}, {1},
                                {g.contiguous()});
    r.run();
    ASSERT_TRUE(r.outcome(i).ok) << r.outcome(i).error;
    expect_equal(gw, r.outcome(i).outputs[0], 1e-4, "grad weight, c=" + std::to_string(c));
  }
  set_num_threads(saved);
}

TEST(ChannelsLast, ElementwiseResultsFollowTheInputLayout) {
  manual_seed(9);
  const Tensor a = randn({2, 5, 3, 4}), b = randn({2, 5, 3, 4}), bias = randn({5, 1, 1});
  const Tensor acl = to_cl(a), bcl = to_cl(b);
  const struct {
    const char* name;
    Tensor got, want;
  } cases[] = {
      {"relu", acl.relu(), a.relu()},
      {"add", acl + bcl, a + b},
      {"add mixed layouts", acl + b, a + b},
      {"mul by a channel vector", acl * bias, a * bias},
      {"scalar", acl * 3.0, a * 3.0},
      {"exp", acl.exp(), a.exp()},
      {"where", where(acl > 0, acl, bcl), where(a > 0, a, b)},
      {"clamp", acl.clamp(-0.5, 0.5), a.clamp(-0.5, 0.5)},
  };
  for (const auto& c : cases) {
    EXPECT_TRUE(is_cl(c.got)) << c.name << ": strides " << c.got.strides();
    expect_equal(c.got, c.want, 0, c.name);
  }
  // NCHW operands give NCHW results, as before.
  EXPECT_TRUE((a + bcl.contiguous()).is_contiguous());
  // In place on a channels-last tensor with an NCHW operand.
  Tensor t = acl.clone();
  t.add_(b);
  EXPECT_TRUE(is_cl(t));
  expect_equal(t, a + b, 0, "add_");
}

TEST(ChannelsLast, ViewExplainsAndReshapeCopiesInLogicalOrder) {
  const Tensor x = randn({2, 4, 3, 3});
  const Tensor y = conv2d(x, randn({6, 4, 1, 1}), Tensor());
  ASSERT_TRUE(is_cl(y));
  const std::string msg = error_message([&] { (void)y.view({2, -1}); });
  EXPECT_NE(msg.find("channels-last"), std::string::npos) << msg;
  EXPECT_NE(msg.find(".reshape"), std::string::npos) << msg;
  expect_equal(y.reshape({2, -1}), y.contiguous().view({2, -1}), 0, "reshape");
  expect_equal(y.flatten(1), y.contiguous().view({2, -1}), 0, "flatten");
}

TEST(ChannelsLast, BatchNormTrainKernelMatchesNchw) {
  // Channel counts on and off the vector width (16 floats, 8 doubles); 140
  // rows (three blocks of 64, the last short) and 324 (five whole blocks,
  // four of them in lockstep, and a short one: Note [Blocks in lockstep]).
  for (int64_t hw : {35, 81})
  for (int64_t c : {3, 8, 16, 20, 32}) {
    for (DType dt : {kFloat32, kFloat64}) {
      manual_seed(10 + c);
      const DimVector shape = hw == 35 ? DimVector{4, c, 5, 7} : DimVector{4, c, 9, 9};
      const Tensor x0 = randn(shape, dt).mul(2).add(1), w = randn({c}, dt), b = randn({c}, dt);
      const Tensor g = randn(shape, dt);
      Tensor out[2], gx[2], gw[2], gb[2], mean[2], var[2];
      for (int cl = 0; cl < 2; ++cl) {
        const Tensor x = (cl ? to_cl(x0) : x0).detach().requires_grad_(true);
        const Tensor wl = w.detach().requires_grad_(true), bl = b.detach().requires_grad_(true);
        ops::BatchNormResult r = ops::batch_norm_train(x, wl, bl, 1e-5);
        EXPECT_EQ(is_cl(r.output), cl == 1);
        r.output.backward(g);
        EXPECT_EQ(is_cl(x.grad()), cl == 1);
        out[cl] = r.output;
        mean[cl] = r.mean;
        var[cl] = r.var;
        gx[cl] = x.grad();
        gw[cl] = wl.grad();
        gb[cl] = bl.grad();
      }
      // Same formula, another summation order: float32 within a few ulps of the values' scale.
      const double tol = dt == kFloat32 ? 2e-5 : 1e-12;
      const std::string what =
          "rows=" + std::to_string(4 * hw) + " c=" + std::to_string(c) + " " + std::string(dtype_name(dt));
      expect_equal(out[1], out[0], tol, what + " output");
      expect_equal(mean[1], mean[0], tol, what + " mean");
      expect_equal(var[1], var[0], tol, what + " var");
      expect_equal(gx[1], gx[0], tol, what + " grad x");
      expect_equal(gw[1], gw[0], tol * 10, what + " grad weight");
      expect_equal(gb[1], gb[0], tol * 10, what + " grad bias");
    }
  }
}

// Fixed row blocks combined in block order: the same bits at any thread count.
TEST(ChannelsLast, BatchNormKernelsDoNotDependOnTheThreadCount) {
  manual_seed(18);
  const Tensor x0 = to_cl(randn({8, 32, 12, 12})), r0 = to_cl(randn({8, 32, 12, 12}));
  const Tensor w = randn({32}), b = randn({32}), g = randn({8, 32, 12, 12});
  const int saved = get_num_threads();
  Tensor out[2], gx[2], gw[2], gr[2];
  for (int i = 0; i < 2; ++i) {
    set_num_threads(i + 1);
    const Tensor x = x0.detach().requires_grad_(true), r = r0.detach().requires_grad_(true);
    const Tensor wl = w.detach().requires_grad_(true);
    const Tensor y = ops::batch_norm_add_relu_train(x, wl, b, r, 1e-5).output;
    y.backward(g);
    out[i] = y;
    gx[i] = x.grad();
    gw[i] = wl.grad();
    gr[i] = r.grad();
  }
  set_num_threads(saved);
  expect_equal(out[1], out[0], 0, "output");
  expect_equal(gx[1], gx[0], 0, "grad x");
  expect_equal(gw[1], gw[0], 0, "grad weight");
  expect_equal(gr[1], gr[0], 0, "grad residual");
}

// A large mean and a small spread: the one-pass block moments (each block
// centred on its own mean, combined exactly in double) keep float32 variance
// as accurate as the NCHW kernel's two global passes.
TEST(ChannelsLast, BatchNormTrainVarianceWithALargeMean) {
  manual_seed(14);
  const Tensor x64 = randn({8, 16, 20, 20}, kFloat64) * 0.01 + 1000.0;
  const Tensor x = x64.to(kFloat32);
  const Tensor want = x.to(kFloat64).var({0, 2, 3}, 0);  // the float32 data's exact variance
  for (int cl = 0; cl < 2; ++cl) {
    const ops::BatchNormResult r = ops::batch_norm_train(cl ? to_cl(x) : x, Tensor(), Tensor(), 1e-5);
    const test::Comparison c = test::compare_tensors(r.var.to(kFloat64), want, 1e-4, 0);
    EXPECT_TRUE(c.ok) << (cl ? "channels-last: " : "NCHW: ") << c.message;
  }
}

TEST(ChannelsLast, BatchNormTrainChannelsLastGradcheck) {
  manual_seed(11);
  const Tensor x = to_cl(randn({3, 8, 2, 3}, kFloat64)).requires_grad_(true);
  const Tensor w = randn({8}, TensorOptions(kFloat64).requires_grad(true));
  const Tensor b = randn({8}, TensorOptions(kFloat64).requires_grad(true));
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& in) {
        EXPECT_TRUE(is_cl(in[0]));
        return TensorList{ops::batch_norm_train(in[0], in[1], in[2], 1e-5).output};
      },
      {x, w, b}));
}

TEST(ChannelsLast, FusedBatchNormReluMatchesTheTwoOps) {
  for (int64_t c : {5, 16, 32}) {
    for (DType dt : {kFloat32, kFloat64}) {
      manual_seed(20 + c);
      const Tensor x0 = to_cl(randn({4, c, 5, 6}, dt)), w = randn({c}, dt), b = randn({c}, dt);
      const Tensor g = randn({4, c, 5, 6}, dt);
      Tensor out[2], gx[2], gw[2], gb[2];
      for (int fused = 0; fused < 2; ++fused) {
        const Tensor x = x0.detach().requires_grad_(true);
        const Tensor wl = w.detach().requires_grad_(true), bl = b.detach().requires_grad_(true);
        const Tensor y = fused ? ops::batch_norm_relu_train(x, wl, bl, 1e-5).output
                               : ops::batch_norm_train(x, wl, bl, 1e-5).output.relu();
        EXPECT_TRUE(is_cl(y));
        if (fused) {
          EXPECT_STREQ(y.grad_fn()->name(), "NativeBatchNormReluBackward0");
        }
        y.backward(g);
        out[fused] = y;
        gx[fused] = x.grad();
        gw[fused] = wl.grad();
        gb[fused] = bl.grad();
      }
      // The fused kernel recomputes the pre-ReLU value with the forward's rounding: the same mask.
      const double tol = dt == kFloat32 ? 2e-5 : 1e-12;
      const std::string what = "c=" + std::to_string(c) + " " + std::string(dtype_name(dt));
      expect_equal(out[1], out[0], tol, what + " output");
      EXPECT_EQ((out[1] > 0).sum().item<int64_t>(), (out[0] > 0).sum().item<int64_t>()) << what;
      expect_equal(gx[1], gx[0], tol, what + " grad x");
      expect_equal(gw[1], gw[0], tol * 10, what + " grad weight");
      expect_equal(gb[1], gb[0], tol * 10, what + " grad bias");
    }
  }
  // NCHW input: the two ops, same result.
  const Tensor x = randn({2, 3, 4, 4});
  expect_equal(ops::batch_norm_relu_train(x, Tensor(), Tensor(), 1e-5).output,
               ops::batch_norm_train(x, Tensor(), Tensor(), 1e-5).output.relu(), 0, "NCHW");
}

TEST(ChannelsLast, FusedBatchNormReluGradcheckAndGradgradcheck) {
  manual_seed(21);
  // Shifted so that some pre-ReLU values are negative and some positive in every channel.
  const Tensor x = to_cl(randn({3, 8, 2, 3}, kFloat64)).requires_grad_(true);
  const Tensor w = randn({8}, TensorOptions(kFloat64).requires_grad(true));
  const Tensor b = (randn({8}, kFloat64) * 0.3).requires_grad_(true);
  auto fn = [](const TensorList& in) {
    return TensorList{ops::batch_norm_relu_train(in[0], in[1], in[2], 1e-5).output};
  };
  EXPECT_TRUE(autograd::gradcheck(fn, {x, w, b}));
  EXPECT_TRUE(autograd::gradgradcheck(fn, {x, w, b}));
}

TEST(ChannelsLast, FusedBatchNormAddReluMatchesTheThreeOps) {
  for (int64_t c : {5, 16}) {
    for (DType dt : {kFloat32, kFloat64}) {
      manual_seed(30 + c);
      const Tensor x0 = to_cl(randn({4, c, 5, 6}, dt)), w = randn({c}, dt), b = randn({c}, dt);
      const Tensor r0 = to_cl(randn({4, c, 5, 6}, dt)), g = randn({4, c, 5, 6}, dt);
      Tensor out[2], gx[2], gw[2], gb[2], gr[2];
      for (int fused = 0; fused < 2; ++fused) {
        const Tensor x = x0.detach().requires_grad_(true), r = r0.detach().requires_grad_(true);
        const Tensor wl = w.detach().requires_grad_(true), bl = b.detach().requires_grad_(true);
        const Tensor y = fused ? ops::batch_norm_add_relu_train(x, wl, bl, r, 1e-5).output
                               : (ops::batch_norm_train(x, wl, bl, 1e-5).output + r).relu();
        EXPECT_TRUE(is_cl(y));
        if (fused) {
          EXPECT_STREQ(y.grad_fn()->name(), "NativeBatchNormAddReluBackward0");
        }
        y.backward(g);
        out[fused] = y;
        gx[fused] = x.grad();
        gw[fused] = wl.grad();
        gb[fused] = bl.grad();
        gr[fused] = r.grad();
      }
      const double tol = dt == kFloat32 ? 2e-5 : 1e-12;
      const std::string what = "c=" + std::to_string(c) + " " + std::string(dtype_name(dt));
      expect_equal(out[1], out[0], tol, what + " output");
      expect_equal(gr[1], gr[0], 0, what + " grad residual (the same mask)");
      expect_equal(gx[1], gx[0], tol, what + " grad x");
      expect_equal(gw[1], gw[0], tol * 10, what + " grad weight");
      expect_equal(gb[1], gb[0], tol * 10, what + " grad bias");
    }
  }
  // A residual that is not channels-last: the three ops.
  const Tensor x = to_cl(randn({2, 3, 4, 4})), r = randn({2, 3, 4, 4});
  expect_equal(ops::batch_norm_add_relu_train(x, Tensor(), Tensor(), r, 1e-5).output,
               (ops::batch_norm_train(x, Tensor(), Tensor(), 1e-5).output + r).relu(), 0, "NCHW residual");
}

TEST(ChannelsLast, FusedBatchNormAddReluGradcheckAndGradgradcheck) {
  manual_seed(31);
  const Tensor x = to_cl(randn({3, 8, 2, 3}, kFloat64)).requires_grad_(true);
  const Tensor r = to_cl(randn({3, 8, 2, 3}, kFloat64)).requires_grad_(true);
  const Tensor w = randn({8}, TensorOptions(kFloat64).requires_grad(true));
  const Tensor b = (randn({8}, kFloat64) * 0.3).requires_grad_(true);
  auto fn = [](const TensorList& in) {
    return TensorList{ops::batch_norm_add_relu_train(in[0], in[1], in[2], in[3], 1e-5).output};
  };
  EXPECT_TRUE(autograd::gradcheck(fn, {x, w, b, r}));
  EXPECT_TRUE(autograd::gradgradcheck(fn, {x, w, b, r}));
}

// The running statistics' update in one pass agrees with the op sequence it
// replaced to the last bit or two (the ops' kernels order the rounding of
// a * keep + m * x their own way).
TEST(ChannelsLast, BatchNormRunningStatsUpdateEqualsTheOps) {
  manual_seed(17);
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor rm = randn({16}, dt), rv = randn({16}, dt).abs();
    const Tensor mean = randn({16}, dt), var = randn({16}, dt).abs();
    Tensor want_m = rm.clone(), want_v = rv.clone();
    want_m.mul_(1.0 - 0.1).add_(mean, 0.1);
    want_v.mul_(1.0 - 0.1).add_(var * (600.0 / 599.0), 0.1);
    const int64_t version = rm.version();
    ops::batch_norm_update_running_stats(rm, rv, mean, var, 0.1, 600);
    const double ulps = dt == kFloat32 ? 2.5e-7 : 5e-16;
    expect_equal(rm, want_m, ulps, "running_mean");
    expect_equal(rv, want_v, ulps, "running_var");
    EXPECT_GT(rm.version(), version) << "an in-place update bumps the version";
  }
}

TEST(ChannelsLast, BatchNormForwardReluKeepsHooks) {
  nn::BatchNorm2d bn(nn::BatchNormOptions{.num_features = 16});
  const Tensor x = conv2d(randn({2, 3, 6, 6}), randn({16, 3, 3, 3}), Tensor(), {1, 1}, {1, 1});
  ASSERT_TRUE(is_cl(x));
  const Tensor plain = bn(x).relu();
  const Tensor fused = bn.forward_relu(x);
  expect_equal(fused, plain, 2e-5, "forward_relu");
  Tensor seen;
  const auto handle = bn.register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) {
    seen = out;
    return Tensor();
  });
  const Tensor hooked = bn.forward_relu(x);
  ASSERT_TRUE(seen.defined());
  EXPECT_GT((seen < 0).sum().item<int64_t>(), 0) << "the hook sees batch norm's output, before the ReLU";
  expect_equal(hooked, seen.relu(), 0, "hooked");
}

// The ops a conv net puts after a conv, given the channels-last tensor a conv
// now returns: the same values and gradients as from the NCHW tensor (any
// kernel that read its input as row-major without asking would differ).
TEST(ChannelsLast, FollowUpOpsAgreeWithNchwInputs) {
  manual_seed(15);
  const Tensor x0 = randn({2, 16, 5, 6});
  const Tensor target = randint(0, 16, {2, 5, 6}, TensorOptions(kInt64));
  const Tensor index = randint(0, 16, {2, 3, 5, 6}, TensorOptions(kInt64));
  const Tensor pick = tensor(std::vector<int64_t>{3, 0, 15});
  nn::GroupNorm gn(nn::GroupNormOptions{.num_groups = 4, .num_channels = 16});
  nn::LayerNorm ln(nn::LayerNormOptions{.normalized_shape = {5, 6}});
  const struct {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
  } cases[] = {
      {"softmax(1)", [](const Tensor& x) { return x.softmax(1); }},
      {"log_softmax(1)", [](const Tensor& x) { return x.log_softmax(1); }},
      {"softmax(-1)", [](const Tensor& x) { return x.softmax(-1); }},
      {"sum(1)", [](const Tensor& x) { return x.sum({1}); }},
      {"mean(2,3)", [](const Tensor& x) { return x.mean({2, 3}); }},
      {"var(0,2,3)", [](const Tensor& x) { return x.var({0, 2, 3}); }},
      {"amax(1)", [](const Tensor& x) { return x.amax({1}); }},
      {"max_pool2d", [](const Tensor& x) { return max_pool2d(x, {2, 2}); }},
      {"avg_pool2d", [](const Tensor& x) { return avg_pool2d(x, {2, 2}); }},
      {"adaptive_avg_pool2d", [](const Tensor& x) { return adaptive_avg_pool2d(x, {2, 3}); }},
      {"cross_entropy (spatial)", [&](const Tensor& x) { return nn::F::cross_entropy(x, target); }},
      {"nll_loss (spatial)", [&](const Tensor& x) { return nn::F::nll_loss(x.log_softmax(1), target); }},
      {"mse_loss", [](const Tensor& x) { return nn::F::mse_loss(x, x.detach() * 0.5); }},
      {"group_norm", [&](const Tensor& x) { return gn(x); }},
      {"layer_norm", [&](const Tensor& x) { return ln(x); }},
      {"cat(1)", [](const Tensor& x) { return cat({x, x * 2}, 1); }},
      {"stack", [](const Tensor& x) { return stack({x, x}, 0); }},
      {"flatten(1)", [](const Tensor& x) { return x.flatten(1); }},
      {"gelu", [](const Tensor& x) { return x.gelu("tanh"); }},
      {"sigmoid", [](const Tensor& x) { return x.sigmoid(); }},
      {"silu", [](const Tensor& x) { return x.silu(); }},
      {"gather(1)", [&](const Tensor& x) { return x.gather(1, index); }},
      {"index_select(1)", [&](const Tensor& x) { return x.index_select(1, pick); }},
      {"matmul", [](const Tensor& x) { return matmul(x, x.transpose(-1, -2)); }},
      {"linear over W", [](const Tensor& x) { return linear(x, x.select(0, 0).select(0, 0), Tensor()); }},
  };
  for (const auto& c : cases) {
    Tensor out[2], grad[2];
    for (int cl = 0; cl < 2; ++cl) {
      const Tensor x = (cl ? to_cl(x0) : x0).detach().requires_grad_(true);
      const Tensor y = c.f(x);
      manual_seed(16);
      const Tensor g = randn(y.sizes());
      (y * g).sum().backward();
      out[cl] = y;
      grad[cl] = x.grad();
    }
    expect_equal(out[1], out[0], 1e-5, std::string(c.name) + " value");
    expect_equal(grad[1], grad[0], 1e-5, std::string(c.name) + " gradient");
  }
}

TEST(ChannelsLast, MaxPoolKeepsTheLayoutAndFallsBackForNaN) {
  manual_seed(12);
  const Tensor x0 = randn({2, 16, 6, 6});
  const Tensor g = randn({2, 16, 3, 3});
  Tensor out[2], gx[2];
  for (int cl = 0; cl < 2; ++cl) {
    const Tensor x = (cl ? to_cl(x0) : x0).detach().requires_grad_(true);
    const Tensor y = max_pool2d(x, {2, 2});
    EXPECT_EQ(is_cl(y), cl == 1);
    y.backward(g);
    EXPECT_EQ(is_cl(x.grad()), cl == 1);
    out[cl] = y;
    gx[cl] = x.grad();
  }
  expect_equal(out[1], out[0], 0, "max_pool2d");
  expect_equal(gx[1], gx[0], 0, "max_pool2d backward");
  {
    const NoGradGuard no_grad;
    const Tensor y = max_pool2d(to_cl(x0), {2, 2});
    EXPECT_TRUE(is_cl(y));
    expect_equal(y, out[0], 0, "max_pool2d without grad");
  }
  // A NaN sends pooling to our NCHW loop (oneDNN would drop it): it must still propagate.
  Tensor xn = x0.clone();
  xn.select(0, 1).select(0, 3).select(0, 2).select(0, 2).fill_(std::numeric_limits<float>::quiet_NaN());
  const Tensor xcl = to_cl(xn).requires_grad_(true);
  const Tensor y = max_pool2d(xcl, {2, 2});
  EXPECT_TRUE(std::isnan(y.select(0, 1).select(0, 3).select(0, 1).select(0, 1).item<float>()));
  expect_equal(y, max_pool2d(xn, {2, 2}), 0, "NaN input");
  y.backward(g);
  const Tensor xr = xn.detach().requires_grad_(true);
  max_pool2d(xr, {2, 2}).backward(g);
  expect_equal(xcl.grad(), xr.grad(), 0, "NaN input backward");
}

}  // namespace
