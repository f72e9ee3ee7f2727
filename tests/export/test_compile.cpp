// kiln::compile: a replayed step computes bitwise what the eager step does
// (losses, parameters, gradients, optimizer state after N steps, for the
// benchmark models with SGD, Adam and AdamW, in float32 and under bf16
// autocast); guards recompile and say which guard failed; graph breaks split
// the call and say what and where; the private pool keeps replay's addresses
// away from everyone else.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

#include "kiln/core/allocator.h"
#include "kiln/core/autocast.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/export/compile.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/lora.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/linalg.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

namespace F = nn::F;

void expect_bitwise(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(a, b)) << what << " differs";
}

/// A model, its optimizer and a step on one batch; twins start identical.
struct TwinRun {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> opt;
  std::function<Tensor()> step;
};

void expect_same_state(const TwinRun& eager, const TwinRun& compiled) {
  auto pe = eager.model->named_parameters(), pc = compiled.model->named_parameters();
  ASSERT_EQ(pe.size(), pc.size());
  for (size_t i = 0; i < pe.size(); ++i) {
    expect_bitwise(pe[i].second, pc[i].second, pe[i].first);
    expect_bitwise(pe[i].second.grad(), pc[i].second.grad(), pe[i].first + ".grad");
  }
  auto be = eager.model->named_buffers(), bc = compiled.model->named_buffers();
  for (size_t i = 0; i < be.size(); ++i) expect_bitwise(be[i].second, bc[i].second, be[i].first);
  const auto se = eager.opt->state_dict(), sc = compiled.opt->state_dict();
  ASSERT_EQ(se.state.size(), sc.state.size());
  for (const auto& [name, st] : se.state) {
    const auto& other = sc.state.at(name);
    EXPECT_EQ(st.step, other.step) << name;
    for (const auto& [k, t] : st.tensors) expect_bitwise(t, other.tensors.at(k), name + "." + k);
  }
}

template <typename MakeRun>
void check_replay_matches_eager(MakeRun make_run, int steps, std::optional<DType> amp = std::nullopt) {
  TwinRun eager = make_run(), compiled = make_run();
  auto guarded = [amp](std::function<Tensor()> f) {
    return [amp, f]() {
      std::optional<AutocastGuard> g;
      if (amp) g.emplace(*amp);
      return f();
    };
  };
  auto eager_step = guarded(eager.step);
  auto step = compile(guarded(compiled.step), {.name = "step", .modules = {compiled.model.get()}});
  for (int i = 0; i < steps; ++i) {
    const Tensor le = eager_step();
    const Tensor lc = step()[0];
    expect_bitwise(le, lc, "loss of step " + std::to_string(i));
  }
  expect_same_state(eager, compiled);
  EXPECT_EQ(step.stats().captures, 1);
  EXPECT_EQ(step.stats().replays, steps - 1);
  EXPECT_EQ(step.stats().eager_calls, 0);
  EXPECT_TRUE(step.stats().graph_breaks.empty()) << step.explain();
  EXPECT_GT(step.stats().kernels, 0);
}

template <typename Model, typename Opts>
auto classifier(Opts model_opts, std::vector<int64_t> input, int64_t classes,
                std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)> make_opt) {
  return [=]() {
    manual_seed(7);
    auto m = std::make_shared<Model>(model_opts);
    TwinRun r;
    r.model = m;
    r.opt = make_opt(*m);
    const Tensor x = randn(input);
    const Tensor y = randint(0, classes, {input[0]});
    optim::Optimizer* opt = r.opt.get();
    r.step = [m, opt, x, y]() {
      opt->zero_grad();
      Tensor loss = F::cross_entropy((*m)(x), y);
      loss.backward();
      opt->step();
      return loss;
    };
    return r;
  };
}

