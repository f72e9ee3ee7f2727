// kiln::compile splits a function at its graph breaks: a call whose record
// has a break runs the function again, holding the kernels that can wait and
// running them as graphs (fused as a replay's are) when host code needs their
// results. The host code runs on every call, so values read with item(),
// branches on them, hooks and the autograd graph are eager's; results are
// bitwise eager's.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kiln/core/autocast.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/compile.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/layer_norm.h"
#include "kiln/ops/linalg.h"
#include "kiln/ops/reduce.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

namespace F = nn::F;

void same(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(a, b)) << what << " differs";
}

void same_parameters(nn::Module& a, nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    same(pa[i].second, pb[i].second, pa[i].first);
    same(pa[i].second.grad(), pb[i].second.grad(), pa[i].first + ".grad");
  }
}

/// An MLP trained with SGD by a step that reads its loss on the host and picks what to
/// backpropagate by that value (a break, then a branch on the value).
struct BranchingRun {
  std::shared_ptr<models::MLP> model;
  std::unique_ptr<optim::SGD> opt;
  std::vector<float> seen;
  std::vector<int> branch;
  float last = 1e30f;

  BranchingRun() {
    manual_seed(11);
    model = std::make_shared<models::MLP>(models::MLPOptions{.in_features = 12, .hidden = {16, 16}, .out_features = 4});
    opt = std::make_unique<optim::SGD>(*model, optim::SGDOptions{.lr = 0.2, .momentum = 0.9});
  }
  std::vector<Tensor> operator()(const std::vector<Tensor>& in) {
    opt->zero_grad();
    const Tensor out = (*model)(in[0]);
    Tensor loss = F::cross_entropy(out, in[1]);
    const float v = loss.item<float>();
    seen.push_back(v);
    branch.push_back(v > last ? 1 : 0);
    // The loss went up: add a penalty on the logits; else backpropagate the loss as it is.
    if (v > last) loss = loss + out.pow(2.0).mean() * 0.05;
    last = v;
    loss.backward();
    opt->step();
    return {loss};
  }
};

TEST(CompileSplit, ABranchOnAnItemValueIsTakenAsEagerOnEveryCall) {
  BranchingRun eager, compiled;
  auto step = compile([&compiled](const std::vector<Tensor>& in) { return compiled(in); },
                      {.name = "branching", .modules = {compiled.model.get()}});
  manual_seed(5);
  for (int i = 0; i < 10; ++i) {
    const std::vector<Tensor> in = {randn({8, 12}) * (1.0 + (i % 3)), randint(0, 4, {8})};
    const Tensor want = eager(in)[0];
    const Tensor got = step(in)[0];
    same(want, got, "loss of call " + std::to_string(i));
  }
  EXPECT_EQ(eager.seen, compiled.seen);
  EXPECT_EQ(eager.branch, compiled.branch);
  int up = 0;
  for (int b : eager.branch) up += b;
  EXPECT_GT(up, 0) << "the test needs both branches";
  EXPECT_LT(up, 10) << "the test needs both branches";
  same_parameters(*eager.model, *compiled.model);

  const CompileStats& s = step.stats();
  EXPECT_EQ(s.captures, 1);
  EXPECT_EQ(s.split_calls, 9);
  EXPECT_EQ(s.replays, 0);
  EXPECT_EQ(s.eager_calls, 0);
  EXPECT_GE(s.split_graphs, 2) << step.explain();
  EXPECT_GT(s.split_kernels, 0);
  // explain() lists each graph with what ran next: here the break itself ends one.
  bool at_break = false;
  for (const CompileStats::SplitGraph& g : s.split_graph_list)
    at_break |= g.before.rfind("the graph break (Tensor.item()", 0) == 0;
  EXPECT_TRUE(at_break) << step.explain();
  EXPECT_EQ(s.split_graph_list.back().before, "Optimizer.step") << step.explain();
  const std::string ex = step.explain();
  EXPECT_NE(ex.find("2 graphs, 1 graph break"), std::string::npos) << ex;
  EXPECT_NE(ex.find("9 split at graph breaks"), std::string::npos) << ex;
  EXPECT_NE(ex.find("Tensor.item()"), std::string::npos) << ex;
}

TEST(CompileSplit, SplitFalseRunsEagerly) {
  BranchingRun eager, compiled;
  auto step = compile([&compiled](const std::vector<Tensor>& in) { return compiled(in); },
                      {.modules = {compiled.model.get()}, .split = false});
  manual_seed(5);
  for (int i = 0; i < 3; ++i) {
    const std::vector<Tensor> in = {randn({8, 12}), randint(0, 4, {8})};
    same(eager(in)[0], step(in)[0], "loss");
  }
  EXPECT_EQ(step.stats().eager_calls, 2);
  EXPECT_EQ(step.stats().split_calls, 0);
  EXPECT_NE(step.explain().find("split = false"), std::string::npos) << step.explain();
}

