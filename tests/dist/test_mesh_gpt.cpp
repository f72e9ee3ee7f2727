// dp x tp x pp (issue 20): parallel::MeshGPT over every layout of the world
// (1, 2 and 4 ranks in ctest dist_2/dist_4, 8 ranks in dist_8_mesh) against
// one process's models::GPT on the same global batch from the same seed:
// losses, the clipping norm, parameters after SGD(momentum) steps, evaluation,
// and the optimizer state merged from (and split back to) the shards.
//
// Tolerance: each layout computes the same float32 operations on slices (of
// the batch across dp and micro-batches, of the heads and vocabulary across
// tp) and sums them in another order than one process, so values differ by
// float32 rounding of reordered sums: losses and norms |d| <= 1e-6 + 1e-5 |want|;
// SGD parameters |d| <= 1e-6 + 1e-5 |want| after 3 clipped steps (lr 0.1,
// momentum 0.9); AdamW's moments |d| <= 1e-7 + 1e-4 |want| (they are the
// gradients' running means and squares, each off by its rounding). The
// observed maxima are printed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <tuple>

#include "kiln/core/guards.h"
#include "kiln/dist/device_mesh.h"
#include "kiln/dist/dist.h"
#include "kiln/models/gpt.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/optim/optimizer.h"
#include "kiln/parallel/mesh_gpt.h"

namespace kiln {
namespace {

using parallel::Schedule;

models::GPTOptions tiny_gpt() {
  models::GPTOptions o;
  o.vocab_size = 32;
  o.block_size = 8;
  o.n_layer = 4;
  o.n_head = 4;
  o.n_embd = 16;
  return o;
}

constexpr int64_t kBatch = 8, kSteps = 3;
constexpr double kClip = 0.5;

std::pair<Tensor, Tensor> batch(int64_t k) {
  Generator g(3000 + 31 * k);
  return {randint(0, 32, {kBatch, 8}, kInt64, &g), randint(0, 32, {kBatch, 8}, kInt64, &g)};
}

struct Layout {
  int dp, tp, pp;
  bool sp = false;
  Schedule schedule = Schedule::OneFOneB;
};

std::string text(const Layout& l) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "dp %d x tp %d x pp %d%s, %s", l.dp, l.tp, l.pp, l.sp ? " (SP)" : "",
                parallel::schedule_name(l.schedule));
  return buf;
}

/// Every layout of `world` ranks this GPT allows (tp divides n_head, pp <= n_layer); at 8 ranks a chosen few.
std::vector<Layout> layouts(int world) {
  if (world == 8)
    return {{2, 2, 2}, {2, 2, 2, true, Schedule::GPipe}, {1, 4, 2, true}, {4, 1, 2}, {2, 4, 1}, {1, 2, 4}};
  std::vector<Layout> out;
  for (int tp : {1, 2, 4})
    for (int pp : {1, 2, 4})
      if (world % (tp * pp) == 0) {
        out.push_back({world / (tp * pp), tp, pp});
        if (tp > 1) out.push_back({world / (tp * pp), tp, pp, true, Schedule::GPipe});
      }
  return out;
}

double max_rel_excess(const Tensor& got, const Tensor& want, double atol, double rtol, double* max_abs) {
  const Tensor g = got.to(kFloat64).contiguous(), w = want.to(kFloat64).contiguous();
  double worst = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const double d = std::abs(g.data_ptr<double>()[i] - w.data_ptr<double>()[i]);
    *max_abs = std::max(*max_abs, d);
    worst = std::max(worst, d - (atol + rtol * std::abs(w.data_ptr<double>()[i])));
  }
  return worst;
}

class MeshGPT : public ::testing::Test {
 protected:
  void SetUp() override {
    if (dist::world()->size() > 8) GTEST_SKIP() << "layouts are listed for 1, 2, 4 and 8 ranks";
  }
};

