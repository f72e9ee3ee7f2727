// quant pruning (kiln/quant/prune.h).
// - Which elements: the unstructured masks (one tensor, pruned again, global
//   over two tensors) and the structured channel ranking equal torch 1.13's
//   torch.nn.utils.prune on the same tensors exactly when magnitudes are
//   distinct; with ties at the threshold the count and every element off the
//   tie class agree (torch's topk picks among exact ties in its own order).
// - Through training: masked gradients are zero, and pruned weights stay zero
//   after SGD (momentum from before pruning, nesterov, weight decay), Adam and
//   AdamW steps; remove() keeps the zeros and drops the mask and hooks.
// - Channels: the shrunk CNN / ResNet computes what the masked one does
//   (within 1e-5), in eval and training mode; a shrunk model's state_dict
//   loads into a fresh model given the recorded channel counts (exactly the
//   same outputs); hostile counts are refused with the unit named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/layers.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/optim/optimizer.h"
#include "kiln/quant/prune.h"
#include "support/oracle.h"

using namespace kiln;
namespace prune = kiln::quant;

namespace {

Tensor randn_t(std::vector<int64_t> shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, TensorOptions(kFloat32), &g);
}

// Small integers: many exact ties in |x|.
Tensor tied_t(std::vector<int64_t> shape, uint64_t seed) {
  Generator g(seed);
  return randint(-3, 4, shape, TensorOptions(kInt64), &g).to(kFloat32);
}

std::vector<float> values(const Tensor& t) {
  const Tensor c = t.detach().to(kFloat32).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

double max_abs_diff(const Tensor& a, const Tensor& b) { return a.sub(b).abs().max().item<float>(); }

// torch.nn.utils.prune (not imported by `import torch` in 1.13).
const char* kP = "__import__('torch.nn.utils.prune', fromlist=['prune'])";

// torch: a bare module holding `w` as its parameter "weight".
const char* kMake = "(lambda w: (lambda m: (setattr(m, 'weight', torch.nn.Parameter(w.clone())), m)[-1])(torch.nn.Module()))";

std::string twice(double a, double b) {
  return std::string("(lambda P, m: (P.l1_unstructured(m, 'weight', ") + std::to_string(a) +
         "), P.l1_unstructured(m, 'weight', " + std::to_string(b) + "), m.weight_mask)[-1])(" + std::string(kP) + ", " +
         kMake + "(x0))";
}

std::string global(double a) {
  return std::string("(lambda P, mk: (lambda a, b: (P.global_unstructured([(a, 'weight'), (b, 'weight')], "
                     "pruning_method=P.L1Unstructured, amount=") +
         std::to_string(a) +
         "), torch.cat([a.weight_mask.flatten(), b.weight_mask.flatten()]))[-1])(mk(x0), mk(x1)))"
         "(" + std::string(kP) + ", " +
         kMake + ")";
}

// kiln's masks of the same cases, on Linear-free bare modules.
struct Holder : nn::Module {
  explicit Holder(const Tensor& w) : nn::Module("Holder") { register_parameter("weight", w.clone()); }
};

Tensor kiln_twice(const Tensor& w, double a, double b) {
  Holder h(w);
  prune::l1_unstructured(h, "weight", a);
  prune::l1_unstructured(h, "weight", b);
  for (auto& [n, t] : h.named_buffers())
    if (n == "weight_mask") return t;
  return {};
}

Tensor kiln_global(const Tensor& w0, const Tensor& w1, double a) {
  Holder h0(w0), h1(w1);
  prune::global_unstructured({{&h0, "weight"}, {&h1, "weight"}}, a);
  Tensor m0, m1;
  for (auto& [n, t] : h0.named_buffers()) m0 = t;
  for (auto& [n, t] : h1.named_buffers()) m1 = t;
  return cat({m0.flatten(), m1.flatten()});
}

// Masks computed on tensors with ties: the same number pruned, the same
// threshold magnitude, and the same decision for every element off it.
void expect_same_up_to_ties(const Tensor& scores, const Tensor& ours, const Tensor& theirs) {
  const auto s = values(scores), a = values(ours), b = values(theirs);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::count(a.begin(), a.end(), 0.0f), std::count(b.begin(), b.end(), 0.0f));
  float thr_a = -1, thr_b = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (a[i] == 0) thr_a = std::max(thr_a, std::fabs(s[i]));
    if (b[i] == 0) thr_b = std::max(thr_b, std::fabs(s[i]));
  }
  EXPECT_EQ(thr_a, thr_b);
  for (size_t i = 0; i < s.size(); ++i)
    if (std::fabs(s[i]) != thr_a) {
      EXPECT_EQ(a[i], b[i]) << "element " << i << " |w| " << std::fabs(s[i]);
    }
}

}  // namespace

