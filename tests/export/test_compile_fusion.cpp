// kiln::compile's fusion: runs of elementwise kernels over one shape replay
// as one tiled loop, bitwise equal to the kernels one after another (odd
// sizes with a tail tile, 2-D and 3-D spaces, bool, bfloat16, int64 and mixed
// dtypes, in-place chains, 1 and 2 threads, a training step); intermediates
// that die inside the run stay out of memory; overlaps that are not element
// for element are not fused.
#include <gtest/gtest.h>

#include <memory>

#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/export/compile.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

/// Eager fn and its compiled replays agree bitwise on each input set (the first call captures).
CompileStats check_fused(const CompiledFunction::Fn& fn, int64_t n, int calls = 3, bool fuse = true) {
  auto step = compile(fn, {.name = "chain", .modules = {}, .fuse = fuse});
  for (int k = 0; k < calls; ++k) {
    const std::vector<Tensor> in = {randn({n}), randn({n})};
    const std::vector<Tensor> want = fn(in);
    const std::vector<Tensor> got = step(in);
    EXPECT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size() && i < got.size(); ++i)
      EXPECT_TRUE(bitwise_equal(want[i], got[i])) << "call " << k << " output " << i << "\n" << step.explain();
  }
  EXPECT_EQ(step.stats().replays, calls - 1) << step.explain();
  return step.stats();
}

std::vector<Tensor> chain(const std::vector<Tensor>& in) {
  const NoGradGuard ng;
  const Tensor& x = in[0];
  return {((x * 2.0 + 1.0).relu() * in[1]).sigmoid()};
}

TEST(CompileFusion, AChainIsOneLoopAndItsIntermediatesAreNotWritten) {
  manual_seed(1);
  const int64_t n = 10007;  // one tile: it fits in L2 (TwoThreadsAndManyTilesAgree has 28 and a tail)
  const CompileStats s = check_fused(chain, n);
  EXPECT_EQ(s.fused_loops, 1);
  EXPECT_EQ(s.fused_kernels, 5);  // mul, add, relu, mul, sigmoid
  // The four temporaries die at the end of the expression: only the result is written.
  EXPECT_EQ(s.unwritten_bytes, 4 * n * 4);
  const CompileStats off = check_fused(chain, n, 3, /*fuse=*/false);
  EXPECT_EQ(off.fused_loops, 0);
  EXPECT_EQ(off.unwritten_bytes, 0);
}

TEST(CompileFusion, IntermediatesReadLaterOrReturnedReachMemory) {
  manual_seed(7);
  const int64_t n = 7000;
  auto fn = [](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    const Tensor t = in[0] * 2.0;            // read again by the row sums after the run
    const Tensor u = (t + in[1]).relu();     // t + in[1] dies inside the run; u at the return
    const Tensor v = u * 3.0;                // returned
    return std::vector<Tensor>{v.exp(), t.reshape({1000, 7}).sum(1), v};  // row sums do not join a run
  };
  const CompileStats s = check_fused(fn, n);
  EXPECT_EQ(s.fused_loops, 1);
  EXPECT_EQ(s.fused_kernels, 5);  // mul, add, relu, mul, exp
  // Only t + in[1]: u is freed when the function returns, after the row sums ran (which, for
  // all the record knows, might have read it).
  EXPECT_EQ(s.unwritten_bytes, n * 4);
}

TEST(CompileFusion, AWholeArrayReductionEndsTheRunAndReducesEachTile) {
  // A squared error written out: sub, mul and the mean are one loop; the difference and the
  // squares never reach memory, and the mean is the kernel's to the bit (its pieces of 32768
  // elements reduced as the tiles are made, then the same tree over them).
  auto mse = [](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    const Tensor d = in[0] - in[1];
    return std::vector<Tensor>{(d * d).mean()};
  };
  auto sum_abs = [](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    return std::vector<Tensor>{(in[0] * in[1]).abs().sum(), in[0].exp().max()};
  };
  const int before = get_num_threads();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    // One tile; one piece and a tail; many pieces and a short last one; whole pieces only.
    for (int64_t n : {int64_t{1000}, int64_t{40000}, int64_t{32768 * 9 + 5}, int64_t{32768 * 4}}) {
      manual_seed(static_cast<uint64_t>(n));
      const CompileStats s = check_fused(mse, n);
      EXPECT_EQ(s.fused_loops, 1) << n;
      EXPECT_EQ(s.fused_kernels, 3) << n;  // sub, mul, mean
      EXPECT_EQ(s.unwritten_bytes, 2 * n * 4) << n;
      const CompileStats t = check_fused(sum_abs, n);
      EXPECT_EQ(t.fused_loops, 2) << n;  // mul, abs, sum; exp, amax
      EXPECT_EQ(t.fused_kernels, 5) << n;
    }
  }
  set_num_threads(before);
}