TEST(Compile, MlpWithSgdMomentumReplaysBitwise) {
  check_replay_matches_eager(classifier<models::MLP>(models::MLPOptions{.in_features = 32, .hidden = {64, 64}}, {8, 32},
                                                     10,
                                                     [](nn::Module& m) {
                                                       return std::make_unique<optim::SGD>(
                                                           m, optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
                                                     }),
                             6);
}

TEST(Compile, CnnWithAdamReplaysBitwise) {
  check_replay_matches_eager(
      classifier<models::CNN>(models::CNNOptions{.channels1 = 4, .channels2 = 8, .hidden = 16, .input_size = {12, 12}},
                              {4, 1, 12, 12}, 10,
                              [](nn::Module& m) {
                                return std::make_unique<optim::Adam>(m, optim::AdamOptions{.lr = 1e-3});
                              }),
      5);
}

TEST(Compile, ResNetWithBatchNormReplaysBitwiseInFloat32AndBf16) {
  auto make = classifier<models::ResNet>(
      models::ResNetOptions{.stem_channels = 4, .widths = {4, 8}, .blocks = {1, 1}}, {4, 3, 8, 8}, 10,
      [](nn::Module& m) {
        return std::make_unique<optim::SGD>(m, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});
      });
  check_replay_matches_eager(make, 4);
  check_replay_matches_eager(make, 4, DType::BFloat16);
}

/// A gpt (vocabulary 32, 16 positions, 2 layers of width 16) with AdamW and a step on one fixed
/// batch; with `lora`, adapters of rank 4 with dropout 0.1 on attention and the MLPs, and AdamW
/// over them alone.
TwinRun gpt_run(uint64_t seed, double dropout, optim::AdamWOptions o, bool lora = false) {
  manual_seed(seed);
  auto m = std::make_shared<models::GPT>(models::GPTOptions{
      .vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = dropout});
  TwinRun r;
  r.model = m;
  if (lora) {
    nn::lora::apply(*m, {.targets = {"attn.c_attn", "mlp.*"}, .rank = 4, .dropout = 0.1});
    optim::ParamGroup g;
    g.params = nn::lora::trainable_parameters(*m);
    r.opt = std::make_unique<optim::AdamW>(std::vector<optim::ParamGroup>{g}, o);
  } else {
    r.opt = std::make_unique<optim::AdamW>(*m, o);
  }
  const Tensor idx = randint(0, 32, {2, 16}), tgt = randint(0, 32, {2, 16});
  optim::Optimizer* opt = r.opt.get();
  r.step = [m, opt, idx, tgt]() {
    opt->zero_grad();
    Tensor loss = m->loss(idx, tgt);
    loss.backward();
    opt->step();
    return loss;
  };
  return r;
}

/// For steps that draw random numbers: `steps` eager steps, then as many compiled ones, each
/// series from the same seed (the two share the default generator, so they cannot alternate);
/// losses, the generator's state and the training state must be equal.
void check_replay_draws_as_eager(TwinRun& eager, TwinRun& compiled, int steps) {
  auto step = compile(compiled.step, {.name = "random_step", .modules = {compiled.model.get()}});
  auto losses = [steps](const std::function<Tensor()>& f) {
    manual_seed(21);
    std::vector<Tensor> out;
    for (int i = 0; i < steps; ++i) out.push_back(f().clone());
    return std::make_pair(out, default_generator().get_state());
  };
  const auto [want, want_state] = losses(eager.step);
  const auto [got, got_state] = losses([&] { return step()[0]; });
  for (int i = 0; i < steps; ++i) expect_bitwise(want[i], got[i], "loss of step " + std::to_string(i));
  EXPECT_EQ(want_state, got_state);
  expect_same_state(eager, compiled);
  EXPECT_EQ(step.stats().replays, steps - 1);
  EXPECT_TRUE(step.stats().graph_breaks.empty()) << step.explain();
}

TEST(Compile, GptWithAdamWReplaysBitwiseInFloat32AndBf16) {
  auto make = [] { return gpt_run(3, 0.0, {.lr = 3e-4, .weight_decay = 0.1}); };
  check_replay_matches_eager(make, 4);
  check_replay_matches_eager(make, 4, DType::BFloat16);
}

TEST(Compile, DropoutStepsReplayWithFreshMasksBitwise) {
  // gpt with dropout in training mode: the residual, attention-weight and embedding dropouts
  // draw new masks on every replay, so from the same seed the compiled steps follow the eager
  // ones loss by loss.
  TwinRun eager = gpt_run(3, 0.2, {.lr = 3e-3, .weight_decay = 0.1});
  TwinRun compiled = gpt_run(3, 0.2, {.lr = 3e-3, .weight_decay = 0.1});
  check_replay_draws_as_eager(eager, compiled, 5);
}

