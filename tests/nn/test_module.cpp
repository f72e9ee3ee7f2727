// nn::Module: registration and dotted names (as PyTorch's), modes, state dicts
// through safetensors, strict/non-strict loading, hooks, zero_grad, printing.
#include <gtest/gtest.h>

#include <memory>

#include "kiln/autograd/autograd_meta.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/holder.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"
#include "kiln/optim/optimizer.h"
#include "support/test_util.h"

using namespace kiln;
using nn::Linear;

namespace {

struct Net : nn::Module {
  Net() : Module("Net") {
    scale = &register_parameter("scale", ones({1}));
    register_buffer("steps", zeros({1}, kInt64));
    register_buffer("scratch", zeros({2}), /*persistent=*/false);
    embed = register_module("embed", std::make_shared<nn::Embedding>(nn::EmbeddingOptions{10, 4}));
    layers = register_module(
        "layers", std::make_shared<nn::ModuleList>(std::initializer_list<nn::ModulePtr>{
                      std::make_shared<Linear>(nn::LinearOptions{.in_features = 4, .out_features = 8}),
                      std::make_shared<nn::ReLU>(),
                      std::make_shared<Linear>(nn::LinearOptions{.in_features = 8, .out_features = 8, .bias = false})}));
    head = register_module("head", std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
                                       std::make_shared<Linear>(nn::LinearOptions{8, 3}),
                                       std::make_shared<nn::Dropout>(0.5)}));
  }
  Tensor forward(const Tensor& idx) override {
    Tensor x = (*embed)(idx);
    for (auto& m : layers->children()) x = (*m)(x);
    return (*head)(x) * *scale;
  }
  Tensor* scale;
  std::shared_ptr<nn::Embedding> embed;
  std::shared_ptr<nn::ModuleList> layers;
  std::shared_ptr<nn::Sequential> head;
};

std::vector<std::string> names(const nn::NamedTensors& v) {
  std::vector<std::string> out;
  for (auto& [n, t] : v) out.push_back(n);
  return out;
}

}  // namespace

TEST(Module, DottedNamesMatchPyTorch) {
  Net net;
  // From the equivalent torch.nn.Module (parameters, then buffers, then children, recursively).
  EXPECT_EQ(names(net.named_parameters()),
            (std::vector<std::string>{"scale", "embed.weight", "layers.0.weight", "layers.0.bias", "layers.2.weight",
                                      "head.0.weight", "head.0.bias"}));
  EXPECT_EQ(names(net.named_buffers()), (std::vector<std::string>{"steps", "scratch"}));
  EXPECT_EQ(names(net.state_dict()),
            (std::vector<std::string>{"scale", "steps", "embed.weight", "layers.0.weight", "layers.0.bias",
                                      "layers.2.weight", "head.0.weight", "head.0.bias"}));
  EXPECT_EQ(net.parameters().size(), 7u);
  EXPECT_EQ(net.parameters(false).size(), 1u);
  EXPECT_EQ(net.children().size(), 3u);
  std::vector<std::string> mods;
  for (auto& [n, m] : net.named_modules()) mods.push_back(n + ":" + m->type_name());
  EXPECT_EQ(mods, (std::vector<std::string>{":Net", "embed:Embedding", "layers:ModuleList", "layers.0:Linear",
                                            "layers.1:ReLU", "layers.2:Linear", "head:Sequential", "head.0:Linear",
                                            "head.1:Dropout"}));
  EXPECT_EQ(net.num_parameters(), 1 + 40 + 32 + 8 + 64 + 24 + 3);
  for (auto& p : net.parameters()) {
    EXPECT_TRUE(p.requires_grad());
    EXPECT_EQ(p.storage()->category(), MemoryCategory::Parameter);
  }
}