TEST(CompileFusion, AReductionOfABroadcastSpaceJoinsOnlyWhenTilesHoldWholePieces) {
  manual_seed(10);
  const Tensor bias128 = randn({128}), bias300 = randn({300});
  auto rows = [](const Tensor& bias) {
    return [bias](const std::vector<Tensor>& in) {
      const NoGradGuard ng;
      const Tensor x = in[0].reshape({-1, bias.size(0)});
      return std::vector<Tensor>{((x + bias).relu() * 2.0).sum()};
    };
  };
  // Rows of 128 divide a piece: tiles of 256 rows. Rows of 300 do not, and a space of more
  // than one piece then keeps the sum apart (still bitwise, as a kernel of its own).
  const CompileStats a = check_fused(rows(bias128), 128 * 1000);
  EXPECT_EQ(a.fused_kernels, 4);
  const CompileStats b = check_fused(rows(bias300), 300 * 1000);
  EXPECT_EQ(b.fused_loops, 1);
  EXPECT_EQ(b.fused_kernels, 3);
  const CompileStats c = check_fused(rows(bias300), 300 * 100);  // one piece: one tile, joined
  EXPECT_EQ(c.fused_kernels, 4);
}

TEST(CompileFusion, TwoThreadsAndManyTilesAgree) {
  manual_seed(2);
  EXPECT_EQ(check_fused(chain, 200003).fused_loops, 1);
  const int before = get_num_threads();
  set_num_threads(2);
  const CompileStats s = check_fused(chain, 200003);
  set_num_threads(before);
  EXPECT_EQ(s.fused_loops, 1);
}

TEST(CompileFusion, AnInPlaceChainWritesOnlyItsLastValue) {
  manual_seed(3);
  auto fn = [](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    Tensor a = in[0].clone();
    a.mul_(2.0).add_(in[1]).relu_();
    return std::vector<Tensor>{a};
  };
  const CompileStats s = check_fused(fn, 5000);
  EXPECT_EQ(s.fused_loops, 1);
  EXPECT_EQ(s.fused_kernels, 4);  // the clone's copy, mul_, add_, relu_
  // Each op overwrites the value before it, element for element: only relu_'s reaches memory.
  EXPECT_EQ(s.unwritten_bytes, 3 * 5000 * 4);
}

TEST(CompileFusion, BroadcastRowsBoolsAndMixedDtypes) {
  manual_seed(4);
  const Tensor bias = randn({300});
  auto fn = [bias](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    const Tensor x = in[0].reshape({-1, 300});
    const Tensor h = (x + bias).relu();  // a 2-D space: tiles of rows
    const Tensor m = h > 0.5;            // bool output, read by the next op
    return std::vector<Tensor>{h.masked_fill(m, 0.25) * 3.0, m.to(kFloat32) + h};
  };
  // 1000 rows of 300: tiles of whole rows, a multiple of 64 of them (so that the 1-D loops'
  // ranges start at multiples of 256 elements), split over threads.
  const CompileStats s = check_fused(fn, 1000 * 300);
  // The broadcast add (a 2-D loop) and everything after it (1-D loops of as many elements).
  EXPECT_EQ(s.fused_loops, 1);
  EXPECT_EQ(s.fused_kernels, 7);
  const int before = get_num_threads();
  set_num_threads(2);
  check_fused(fn, 1000 * 300);
  check_fused(fn, 64 * 300);  // one tile
  set_num_threads(before);
}

TEST(CompileFusion, ANormalisationWrittenOutPerChannel) {
  manual_seed(8);
  const Tensor mean = randn({1, 16, 1}), scale = randn({1, 16, 1}), shift = randn({1, 16, 1});
  auto fn = [=](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    const Tensor x = in[0].reshape({-1, 16, 50});
    return std::vector<Tensor>{((x - mean) * scale + shift).relu()};
  };
  const CompileStats s = check_fused(fn, 64 * 16 * 50);
  EXPECT_EQ(s.fused_loops, 1);
  EXPECT_EQ(s.fused_kernels, 4);  // three 3-D broadcast loops and the 1-D ReLU
  EXPECT_EQ(s.unwritten_bytes, 3 * 64 * 16 * 50 * 4);
}

