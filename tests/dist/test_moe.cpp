// Mixture of experts and expert parallelism (issue 20) with ep = the world
// (1, 2 or 4 ranks under mpirun; ctest runs dist_2, dist_4 and dist_2_debug).
//
//  - MoE.MatchesPyTorchTwin: the expert-parallel layer on deterministic
//    weights and inputs (every rank feeds the same tokens) against
//    tests/parity/moe_twin.py: outputs, input and router gradients, the
//    load-balancing loss, tokens per expert and dropped counts, with capacity
//    factor 1.0 (drops when routing is unbalanced) and 100 (drops none).
//  - MoE.ExpertParallelMatchesOneProcess: every rank routes its own tokens;
//    the same experts in one process (group nullptr, same weights) run every
//    rank's tokens one batch at a time. Outputs, aux loss, stats, input and
//    router gradients (this rank's tokens) and each held expert's gradients
//    (the sum over every rank's tokens) agree.
//  - MoE.DroppedTokensLeaveZero: top-1 routing all to one expert, capacity
//    factor 1: tokens over capacity leave the layer as exact zeros.
//  - MoE.TinyMoEGPTTrains: a 2-layer MoEGPT (experts spread over the world)
//    trains for a few AdamW steps and its loss falls on every rank.
//
// Tolerances (float32): outputs and gradients |d| <= 1e-6 + 1e-5 |want| (the
// experts multiply batches of other sizes, and an expert's gradient sums the
// ranks' rows in another order than one process); against PyTorch
// |d| <= 1e-5 + 1e-4 |want| (other GEMM and GELU kernels).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "dist/ddp_nets.h"
#include "kiln/core/guards.h"
#include "kiln/dist/dist.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/init.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"
#include "kiln/parallel/moe.h"
#include "support/test_util.h"

namespace kiln {
namespace {

constexpr double kRtol = 1e-5, kAtol = 1e-6;
constexpr double kTwinRtol = 1e-4, kTwinAtol = 1e-5;

// The twin's deterministic tensors: scale * fn(a * i + b), rounded to float32.
Tensor det(std::vector<int64_t> shape, double a, double b, double scale, bool use_cos = false) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(scale * (use_cos ? std::cos(a * i + b) : std::sin(a * i + b)));
  return kiln::tensor<float>(v, shape);
}

void expect_values(const Tensor& got, const std::vector<double>& want, double rtol, double atol,
                   const std::string& what) {
  std::vector<double> g = test::to_doubles(got);
  ASSERT_EQ(g.size(), want.size()) << what << ": expected " << want.size() << " values, got " << g.size();
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double excess = std::abs(g[i] - want[i]) - (atol + rtol * std::abs(want[i]));
    if (i == 0 || excess > worst) {
      worst = excess;
      at = i;
    }
  }
  EXPECT_LE(worst, 0.0) << what << ": element " << at << " is " << g[at] << ", expected " << want[at];
}

std::vector<double> as_doubles(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

class MoETest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's MoE cases run under mpirun: ctest -R dist_";
    pg = dist::world();
    n = pg->size();
    rank = pg->rank();
  }
  std::string who(const std::string& what) const {
    return what + " (rank " + std::to_string(rank) + " of ep " + std::to_string(n) + ")";
  }
  dist::ProcessGroupPtr pg;
  int n = 1, rank = 0;
};