TEST(Module, InPlaceErrorNamesTheParameter) {
  Net net;
  net.named_parameters();
  try {
    net.layers->children()[0]->named_parameters()[0].second.add_(1.0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.weight"), std::string::npos) << e.what();
  }
}

TEST(Module, RegistrationErrors) {
  nn::Module m;
  EXPECT_THROW(m.register_parameter("a.b", ones({1})), ValueError);
  m.register_buffer("x", ones({1}));
  EXPECT_THROW(m.register_parameter("x", ones({1})), ValueError);
  EXPECT_THROW(m.forward(ones({1})), ValueError);
}

TEST(Module, TrainEvalPropagates) {
  Net net;
  EXPECT_TRUE(net.is_training());
  net.eval();
  for (auto* m : net.modules()) EXPECT_FALSE(m->is_training()) << m->type_name();
  net.train();
  for (auto* m : net.modules()) EXPECT_TRUE(m->is_training()) << m->type_name();
  int count = 0;
  net.apply([&](nn::Module&) { ++count; });
  EXPECT_EQ(count, 9);
}

TEST(Module, StateDictRoundTripThroughSafetensors) {
  test::TempDir dir;
  Net a, b;
  io::save_safetensors(dir.file("m.safetensors"), a.state_dict());
  auto f = io::load_safetensors(dir.file("m.safetensors"));
  auto r = b.load_state_dict(f.tensors);
  EXPECT_TRUE(r.missing_keys.empty());
  EXPECT_TRUE(r.unexpected_keys.empty());
  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(test::bitwise_equal(sa[i].second, sb[i].second)) << sa[i].first;
  a.eval();
  b.eval();
  Tensor idx = tensor<int64_t>({1, 5, 9}, {3});
  EXPECT_TRUE(test::bitwise_equal(a(idx), b(idx)));
  // Loading keeps parameters leaves that require grad.
  for (auto& p : b.parameters()) EXPECT_TRUE(p.is_leaf() && p.requires_grad());
}

TEST(Module, StrictLoadReportsEverythingAndChangesNothing) {
  Net a;
  auto sd = a.state_dict();
  nn::NamedTensors bad;
  for (auto& [n, t] : sd) {
    if (n == "embed.weight" || n == "steps") continue;  // missing
    if (n == "head.0.bias") bad.emplace_back(n, zeros({4}));  // shape mismatch
    else if (n == "layers.0.bias") bad.emplace_back(n, zeros({8}, kFloat64));  // dtype mismatch
    else bad.emplace_back(n, zeros_like(t));
  }
  bad.emplace_back("extra.weight", zeros({1}));
  bad.emplace_back("layers.9.bias", zeros({1}));
  Tensor before = a.state_dict()[2].second.clone();
  try {
    a.load_state_dict(bad);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    std::string m = e.what();
    for (const char* k : {"embed.weight", "steps", "head.0.bias", "layers.0.bias", "extra.weight", "layers.9.bias"})
      EXPECT_NE(m.find(k), std::string::npos) << k << " not in: " << m;
    EXPECT_NE(m.find("[3]"), std::string::npos) << m;
    EXPECT_NE(m.find("[4]"), std::string::npos) << m;
  }
  EXPECT_TRUE(test::bitwise_equal(before, a.state_dict()[2].second));  // nothing changed
  EXPECT_FALSE(a.state_dict()[0].second.equal(zeros({1})));

  // Non-strict: missing/unexpected are returned, shape mismatches still raise.
  EXPECT_THROW(a.load_state_dict(bad, false), ValueError);
  nn::NamedTensors partial;
  for (auto& [n, t] : sd)
    if (n != "embed.weight") partial.emplace_back(n, zeros_like(t));
  partial.emplace_back("unused", zeros({1}));
  auto r = a.load_state_dict(partial, false);
  EXPECT_EQ(r.missing_keys, std::vector<std::string>{"embed.weight"});
  EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"unused"});
  EXPECT_TRUE(a.state_dict()[0].second.equal(zeros({1})));
}

