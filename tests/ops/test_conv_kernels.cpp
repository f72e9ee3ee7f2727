// conv2d's kernel choices on oneDNN against PyTorch. The forward runs
// oneDNN's direct jit kernel below 64 input channels and brgconv from 64 on,
// and for float32 rows wider than 28 columns with at most 16 output channels
// (Note [Forward convolution kernel] in src/kernels/cpu/dnnl_conv.cpp): each
// against torch. The weight gradient runs as the unfolded input times
// grad_output (Note [Weight gradient by unfolding] in
// src/kernels/cpu/conv_weight_gemm.cpp) against PyTorch's and against
// oneDNN's backward-weights primitive: strides, dilation, uneven padding,
// windows over every edge, a bias, float32 and bfloat16, 1 and 2 threads.
// float32 against torch within 1e-4 of the largest element (a different
// summation order); bfloat16 against the float32 result of the same bf16
// values within bf16's rounding of the result (2^-8 relative to the largest
// element), and against the primitive within the same.
#include <gtest/gtest.h>

#include <iterator>
#include <utility>
#include <string>
#include <vector>

#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/ops/memory_format.h"
#include "support/compare.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;
using kernels::ConvWeightGradPath;

namespace {

#define SKIP_WITHOUT_DIRECT_KERNELS() \
  if (!test::direct_conv_kernels_built()) GTEST_SKIP() << "this build has no direct convolution kernels (they need AVX-512)"

struct Case {
  int64_t n, c, h, w, o, kh, kw, stride, pad, dilation;
  bool bias;
  std::string torch_args;  // stride=, padding=, dilation= as torch spells them
};

const Case kCases[] = {
    {2, 16, 9, 8, 8, 3, 3, 2, 1, 1, true, "stride=2, padding=1"},
    {3, 32, 8, 8, 16, 3, 3, 2, 1, 1, false, "stride=2, padding=1"},
    {2, 8, 11, 7, 4, 5, 3, 3, 2, 1, true, "stride=3, padding=2"},
    {2, 4, 10, 10, 6, 3, 3, 1, 2, 2, true, "stride=1, padding=2, dilation=2"},
    {1, 5, 7, 9, 3, 2, 2, 2, 0, 1, true, "stride=2"},
    {2, 6, 6, 6, 5, 1, 1, 2, 0, 1, false, "stride=2"},
    {2, 3, 9, 9, 4, 2, 2, 3, 0, 1, true, "stride=3"},              // gaps between windows
    {1, 2, 3, 3, 2, 5, 5, 2, 2, 1, false, "stride=2, padding=2"},  // windows mostly over the padding
};

// Restores the path when a test ends, however it ends.
class PathScope {
 public:
  explicit PathScope(ConvWeightGradPath p) : prev_(kernels::conv_weight_grad_path()) {
    kernels::set_conv_weight_grad_path(p);
  }
  ~PathScope() { kernels::set_conv_weight_grad_path(prev_); }

 private:
  ConvWeightGradPath prev_;
};

struct Grads {
  Tensor w, b;
};

Grads grads(const Case& k, const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& g, DType dt) {
  const Tensor x = contiguous(x0.to(dt), MemoryFormat::ChannelsLast);
  const Tensor w = w0.to(dt).detach().requires_grad_(true);
  const Tensor b = k.bias ? b0.to(dt).detach().requires_grad_(true) : Tensor();
  const Tensor y = conv2d(x, w, b, {k.stride, k.stride}, {k.pad, k.pad}, {k.dilation, k.dilation});
  y.backward(contiguous(g.to(dt), MemoryFormat::ChannelsLast));
  return {w.grad(), k.bias ? b.grad() : Tensor()};
}

void expect_close(const Tensor& got, const Tensor& want, double rel, const std::string& what) {
  const double scale = want.to(kFloat64).abs().max().item<double>();
  const test::Comparison c = test::compare_tensors(got.to(kFloat32), want.to(kFloat32), 0, rel * scale);
  EXPECT_TRUE(c.ok) << what << ": " << c.message;
}

// Random x, w, b and grad_output for each case, with torch's weight and bias
// gradients of them queued on `oracle` under tag + index.
struct Inputs {
  std::vector<Tensor> xs, ws, bs, gs;
  std::vector<size_t> ids;
};

Inputs queue_cases(test::OracleBatch& oracle, const Case* cases, size_t count, const std::string& tag) {
  Inputs in;
  for (size_t i = 0; i < count; ++i) {
    const Case& k = cases[i];
    const Tensor x = randn({k.n, k.c, k.h, k.w}), w = randn({k.o, k.c, k.kh, k.kw}), b = randn({k.o});
    const int64_t oh = (k.h + 2 * k.pad - k.dilation * (k.kh - 1) - 1) / k.stride + 1;
    const int64_t ow = (k.w + 2 * k.pad - k.dilation * (k.kw - 1) - 1) / k.stride + 1;
    const Tensor g = randn({k.n, k.o, oh, ow});
    in.xs.push_back(x), in.ws.push_back(w), in.bs.push_back(b), in.gs.push_back(g);
    const std::string args = k.torch_args.empty() ? "" : ", " + k.torch_args;
    in.ids.push_back(oracle.add_grad(tag + std::to_string(i), "torch.nn.functional.conv2d(x0, x1, x2" + args + ")",
                                     {x, w, b}, {1, 2}, {g}));
  }
  return in;
}

}  // namespace