TEST(Prune, MasksEqualTorchPrune) {
  const Tensor w = randn_t({16, 8, 3, 3}, 1), w1 = randn_t({40, 30}, 2);
  const Tensor t = tied_t({16, 8, 3, 3}, 3), t1 = tied_t({40, 30}, 4);
  test::OracleBatch b;
  std::vector<double> amounts = {0.0, 0.3, 0.5, 0.9, 1.0};
  std::vector<size_t> one, ties, structured, structured_ties;
  for (double a : amounts) {
    one.push_back(b.add("l1_" + std::to_string(a),
                        std::string(kP) + ".L1Unstructured(" + std::to_string(a) +
                            ").compute_mask(x0, torch.ones_like(x0))",
                        {w}));
    ties.push_back(b.add("l1_ties_" + std::to_string(a),
                         std::string(kP) + ".L1Unstructured(" + std::to_string(a) +
                             ").compute_mask(x0, torch.ones_like(x0))",
                         {t}));
  }
  for (double a : {0.25, 0.5, 0.75}) {
    structured.push_back(b.add("ln_" + std::to_string(a),
                               std::string(kP) + ".LnStructured(" + std::to_string(a) +
                                   ", n=1, dim=0).compute_mask(x0, torch.ones_like(x0))",
                               {w}));
    structured_ties.push_back(b.add("ln_ties_" + std::to_string(a),
                                    std::string(kP) + ".LnStructured(" + std::to_string(a) +
                                        ", n=1, dim=0).compute_mask(x0, torch.ones_like(x0))",
                                    {t}));
  }
  const size_t again = b.add("l1_twice", twice(0.5, 0.4), {w});
  const size_t again_ties = b.add("l1_twice_ties", twice(0.5, 0.4), {t});
  const size_t glob = b.add("global", global(0.6), {w, w1});
  const size_t glob_ties = b.add("global_ties", global(0.6), {t, t1});
  b.run();
  for (size_t i = 0; i < amounts.size(); ++i) {
    SCOPED_TRACE(amounts[i]);
    ASSERT_TRUE(b.outcome(one[i]).ok) << b.outcome(one[i]).error;
    EXPECT_EQ(values(prune::l1_unstructured_mask(w, amounts[i])), values(b.outcome(one[i]).outputs[0]));
    expect_same_up_to_ties(t, prune::l1_unstructured_mask(t, amounts[i]), b.outcome(ties[i]).outputs[0]);
  }
  const std::vector<double> ch = {0.25, 0.5, 0.75};
  for (size_t i = 0; i < ch.size(); ++i) {
    SCOPED_TRACE(ch[i]);
    for (const auto& [x, idx, exact] : {std::tuple{w, structured[i], true}, std::tuple{t, structured_ties[i], false}}) {
      ASSERT_TRUE(b.outcome(idx).ok) << b.outcome(idx).error;
      const auto m = values(b.outcome(idx).outputs[0]);
      const int64_t per_row = x.numel() / x.size(0);
      std::vector<int64_t> torch_kept;
      for (int64_t r = 0; r < x.size(0); ++r)
        if (m[static_cast<size_t>(r * per_row)] != 0) torch_kept.push_back(r);
      const auto ours = prune::l1_top_channels(x, prune::channels_to_keep(x.size(0), ch[i]));
      ASSERT_EQ(ours.size(), torch_kept.size());
      if (exact) {
        EXPECT_EQ(ours, torch_kept);
      } else {  // the row norms of the two choices are the same multiset
        const Tensor norms = x.abs().sum(std::vector<int64_t>{1, 2, 3});
        std::vector<float> a, c;
        for (int64_t r : ours) a.push_back(norms[r].item<float>());
        for (int64_t r : torch_kept) c.push_back(norms[r].item<float>());
        std::sort(a.begin(), a.end());
        std::sort(c.begin(), c.end());
        EXPECT_EQ(a, c);
      }
    }
  }
  ASSERT_TRUE(b.outcome(again).ok) << b.outcome(again).error;
  EXPECT_EQ(values(kiln_twice(w, 0.5, 0.4)), values(b.outcome(again).outputs[0]));
  expect_same_up_to_ties(t, kiln_twice(t, 0.5, 0.4), b.outcome(again_ties).outputs[0]);
  ASSERT_TRUE(b.outcome(glob).ok) << b.outcome(glob).error;
  EXPECT_EQ(values(kiln_global(w, w1, 0.6)), values(b.outcome(glob).outputs[0]));
  expect_same_up_to_ties(cat({t.flatten(), t1.flatten()}), kiln_global(t, t1, 0.6), b.outcome(glob_ties).outputs[0]);
}