TEST(Module, ForwardHooksAndRemovableHandles) {
  Linear lin({.in_features = 2, .out_features = 2});
  std::vector<std::string> calls;
  auto h1 = lin.register_forward_pre_hook([&](nn::Module&, const Tensor& x) {
    calls.push_back("pre");
    return x * 2.0;
  });
  auto h2 = lin.register_forward_hook([&](nn::Module& m, const Tensor&, const Tensor& y) {
    calls.push_back("post:" + m.type_name());
    return y + 1.0;
  });
  Tensor x = ones({1, 2});
  Tensor expected = x.mul(2.0).matmul(lin.weight.t()) + lin.bias + 1.0;
  EXPECT_TRUE(lin(x).allclose(expected));
  EXPECT_EQ(calls, (std::vector<std::string>{"pre", "post:Linear"}));
  h1.remove();
  h2.remove();
  h2.remove();  // idempotent
  EXPECT_TRUE(lin(x).allclose(lin.forward(x)));
  EXPECT_EQ(calls.size(), 2u);
  // A hook that removes itself runs once.
  auto once = std::make_shared<HookHandle>();
  int runs = 0;
  *once = lin.register_forward_pre_hook([&runs, once](nn::Module&, const Tensor&) {
    ++runs;
    once->remove();
    return Tensor();
  });
  lin(x);
  lin(x);
  EXPECT_EQ(runs, 1);
}

// Issue 27: a two-input module is called the same way as a one-input one, and
// that call runs the hooks (forward(x, mask) itself is the bare computation).
struct Masked : nn::Module {
  Masked() : Module("Masked") { scale = register_parameter("scale", full({1}, 3.0f)); }
  Tensor forward(const Tensor& x, const Tensor& mask) override { return x * mask * scale; }
  Tensor scale;
};

TEST(Module, TwoInputForwardRunsThroughTheCallWithHooks) {
  auto m = std::make_shared<Masked>();
  std::vector<std::string> calls;
  auto pre = m->register_forward_pre_hook([&](nn::Module&, const Tensor& x) {
    calls.push_back("pre");
    return x + 1.0;
  });
  auto post = m->register_forward_hook([&](nn::Module& mod, const Tensor& in, const Tensor& y) {
    calls.push_back("post:" + mod.type_name());
    EXPECT_TRUE(in.equal(full({2}, 2.0f)));  // the input after the pre-hook
    return y * 2.0;
  });
  Tensor x = ones({2}), mask = tensor<float>({1.0f, 0.0f});
  Tensor y = (*m)(x, mask);  // (x + 1) * mask * 3, then * 2
  EXPECT_TRUE(y.equal(tensor<float>({12.0f, 0.0f}))) << y.to_string();
  EXPECT_EQ(calls, (std::vector<std::string>{"pre", "post:Masked"}));
  nn::Module& base = *m;  // through the base class as well (a ModuleList element, say)
  EXPECT_TRUE(base(x, mask).equal(y));
  // A one-input module called with two inputs says so, naming it.
  Linear lin({.in_features = 2, .out_features = 2});
  const std::string msg = test::error_message<ValueError>([&] { lin(x, mask); });
  EXPECT_NE(msg.find("Linear was called with two inputs, but it has no two-input forward"), std::string::npos) << msg;
}