TEST_F(MoETest, MatchesPyTorchTwin) {
  constexpr int64_t D = 8, DFF = 16, E = 4, K = 2, N = 12;
  if (E % n != 0) GTEST_SKIP() << "4 experts do not spread evenly over " << n << " ranks";
  const auto table = test::run_python_table("moe_twin.py");
  auto want = [&](const std::string& key) {
    auto it = table.find(key);
    EXPECT_NE(it, table.end()) << "moe_twin.py printed no line '" << key << "'";
    return it == table.end() ? std::vector<double>{} : it->second;
  };
  for (bool skew : {false, true}) {
    for (double cf : {1.0, 100.0}) {
      const std::string name = std::string(skew ? "skew_" : "mixed_") + (cf == 1.0 ? "cf1" : "cf100");
      parallel::MoE moe(parallel::MoEOptions{
                            .d_model = D, .d_ff = DFF, .num_experts = E, .top_k = K, .capacity_factor = cf, .name = name},
                        pg);
      {
        NoGradGuard ng;
        Tensor r = det({E, D}, 0.73, 1.0, 0.5);
        if (skew) r.narrow(0, 0, 1).add_(0.5);
        moe.router->weight.copy_(r);
        for (int64_t e = moe.first_expert; e < moe.first_expert + moe.local_experts; ++e) {
          auto* m = static_cast<nn::TransformerMLP*>((*moe.experts)[std::to_string(e)].get());
          m->c_fc->weight.copy_(det({DFF, D}, 0.11, static_cast<double>(e), 0.2));
          m->c_fc->bias.copy_(det({DFF}, 0.05, static_cast<double>(e), 0.1, true));
          m->c_proj->weight.copy_(det({D, DFF}, 0.07, 2.0 * e, 0.2));
          m->c_proj->bias.copy_(det({D}, 0.13, static_cast<double>(e), 0.1, true));
        }
      }
      Tensor x = det({N, D}, 0.31, 0.5, 1.0);
      if (skew) x = x + 1.0;
      x.requires_grad_(true);
      Tensor y = moe(x);
      const Tensor w = det({N, D}, 0.17, 0.0, 1.0, true);
      ((y * w).sum() + moe.aux_loss()).backward();
      const auto& s = moe.stats();
      expect_values(y, want(name + "_y"), kTwinRtol, kTwinAtol, who(name + " output"));
      expect_values(moe.aux_loss(), want(name + "_aux"), kTwinRtol, kTwinAtol, who(name + " aux loss"));
      EXPECT_EQ(as_doubles({s.dropped}), want(name + "_dropped")) << who(name);
      EXPECT_EQ(as_doubles({s.dropped_tokens}), want(name + "_dropped_tokens")) << who(name);
      EXPECT_EQ(as_doubles(s.routed), want(name + "_routed")) << who(name);
      EXPECT_EQ(as_doubles(s.kept), want(name + "_kept")) << who(name);
      expect_values(x.grad(), want(name + "_gx"), kTwinRtol, kTwinAtol, who(name + " input gradient"));
      // Every rank fed the same tokens: the router's gradient is this rank's, equal to the twin's.
      expect_values(moe.router->weight.grad(), want(name + "_grouter"), kTwinRtol, kTwinAtol,
                    who(name + " router gradient"));
      if (cf == 1.0 && skew) EXPECT_GT(s.dropped, 0) << who("capacity factor 1.0 on skewed routing drops");
      if (cf == 100.0) EXPECT_EQ(s.dropped, 0) << who("capacity factor 100 drops nothing");
    }
  }
}

TEST_F(MoETest, ExpertParallelMatchesOneProcess) {
  constexpr int64_t D = 8, DFF = 16, E = 8;
  if (E % n != 0) GTEST_SKIP() << "8 experts do not spread evenly over " << n << " ranks";
  for (int64_t k : {1, 2}) {
    for (double cf : {1.0, 0.0}) {
      const std::string what = "top-" + std::to_string(k) + ", capacity factor " + std::to_string(cf);
      const parallel::MoEOptions o{
          .d_model = D, .d_ff = DFF, .num_experts = E, .top_k = k, .capacity_factor = cf, .name = "moe"};
      manual_seed(21);
      parallel::MoE full(o);
      parallel::MoE ep_layer(o, pg);
      ep_layer.load_from_full(full.state_dict());
      EXPECT_EQ(ep_layer.local_experts, E / n);
      EXPECT_EQ(static_cast<int64_t>(ep_layer.experts->size()), E / n);

      // Rank s's tokens and output weights; every rank can make every rank's.
      auto batch = [&](int s) {
        Generator g(100 + s);
        return std::make_pair(randn({3, 5, D}, {}, &g), randn({3, 5, D}, {}, &g));
      };
      auto [x, w] = batch(rank);
      x.requires_grad_(true);
      Tensor y = ep_layer(x);
      ((y * w).sum() + ep_layer.aux_loss() * 0.1).backward();

      // One process: every rank's batch through the same experts; the router's
      // gradient of this rank's batch is read before the others accumulate.
      Tensor want_y, want_gx, want_grouter, want_aux;
      parallel::MoEStats want_stats;
      for (int s = 0; s < n; ++s) {
        const int src = (rank + s) % n;  // this rank's batch first
        auto [xs, ws] = batch(src);
        xs.requires_grad_(true);
        Tensor ys = full(xs);
        ((ys * ws).sum() + full.aux_loss() * 0.1).backward();
        if (s == 0) {
          want_y = ys.detach();
          want_gx = xs.grad();
          want_grouter = full.router->weight.grad().clone();
          want_aux = full.aux_loss().detach();
          want_stats = full.stats();
        }
      }
      test::expect_close(y, want_y, kRtol, kAtol, who(what + " output"));
      test::expect_close(ep_layer.aux_loss(), want_aux, kRtol, kAtol, who(what + " aux loss"));
      EXPECT_EQ(ep_layer.stats().routed, want_stats.routed) << who(what);
      EXPECT_EQ(ep_layer.stats().kept, want_stats.kept) << who(what);
      EXPECT_EQ(ep_layer.stats().dropped, want_stats.dropped) << who(what);
      EXPECT_EQ(ep_layer.stats().dropped_tokens, want_stats.dropped_tokens) << who(what);
      if (cf == 0.0) EXPECT_EQ(ep_layer.stats().dropped, 0) << who(what);
      test::expect_close(x.grad(), want_gx, kRtol, kAtol, who(what + " input gradient"));
      test::expect_close(ep_layer.router->weight.grad(), want_grouter, kRtol, kAtol, who(what + " router gradient"));
      const auto full_params = full.named_parameters();
      for (const auto& [name, p] : ep_layer.named_parameters()) {
        if (name.rfind("experts.", 0) != 0) continue;
        for (const auto& [fname, fp] : full_params)
          if (fname == name) {
            // An expert no rank routed a token to has no gradient in either.
            EXPECT_EQ(p.grad().defined(), fp.grad().defined()) << who(what + " gradient of " + name);
            if (p.grad().defined() && fp.grad().defined())
              test::expect_close(p.grad(), fp.grad(), kRtol, kAtol, who(what + " gradient of " + name));
          }
      }
      if (n > 1) EXPECT_GT(ep_layer.stats().alltoall_bytes, 0) << who(what);
    }
  }
}