TEST(Compile, LoraWithDropoutReplaysBitwise) {
  // LoRA's branch is a forward hook on each wrapped Linear (declared TensorOpsOnly), with
  // dropout on the adapter's input.
  TwinRun eager = gpt_run(8, 0.0, {.lr = 1e-2}, /*lora=*/true);
  TwinRun compiled = gpt_run(8, 0.0, {.lr = 1e-2}, /*lora=*/true);
  check_replay_draws_as_eager(eager, compiled, 4);
}

TEST(Compile, AStepSplitAtABreakIntoTwoCompiledFunctionsMatchesEager) {
  // The C++ form of torch.compile's split at a graph break: clip_grad_norm_ returns the norm
  // on the host, so forward and backward are one compiled function, the clipping runs
  // eagerly on the gradients that function leaves, and the optimizer step is another.
  auto make = [] { return gpt_run(3, 0.0, {.lr = 1e-2, .weight_decay = 0.1}); };
  TwinRun eager = make(), split = make();
  const Tensor idx = randint(0, 32, {2, 16}), tgt = randint(0, 32, {2, 16});
  auto fwd_bwd = [idx, tgt](TwinRun& r) {
    return [&r, idx, tgt]() {
      r.opt->zero_grad();
      Tensor loss = static_cast<models::GPT&>(*r.model).loss(idx, tgt);
      loss.backward();
      return loss;
    };
  };
  auto first = compile(fwd_bwd(split), {.name = "fwd_bwd", .modules = {split.model.get()}});
  auto second = compile(
      [&split] {
        split.opt->step();
        return Tensor();
      },
      {.name = "opt_step", .modules = {split.model.get()}});
  for (int i = 0; i < 5; ++i) {
    const Tensor le = fwd_bwd(eager)();
    const double ne = optim::clip_grad_norm_(eager.model->named_parameters(), 0.05);
    eager.opt->step();
    const Tensor lc = first()[0];
    const double nc = optim::clip_grad_norm_(split.model->named_parameters(), 0.05);  // eager, between graphs
    second();
    expect_bitwise(le, lc, "loss of step " + std::to_string(i));
    EXPECT_EQ(ne, nc) << "gradient norm of step " << i;
    EXPECT_GT(nc, 0.05) << "the clipping must act for the test to mean anything";
  }
  expect_same_state(eager, split);
  for (const CompiledFunction* f : {&first, &second}) {
    EXPECT_EQ(f->stats().replays, 4) << f->explain();
    EXPECT_TRUE(f->stats().graph_breaks.empty()) << f->explain();
  }
}

