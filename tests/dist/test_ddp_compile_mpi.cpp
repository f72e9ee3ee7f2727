// kiln::compile around a DDP training step under mpirun (ctest dist_2,
// dist_4): DDP's gradient hooks and its collectives are graph breaks, so
// from the second call the step runs split at them (docs/compile.md, "Graph
// breaks"); every rank must end where the same step run eagerly ends, bit for bit.
#include <gtest/gtest.h>

#include "dist/ddp_nets.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/traffic.h"
#include "kiln/export/compile.h"
#include "kiln/optim/optimizer.h"

namespace kiln {
namespace {

constexpr double kSmallCap = 1024.0 / (1024 * 1024);  // several buckets

// Trains rank r's share of each batch through DDP with AdamW, the step
// compiled or not; returns the losses.
std::vector<float> train(const std::shared_ptr<test::Net>& net, const dist::ProcessGroupPtr& pg,
                         const test::Batches& b, int64_t B, bool compiled, std::string* explain = nullptr) {
  dist::DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = kSmallCap});
  optim::AdamW opt(net->named_parameters(), {.lr = 0.05});
  const int64_t r = pg->rank();
  auto step = [&](const std::vector<Tensor>& in) {
    opt.zero_grad();
    Tensor loss = test::mse(ddp(in[0]), in[1]);
    loss.backward();
    opt.step();
    return std::vector<Tensor>{loss.detach()};
  };
  CompiledFunction compiled_step = compile(step, CompileOptions{.name = "ddp_step", .modules = {net.get()}});
  std::vector<float> losses;
  for (size_t k = 0; k < b.xs.size(); ++k) {
    const std::vector<Tensor> in{b.xs[k].narrow(0, r * B, B).contiguous(), b.ys[k].narrow(0, r * B, B).contiguous()};
    const std::vector<Tensor> out = compiled ? compiled_step(in) : step(in);
    losses.push_back(out[0].item<float>());
  }
  if (explain) *explain = compiled_step.explain();
  if (compiled) {
    EXPECT_EQ(compiled_step.stats().split_calls, static_cast<int64_t>(b.xs.size()) - 1) << compiled_step.explain();
  }
  return losses;
}

TEST(DDPCompileMpi, ACompiledStepSplitAtItsCollectivesMatchesEagerBitwise) {
  ASSERT_TRUE(dist::is_initialized()) << "run under mpirun: ctest -R dist_";
  const dist::ProcessGroupPtr pg = dist::world();
  const int n = pg->size();
  const int64_t B = 3;
  const test::Batches batches = test::make_batches(n * B, 5, 61);
  auto eager_net = test::make_net(9);
  auto compiled_net = test::make_net(9);
  eager_net->use_never = compiled_net->use_never = true;  // every parameter gets a gradient
  const std::vector<float> want = train(eager_net, pg, batches, B, false);
  std::string explain;
  const std::vector<float> got = train(compiled_net, pg, batches, B, true, &explain);
  EXPECT_EQ(got, want);
  auto g = compiled_net->named_parameters();
  auto w = eager_net->named_parameters();
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) EXPECT_TRUE(g[i].second.equal(w[i].second)) << w[i].first;
  EXPECT_NE(explain.find("collective"), std::string::npos) << explain;
}

// Gradient accumulation: the compiled step's hooks run in its split calls and
// see DDP's no_sync, so a micro-batch under it communicates nothing and the
// step ends where eager accumulation ends.
TEST(DDPCompileMpi, ACompiledMicroBatchUnderNoSyncCommunicatesNothing) {
  ASSERT_TRUE(dist::is_initialized()) << "run under mpirun: ctest -R dist_";
  const dist::ProcessGroupPtr pg = dist::world();
  const int64_t B = 2, r = pg->rank();
  const test::Batches batches = test::make_batches(pg->size() * B, 6, 62);
  std::vector<std::shared_ptr<test::Net>> nets;
  for (const bool compiled : {false, true}) {
    auto net = test::make_net(10);
    net->use_never = true;
    dist::DistributedDataParallel ddp(net, pg, {.bucket_cap_mb = kSmallCap});
    optim::SGD opt(net->named_parameters(), {.lr = 0.1});
    auto backward = [&](const std::vector<Tensor>& in) {
      Tensor loss = test::mse(ddp(in[0]), in[1]);
      loss.backward();
      return std::vector<Tensor>{loss.detach()};
    };
    CompiledFunction step = compile(backward, CompileOptions{.name = "micro_batch", .modules = {net.get()}});
    for (size_t k = 0; k + 1 < batches.xs.size(); k += 2) {
      opt.zero_grad();
      auto in = [&](size_t j) {
        return std::vector<Tensor>{batches.xs[j].narrow(0, r * B, B).contiguous(),
                                   batches.ys[j].narrow(0, r * B, B).contiguous()};
      };
      {
        auto no_sync = ddp.no_sync();
        const int64_t before = dist::traffic().bytes;
        compiled ? step(in(k)) : backward(in(k));
        EXPECT_EQ(dist::traffic().bytes, before) << "micro-batch " << k << (compiled ? ", compiled" : ", eager");
      }
      compiled ? step(in(k + 1)) : backward(in(k + 1));
      opt.step();
    }
    if (compiled) {
      EXPECT_GT(step.stats().split_calls, 0) << step.explain();
    }
    nets.push_back(net);
  }
  auto w = nets[0]->named_parameters(), g = nets[1]->named_parameters();
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) EXPECT_TRUE(g[i].second.equal(w[i].second)) << w[i].first;
}

}  // namespace
}  // namespace kiln