TEST(ConvWeightGrad, ProductMatchesTorchAndThePrimitive) {
  const int saved = get_num_threads();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    manual_seed(21);
    test::OracleBatch oracle;
    const Inputs in = queue_cases(oracle, kCases, std::size(kCases), "wgrad");
    const auto &xs = in.xs, &ws = in.ws, &bs = in.bs, &gs = in.gs;
    const auto& ids = in.ids;
    oracle.run();
    for (size_t i = 0; i < ids.size(); ++i) {
      const Case& k = kCases[i];
      const std::string what = "case " + std::to_string(i) + " (" + k.torch_args + "), threads " +
                               std::to_string(threads);
      const test::OracleOutcome& r = oracle.outcome(ids[i]);
      ASSERT_TRUE(r.ok) << r.error;
      Grads f32, bf16_product, bf16_primitive, bf16_as_f32;
      {
        const PathScope path(ConvWeightGradPath::Product);
        f32 = grads(k, xs[i], ws[i], bs[i], gs[i], kFloat32);
        bf16_product = grads(k, xs[i], ws[i], bs[i], gs[i], kBFloat16);
      }
      {
        const PathScope path(ConvWeightGradPath::Primitive);
        bf16_primitive = grads(k, xs[i], ws[i], bs[i], gs[i], kBFloat16);
        // The exact gradient of the bf16 values, as float32 computes it.
        bf16_as_f32 = grads(k, xs[i].to(kBFloat16), ws[i].to(kBFloat16), bs[i].to(kBFloat16),
                            gs[i].to(kBFloat16), kFloat32);
      }
      expect_close(f32.w, r.outputs[0], 1e-4, what + ": float32 weight gradient vs torch");
      expect_close(bf16_product.w, bf16_as_f32.w, 1.0 / 256, what + ": bf16 weight gradient vs float32");
      expect_close(bf16_product.w, bf16_primitive.w, 1.0 / 256, what + ": bf16 weight gradient vs the primitive");
      if (k.bias) {
        expect_close(f32.b, r.outputs[1], 1e-4, what + ": float32 bias gradient vs torch");
        expect_close(bf16_product.b, bf16_as_f32.b, 1.0 / 256, what + ": bf16 bias gradient vs float32");
      }
    }
  }
  set_num_threads(saved);
}