/// gpt with dropout and AdamW whose step logs the loss and clips the gradients by their
/// norm inside: two breaks, dropout masks drawn in held kernels.
struct LoggedGpt {
  std::shared_ptr<models::GPT> model;
  std::unique_ptr<optim::AdamW> opt;
  Tensor idx, tgt;
  std::vector<double> log;

  LoggedGpt() {
    manual_seed(3);
    models::GPTOptions o;
    o.vocab_size = 32;
    o.block_size = 16;
    o.n_layer = 2;
    o.n_head = 2;
    o.n_embd = 16;
    o.dropout = 0.2;
    model = std::make_shared<models::GPT>(o);
    opt = std::make_unique<optim::AdamW>(*model, optim::AdamWOptions{.lr = 3e-3, .weight_decay = 0.1});
    idx = randint(0, 32, {2, 16});
    tgt = randint(0, 32, {2, 16});
  }
  Tensor step() {
    opt->zero_grad();
    Tensor loss = model->loss(idx, tgt);
    log.push_back(loss.item<float>());
    loss.backward();
    log.push_back(optim::clip_grad_norm_(model->named_parameters(), 0.5));
    opt->step();
    return loss;
  }
};

TEST(CompileSplit, GptStepThatLogsAndClipsMatchesEagerBitwise) {
  LoggedGpt eager, compiled;
  auto step = compile([&compiled] { return compiled.step(); }, {.name = "gpt", .modules = {compiled.model.get()}});
  auto run = [](const std::function<Tensor()>& f) {
    manual_seed(21);
    std::vector<Tensor> out;
    for (int i = 0; i < 5; ++i) out.push_back(f().clone());
    return std::make_pair(out, default_generator().get_state());
  };
  const auto [want, want_state] = run([&eager] { return eager.step(); });
  const auto [got, got_state] = run([&step] { return step()[0]; });
  for (size_t i = 0; i < want.size(); ++i) same(want[i], got[i], "loss of step " + std::to_string(i));
  EXPECT_EQ(want_state, got_state);  // the held dropout fills drew as eager's did
  EXPECT_EQ(eager.log, compiled.log);
  same_parameters(*eager.model, *compiled.model);
  const CompileStats& s = step.stats();
  EXPECT_EQ(s.split_calls, 4);
  EXPECT_EQ(s.graph_breaks.size(), 2u) << step.explain();
  EXPECT_GT(s.split_fused_loops, 0) << step.explain();
  EXPECT_NE(step.explain().find("3 graphs, 2 graph breaks"), std::string::npos) << step.explain();
}

/// A classifier's step that logs its loss between backward and the optimizer step.
template <typename Model, typename Opts, typename MakeOpt>
struct LoggedClassifier {
  std::shared_ptr<Model> model;
  std::unique_ptr<optim::Optimizer> opt;
  Tensor x, y;
  std::vector<float> log;

  LoggedClassifier(const Opts& o, std::vector<int64_t> input, MakeOpt make_opt) {
    manual_seed(7);
    model = std::make_shared<Model>(o);
    opt = make_opt(*model);
    x = randn(input);
    y = randint(0, 10, {input[0]});
  }
  Tensor step(std::optional<DType> amp) {
    opt->zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> g;
      if (amp) g.emplace(*amp);
      loss = F::cross_entropy((*model)(x), y);
    }
    loss.backward();
    log.push_back(loss.item<float>());
    opt->step();
    return loss;
  }
};

template <typename Model, typename Opts, typename MakeOpt>
void check_logged_classifier(const Opts& o, const std::vector<int64_t>& input, MakeOpt make_opt,
                             std::optional<DType> amp) {
  LoggedClassifier<Model, Opts, MakeOpt> eager(o, input, make_opt), compiled(o, input, make_opt);
  auto step = compile([&compiled, amp] { return compiled.step(amp); }, {.modules = {compiled.model.get()}});
  for (int i = 0; i < 4; ++i) same(eager.step(amp), step()[0], "loss of step " + std::to_string(i));
  EXPECT_EQ(eager.log, compiled.log);
  same_parameters(*eager.model, *compiled.model);
  auto be = eager.model->named_buffers(), bc = compiled.model->named_buffers();
  for (size_t i = 0; i < be.size(); ++i) same(be[i].second, bc[i].second, be[i].first);
  EXPECT_EQ(step.stats().split_calls, 3);
  EXPECT_GT(step.stats().split_kernels, 0);
}