TEST_F(MoETest, DroppedTokensLeaveZero) {
  constexpr int64_t D = 4, E = 4, N = 8;
  if (E % n != 0) GTEST_SKIP() << "4 experts do not spread evenly over " << n << " ranks";
  parallel::MoE moe(
      parallel::MoEOptions{.d_model = D, .d_ff = 8, .num_experts = E, .top_k = 1, .capacity_factor = 1.0, .name = "drop"},
      pg);
  {
    NoGradGuard ng;
    // Every token's largest logit is expert 2's: x is positive, only row 2 of the router is.
    moe.router->weight.zero_();
    moe.router->weight.narrow(0, 2, 1).fill_(1.0);
  }
  Tensor x = det({N, D}, 0.4, 0.1, 0.5) + 1.0;
  Tensor y = moe(x);
  const auto& s = moe.stats();
  EXPECT_EQ(s.capacity, 2);  // ceil(1.0 * 8 * 1 / 4)
  EXPECT_EQ(s.routed, (std::vector<int64_t>{0, 0, N, 0}));
  EXPECT_EQ(s.kept, (std::vector<int64_t>{0, 0, 2, 0}));
  EXPECT_EQ(s.dropped, N - 2);
  EXPECT_EQ(s.dropped_tokens, N - 2);
  // The first two tokens went through expert 2; the rest are exact zeros.
  Tensor rest = y.narrow(0, 2, N - 2);
  EXPECT_EQ(rest.abs().sum().item<float>(), 0.0f) << who("dropped tokens' output");
  EXPECT_GT(y.narrow(0, 0, 2).abs().sum().item<float>(), 0.0f) << who("kept tokens' output");
  // All of f sits on expert 2: aux = E * P_2 with P_2 the mean probability of expert 2.
  EXPECT_GT(moe.aux_loss().item<float>(), 1.0f);
}

TEST_F(MoETest, TinyMoEGPTTrains) {
  parallel::MoEGPTOptions o;
  o.gpt = models::GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16};
  o.num_experts = 4;
  o.top_k = 2;
  o.capacity_factor = 1.5;
  o.moe_layers = {false, true};
  if (o.num_experts % n != 0) GTEST_SKIP() << "4 experts do not spread evenly over " << n << " ranks";
  manual_seed(5);
  parallel::MoEGPT model(o, pg);
  {
    // Replicated parameters start equal on every rank (each rank's experts are its own).
    NoGradGuard ng;
    for (auto& [name, p] : model.named_parameters())
      if (name.find(".experts.") == std::string::npos) pg->broadcast(p, 0)->wait();
  }
  EXPECT_EQ(model.moe_layers().size(), 1u);
  Generator g(300 + rank);
  Tensor idx = randint(0, 32, {4, 16}, kInt64, &g);
  Tensor targets = randint(0, 32, {4, 16}, kInt64, &g);
  optim::AdamW opt(model.named_parameters(), optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
  float first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    opt.zero_grad();
    Tensor loss = model.loss(idx, targets);
    loss.backward();
    // Data parallel over the ranks' batches: average the replicated gradients;
    // an expert's gradient already sums every rank's loss, so divide by n.
    for (auto& [name, p] : model.named_parameters()) {
      if (!p.grad().defined()) continue;
      Tensor gr = p.grad();
      if (name.find(".experts.") == std::string::npos)
        pg->allreduce(gr, dist::ReduceOp::Avg)->wait();
      else
        gr.div_(static_cast<double>(n));
    }
    opt.step();
    Tensor l = loss.detach().clone();
    pg->allreduce(l, dist::ReduceOp::Avg)->wait();
    if (step == 0) first = l.item<float>();
    last = l.item<float>();
  }
  if (rank == 0) std::printf("MoEGPT mean loss over %d rank(s): %.4f -> %.4f in 8 steps\n", n, first, last);
  EXPECT_LT(last, first - 0.1f) << who("mean loss over the ranks after 8 steps");
  EXPECT_TRUE(std::isfinite(last));
}