TEST(Compile, GradientAccumulationOutsideTheFunctionFollowsEager) {
  // Forward and backward compiled without zero_grad: the first micro-batch of a step finds
  // every .grad None and sets it, the next ones add to it. Each is its own record, chosen by
  // the gradients' state when the call begins, so accumulation matches eager bit for bit.
  auto make = []() {
    manual_seed(5);
    auto m = std::make_shared<models::MLP>(models::MLPOptions{.in_features = 12, .hidden = {16}, .out_features = 4});
    TwinRun r;
    r.model = m;
    r.opt = std::make_unique<optim::SGD>(*m, optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
    return r;
  };
  auto fwd_bwd = [](TwinRun& r) {
    return [&r](const std::vector<Tensor>& in) {
      Tensor loss = F::cross_entropy((*r.model)(in[0]), in[1]).div(3.0);
      loss.backward();
      return std::vector<Tensor>{loss};
    };
  };
  // zero_grad to None between steps, or zeros in place (the second record then serves
  // every micro-batch after the first step: it adds into the zeroed tensor, as eager does).
  for (const bool set_to_none : {true, false}) {
    TwinRun eager = make(), comp = make();
    auto eager_fb = fwd_bwd(eager);
    auto step = compile(fwd_bwd(comp), {.name = "micro_batch", .modules = {comp.model.get()}});
    for (int s = 0; s < 4; ++s) {
      for (TwinRun* r : {&eager, &comp}) r->opt->zero_grad(set_to_none);
      for (int k = 0; k < 3; ++k) {
        const std::vector<Tensor> in = {randn({8, 12}), randint(0, 4, {8})};
        expect_bitwise(eager_fb(in)[0], step(in)[0], "loss of step " + std::to_string(s) + "." + std::to_string(k));
      }
      for (TwinRun* r : {&eager, &comp}) r->opt->step();
    }
    expect_same_state(eager, comp);
    EXPECT_EQ(step.stats().captures, 2) << step.explain();
    EXPECT_EQ(step.stats().replays, 10) << step.explain();
    ASSERT_EQ(step.stats().recompile_reasons.size(), 1u);
    EXPECT_NE(step.stats().recompile_reasons[0].find(".grad holds a gradient, captured None"), std::string::npos)
        << step.stats().recompile_reasons[0];
  }
}

/// An MLP step that takes its batch as inputs.
struct InputStep {
  std::shared_ptr<models::MLP> model;
  std::unique_ptr<optim::SGD> opt;
  CompiledFunction::Fn fn;
  explicit InputStep(int64_t features = 6) {
    manual_seed(11);
    model = std::make_shared<models::MLP>(
        models::MLPOptions{.in_features = features, .hidden = {features + 2}, .out_features = 3});
    opt = std::make_unique<optim::SGD>(*model, optim::SGDOptions{.lr = 0.1});
    fn = [m = model, o = opt.get()](const std::vector<Tensor>& in) {
      o->zero_grad();
      Tensor loss = F::cross_entropy((*m)(in[0]), in[1]);
      loss.backward();
      o->step();
      return std::vector<Tensor>{loss};
    };
  }
};

/// `s`'s step after a no-grad forward of the same batch (a "probe", its last output), which
/// reads nn::Linear's packed weights.
CompiledFunction::Fn with_probe(InputStep& s) {
  return [&s](const std::vector<Tensor>& in) {
    Tensor probe;
    {
      const NoGradGuard ng;
      probe = (*s.model)(in[0]);
    }
    std::vector<Tensor> out = s.fn(in);
    out.push_back(probe);
    return out;
  };
}

TEST(Compile, InferencePacksFollowTheStepsOwnUpdates) {
  // A no-grad forward reads packed weights (nn::Linear's WeightPack); the step's own
  // optimizer changes the weights, so each replay must pack again as eager does.
  InputStep eager(64), compiled(64);  // wide enough that oneDNN packs the weights
  auto eager_fn = with_probe(eager);
  auto step = compile(with_probe(compiled), {.modules = {compiled.model.get()}});
  const std::vector<Tensor> in = {randn({16, 64}), randint(0, 3, {16})};
  for (int i = 0; i < 4; ++i) {
    const auto want = eager_fn(in);
    const auto got = step(in);
    expect_bitwise(want[0], got[0], "loss of step " + std::to_string(i));
    expect_bitwise(want[1], got[1], "no-grad forward of step " + std::to_string(i));
  }
  EXPECT_EQ(step.stats().replays, 3);
  EXPECT_GT(step.stats().ops_in_graph.count("linear (weight pack)"), 0u) << step.explain();
}

TEST(Compile, NewShapesRecompileAndSayWhichGuardFailed) {
  InputStep eager, compiled;
  auto step = compile(compiled.fn, {.name = "train_step", .modules = {compiled.model.get()}});
  const std::vector<Tensor> a = {randn({4, 6}), randint(0, 3, {4})};
  const std::vector<Tensor> b = {randn({5, 6}), randint(0, 3, {5})};
  for (const auto* in : {&a, &a, &b, &b, &a}) {
    const Tensor le = eager.fn(*in)[0];
    const Tensor lc = step(*in)[0];
    expect_bitwise(le, lc, "loss");
  }
  EXPECT_EQ(step.stats().captures, 2);
  EXPECT_EQ(step.stats().recompiles, 1);
  EXPECT_EQ(step.stats().replays, 3);  // a again, b again, and a from its own entry
  ASSERT_EQ(step.stats().recompile_reasons.size(), 1u);
  EXPECT_EQ(step.stats().recompile_reasons[0], "input 0: sizes [5, 6], captured with [4, 6]");
  const std::string ex = step.explain();
  EXPECT_NE(ex.find("2 graphs, 0 graph breaks, 1 recompile"), std::string::npos) << ex;
  EXPECT_NE(ex.find("input 0: sizes [5, 6], captured with [4, 6]"), std::string::npos) << ex;
}

TEST(Compile, ModeChangesRecompileAndOutsideChangesAreRead) {
  InputStep eager, s;
  auto step = compile(s.fn, {.modules = {s.model.get()}});
  const std::vector<Tensor> in = {randn({4, 6}), randint(0, 3, {4})};
  auto both = [&](const std::string& what) { expect_bitwise(eager.fn(in)[0], step(in)[0], what); };
  both("capture");
  both("replay");
  s.model->eval();
  eager.model->eval();
  both("eval");
  s.model->train();
  eager.model->train();
  both("train again");  // the first capture's guards hold again
  for (InputStep* t : {&eager, &s}) {
    const NoGradGuard ng;
    t->model->named_parameters()[0].second.mul_(0.5);  // changed outside the compiled step
  }
  both("after a change outside");  // replayed: the record reads the weights where they are
  {
    const AutocastGuard ac(DType::BFloat16);
    step(in);
  }
  const auto& r = step.stats().recompile_reasons;
  ASSERT_EQ(r.size(), 2u) << step.explain();
  EXPECT_NE(r[0].find("is in eval mode, captured in training mode"), std::string::npos) << r[0];
  EXPECT_EQ(r[1], "autocast: autocast to bfloat16, captured off");
  EXPECT_EQ(step.stats().replays, 3);
}

TEST(Compile, ACopyMadeBeforeTheCaptureIsDroppedWithItsSource) {
  // An eager call packs the weights (nn::Linear's WeightPack) and, under an autocast region
  // that spans the calls, casts them (autocast's cache). A capture after it finds both ready
  // and replays them as they are, so a change to the weights outside the compiled function
  // must drop the record, and the next call captures again.
  for (const bool autocast : {false, true}) {
    manual_seed(4);
    models::MLP m(models::MLPOptions{.in_features = 64, .hidden = {64}, .out_features = 8});
    m.eval();
    const NoGradGuard ng;
    std::optional<AutocastGuard> region;
    if (autocast) region.emplace(DType::BFloat16);
    const Tensor x = randn({16, 64});
    auto fwd = compile([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{m(in[0])}; },
                       {.name = "fwd", .modules = {&m}});
    (void)m(x);  // the copies exist before the capture
    expect_bitwise(m(x), fwd({x})[0], "capture");
    expect_bitwise(m(x), fwd({x})[0], "replay");
    m.named_parameters()[0].second.mul_(0.5);
    expect_bitwise(m(x), fwd({x})[0], "after the change");
    expect_bitwise(m(x), fwd({x})[0], "replay after the change");
    ASSERT_EQ(fwd.stats().recompile_reasons.size(), 1u) << fwd.explain();
    EXPECT_NE(fwd.stats().recompile_reasons[0].find("'layers.0.weight' was modified outside the compiled function"),
              std::string::npos)
        << fwd.stats().recompile_reasons[0];
    EXPECT_EQ(fwd.stats().replays, 2) << fwd.explain();
  }
}

TEST(Compile, ACopyMadeBeforeTheCaptureOfAStepThatChangesItsSourceIsCapturedAgain) {
  // As InferencePacksFollowTheStepsOwnUpdates, but an eager call has packed the weights
  // before the capture: the record would replay that pack while the step's own optimizer
  // moves the weights, so the next call captures again, and that record packs for itself.
  InputStep eager(64), compiled(64);
  const std::vector<Tensor> in = {randn({16, 64}), randint(0, 3, {16})};
  for (InputStep* s : {&eager, &compiled}) {
    const NoGradGuard ng;
    (void)(*s->model)(in[0]);
  }
  auto eager_fn = with_probe(eager);
  auto step = compile(with_probe(compiled), {.modules = {compiled.model.get()}});
  for (int i = 0; i < 5; ++i) {
    const auto want = eager_fn(in);
    const auto got = step(in);
    expect_bitwise(want[0], got[0], "loss of step " + std::to_string(i));
    expect_bitwise(want[1], got[1], "no-grad forward of step " + std::to_string(i));
  }
  ASSERT_EQ(step.stats().recompile_reasons.size(), 1u) << step.explain();
  EXPECT_NE(step.stats().recompile_reasons[0].find("a packed weight of 'layers.0.weight' was made before the capture"),
            std::string::npos)
      << step.stats().recompile_reasons[0];
  EXPECT_EQ(step.stats().replays, 3);
}

TEST(Compile, GraphBreakSplitsTheCallAndNamesTheOpAndLine) {
  InputStep eager, compiled;
  double seen = 0;
  auto fn_with_item = [&](const std::vector<Tensor>& in) {
    auto out = compiled.fn(in);
    seen = out[0].item<float>();  // a host read: the value could steer what follows
    return out;
  };
  const int line = __LINE__ - 3;
  auto step = compile(fn_with_item, {.name = "logged_step", .modules = {compiled.model.get()}});
  const std::vector<Tensor> in = {randn({4, 6}), randint(0, 3, {4})};
  for (int i = 0; i < 3; ++i) {
    const Tensor le = eager.fn(in)[0];
    const Tensor lc = step(in)[0];
    expect_bitwise(le, lc, "loss");
    EXPECT_EQ(seen, le.item<float>());
  }
  EXPECT_EQ(step.stats().captures, 1);
  EXPECT_EQ(step.stats().split_calls, 2);  // tests/export/test_compile_split.cpp
  EXPECT_EQ(step.stats().replays, 0);
  ASSERT_EQ(step.stats().graph_breaks.size(), 1u);
  EXPECT_NE(step.stats().graph_breaks[0].reason.find("Tensor.item()"), std::string::npos)
      << step.stats().graph_breaks[0].reason;
  const std::string& site = step.stats().graph_breaks[0].site;
  const std::string want = "test_compile.cpp:" + std::to_string(line);
  EXPECT_TRUE(site.size() >= want.size() && site.compare(site.size() - want.size(), want.size(), want) == 0)
      << site << " (the item() call is at line " << line << ")";
  EXPECT_NE(step.explain().find("1 graph break"), std::string::npos) << step.explain();

  InputStep full;
  auto strict = compile(
      [&](const std::vector<Tensor>& in) {
        auto out = full.fn(in);
        (void)out[0].item<float>();
        return out;
      },
      {.fullgraph = true});
  EXPECT_THROW(strict(in), ValueError);
}

// The profile names each replayed event's op and user line, so the kernel
// "binary" reads as GELU's backward of this file's line.
TEST(Compile, AProfiledReplayNamesEachEventsOpAndLine) {
  manual_seed(5);
  auto fc = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 64});
  optim::SGD opt(fc->named_parameters(), {.lr = 0.1});
  const Tensor x = randn({32, 8});
  int gelu_line = 0;
  auto run = [&]() {
    opt.zero_grad();
    gelu_line = __LINE__ + 1;
    const Tensor a = (*fc)(x).gelu("tanh");
    Tensor loss = (a * a).mean();
    loss.backward();
    opt.step();
    return loss;
  };
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  const std::string here = "test_compile.cpp:";
  for (const bool fuse : {false, true}) {
    auto step = compile(run, {.name = "profiled", .modules = {fc.get()}, .fuse = fuse, .profile = true});
    for (int i = 0; i < 4; ++i) step();
    const CompileStats& s = step.stats();
    ASSERT_EQ(s.replays, 3);
    ASSERT_EQ(static_cast<int64_t>(s.replay_events.size()), s.kernels + s.host_actions - s.fused_kernels + s.fused_loops)
        << step.explain();
    double total = 0, by_name = 0;
    for (const auto& [name, ms] : s.replay_ms) by_name += ms;
    const CompileStats::ReplayEvent *gelu = nullptr, *gelu_backward = nullptr, *product = nullptr;
    for (size_t i = 0; i < s.replay_events.size(); ++i) {
      const CompileStats::ReplayEvent& ev = s.replay_events[i];
      EXPECT_EQ(ev.index, static_cast<int64_t>(i));
      EXPECT_GE(ev.ms, 0.0) << ev.kernel;
      total += ev.ms;
      if (!ev.backward && ev.op.find("gelu") != std::string::npos) gelu = &ev;
      if (ev.backward && ev.op.find("GeluBackward0") != std::string::npos) gelu_backward = &ev;
      if (!ev.backward && ev.op == "linear") product = &ev;
    }
    EXPECT_NEAR(total, by_name, 1e-9 + 1e-9 * by_name) << "the two views time the same events";
    ASSERT_TRUE(gelu && gelu_backward && product) << step.explain();
    EXPECT_EQ(product->kernel, "matmul");
    EXPECT_TRUE(ends_with(product->site, ".cpp:" + product->site.substr(product->site.rfind(':') + 1)));
    EXPECT_EQ(product->site.find(here), std::string::npos) << product->site << ": nn::Linear's own line";
    if (!fuse) {
      // Each kernel on its own: the forward GELU at its line, its backward at the same line.
      EXPECT_EQ(gelu->kernel, "unary");
      EXPECT_EQ(gelu->op, "gelu");
      EXPECT_TRUE(ends_with(gelu->site, here + std::to_string(gelu_line))) << gelu->site << " vs line " << gelu_line;
      EXPECT_EQ(gelu_backward->kernel, "binary");
      EXPECT_EQ(gelu_backward->op, "GeluBackward0");
      EXPECT_EQ(gelu_backward->elements, 32 * 64);
      EXPECT_TRUE(ends_with(gelu_backward->site, here + std::to_string(gelu_line))) << gelu_backward->site;
    } else {
      // A fused loop lists the ops of its kernels.
      EXPECT_EQ(gelu_backward->kernel.rfind("fused(", 0), 0u) << gelu_backward->kernel;
    }
    const std::string ex = step.explain();
    EXPECT_NE(ex.find("Slowest events"), std::string::npos) << ex;
    EXPECT_NE(ex.find("GeluBackward0"), std::string::npos) << ex;
    // The products' share, which replay and fusion leave as it is: the bound on what fusion could still save.
    double products = 0;
    for (const auto& [name, ms] : s.replay_ms)
      if (name.rfind("matmul", 0) == 0 || name.rfind("conv2d", 0) == 0) products += ms;
    ASSERT_GT(products, 0) << ex;
    const std::string key = "products (matmul*, conv2d*) ";
    const size_t at = ex.find(key);
    ASSERT_NE(at, std::string::npos) << ex;
    const double shown = std::stod(ex.substr(at + key.size()));
    EXPECT_NEAR(shown, 100 * products / by_name, 0.051) << ex;
    EXPECT_NE(ex.find("bounds what further fusion could save", at), std::string::npos) << ex;
  }

  // Without the option (and without KILN_COMPILE_PROFILE) nothing is timed.
  if (std::getenv("KILN_COMPILE_PROFILE") == nullptr) {
    auto plain = compile(run, {.modules = {fc.get()}});
    for (int i = 0; i < 3; ++i) plain();
    EXPECT_TRUE(plain.stats().replay_events.empty());
    EXPECT_TRUE(plain.stats().replay_ms.empty());
  }
}