// A float32 convolution over one input channel takes the direct sum for NHWC
// grad_output (Note [Few-channel weight gradient] in
// src/kernels/cpu/conv_direct.cpp) and, for NCHW at 2 threads, oneDNN's
// blocked backward-weights kernel; both sum the bias gradient in double (Note
// [Single-channel weight gradient] in src/kernels/cpu/dnnl_conv.cpp): against
// torch within 1e-5 of the largest element, NHWC and NCHW, with and without a
// bias, at 1 and 2 threads; the bias also against the float64 sum of
// grad_output rounded once, to float32's own rounding.
TEST(ConvWeightGrad, SingleInputChannelMatchesTorch) {
  const int saved = get_num_threads();
  const Case cases[] = {{4, 1, 28, 28, 32, 3, 3, 1, 1, 1, true, "padding=1"},
                        {3, 1, 9, 8, 5, 3, 3, 2, 1, 1, true, "stride=2, padding=1"},
                        {2, 1, 7, 7, 4, 2, 2, 1, 0, 1, false, ""}};
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    manual_seed(24);
    test::OracleBatch oracle;
    const Inputs in = queue_cases(oracle, cases, std::size(cases), "single");
    const auto &xs = in.xs, &ws = in.ws, &bs = in.bs, &gs = in.gs;
    const auto& ids = in.ids;
    oracle.run();
    for (size_t i = 0; i < ids.size(); ++i) {
      const Case& k = cases[i];
      const test::OracleOutcome& r = oracle.outcome(ids[i]);
      ASSERT_TRUE(r.ok) << r.error;
      for (bool nhwc : {true, false}) {
        const std::string what = "case " + std::to_string(i) + ", " + (nhwc ? "NHWC" : "NCHW") + ", threads " +
                                 std::to_string(threads);
        const MemoryFormat f = nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
        const Tensor w = ws[i].detach().requires_grad_(true);
        const Tensor b = k.bias ? bs[i].detach().requires_grad_(true) : Tensor();
        const Tensor y = conv2d(contiguous(xs[i], f), w, b, {k.stride, k.stride}, {k.pad, k.pad});
        y.backward(contiguous(gs[i], f));
        expect_close(w.grad(), r.outputs[0], 1e-5, what + ": weight gradient vs torch");
        if (!k.bias) {
          EXPECT_FALSE(b.defined());
          continue;
        }
        expect_close(b.grad(), r.outputs[1], 1e-5, what + ": bias gradient vs torch");
        // NHWC takes the direct sum (its bias summed in double) at any thread
        // count; NCHW oneDNN's blocked kernel at 2 threads, its own NCHW kernel
        // (which sums the bias itself) at 1.
        // Without the direct kernels NHWC takes oneDNN's kernels too.
        if (threads == 1 && !nhwc) continue;
        if (nhwc && !test::direct_conv_kernels_built()) continue;
        const Tensor exact = gs[i].to(kFloat64).sum({0, 2, 3}).to(kFloat32);
        const test::Comparison c = test::compare_tensors(b.grad(), exact, 1.2e-7, 0);
        EXPECT_TRUE(c.ok) << what << ": bias gradient vs the float64 sum: " << c.message;
      }
    }
  }
  set_num_threads(saved);
}

// Auto takes the product exactly where the rule says (dnnl.h): a strided
// 3x3 over 32 channels in bf16 gets the product's bits, a 1x1 and a float32
// one the primitive's.
TEST(ConvWeightGrad, AutoFollowsTheRule) {
  manual_seed(22);
  const Case wide{2, 32, 8, 8, 16, 3, 3, 2, 1, 1, false, ""}, one{2, 32, 8, 8, 16, 1, 1, 2, 0, 1, false, ""};
  for (const Case& k : {wide, one}) {
    const Tensor x = randn({k.n, k.c, k.h, k.w}), w = randn({k.o, k.c, k.kh, k.kw});
    const int64_t oh = (k.h + 2 * k.pad - k.kh) / k.stride + 1;
    const Tensor g = randn({k.n, k.o, oh, oh});
    for (DType dt : {kBFloat16, kFloat32}) {
      Tensor by[3];
      for (ConvWeightGradPath p : {ConvWeightGradPath::Auto, ConvWeightGradPath::Primitive,
                                   ConvWeightGradPath::Product}) {
        const PathScope path(p);
        by[static_cast<int>(p)] = grads(k, x, w, Tensor(), g, dt).w;
      }
      const bool product = dt == kBFloat16 && k.kh == 3;
      const Tensor& want = by[static_cast<int>(product ? ConvWeightGradPath::Product : ConvWeightGradPath::Primitive)];
      EXPECT_TRUE(equal(by[0], want)) << "kernel " << k.kh << ", " << dtype_name(dt) << ": expected the "
                                      << (product ? "product" : "primitive");
    }
  }
}