// Issue 27: containers in range-for, typed element access, and a Sequential
// that std::make_shared can build from the modules themselves.
TEST(Module, ContainersIterateAndIndexByType) {
  auto l1 = std::make_shared<Linear>(nn::LinearOptions{.in_features = 2, .out_features = 3});
  auto act = std::make_shared<nn::ReLU>();
  auto l2 = std::make_shared<Linear>(nn::LinearOptions{.in_features = 3, .out_features = 1});
  auto seq = std::make_shared<nn::Sequential>(l1, act, l2);
  ASSERT_EQ(seq->size(), 3u);
  std::vector<std::string> types;
  for (const nn::ModulePtr& m : *seq) types.push_back(m->type_name());
  EXPECT_EQ(types, (std::vector<std::string>{"Linear", "ReLU", "Linear"}));
  EXPECT_TRUE(seq->at<Linear>(2)->weight.is_same(l2->weight));
  const std::string msg = test::error_message<ValueError>([&] { seq->at<Linear>(1); });
  EXPECT_NE(msg.find("Sequential element 1 is a ReLU (kiln::nn::ReLU), not a kiln::nn::Linear"), std::string::npos)
      << msg;
  Tensor x = ones({4, 2});
  EXPECT_TRUE((*seq)(x).equal((*l2)((*l1)(x).relu())));
  nn::ModuleList list(l1, l2);
  int64_t n = 0;
  for (const auto& m : list) n += m->num_parameters();
  EXPECT_EQ(n, 9 + 4);
  EXPECT_EQ(names(list.named_parameters()).front(), "0.weight");
  EXPECT_THROW(list[2], IndexError);
}

// Issue 27: a module's type name defaults to its class name, and a module with
// parameters called inside a model but never registered in it is reported.
TEST(Module, TypeNameDefaultsToTheClassAndUnregisteredMembersAreReported) {
  struct Inner : nn::Module {
    Inner() { w = register_parameter("w", ones({2})); }
    Tensor forward(const Tensor& x) override { return x * w; }
    Tensor w;
  };
  struct Outer : nn::Module {
    Outer() {
      inner = std::make_shared<Inner>();  // forgotten: register_module("inner", inner)
      act = register_module("act", std::make_shared<nn::ReLU>());
    }
    Tensor forward(const Tensor& x) override { return (*act)((*inner)(x)); }
    std::shared_ptr<Inner> inner;
    std::shared_ptr<nn::ReLU> act;
  };
  Outer outer;
  EXPECT_EQ(outer.type_name(), "Outer");
  EXPECT_EQ(outer.inner->type_name(), "Inner");
  EXPECT_EQ(nn::Module().type_name(), "Module");
  EXPECT_EQ(outer.to_string(), "Outer(\n  (act): ReLU()\n)");
  testing::internal::CaptureStderr();
  outer(ones({2}));
  outer(ones({2}));
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("Inner (2 trainable parameters) was called inside Outer's forward, but it is not registered "
                     "in Outer"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("kiln warning"), err.rfind("kiln warning")) << "warned more than once: " << err;
  // Registered, it is part of the model and nothing is reported.
  Outer fixed;
  fixed.register_module("inner", fixed.inner);
  testing::internal::CaptureStderr();
  fixed(ones({2}));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(names(fixed.named_parameters()), std::vector<std::string>{"inner.w"});
}

// Issue 27: a lambda as a module inside a Sequential, printed with its name.
TEST(Module, FunctionalWrapsALambda) {
  auto seq = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Functional>([](const Tensor& x) { return x.flatten(1); }, "flatten"),
      std::make_shared<Linear>(nn::LinearOptions{.in_features = 6, .out_features = 2}));
  Tensor x = ones({4, 2, 3});
  EXPECT_EQ((*seq)(x).shape_string(), "[4, 2]");
  EXPECT_EQ(seq->to_string(),
            "Sequential(\n  (0): Functional(flatten)\n  (1): Linear(in_features=6, out_features=2, bias=True)\n)");
  EXPECT_THROW(nn::Functional(nn::Functional::Fn()), ValueError);
}

TEST(Module, ZeroGrad) {
  Linear lin({.in_features = 3, .out_features = 2});
  lin(ones({4, 3})).sum().backward();
  ASSERT_TRUE(lin.weight.grad().defined());
  lin.zero_grad(false);
  EXPECT_TRUE(lin.weight.grad().equal(zeros({2, 3})));
  lin.zero_grad();
  EXPECT_FALSE(lin.weight.grad().defined());
  EXPECT_FALSE(lin.bias.grad().defined());
}