TEST(Compile, ForwardOnlyWithGradIsABreakAndUnderNoGradReplays) {
  manual_seed(2);
  models::MLP m(models::MLPOptions{.in_features = 6, .hidden = {8}, .out_features = 3});
  auto fwd = compile([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{m(in[0])}; });
  const Tensor x = randn({4, 6});
  fwd({x});
  ASSERT_EQ(fwd.stats().graph_breaks.size(), 1u);
  EXPECT_NE(fwd.stats().graph_breaks[0].reason.find("requires grad"), std::string::npos);
  const NoGradGuard ng;
  const Tensor want = m(x);
  fwd({x});  // grad mode differs: a new capture, without the break
  const Tensor got = fwd({x})[0];
  expect_bitwise(want, got, "forward");
  EXPECT_EQ(fwd.stats().replays, 1);
}

TEST(Compile, OutputsAreStaticAndThePoolIsNotLent) {
  InputStep s;
  auto step = compile(s.fn, {.modules = {s.model.get()}});
  const std::vector<Tensor> in = {randn({4, 6}), randint(0, 3, {4})};
  const void* first = step(in)[0].data_ptr();
  EXPECT_EQ(step(in)[0].data_ptr(), first);  // the same static output, overwritten
  EXPECT_GT(step.stats().pool_bytes, 0);
  // Tensors made outside the capture never get the pool's blocks, even of the same size.
  std::vector<Tensor> others;
  for (int i = 0; i < 64; ++i) others.push_back(full({4, 8}, 3.0f));
  for (int i = 0; i < 3; ++i) step(in);
  for (const Tensor& t : others) EXPECT_TRUE(t.eq(3.0f).all().item<bool>());
}