TEST(CompileSplit, ConvolutionModelsMatchEagerBitwiseInFloat32AndBf16) {
  // Convolutions, max pools (whose oneDNN forward runs at once: its result picks the
  // backward), batch norm's running statistics (host writes), Adam and SGD.
  auto adam = [](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::Adam>(m, optim::AdamOptions{.lr = 1e-3});
  };
  auto sgd = [](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::SGD>(m, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});
  };
  const models::CNNOptions cnn{.channels1 = 4, .channels2 = 8, .hidden = 16, .input_size = {12, 12}};
  models::ResNetOptions resnet;
  resnet.stem_channels = 4;
  resnet.widths = {4, 8};
  resnet.blocks = {1, 1};
  for (std::optional<DType> amp : {std::optional<DType>(), std::optional<DType>(DType::BFloat16)}) {
    SCOPED_TRACE(amp ? "bf16 autocast" : "float32");
    check_logged_classifier<models::CNN>(cnn, {4, 1, 12, 12}, adam, amp);
    check_logged_classifier<models::ResNet>(resnet, {4, 3, 8, 8}, sgd, amp);
  }
}

TEST(CompileSplit, AForwardWithGradBuildsItsAutogradGraph) {
  // A forward compiled for a backward outside it is a break (a replay builds no autograd
  // graph); split, the forward runs as itself, so the backward outside works.
  manual_seed(2);
  models::MLP a(models::MLPOptions{.in_features = 6, .hidden = {8}, .out_features = 3});
  manual_seed(2);
  models::MLP b(models::MLPOptions{.in_features = 6, .hidden = {8}, .out_features = 3});
  auto fwd = compile([&b](const std::vector<Tensor>& in) { return std::vector<Tensor>{b(in[0]).relu()}; });
  for (int i = 0; i < 3; ++i) {
    const Tensor x = randn({4, 6});
    const Tensor want = a(x);
    const Tensor want_r = want.relu();
    want_r.pow(2.0).sum().backward();
    const Tensor got = fwd({x})[0];
    ASSERT_TRUE(got.requires_grad());
    got.pow(2.0).sum().backward();
    same(want_r, got, "forward");
  }
  same_parameters(a, b);
  EXPECT_EQ(fwd.stats().split_calls, 2);
}

TEST(CompileSplit, ATensorFreedInTheCallIsNotReusedBeforeTheKernelsThatReadItRun) {
  // A tensor made before the call (from the shared cache) is read by a held kernel and then
  // dropped; another thread (a data loader's) allocates the same size before the graph runs.
  // The block is held back until the graph has run, so the held kernel reads its own values.
  NoGradGuard ng;
  Tensor state;
  auto f = compile([&state](const std::vector<Tensor>& in) {
    const Tensor y = state * 2.0;
    state = in[0].clone();
    std::thread([] { (void)full({4096}, 7.0f); }).join();
    const float s = y.sum().item<float>();
    return std::vector<Tensor>{y * s};
  });
  const Tensor x = zeros({4096});
  for (int i = 0; i < 4; ++i) {
    state = full({4096}, 1.0f);
    same(f({x})[0], full({4096}, 2.0f * 8192.0f), "call " + std::to_string(i));
  }
  EXPECT_EQ(f.stats().split_calls, 3);
}