// With every flag of moe_layers false MoEGPT is models::GPT under its names:
// a GPT's state dict loads strictly and the logits agree. With MoE layers the
// names differ only under transformer.h.N.mlp (router, experts.M.*).
TEST_F(MoETest, MoEGPTUsesGPTNames) {
  const models::GPTOptions go{.vocab_size = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16};
  manual_seed(9);
  models::GPT gpt(go);
  parallel::MoEGPTOptions o;
  o.gpt = go;
  o.moe_layers = {false, false};
  parallel::MoEGPT dense(o);
  auto r = dense.load_state_dict(gpt.state_dict(), /*strict=*/true);
  EXPECT_TRUE(r.missing_keys.empty() && r.unexpected_keys.empty());
  Generator g(10);
  Tensor idx = randint(0, 32, {2, 8}, kInt64, &g);
  test::expect_close(dense(idx), gpt(idx), kRtol, kAtol, who("dense MoEGPT logits against models::GPT"));

  o.moe_layers = {false, true};
  o.num_experts = 4;
  if (o.num_experts % n != 0) GTEST_SKIP() << "4 experts do not spread evenly over " << n << " ranks";
  parallel::MoEGPT moe(o, pg);
  std::vector<std::string> names;
  for (const auto& [name, t] : moe.state_dict())
    if (name.rfind("transformer.h.1.mlp.", 0) == 0) names.push_back(name);
  std::vector<std::string> want{"transformer.h.1.mlp.router.weight"};
  for (int64_t e = rank * (4 / n); e < (rank + 1) * (4 / n); ++e)
    for (const char* p : {"c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"})
      want.push_back("transformer.h.1.mlp.experts." + std::to_string(e) + "." + p);
  EXPECT_EQ(names, want) << who("MoE layer names");
}

// The figures of docs/moe.md: one forward and backward of a GPT-sized MoE
// layer (d 256, d_ff 1024, 8 experts, top-2, capacity factors 1.0 and 1.25) on 1024
// tokens per rank from nanoGPT's router init (N(0, 0.02)); checks the
// bookkeeping (every assignment kept or dropped; the bytes the splits imply).
TEST_F(MoETest, GptSizedLayerFigures) {
  constexpr int64_t D = 256, E = 8, K = 2, N = 1024;
  if (E % n != 0) GTEST_SKIP() << "8 experts do not spread evenly over " << n << " ranks";
  for (double cf : {1.0, 1.25}) {
  manual_seed(7);
  parallel::MoE moe(parallel::MoEOptions{.d_model = D, .num_experts = E, .top_k = K, .capacity_factor = cf,
                                         .name = "figures"},
                    pg);
  {
    NoGradGuard ng;
    nn::init::normal_(moe.router->weight, 0.0, 0.02);
  }
  Generator g(400 + rank);
  Tensor x = randn({8, 128, D}, {}, &g);
  x.requires_grad_(true);
  Tensor y = moe(x);
  (y.sum() + moe.aux_loss() * 0.01).backward();
  const auto& s = moe.stats();
  int64_t kept = 0, routed = 0;
  for (int64_t e = 0; e < E; ++e) {
    kept += s.kept[e];
    routed += s.routed[e];
    EXPECT_LE(s.kept[e], s.capacity) << who("expert " + std::to_string(e));
  }
  EXPECT_EQ(routed, N * K);
  EXPECT_EQ(kept + s.dropped, N * K);
  EXPECT_EQ(s.capacity, cf == 1.0 ? 256 : 320);  // ceil(cf * 1024 * 2 / 8)
  if (n == 1) EXPECT_EQ(s.alltoall_bytes, 0);
  std::string per_expert;
  for (int64_t e = 0; e < E; ++e) per_expert += " " + std::to_string(s.routed[e]);
  std::printf("MoE figures (capacity factor %.2f) rank %d of %d: assignments per expert%s; capacity %lld, dropped %lld (%lld tokens), "
              "aux %.4f, all-to-all bytes sent in forward %lld\n",
              cf, rank, n, per_expert.c_str(), static_cast<long long>(s.capacity), static_cast<long long>(s.dropped),
              static_cast<long long>(s.dropped_tokens), moe.aux_loss().item<float>(),
              static_cast<long long>(s.alltoall_bytes));
  }
}

}  // namespace
}  // namespace kiln