TEST(Module, ToDtypeCastsFloatingTensorsOnly) {
  Net net;
  net.to(kFloat64);
  for (auto& [n, p] : net.named_parameters()) {
    EXPECT_EQ(p.dtype(), kFloat64) << n;
    EXPECT_TRUE(p.requires_grad() && p.is_leaf()) << n;
  }
  EXPECT_EQ(net.named_buffers()[0].second.dtype(), kInt64);
  EXPECT_EQ(net.named_buffers()[1].second.dtype(), kFloat64);
  EXPECT_EQ(net.head->children()[0]->named_parameters()[0].second.dtype(), kFloat64);
  auto* lin = dynamic_cast<Linear*>(net.head->children()[0].get());
  EXPECT_EQ(lin->weight.dtype(), kFloat64);  // the member reference follows
}

// Issue 27: the libtorch habit of keeping a parameter as a Tensor member (a copy
// of the handle, not a reference to the slot). to(dtype) must convert it in
// place so that member, an optimizer built before to() and tensor hooks still
// see the tensor the module computes with.
struct Gain : nn::Module {
  Gain() : Module("Gain") {
    gain = register_parameter("gain", ones({3}));
    running = register_buffer("running", full({3}, 0.5f));
  }
  Tensor forward(const Tensor& x) override { return x * gain + running; }
  Tensor gain;
  Tensor running;
};

TEST(Module, ToDtypeKeepsParameterIdentity) {
  Gain m;
  optim::SGD opt(m.named_parameters(), {.lr = 0.5});
  int hook_runs = 0, post_runs = 0;
  auto h1 = m.gain.register_hook([&](const Tensor& g) {
    ++hook_runs;
    EXPECT_EQ(g.dtype(), kFloat64);
    return Tensor();
  });
  auto h2 = m.gain.register_post_accumulate_grad_hook([&](Tensor&) { ++post_runs; });
  const TensorImpl* before = m.gain.impl();
  m.to(kFloat64);
  // The member, the registered slot and the optimizer's handle are one tensor, now float64.
  EXPECT_EQ(m.gain.impl(), before);
  EXPECT_EQ(m.gain.dtype(), kFloat64);
  EXPECT_TRUE(m.named_parameters()[0].second.is_same(m.gain));
  EXPECT_TRUE(opt.param_groups()[0].params[0].second.is_same(m.gain));
  EXPECT_TRUE(m.gain.requires_grad() && m.gain.is_leaf());
  EXPECT_EQ(m.running.dtype(), kFloat64);  // the buffer member follows too
  EXPECT_TRUE(m.named_buffers()[0].second.is_same(m.running));
  EXPECT_EQ(m.gain.storage()->category(), MemoryCategory::Parameter);
  // Training through the optimizer built before to() moves what forward uses:
  // d/dgain sum(x * gain + running) over two rows of ones = 2, so gain = 1 - 0.5 * 2.
  Tensor x = ones({2, 3}, kFloat64);
  m(x).sum().backward();
  EXPECT_EQ(hook_runs, 1);
  EXPECT_EQ(post_runs, 1);
  opt.step();
  EXPECT_TRUE(m.gain.equal(full({3}, 0.0, kFloat64))) << m.gain.to_string();
  EXPECT_TRUE(m.named_parameters()[0].second.equal(m.gain));
  // An existing gradient is converted with its parameter, and the name stays.
  m.to(kFloat32);
  EXPECT_EQ(m.gain.grad().dtype(), kFloat32);
  EXPECT_NE(autograd::describe(m.gain).find("gain"), std::string::npos) << autograd::describe(m.gain);
}