// Both forward kernels, and kiln's direct one for one input channel, float32
// and bfloat16, at 1 and 2 threads.
TEST(ConvForward, BothKernelsMatchTorch) {
  const int saved = get_num_threads();
  manual_seed(23);
  const int64_t channels[] = {1, 3, 16, 64, 96};  // 1: the direct forward (Note [Few-channel convolution])
  std::vector<Tensor> xs, ws, bs;
  test::OracleBatch oracle;
  std::vector<size_t> ids;
  for (int64_t c : channels) {
    xs.push_back(randn({4, c, 10, 10}));
    ws.push_back(randn({32, c, 3, 3}));
    bs.push_back(randn({32}));
    ids.push_back(oracle.add("fwd" + std::to_string(c), "torch.nn.functional.conv2d(x0, x1, x2, stride=2, padding=1)",
                             {xs.back(), ws.back(), bs.back()}));
  }
  oracle.run();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string what = "c=" + std::to_string(channels[i]) + ", threads " + std::to_string(threads);
      const test::OracleOutcome& r = oracle.outcome(ids[i]);
      ASSERT_TRUE(r.ok) << r.error;
      const Tensor x = contiguous(xs[i], MemoryFormat::ChannelsLast);
      expect_close(conv2d(x, ws[i], bs[i], {2, 2}, {1, 1}), r.outputs[0], 1e-5, what + ": float32");
      const Tensor xb = x.to(kBFloat16), wb = ws[i].to(kBFloat16), bb = bs[i].to(kBFloat16);
      const Tensor exact = conv2d(xb.to(kFloat32), wb.to(kFloat32), bb.to(kFloat32), {2, 2}, {1, 1});
      expect_close(conv2d(xb, wb, bb, {2, 2}, {1, 1}), exact, 1.0 / 256, what + ": bf16 vs float32 of its values");
    }
  }
  set_num_threads(saved);
}

// Rows wider than 28 columns with at most 16 output channels take brgconv in
// float32 (Note [Forward convolution kernel]); rows of 28, more output
// channels, bfloat16 and first layers keep the direct kernel.
TEST(ConvForward, WideRowsWithOneOutputBlockTakeBrgconv) {
  SKIP_WITHOUT_DIRECT_KERNELS();
  auto impl = [](DType dt, int64_t c, int64_t o, int64_t w) {
    kernels::Conv2dParams p;
    p.dtype = dt;
    p.n = 2;
    p.c = c;
    p.o = o;
    p.h = p.oh = 4;
    p.w = p.ow = w;
    p.kh = p.kw = 3;
    p.pad_l[0] = p.pad_l[1] = p.pad_r[0] = p.pad_r[1] = 1;
    p.input_nhwc = p.output_nhwc = true;
    return kernels::conv2d_forward_impl(p);
  };
  EXPECT_EQ(impl(kFloat32, 16, 16, 32).rfind("brgconv", 0), 0u) << impl(kFloat32, 16, 16, 32);
  EXPECT_EQ(impl(kFloat32, 32, 8, 40).rfind("brgconv", 0), 0u) << impl(kFloat32, 32, 8, 40);
  for (const std::string& direct : {impl(kFloat32, 16, 16, 28), impl(kFloat32, 16, 32, 32),
                                    impl(kBFloat16, 16, 16, 32), impl(kFloat32, 3, 16, 32)})
    EXPECT_EQ(direct.rfind("jit", 0), 0u) << direct;
}

// The brgconv path's values: 16 and 8 output channels over rows of 33, 64 and
// 40, against torch within 1e-5 of the largest element, with the backward that
// takes the forward as its hint, at 1 and 2 threads.
TEST(ConvForward, WideRowsWithOneOutputBlockMatchTorch) {
  const int saved = get_num_threads();
  manual_seed(29);
  struct Wide {
    int64_t c, o, h, w;
  };
  const Wide cases[] = {{16, 16, 5, 33}, {8, 16, 4, 64}, {32, 8, 3, 40}};
  std::vector<Tensor> xs, ws, gs;
  test::OracleBatch oracle;
  std::vector<size_t> ids, grad_ids;
  const std::string expr = "torch.nn.functional.conv2d(x0, x1, padding=1)";
  for (const Wide& k : cases) {
    xs.push_back(randn({2, k.c, k.h, k.w}));
    ws.push_back(randn({k.o, k.c, 3, 3}));
    gs.push_back(randn({2, k.o, k.h, k.w}));
    const std::string id = "wide" + std::to_string(ids.size());
    ids.push_back(oracle.add(id, expr, {xs.back(), ws.back()}));
    grad_ids.push_back(oracle.add_grad(id + "_grad", expr, {xs.back(), ws.back()}, {0, 1}, {gs.back()}));
  }
  oracle.run();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string what = "case " + std::to_string(i) + ", threads " + std::to_string(threads);
      const test::OracleOutcome& r = oracle.outcome(ids[i]);
      const test::OracleOutcome& rg = oracle.outcome(grad_ids[i]);
      ASSERT_TRUE(r.ok) << r.error;
      ASSERT_TRUE(rg.ok) << rg.error;
      const Tensor x = contiguous(xs[i], MemoryFormat::ChannelsLast).detach().requires_grad_(true);
      const Tensor w = ws[i].detach().requires_grad_(true);
      const Tensor y = conv2d(x, w, Tensor(), {1, 1}, {1, 1});
      expect_close(y, r.outputs[0], 1e-5, what + ": output");
      y.backward(contiguous(gs[i], MemoryFormat::ChannelsLast));
      expect_close(x.grad(), rg.outputs[0], 1e-5, what + ": input gradient");
      expect_close(w.grad(), rg.outputs[1], 1e-5, what + ": weight gradient");
    }
  }
  set_num_threads(saved);
}