TEST_F(MeshGPT, TrainsLikeOneProcessInEveryLayout) {
  const int world = dist::world()->size();
  for (const Layout& l : layouts(world)) {
    SCOPED_TRACE(text(l));
    dist::DeviceMesh mesh({{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}});
    manual_seed(5);
    models::GPT ref(tiny_gpt());
    const int64_t b = kBatch / l.dp;
    std::unique_ptr<parallel::MeshGPT> m;
    {
      manual_seed(5);
      models::GPT full(tiny_gpt());
      m = std::make_unique<parallel::MeshGPT>(
          full, mesh,
          parallel::MeshGPTOptions{.micro_batches = std::min<int64_t>(2, b), .schedule = l.schedule, .sequence_parallel = l.sp});
    }
    const optim::SGDOptions sgd{.lr = 0.1, .momentum = 0.9};
    optim::SGD ref_opt(ref.named_parameters(), sgd), opt(m->module().named_parameters(), sgd);
    double worst_loss = 0, worst_norm = 0;
    for (int64_t k = 0; k < kSteps; ++k) {
      auto [idx, tgt] = batch(k);
      ref_opt.zero_grad();
      Tensor want = ref.loss(idx, tgt);
      want.backward();
      const double want_norm = optim::clip_grad_norm_(ref.named_parameters(), kClip);
      ref_opt.step();

      opt.zero_grad();
      const int64_t at = mesh.coordinate("dp") * b;
      auto r = m->forward_backward(idx.narrow(0, at, b), tgt.narrow(0, at, b));
      m->allreduce_gradients();
      const double norm = m->clip_grad_norm_(kClip);
      opt.step();
      Tensor loss = full({1}, r.loss / l.dp, TensorOptions(kFloat32));  // float32: what collectives carry
      m->dp_group()->allreduce(loss, dist::ReduceOp::Sum)->wait();
      const double w = want.item<double>(), g = loss.item<double>();
      worst_loss = std::max(worst_loss, std::abs(g - w));
      worst_norm = std::max(worst_norm, std::abs(norm - want_norm));
      EXPECT_LE(std::abs(g - w), 1e-6 + 1e-5 * std::abs(w)) << "step " << k;
      EXPECT_LE(std::abs(norm - want_norm), 1e-6 + 1e-5 * want_norm) << "step " << k << ": clip norm";
      EXPECT_GT(want_norm, kClip) << "the clip should act, so that its scaling is tested";
    }
    double worst_param = 0;
    const nn::NamedTensors got = m->full_state_dict(), want = ref.state_dict();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].first, want[i].first);
      ASSERT_EQ(got[i].second.sizes(), want[i].second.sizes()) << got[i].first;
      EXPECT_LE(max_rel_excess(got[i].second, want[i].second, 1e-6, 1e-5, &worst_param), 0) << got[i].first;
    }
    // Evaluation, forward only, on a batch of another size (no micro-batches).
    ref.eval();
    m->module().eval();
    {
      NoGradGuard no_grad;
      auto [idx, tgt] = batch(99);
      const double want_eval = ref.loss(idx.narrow(0, 0, 3), tgt.narrow(0, 0, 3)).item<double>();
      const double got_eval = m->evaluate(idx.narrow(0, 0, 3), tgt.narrow(0, 0, 3));
      EXPECT_LE(std::abs(got_eval - want_eval), 1e-6 + 1e-5 * want_eval);
    }
    if (dist::world()->rank() == 0)
      std::printf("  %s: max |d| loss %.2e, clip norm %.2e, parameters %.2e\n", text(l).c_str(), worst_loss,
                  worst_norm, worst_param);
  }
}

TEST_F(MeshGPT, OptimizerStateMergesAndSplitsBack) {
  const int world = dist::world()->size();
  const Layout l = world == 8 ? Layout{2, 2, 2} : world == 4 ? Layout{1, 2, 2} : Layout{1, world, 1};
  SCOPED_TRACE(text(l));
  dist::DeviceMesh mesh({{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}});
  manual_seed(7);
  models::GPT ref(tiny_gpt());
  parallel::MeshGPT m(ref, mesh, {.micro_batches = 2});
  const optim::AdamWOptions adamw{.lr = 1e-3, .weight_decay = 0.1};
  optim::AdamW ref_opt(ref.named_parameters(), adamw), opt(m.module().named_parameters(), adamw);
  const int64_t b = kBatch / l.dp;
  for (int64_t k = 0; k < 2; ++k) {
    auto [idx, tgt] = batch(k);
    ref_opt.zero_grad();
    ref.loss(idx, tgt).backward();
    ref_opt.step();
    opt.zero_grad();
    const int64_t at = mesh.coordinate("dp") * b;
    m.forward_backward(idx.narrow(0, at, b), tgt.narrow(0, at, b));
    m.allreduce_gradients();
    opt.step();
  }
  const auto local = opt.state_dict().state;
  const auto merged = m.full_optim_state(local);
  const auto want = ref_opt.state_dict().state;
  ASSERT_EQ(merged.size(), want.size()) << "one entry per GPT parameter (the tied weight once)";
  double worst = 0;
  for (const auto& [name, st] : want) {
    auto it = merged.find(name);
    ASSERT_NE(it, merged.end()) << name;
    EXPECT_EQ(it->second.step, st.step) << name;
    ASSERT_EQ(it->second.tensors.size(), st.tensors.size()) << name;
    for (const auto& [key, t] : st.tensors) {
      ASSERT_EQ(it->second.tensors.at(key).sizes(), t.sizes()) << name << " " << key;
      EXPECT_LE(max_rel_excess(it->second.tensors.at(key), t, 1e-7, 1e-4, &worst), 0) << name << " " << key;
    }
  }
  // Split back: every rank gets exactly its own state again.
  const auto back = m.local_optim_state(merged);
  ASSERT_EQ(back.size(), local.size());
  for (const auto& [name, st] : local) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_EQ(back.at(name).step, st.step);
    for (const auto& [key, t] : st.tensors) EXPECT_TRUE(back.at(name).tensors.at(key).equal(t)) << name << " " << key;
  }
  // A single-process state dict loads into the layout and merges back bit for bit.
  manual_seed(11);
  models::GPT other(tiny_gpt());
  m.load_full_state_dict(other.state_dict());
  const nn::NamedTensors got = m.full_state_dict(), sd = other.state_dict();
  ASSERT_EQ(got.size(), sd.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i].second.equal(sd[i].second)) << got[i].first;
  if (dist::world()->rank() == 0) std::printf("  %s: AdamW moments max |d| %.2e\n", text(l).c_str(), worst);
}

TEST_F(MeshGPT, RefusesAMeshWithoutItsDimensions) {
  dist::DeviceMesh mesh({{"dp", dist::world()->size()}, {"tp", 1}});
  manual_seed(5);
  models::GPT full(tiny_gpt());
  try {
    parallel::MeshGPT m(full, mesh);
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("which has no 'pp'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