TEST(Compile, FullCacheRunsEagerly) {
  InputStep eager, compiled;
  auto step = compile(compiled.fn, {.modules = {compiled.model.get()}, .cache_size_limit = 1});
  const std::vector<Tensor> a = {randn({4, 6}), randint(0, 3, {4})};
  const std::vector<Tensor> b = {randn({5, 6}), randint(0, 3, {5})};
  for (const auto* in : {&a, &b, &a, &b}) expect_bitwise(eager.fn(*in)[0], step(*in)[0], "loss");
  EXPECT_EQ(step.stats().captures, 1);
  EXPECT_EQ(step.stats().eager_calls, 2);
  EXPECT_EQ(step.stats().replays, 1);
}

TEST(Compile, AMaxPoolCapturedOnOneDnnRefusesANaNOnReplay) {
  // oneDNN does not take a NaN in a max pool's input; eager falls back to kiln's loop and
  // picks the backward by that. A replay cannot change path, so it says so.
  auto pool = compile([](const std::vector<Tensor>& in) {
    const NoGradGuard ng;
    return std::vector<Tensor>{max_pool2d(in[0], {2, 2})};
  });
  const Tensor x = randn({1, 2, 4, 4});
  pool({x});
  expect_bitwise(max_pool2d(x, {2, 2}), pool({x})[0], "replayed max pool");
  Tensor bad = x.clone();
  bad.view({-1}).narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
  EXPECT_THROW(pool({bad}), ValueError);
}