// The direct sum over few input channels (Note [Few-channel weight gradient]
// in src/kernels/cpu/conv_direct.cpp), forced for 1 to 4 channels:
// strides, dilation, padding, windows of 2x2 to 5x3, 5 to 64 output channels
// (the last vector partial at 5, 20 and 33), with and without a bias. float32
// against torch within 1e-5 of the largest element; bfloat16 against the
// float32 gradient of the same bf16 values within 2^-8 of it; the same bits
// at 1, 2 and 3 threads.
TEST(ConvWeightGrad, DirectSumMatchesTorchAtEveryThreadCount) {
  SKIP_WITHOUT_DIRECT_KERNELS();
  const int saved = get_num_threads();
  const Case cases[] = {{4, 1, 28, 28, 32, 3, 3, 1, 1, 1, true, "padding=1"},
                        {3, 1, 9, 8, 5, 3, 3, 2, 1, 1, true, "stride=2, padding=1"},
                        {2, 3, 10, 10, 16, 3, 3, 1, 1, 1, false, "padding=1"},
                        {2, 3, 11, 9, 20, 5, 3, 2, 2, 1, true, "stride=2, padding=2"},
                        {2, 2, 10, 10, 40, 3, 3, 1, 2, 2, true, "stride=1, padding=2, dilation=2"},
                        {1, 4, 7, 7, 64, 2, 2, 1, 0, 1, true, ""},
                        {2, 3, 9, 9, 33, 3, 3, 1, 1, 1, true, "padding=1"}};
  manual_seed(25);
  test::OracleBatch oracle;
  const Inputs in = queue_cases(oracle, cases, std::size(cases), "direct");
  oracle.run();
  const PathScope path(ConvWeightGradPath::Direct);
  for (size_t i = 0; i < in.ids.size(); ++i) {
    const Case& k = cases[i];
    const test::OracleOutcome& r = oracle.outcome(in.ids[i]);
    ASSERT_TRUE(r.ok) << r.error;
    Grads by_threads[3], bf16, bf16_as_f32;
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      by_threads[threads - 1] = grads(k, in.xs[i], in.ws[i], in.bs[i], in.gs[i], kFloat32);
    }
    set_num_threads(1);
    bf16 = grads(k, in.xs[i], in.ws[i], in.bs[i], in.gs[i], kBFloat16);
    bf16_as_f32 = grads(k, in.xs[i].to(kBFloat16), in.ws[i].to(kBFloat16), in.bs[i].to(kBFloat16),
                        in.gs[i].to(kBFloat16), kFloat32);
    const std::string what = "case " + std::to_string(i) + " (" + k.torch_args + ", " + std::to_string(k.c) + " -> " +
                             std::to_string(k.o) + " channels)";
    expect_close(by_threads[0].w, r.outputs[0], 1e-5, what + ": float32 weight gradient vs torch");
    expect_close(bf16.w, bf16_as_f32.w, 1.0 / 256, what + ": bf16 weight gradient vs float32");
    for (int t : {1, 2}) {
      EXPECT_TRUE(equal(by_threads[t].w, by_threads[0].w)) << what << ": weight gradient at " << t + 1 << " threads";
      if (k.bias) {
        EXPECT_TRUE(equal(by_threads[t].b, by_threads[0].b)) << what << ": bias at " << t + 1 << " threads";
      }
    }
    if (k.bias) {
      expect_close(by_threads[0].b, r.outputs[1], 1e-5, what + ": float32 bias gradient vs torch");
      expect_close(bf16.b, bf16_as_f32.b, 1.0 / 256, what + ": bf16 bias gradient vs float32");
    }
  }
  set_num_threads(saved);
}