TEST(Prune, TiesGoToTheLowerIndex) {
  const Tensor x = tensor<float>({1, 2, 1, -1, 3, 2, -2, 1, 0.5, -0.5, 2, 1});
  // 4 of 12: both 0.5s, then the first two 1s.
  EXPECT_EQ(values(prune::l1_unstructured_mask(x, 4.0 / 12)),
            (std::vector<float>{0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1}));
  // Python's round: 0.25 * 10 = 2.5 prunes 2, 0.35 * 10 = 3.5 prunes 4.
  const Tensor y = arange(10, TensorOptions(kFloat32)).add(1.0);
  EXPECT_EQ(values(prune::l1_unstructured_mask(y, 0.25)), (std::vector<float>{0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(values(prune::l1_unstructured_mask(y, 0.35)), (std::vector<float>{0, 0, 0, 0, 1, 1, 1, 1, 1, 1}));
  EXPECT_THROW(prune::l1_unstructured_mask(y, 1.5), ValueError);
  EXPECT_THROW(prune::l1_unstructured_mask(y, -0.1), ValueError);
  EXPECT_THROW(prune::l1_unstructured_mask(y, std::nan("")), ValueError);
}

namespace {

// Trains a pruned Linear with `make_opt` and checks the pruned weights stay 0
// and their gradients are 0, after a few steps taken before pruning (so
// momentum and moments exist on weights that then get pruned).
template <typename MakeOpt>
void stays_pruned(MakeOpt make_opt) {
  manual_seed(3);
  auto lin = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 12, .out_features = 6});
  auto opt = make_opt(*lin);
  const Tensor x = randn_t({16, 12}, 5), y = randn_t({16, 6}, 6);
  auto step = [&] {
    opt->zero_grad();
    (*lin)(x).sub(y).pow(2.0).mean().backward();
    opt->step();
  };
  for (int i = 0; i < 3; ++i) step();
  prune::l1_unstructured(*lin, "weight", 0.5);
  ASSERT_TRUE(prune::is_pruned(*lin, "weight"));
  std::vector<float> m;
  for (auto& [n, t] : lin->named_buffers())
    if (n == "weight_mask") m = values(t);
  ASSERT_EQ(m.size(), 72u);
  EXPECT_EQ(std::count(m.begin(), m.end(), 0.0f), 36);
  for (int i = 0; i < 5; ++i) {
    step();
    const auto g = values(lin->weight.grad());
    for (size_t k = 0; k < m.size(); ++k)
      if (m[k] == 0) {
        EXPECT_EQ(g[k], 0.0f) << "grad " << k;
      }
    {
      const NoGradGuard no_grad;
      (*lin)(x);  // the forward reads the re-masked weight
    }
    const auto w = values(lin->weight);
    for (size_t k = 0; k < m.size(); ++k)
      if (m[k] == 0) {
        EXPECT_EQ(w[k], 0.0f) << "step " << i << " weight " << k;
      }
  }
  // The state_dict is the dense layout (no mask), loadable by a model never pruned.
  for (auto& [n, t] : lin->state_dict()) EXPECT_NE(n, "weight_mask");
  nn::Linear fresh(nn::LinearOptions{.in_features = 12, .out_features = 6});
  fresh.load_state_dict(lin->state_dict());
  // remove(): the zeros stay, mask and hooks go (a step now moves them again).
  step();
  prune::remove(*lin, "weight");
  EXPECT_FALSE(prune::is_pruned(*lin, "weight"));
  for (auto& [n, t] : lin->named_buffers()) EXPECT_NE(n, "weight_mask");
  auto w = values(lin->weight);
  for (size_t k = 0; k < m.size(); ++k)
    if (m[k] == 0) {
      EXPECT_EQ(w[k], 0.0f);
    }
  step();
  step();
  w = values(lin->weight);
  EXPECT_GT(std::count_if(w.begin(), w.end(), [](float v) { return v != 0.0f; }), 36);
  EXPECT_THROW(prune::remove(*lin, "weight"), ValueError);
}

}  // namespace

TEST(Prune, PrunedWeightsStayZeroThroughSGDMomentumAndWeightDecay) {
  stays_pruned([](nn::Module& m) {
    return std::make_unique<optim::SGD>(
        m, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
  });
}

TEST(Prune, PrunedWeightsStayZeroThroughAdamAndAdamW) {
  stays_pruned([](nn::Module& m) { return std::make_unique<optim::Adam>(m, optim::AdamOptions{.lr = 0.05}); });
  stays_pruned([](nn::Module& m) {
    return std::make_unique<optim::AdamW>(m, optim::AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
  });
}

TEST(Prune, IterativeGlobalAndSparsityReport) {
  manual_seed(1);
  models::CNN cnn({.channels1 = 4, .channels2 = 8, .hidden = 16, .input_size = {8}});
  prune::l1_unstructured(*cnn.conv1, "weight", 0.5);
  prune::l1_unstructured(*cnn.conv1, "weight", 0.5);  // half of what is left
  const auto s = prune::weight_sparsity(cnn);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].layer, "conv1");
  EXPECT_EQ(s[0].zeros, 18 + 9);  // of 36
  std::vector<std::pair<nn::Module*, std::string>> all;
  for (auto& [path, m] : prune::prunable_layers(cnn)) all.emplace_back(m, "weight");
  prune::global_unstructured(all, 0.8);
  int64_t zeros = 0, n = 0;
  for (const auto& l : prune::weight_sparsity(cnn)) zeros += l.zeros, n += l.numel;
  const int64_t alive_before = n - 27;
  EXPECT_EQ(zeros, 27 + static_cast<int64_t>(std::nearbyint(0.8 * static_cast<double>(alive_before))));
  EXPECT_EQ(prune::remove_all(cnn), 4);
  EXPECT_EQ(prune::remove_all(cnn), 0);
  EXPECT_THROW(prune::l1_unstructured(*cnn.conv1, "nothing", 0.5), ValueError);
  EXPECT_THROW(prune::global_unstructured({}, 0.5), ValueError);
}

namespace {

void expect_shrunk_equals_masked(const std::function<std::shared_ptr<nn::Module>()>& make, const Tensor& x,
                                 const prune::ChannelCounts& expected, bool training) {
  auto masked = make(), shrunk = make();
  masked->train(training);
  shrunk->train(training);
  prune::mask_channels(*masked, 0.5);
  EXPECT_EQ(prune::prune_channels(*shrunk, 0.5), expected);
  EXPECT_EQ(prune::channel_counts(*shrunk), expected);
  EXPECT_LT(shrunk->num_parameters(), masked->num_parameters());
  const NoGradGuard no_grad;
  const Tensor a = (*masked)(x), b = (*shrunk)(x);
  EXPECT_LT(max_abs_diff(a, b), 1e-5);
  // Save / load: the counts build the architecture, the state_dict fills it.
  auto fresh = make();
  fresh->train(training);
  prune::shape_pruned_channels(*fresh, prune::parse_channel_counts(prune::channel_counts_json(expected), "test"));
  fresh->load_state_dict(shrunk->state_dict());
  if (!training) {
    EXPECT_EQ(values((*fresh)(x)), values(b));
  }
}

// A ResNet with moved BatchNorm statistics and affine parameters.
std::shared_ptr<nn::Module> make_resnet() {
  manual_seed(7);
  auto m = std::make_shared<models::ResNet>(
      models::ResNetOptions{.in_channels = 1, .stem_channels = 4, .widths = {6, 8}, .blocks = {1, 2}, .num_classes = 3, .activation_checkpointing = {}});
  const NoGradGuard no_grad;
  m->train();
  for (uint64_t s = 0; s < 2; ++s) (*m)(randn_t({8, 1, 8, 8}, 30 + s).mul(2.0));
  Generator g(9);
  for (auto& [name, t] : m->named_parameters())
    if (name.find("bn") != std::string::npos) t.copy_(rand(t.sizes(), TensorOptions(kFloat32), &g).add(0.5));
  m->eval();
  return m;
}

}  // namespace

TEST(PruneChannels, ShrunkCnnEqualsMasked) {
  auto make = [] {
    manual_seed(2);
    return std::make_shared<models::CNN>(
        models::CNNOptions{.channels1 = 8, .channels2 = 10, .hidden = 12, .input_size = {12}});
  };
  for (bool training : {false, true})
    expect_shrunk_equals_masked(make, randn_t({5, 1, 12, 12}, 11), {{"conv1", 4}, {"conv2", 5}, {"fc1", 6}},
                                training);
}

TEST(PruneChannels, ShrunkResnetEqualsMasked) {
  for (bool training : {false, true})
    expect_shrunk_equals_masked(make_resnet, randn_t({5, 1, 8, 8}, 12),
                                {{"layer1.0", 3}, {"layer2.0", 4}, {"layer2.1", 4}}, training);
}

TEST(PruneChannels, HostileCountsAreRefused) {
  auto cnn = std::make_shared<models::CNN>(models::CNNOptions{.channels1 = 4, .channels2 = 8, .hidden = 16});
  auto expect_msg = [](auto&& fn, const std::string& what) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_msg([] { prune::parse_channel_counts("{\"conv1\": ", "f.safetensors"); }, "is not JSON");
  expect_msg([] { prune::parse_channel_counts("[1, 2]", "f.safetensors"); }, "expects a JSON object");
  expect_msg([] { prune::parse_channel_counts("{\"conv1\": \"x\"}", "f.safetensors"); }, "expects an integer");
  expect_msg([] { prune::parse_channel_counts("{\"conv1\": 1.5}", "f.safetensors"); }, "expects an integer");
  EXPECT_THROW(prune::parse_channel_counts("null", "f"), FormatError);
  expect_msg([&] { prune::shape_pruned_channels(*cnn, {{"layer1.0", 2}}); }, "unit \"layer1.0\"");
  expect_msg([&] { prune::shape_pruned_channels(*cnn, {{"conv1", 0}}); }, "expects 1 to 4");
  expect_msg([&] { prune::shape_pruned_channels(*cnn, {{"conv1", 5}}); }, "expects 1 to 4");
  expect_msg([&] { prune::shape_pruned_channels(*cnn, {{"fc1", -3}}); }, "expects 1 to 16");
  EXPECT_EQ(prune::channel_counts(*cnn), (prune::ChannelCounts{{"conv1", 4}, {"conv2", 8}, {"fc1", 16}}));
  models::MLP mlp({.in_features = 4, .hidden = {8}, .out_features = 2});
  expect_msg([&] { prune::prune_channels(mlp, 0.5); }, "covers kiln's cnn and resnet");
  expect_msg([&] { prune::prune_channels(*cnn, 1.0); }, "fraction in [0, 1)");
  expect_msg([] { prune::channels_to_keep(1, 0.6); }, "would keep none");
}