TEST(CompileFusion, Bfloat16AndIntegerChains) {
  manual_seed(9);
  auto fn = [](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    const Tensor h = in[0].to(kBFloat16);                 // a cast: 2-byte output
    const Tensor b = ((h * 3.0 + in[1].to(kBFloat16)).relu() - 0.5).to(kFloat32);
    const Tensor i = (in[0] * 100.0).to(kInt64);          // 8-byte elements
    return std::vector<Tensor>{b, (i * 3 + 7).maximum(i) - i};
  };
  // Casts to and from bfloat16, float32 arithmetic and int64 arithmetic: one run of 2-, 4- and
  // 8-byte elements, each intermediate in a slot of its own element size.
  const CompileStats s = check_fused(fn, 30011);
  EXPECT_EQ(s.fused_loops, 1);
  EXPECT_GE(s.fused_kernels, 9);
  EXPECT_GT(s.unwritten_bytes, 0);
}

TEST(CompileFusion, ShiftedOverlapsAreNotFused) {
  manual_seed(5);
  const int64_t n = 9000;
  auto fn = [n](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    Tensor a = in[0].clone();
    a.narrow(0, 0, n - 1).add_(1.0);             // writes a[0, n-1)
    Tensor b = a.narrow(0, 1, n - 1) * in[1].narrow(0, 0, n - 1);  // reads a[1, n): one element later
    return std::vector<Tensor>{b};
  };
  const CompileStats s = check_fused(fn, n);
  // The add and the mul share a shape but not their elements' positions: tile by tile,
  // the mul would read a[k + 1] before the add wrote it.
  EXPECT_EQ(s.fused_loops, 0);
}

TEST(CompileFusion, ATrainingStepWithWrittenOutOpsMatchesEagerBitwise) {
  struct Twin {
    std::shared_ptr<nn::Linear> fc1, fc2;
    std::unique_ptr<optim::Optimizer> opt;
  };
  auto make = [] {
    manual_seed(6);
    Twin t;
    t.fc1 = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 32, .out_features = 64});
    t.fc2 = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 64, .out_features = 8});
    optim::ParamGroup g;
    for (const auto& [n, p] : t.fc1->named_parameters()) g.params.emplace_back("fc1." + n, p);
    for (const auto& [n, p] : t.fc2->named_parameters()) g.params.emplace_back("fc2." + n, p);
    t.opt = std::make_unique<optim::Adam>(std::vector<optim::ParamGroup>{g}, optim::AdamOptions{.lr = 1e-2});
    return t;
  };
  Twin eager = make(), comp = make();
  const Tensor x = randn({16, 32}), y = randn({16, 8});
  auto step_of = [&x, &y](Twin& t) {
    return [&t, &x, &y]() {
      t.opt->zero_grad();
      const Tensor h = (*t.fc1)(x);
      const Tensor a = h * h.sigmoid();  // silu, written out
      const Tensor d = (*t.fc2)(a) - y;
      Tensor loss = (d * d * 0.5).mean();  // a squared error, written out
      loss.backward();
      t.opt->step();
      return loss;
    };
  };
  auto eager_step = step_of(eager);
  auto step = compile(step_of(comp), {.name = "silu step", .modules = {comp.fc1.get(), comp.fc2.get()}});
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(bitwise_equal(eager_step(), step()[0])) << "loss of step " << i;
  EXPECT_EQ(step.stats().replays, 3);
  EXPECT_GE(step.stats().fused_loops, 1) << step.explain();
  for (auto [e, c] : {std::pair{eager.fc1.get(), comp.fc1.get()}, std::pair{eager.fc2.get(), comp.fc2.get()}}) {
    const auto pe = e->parameters(), pc = c->parameters();
    for (size_t i = 0; i < pe.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(pe[i], pc[i]));
      EXPECT_TRUE(bitwise_equal(pe[i].grad(), pc[i].grad()));
    }
  }
  EXPECT_NE(step.explain().find("fused loop"), std::string::npos) << step.explain();
}

}  // namespace
}  // namespace kiln::test