// The direct sum reads an NCHW input (a 3-channel image) with the bits of the
// same values in NHWC, and Auto takes it for one input channel only.
TEST(ConvWeightGrad, DirectSumReadsEitherInputLayoutAndAutoTakesOneChannel) {
  SKIP_WITHOUT_DIRECT_KERNELS();
  manual_seed(26);
  kernels::Conv2dParams p;
  p.n = 2, p.c = 3, p.h = p.w = 9, p.o = 24, p.kh = p.kw = 3, p.oh = p.ow = 9;
  p.pad_l[0] = p.pad_l[1] = p.pad_r[0] = p.pad_r[1] = 1;
  p.output_nhwc = true;
  const Tensor x = randn({p.n, p.c, p.h, p.w}), dy = randn({p.n, p.oh, p.ow, p.o});
  const Tensor x_nhwc = x.permute({0, 2, 3, 1}).contiguous();
  auto run = [&](bool nhwc, ConvWeightGradPath path) {
    const PathScope scope(path);
    kernels::Conv2dParams q = p;
    q.input_nhwc = nhwc;
    Tensor dw = empty({p.o, p.c, p.kh, p.kw}), db = empty({p.o});
    kernels::conv2d_backward_weight(q, dy.data_ptr(), (nhwc ? x_nhwc : x).data_ptr(), dw.data_ptr(), db.data_ptr());
    return std::make_pair(dw, db);
  };
  const auto nchw = run(false, ConvWeightGradPath::Direct), nhwc = run(true, ConvWeightGradPath::Direct);
  EXPECT_TRUE(equal(nchw.first, nhwc.first));
  EXPECT_TRUE(equal(nchw.second, nhwc.second));
  kernels::Conv2dParams one = p;
  one.c = 1;
  const PathScope automatic(ConvWeightGradPath::Auto);
  EXPECT_TRUE(kernels::conv2d_backward_weight_direct(one));
  EXPECT_FALSE(kernels::conv2d_backward_weight_direct(p));
  one.output_nhwc = false;  // the direct sum reads grad_output's channels as vectors
  EXPECT_FALSE(kernels::conv2d_backward_weight_direct(one));
}

namespace {

// A first layer as cnn's: 3 images of size x size, 1 -> 20 channels, 3x3 with
// padding 1 (NHWC), then a max pool of window x window, stride window.
std::pair<kernels::Conv2dParams, kernels::Pool2dParams> first_layer(DType dt, int64_t size, int64_t window,
                                                                    int64_t pool_pad) {
  kernels::Conv2dParams p;
  p.dtype = dt;
  p.n = 3, p.c = 1, p.h = p.w = size, p.o = 20, p.kh = p.kw = 3, p.oh = p.ow = size;
  p.pad_l[0] = p.pad_l[1] = p.pad_r[0] = p.pad_r[1] = 1;
  p.input_nhwc = p.output_nhwc = true;
  kernels::Pool2dParams q;
  q.dtype = dt;
  q.n = p.n, q.c = p.o, q.h = p.oh, q.w = p.ow;
  q.kernel[0] = q.kernel[1] = q.stride[0] = q.stride[1] = window;
  q.pad[0] = q.pad[1] = pool_pad;
  q.oh = q.ow = (p.oh + 2 * pool_pad - window) / window + 1;
  q.nhwc = true;
  return {p, q};
}

}  // namespace