TEST(CompileSplit, OpsAroundABreakMatchEagerWithTheirGradients) {
  // Each op's forward and backward kernels held in a split call: the op on a leaf made in the
  // call, a read of the result (the break), then a backward that depends on the value read.
  using Op = std::function<Tensor(const Tensor& x, const Tensor& idx)>;
  const std::vector<std::pair<std::string, Op>> ops = {
      {"softmax", [](const Tensor& x, const Tensor&) { return softmax(x, 1); }},
      {"log_softmax", [](const Tensor& x, const Tensor&) { return log_softmax(x, 1); }},
      {"layer_norm", [](const Tensor& x, const Tensor&) { return ops::layer_norm(x, {8}); }},
      {"var", [](const Tensor& x, const Tensor&) { return var(x, {1}); }},
      {"norm", [](const Tensor& x, const Tensor&) { return norm(x, 2.0, {1}); }},
      {"logsumexp", [](const Tensor& x, const Tensor&) { return logsumexp(x, {1}); }},
      {"clamp", [](const Tensor& x, const Tensor&) { return x.clamp(-0.5, 0.5); }},
      {"where", [](const Tensor& x, const Tensor&) { return where(x.gt(0.0), x, x * 0.1); }},
      {"cat", [](const Tensor& x, const Tensor&) { return cat({x, x * 2.0}, 0); }},
      {"stack", [](const Tensor& x, const Tensor&) { return stack({x, x.exp()}, 1); }},
      {"index_select", [](const Tensor& x, const Tensor& idx) { return index_select(x, 1, idx); }},
      {"gather", [](const Tensor& x, const Tensor& idx) { return gather(x, 1, idx.reshape({4, 1})); }},
      {"embedding", [](const Tensor& x, const Tensor& idx) { return embedding(x.t().contiguous(), idx); }},
      {"one_hot", [](const Tensor& x, const Tensor& idx) { return one_hot(idx, 8).to(kFloat32) * x; }},
      {"pow", [](const Tensor& x, const Tensor&) { return x.pow(3.0); }},
      {"gelu tanh", [](const Tensor& x, const Tensor&) { return x.gelu("tanh").tanh().sigmoid(); }},
      {"sums", [](const Tensor& x, const Tensor&) { return x.sum({0}) + x.mean() + x.max(); }},
      {"matmul", [](const Tensor& x, const Tensor&) { return matmul(x, x.t()).relu(); }},
      {"transpose copy", [](const Tensor& x, const Tensor&) { return x.t().contiguous() * x.t().abs(); }},
  };
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    auto fn = [op](const std::vector<Tensor>& in) {
      Tensor w = in[0].clone().requires_grad_(true);
      const Tensor y = op(w, in[1]);
      const float s = y.sum().item<float>();
      (y * (s > 0 ? 2.0 : -3.0)).pow(2.0).sum().backward();
      return std::vector<Tensor>{y.detach(), w.grad()};
    };
    auto f = compile(fn);
    manual_seed(4);
    for (int i = 0; i < 3; ++i) {
      const std::vector<Tensor> in = {randn({4, 8}), randint(0, 8, {4})};
      const auto want = fn(in);
      const auto got = f(in);
      same(want[0], got[0], "output of call " + std::to_string(i));
      same(want[1], got[1], "gradient of call " + std::to_string(i));
    }
    EXPECT_EQ(f.stats().split_calls, 2);
    EXPECT_GT(f.stats().split_kernels, 0);
  }
}

TEST(CompileSplit, AnErrorInTheFunctionLeavesWhatRanBeforeItDone) {
  // The function throws after a break; the kernels it launched before the throw have run, as
  // they would have eagerly (here: the gradients a caller that catches the error would see).
  manual_seed(9);
  models::MLP m(models::MLPOptions{.in_features = 6, .hidden = {8}, .out_features = 3});
  bool fail = false;
  auto f = compile([&](const std::vector<Tensor>& in) {
    m.zero_grad();
    Tensor loss = m(in[0]).pow(2.0).mean();
    (void)loss.item<float>();
    loss.backward();
    KILN_CHECK(!fail, ValueError, "the function failed after its backward");
    return std::vector<Tensor>{loss.detach()};
  }, {.modules = {&m}});
  const Tensor x1 = randn({4, 6}), x2 = randn({4, 6});
  f({x1});
  f({x1});
  fail = true;
  EXPECT_THROW(f({x2}), ValueError);
  const Tensor got = m.layers->named_parameters()[0].second.grad().clone();
  fail = false;
  f({x2});  // a split call that completes: the same gradients
  same(got, m.layers->named_parameters()[0].second.grad(), "gradient left by the failed call");
}

TEST(CompileSplit, AnErrorInAHeldKernelIsRaisedByTheCall) {
  // index_put_ checks its indices in the kernel it records; held, the check runs when the
  // graph runs, and the call raises as eager's op does.
  NoGradGuard ng;
  auto f = compile([](const std::vector<Tensor>& in) {
    Tensor x = zeros({5});
    const float s = in[0].sum().item<float>();  // a break before the indexing
    x.index_put_({in[1] + 1}, full({2}, s));
    return std::vector<Tensor>{x * 2.0};
  });
  const Tensor v = ones({3});
  const Tensor ok = tensor<int64_t>({0, 2}, {2});
  same(f({v, ok})[0], tensor<float>({0, 6, 0, 6, 0}, {5}), "first call");
  same(f({v, ok})[0], tensor<float>({0, 6, 0, 6, 0}, {5}), "split call");
  EXPECT_THROW(f({v, tensor<int64_t>({0, 4}, {2})}), IndexError);
  same(f({v * 2.0, ok})[0], tensor<float>({0, 12, 0, 12, 0}, {5}), "after the error");
}

}  // namespace
}  // namespace kiln::test