// A replayed product calls the oneDNN primitive its capture found, holding it: oneDNN's
// per-thread cache may drop it meanwhile (it is cleared past 2048 entries), and another
// thread, whose cache it is not in, takes the normal path.
TEST(Compile, AReplayedProductOutlivesOneDnnsCacheAndReplaysOnAnotherThread) {
  manual_seed(11);
  const Tensor a = randn({8, 32}), b = randn({32, 16});
  auto fn = [&] { return mm(a, b).relu(); };
  const Tensor want = fn();
  auto step = compile(std::function<Tensor()>(fn), {.name = "mm", .modules = {}});
  step();
  for (int64_t k = 1; k <= 2100; ++k) (void)mm(ones({1, k}), ones({k, 1}));
  EXPECT_TRUE(bitwise_equal(step()[0], want));
  Tensor other;
  std::thread t([&] { other = step()[0].clone(); });
  t.join();
  EXPECT_TRUE(bitwise_equal(other, want));
  EXPECT_EQ(step.stats().captures, 1);
  EXPECT_EQ(step.stats().replays, 2);
}

TEST(Compile, BadOptionsAreRefused) {
  EXPECT_THROW(compile(CompiledFunction::Fn{}), ValueError);
  EXPECT_THROW(compile([] { return Tensor(); }, {.cache_size_limit = 0}), ValueError);
  EXPECT_THROW(compile([] { return Tensor(); }, {.modules = {nullptr}}), ValueError);
  InputStep s;
  auto step = compile(s.fn);
  Tensor x = randn({4, 6});
  x.requires_grad_(true);
  EXPECT_THROW(step({x, randint(0, 3, {4})}), ValueError);
}

}  // namespace
}  // namespace kiln::test