// kiln::compile's pooled form (conv2d_backward_weight_pooled) has the bits of
// the max pool's backward followed by the direct weight gradient: 2x2 windows
// of stride 2 over an odd size (a row and column no window covers), 3x3 of
// stride 3 with padding, windows the ReLU-pooling rewrite marked (bit 7), float32
// and bfloat16, with and without a bias, at 1 and 2 threads.
TEST(ConvWeightGrad, PooledFormHasTheBitsOfThePoolBackwardThenTheWeightGradient) {
  SKIP_WITHOUT_DIRECT_KERNELS();
  const int saved = get_num_threads();
  manual_seed(27);
  for (int64_t window : {2, 3}) {
    for (DType dt : {kFloat32, kBFloat16}) {
      for (bool bias : {true, false}) {
        const auto [p, q] = first_layer(dt, 9, window, window == 3 ? 1 : 0);
        ASSERT_TRUE(kernels::conv2d_backward_weight_pooled_applies(p, q));
        const Tensor x = randn({p.n, p.h, p.w, 1}).to(dt), y = randn({p.n, p.oh, p.ow, p.o}).to(dt);
        const Tensor gp = randn({p.n, q.oh, q.ow, p.o}).to(dt), pooled = empty({p.n, q.oh, q.ow, p.o}, dt);
        std::vector<uint8_t> ws(kernels::pool2d_workspace_bytes(q));
        ASSERT_TRUE(kernels::pool2d_forward(q, y.data_ptr(), pooled.data_ptr(), ws.data()));
        for (size_t i = 0; i < ws.size(); i += 7) ws[i] |= 0x80;  // windows a ReLU's backward masks
        for (int threads : {1, 2}) {
          set_num_threads(threads);
          const std::string what = std::to_string(window) + "x" + std::to_string(window) + " windows, " +
                                   std::string(dtype_name(dt)) + (bias ? ", bias" : "") + ", threads " +
                                   std::to_string(threads);
          Tensor gi = empty({p.n, p.oh, p.ow, p.o}, dt);
          Tensor dw = empty({p.o, 1, 3, 3}, dt), db = empty({p.o}, dt);
          Tensor fw = empty({p.o, 1, 3, 3}, dt), fb = empty({p.o}, dt);
          kernels::max_pool2d_backward_workspace(q, gp.data_ptr(), ws.data(), gi.data_ptr());
          kernels::conv2d_backward_weight(p, gi.data_ptr(), x.data_ptr(), dw.data_ptr(), bias ? db.data_ptr() : nullptr);
          kernels::conv2d_backward_weight_pooled(p, q, gp.data_ptr(), ws.data(), x.data_ptr(), fw.data_ptr(),
                                                 bias ? fb.data_ptr() : nullptr);
          EXPECT_TRUE(equal(fw, dw)) << what;
          if (bias) {
            EXPECT_TRUE(equal(fb, db)) << what;
          }
        }
      }
    }
  }
  set_num_threads(saved);
}

// kiln::compile's pooled forward (conv2d_forward_pooled) has the bits of the
// direct forward followed by the max pool: 2x2 windows of stride 2 over an odd
// size (a row and column no window reads), 3x3 of stride 3, float32 and
// bfloat16, with and without a bias, at 1 and 2 threads.
TEST(ConvForward, PooledFormHasTheBitsOfTheConvolutionThenThePool) {
  SKIP_WITHOUT_DIRECT_KERNELS();
  const int saved = get_num_threads();
  manual_seed(28);
  for (int64_t window : {2, 3}) {
    for (DType dt : {kFloat32, kBFloat16}) {
      for (bool bias : {true, false}) {
        const auto [p, q] = first_layer(dt, 11, window, 0);
        ASSERT_TRUE(kernels::conv2d_forward_pooled_applies(p, q));
        const Tensor x = randn({p.n, p.h, p.w, 1}).to(dt), w = randn({p.o, 1, 3, 3}).to(dt), b = randn({p.o}).to(dt);
        for (int threads : {1, 2}) {
          set_num_threads(threads);
          const std::string what = std::to_string(window) + "x" + std::to_string(window) + " windows, " +
                                   std::string(dtype_name(dt)) + (bias ? ", bias" : "") + ", threads " +
                                   std::to_string(threads);
          Tensor y = empty({p.n, p.oh, p.ow, p.o}, dt), pooled = empty({p.n, q.oh, q.ow, p.o}, dt);
          Tensor fused = empty({p.n, q.oh, q.ow, p.o}, dt);
          std::vector<uint8_t> ws(kernels::pool2d_workspace_bytes(q)), fws(ws.size());
          kernels::conv2d_forward(p, x.data_ptr(), w.data_ptr(), bias ? b.data_ptr() : nullptr, y.data_ptr());
          ASSERT_TRUE(kernels::pool2d_forward(q, y.data_ptr(), pooled.data_ptr(), ws.data()));
          kernels::conv2d_forward_pooled(p, q, x.data_ptr(), w.data_ptr(), bias ? b.data_ptr() : nullptr,
                                         fused.data_ptr(), fws.data(), nullptr);
          EXPECT_TRUE(equal(fused, pooled)) << what;
          EXPECT_EQ(fws, ws) << what;
        }
      }
    }
  }
  set_num_threads(saved);
}