// libtorch users write model(x); a holder from nn::make_module calls the module
// with its hooks, and is a shared_ptr everywhere else.
TEST(Module, HolderIsCalledLikeTheModule) {
  manual_seed(3);
  auto fc = nn::make_module<nn::Linear>(nn::LinearOptions{.in_features = 4, .out_features = 2});
  int hooked = 0;
  fc->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor&) {
    ++hooked;
    return Tensor();
  });
  Tensor x = randn({3, 4});
  Tensor y = fc(x);
  EXPECT_EQ(hooked, 1);
  EXPECT_TRUE(y.equal((*fc)(x)));
  EXPECT_EQ(hooked, 2);
  nn::Sequential seq;
  std::shared_ptr<nn::Linear> inner = seq.register_module("fc", fc);  // converts like any shared_ptr
  EXPECT_EQ(inner.get(), fc.get());
  EXPECT_EQ(seq.named_parameters().size(), 2u);
  nn::ModuleHolder<nn::Linear> empty;
  EXPECT_THROW(empty(x), ValueError);
}

TEST(Module, PrintsLikePyTorch) {
  Net net;
  EXPECT_EQ(net.to_string(),
            "Net(\n"
            "  (embed): Embedding(10, 4)\n"
            "  (layers): ModuleList(\n"
            "    (0): Linear(in_features=4, out_features=8, bias=True)\n"
            "    (1): ReLU()\n"
            "    (2): Linear(in_features=8, out_features=8, bias=False)\n"
            "  )\n"
            "  (head): Sequential(\n"
            "    (0): Linear(in_features=8, out_features=3, bias=True)\n"
            "    (1): Dropout(p=0.5, inplace=False)\n"
            "  )\n"
            ")");
  std::string s = net.summary();
  EXPECT_NE(s.find("layers.0.weight [8, 4] 32"), std::string::npos) << s;
  EXPECT_NE(s.find("Total params: 172"), std::string::npos) << s;
}

TEST(Module, TiedAndFrozenParameters) {
  auto emb = std::make_shared<nn::Embedding>(nn::EmbeddingOptions{.num_embeddings = 5, .embedding_dim = 3});
  auto out = std::make_shared<Linear>(nn::LinearOptions{.in_features = 3, .out_features = 5, .bias = false});
  out->register_parameter("weight", emb->weight);  // weight tying: one tensor, listed once
  nn::ModuleDict d({{"emb", emb}, {"out", out}});
  EXPECT_EQ(names(d.named_parameters()), std::vector<std::string>{"emb.weight"});
  EXPECT_TRUE(out->weight.is_same(emb->weight));
  EXPECT_EQ(d.num_parameters(), 15);
  // As torch: state_dict lists a tied tensor under each name, and strict loading wants both.
  auto sd = d.state_dict();
  EXPECT_EQ(names(sd), (std::vector<std::string>{"emb.weight", "out.weight"}));
  EXPECT_EQ(sd[0].second.data_ptr(), sd[1].second.data_ptr());
  EXPECT_THROW(d.load_state_dict({sd[0]}, /*strict=*/true), ValueError);
  d.load_state_dict(sd, /*strict=*/true);
  d.to(kFloat64);  // stays tied
  EXPECT_TRUE(out->weight.is_same(emb->weight));
  EXPECT_EQ(out->weight.dtype(), kFloat64);
  nn::Module m;
  m.register_parameter("frozen", ones({2, 2}), /*requires_grad=*/false);
  m.register_parameter("absent", Tensor());
  EXPECT_EQ(names(m.named_parameters()), std::vector<std::string>{"frozen"});
  EXPECT_FALSE(m.parameters()[0].requires_grad());
  EXPECT_EQ(m.num_parameters(), 4);
  EXPECT_EQ(m.num_parameters(/*trainable_only=*/true), 0);
  EXPECT_THROW(m.register_parameter("derived", ones({1}).requires_grad_().mul(2.0)), ValueError);
  nn::Sequential s({std::make_shared<nn::ReLU>(), std::make_shared<nn::Tanh>()});
  EXPECT_EQ(s[1]->type_name(), "Tanh");
  EXPECT_THROW(s[2], IndexError);
  EXPECT_TRUE(s(full({1}, -1.0f)).equal(zeros({1})));
}
