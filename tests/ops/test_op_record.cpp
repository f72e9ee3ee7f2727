// What ops, the autograd engine and optimizers tell the record hook
// (include/kiln/core/record.h): one Op event per public op call named as
// torch's aten op, products and convolutions with their analytic FLOPs (a
// multiply-add is 2, as torch's with_flops), one Backward event per node run
// carrying the sequence number of the forward op that made the node, the
// operands' shapes, Optimizer events named as torch's, and nothing at all
// without a listener.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu/small_gemm.h"
#include "kiln/core/record.h"
#include "kiln/kiln.h"
#include "ops/specs/op_spec.h"

using namespace kiln;

namespace {

struct Seen {
  record::Kind kind = record::Kind::Op;
  std::string name;
  std::vector<std::vector<int64_t>> shapes;
  int64_t seq = -1;
  double flops = 0;
  uint32_t depth = 0;
  uint64_t id = 0, parent = 0;
};

// A listener keeping copies of the events of the calling thread.
class Collector {
 public:
  Collector() {
    handle_ = record::add_callbacks(&on_event, nullptr, this);
    record::set_enabled(true);
  }
  ~Collector() { stop(); }
  Collector(const Collector&) = delete;
  Collector& operator=(const Collector&) = delete;

  void stop() {
    if (handle_ < 0) return;
    record::set_enabled(false);
    record::remove_callbacks(handle_);
    handle_ = -1;
  }
  const std::vector<Seen>& events() const { return events_; }
  std::vector<Seen> of(record::Kind kind, const std::string& name = "") const {
    std::vector<Seen> out;
    for (const Seen& e : events_)
      if (e.kind == kind && (name.empty() || e.name == name)) out.push_back(e);
    return out;
  }
  // Calls per op name among the ops called directly (no Op or Backward event around them).
  std::map<std::string, int> top_level_ops() const {
    std::map<uint64_t, const Seen*> by_id;
    for (const Seen& e : events_) by_id[e.id] = &e;
    std::map<std::string, int> calls;
    for (const Seen& e : events_) {
      if (e.kind != record::Kind::Op) continue;
      auto it = by_id.find(e.parent);
      const bool nested = it != by_id.end() &&
                          (it->second->kind == record::Kind::Op || it->second->kind == record::Kind::Backward);
      if (!nested) ++calls[e.name];
    }
    return calls;
  }
  // The events whose parent is `parent`.
  std::vector<Seen> children(const Seen& parent) const {
    std::vector<Seen> out;
    for (const Seen& e : events_)
      if (e.parent == parent.id) out.push_back(e);
    return out;
  }

 private:
  static void on_event(const record::Event& ev, void* user) {
    auto* self = static_cast<Collector*>(user);
    if (ev.thread != self->thread_) return;
    Seen s;
    s.kind = ev.kind;
    s.name = std::string(ev.name);
    for (int i = 0; i < ev.num_inputs; ++i) {
      const IntArrayRef sz = ev.inputs[i]->sizes();
      s.shapes.emplace_back(sz.begin(), sz.end());
    }
    s.seq = ev.seq;
    s.flops = ev.flops;
    s.depth = ev.depth;
    s.id = ev.id;
    s.parent = ev.parent;
    std::lock_guard<std::mutex> lock(self->mu_);
    self->events_.push_back(std::move(s));
  }

  int handle_ = -1;
  uint32_t thread_ = record::thread_index();
  std::mutex mu_;
  std::vector<Seen> events_;
};

// The one event of `kind` named `name` (fails the test otherwise).
Seen only(const Collector& c, record::Kind kind, const std::string& name) {
  const std::vector<Seen> v = c.of(kind, name);
  EXPECT_EQ(v.size(), 1u) << name;
  return v.empty() ? Seen{} : v[0];
}

}  // namespace

TEST(OpRecord, LinearReluCrossEntropyForwardAndBackward) {
  manual_seed(0);
  const int64_t B = 4, in = 6, out = 3;
  const Tensor x = randn({B, in});
  const Tensor w = randn({out, in}).requires_grad_();
  const Tensor b = randn({out}).requires_grad_();
  const Tensor target = tensor(std::vector<int64_t>{0, 2, 1, 2});
  Collector c;
  const Tensor loss = ops::cross_entropy(relu(linear(x, w, b)), target);
  loss.backward();
  c.stop();

  // The ops the user called, once each (the loss's backward seed is a ones_like).
  const std::map<std::string, int> calls = c.top_level_ops();
  EXPECT_EQ(calls.at("linear"), 1);
  EXPECT_EQ(calls.at("relu"), 1);
  EXPECT_EQ(calls.at("cross_entropy"), 1);
  const Seen lin = only(c, record::Kind::Op, "linear");
  ASSERT_EQ(lin.shapes.size(), 3u);
  EXPECT_EQ(lin.shapes[0], (std::vector<int64_t>{B, in}));
  EXPECT_EQ(lin.shapes[1], (std::vector<int64_t>{out, in}));
  EXPECT_EQ(lin.shapes[2], (std::vector<int64_t>{out}));
  EXPECT_EQ(lin.flops, 2.0 * B * in * out);
  EXPECT_EQ(only(c, record::Kind::Op, "cross_entropy").shapes.size(), 2u) << "input and target";

  // One Backward event per node: the three ops' nodes and the two leaves' AccumulateGrad.
  const Seen lin_bw = only(c, record::Kind::Backward, "LinearBackward0");
  only(c, record::Kind::Backward, "ReluBackward0");
  only(c, record::Kind::Backward, "CrossEntropyLossBackward0");
  EXPECT_EQ(c.of(record::Kind::Backward, "AccumulateGrad").size(), 2u);
  // x needs no gradient: LinearBackward0 runs one product, grad_W = gᵀ · x, as aten::mm.
  int products = 0;
  for (const Seen& e : c.children(lin_bw)) {
    if (e.name != "mm") continue;
    ++products;
    EXPECT_EQ(e.flops, 2.0 * B * in * out);
  }
  EXPECT_EQ(products, 1);

  // Every node's event names the forward op that made it: exactly one Op event has its number.
  for (const Seen& bw : c.of(record::Kind::Backward)) {
    if (bw.name == "AccumulateGrad") {
      EXPECT_EQ(bw.seq, -1) << "a leaf's AccumulateGrad was made by no op";
      continue;
    }
    ASSERT_GE(bw.seq, 0) << bw.name;
    int makers = 0;
    std::string maker;
    for (const Seen& op : c.of(record::Kind::Op)) {
      if (op.seq == bw.seq) {
        ++makers;
        maker = op.name;
      }
    }
    EXPECT_EQ(makers, 1) << bw.name;
    const std::map<std::string, std::string> expected_maker = {
        {"LinearBackward0", "linear"}, {"ReluBackward0", "relu"}, {"CrossEntropyLossBackward0", "cross_entropy"}};
    auto want = expected_maker.find(bw.name);
    if (want != expected_maker.end()) {
      EXPECT_EQ(maker, want->second) << bw.name;
    }
  }
  // Backward events are not nested in the forward ops, and each node runs outside any other node.
  for (const Seen& bw : c.of(record::Kind::Backward)) EXPECT_EQ(bw.depth, 0u) << bw.name;
}

TEST(OpRecord, ProductFlopsAreAnalytic) {
  const int64_t M = 5, K = 7, N = 3, Bt = 2;
  const Tensor a = randn({M, K}).requires_grad_(), bm = randn({K, N}).requires_grad_();
  const Tensor a3 = randn({Bt, M, K}), b3 = randn({Bt, K, N});
  const Tensor a4 = randn({Bt, 3, M, K}), b2 = randn({K, N});
  Collector c;
  const Tensor y = mm(a, bm);
  bmm(a3, b3);
  matmul(a4, b2);
  matmul(randn({K}), randn({K}));  // a dot product
  y.sum().backward();
  c.stop();

  // The forward product made MmBackward0 (a sequence number); backward's products made no node.
  std::vector<Seen> mms;
  for (const Seen& e : c.of(record::Kind::Op, "mm"))
    if (e.seq >= 0) mms.push_back(e);
  ASSERT_EQ(mms.size(), 1u);
  EXPECT_EQ(mms[0].shapes[0], (std::vector<int64_t>{M, K}));
  EXPECT_EQ(mms[0].flops, 2.0 * M * N * K);
  EXPECT_EQ(mms[0].shapes[1], (std::vector<int64_t>{K, N}));
  EXPECT_EQ(only(c, record::Kind::Op, "bmm").flops, 2.0 * Bt * M * N * K);
  std::vector<Seen> matmuls = c.of(record::Kind::Op, "matmul");
  ASSERT_EQ(matmuls.size(), 2u);
  EXPECT_EQ(matmuls[0].flops, 2.0 * Bt * 3 * M * N * K);
  EXPECT_EQ(matmuls[1].flops, 2.0 * K);
  // MmBackward0 with both operands requiring grad runs two products: 4·M·N·K in all.
  const Seen mm_bw = only(c, record::Kind::Backward, "MmBackward0");
  double backward_flops = 0;
  int products = 0;
  for (const Seen& e : c.children(mm_bw)) {
    if (e.name != "mm") continue;
    backward_flops += e.flops;
    ++products;
  }
  EXPECT_EQ(products, 2);
  EXPECT_EQ(backward_flops, 4.0 * M * N * K);
}

TEST(OpRecord, ConvolutionFlopsAreAnalytic) {
  const int64_t N = 2, Cin = 4, H = 9, W = 8, Cout = 6, kH = 3, kW = 2, groups = 2;
  const Tensor x = randn({N, Cin, H, W}).requires_grad_();
  const Tensor w = randn({Cout, Cin / groups, kH, kW}).requires_grad_();
  const Tensor b = randn({Cout}).requires_grad_();
  Collector c;
  const Tensor y = conv2d(x, w, b, /*stride=*/{2, 1}, /*padding=*/{1, 0}, /*dilation=*/1, groups);
  y.sum().backward();
  c.stop();
  const int64_t Hout = (H + 2 - kH) / 2 + 1, Wout = W - kW + 1;
  ASSERT_EQ(y.sizes(), (IntArrayRef{N, Cout, Hout, Wout}));
  const double one = 2.0 * N * Cout * Hout * Wout * (Cin / groups) * kH * kW;
  const Seen conv = only(c, record::Kind::Op, "conv2d");
  EXPECT_EQ(conv.flops, one);
  ASSERT_EQ(conv.shapes.size(), 3u);
  EXPECT_EQ(conv.shapes[1], (std::vector<int64_t>{Cout, Cin / groups, kH, kW}));
  // Input and weight gradients: one convolution's worth each, inside the node's event.
  const Seen bw = only(c, record::Kind::Backward, "ConvolutionBackward0");
  EXPECT_EQ(bw.seq, conv.seq);
  const Seen grad = only(c, record::Kind::Op, "convolution_backward");
  EXPECT_EQ(grad.parent, bw.id);
  EXPECT_EQ(grad.flops, 2 * one);
}

// Note [Attention FLOPs where they run] (src/ops/attention.cpp): each
// product's FLOPs once, on the event whose self time runs it.
TEST(OpRecord, AttentionFlopsCountTheProductsWhereTheyRun) {
  const int64_t Bt = 2, Hd = 3, L = 100, E = 8;
  const double causal_scores = 100.0 * 101 / 2;  // the lower triangle, diagonal included
  // The FLOPs of every event, and of those named `name`.
  const auto flops = [](const Collector& c, const std::string& name = "") {
    double sum = 0;
    for (const Seen& e : c.of(record::Kind::Op, name)) sum += e.flops;
    return sum;
  };
  // Run block by block over all heads (3-D operands): its products are matmul
  // events, which count the banded products' FLOPs, and nothing else does.
  const Tensor q = randn({Bt, Hd, L, E}), k = randn({Bt, Hd, L, E}), v = randn({Bt, Hd, L, E});
  const Tensor q3 = q.view({Bt * Hd, L, E}), k3 = k.view({Bt * Hd, L, E}), v3 = v.view({Bt * Hd, L, E});
  {
    Collector c;
    ops::scaled_dot_product_attention(q3, k3, v3, {}, 0.0, /*is_causal=*/true);
    c.stop();
    EXPECT_EQ(flops(c, "matmul"), 4.0 * Bt * Hd * causal_scores * E);
    EXPECT_EQ(flops(c), flops(c, "matmul")) << "the products counted once";
  }
  // The composite (dropout in training): its matmuls count every score.
  {
    Collector c;
    ops::scaled_dot_product_attention(q3, k3, v3, {}, 0.5, /*is_causal=*/true, /*training=*/true);
    c.stop();
    EXPECT_EQ(flops(c), 4.0 * Bt * Hd * L * L * E);
    EXPECT_EQ(flops(c), flops(c, "matmul"));
  }
  // Heads take the one-head-at-a-time kernel, whose products run inside it:
  // the forward's two on "attention_fused_forward", the backward's five
  // (scores again, dP, dv, dq, dk) on "attention_fused_backward". That kernel
  // runs on the small products' kernel, which a build for a CPU without
  // AVX512-BF16 does not have.
  kernels::MatmulArgs head_product;
  head_product.m = head_product.n = head_product.k = L;
  if (!kernels::detail::small_matmul_fits(head_product))
    GTEST_SKIP() << "the rest needs the small products' kernel, which this build has not (it needs AVX512-BF16)";
  {
    Collector c;
    ops::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/false);
    ops::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    c.stop();
    const std::vector<Seen> fwd = c.of(record::Kind::Op, "attention_fused_forward");
    ASSERT_EQ(fwd.size(), 2u);
    EXPECT_EQ(fwd[0].flops, 4.0 * Bt * Hd * L * L * E);
    EXPECT_EQ(fwd[1].flops, 4.0 * Bt * Hd * causal_scores * E);
    EXPECT_EQ(flops(c), fwd[0].flops + fwd[1].flops) << "scaled_dot_product_attention counts none of them again";
  }
  const Tensor x = randn({Bt, L, 3 * Hd * E}).requires_grad_();
  auto parts = (x * 1.0).split(Hd * E, 2);
  auto heads = [&](const Tensor& t) { return t.view({Bt, L, Hd, E}).transpose(1, 2); };
  const Tensor y = ops::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, 0.0, true);
  Collector back;
  y.backward(ones_like(y));
  back.stop();
  EXPECT_EQ(only(back, record::Kind::Op, "attention_fused_backward").flops, 2.0 * Bt * Hd * causal_scores * 5 * E);
}

TEST(OpRecord, ViewsAndCopiesAreOps) {
  const Tensor x = randn({4, 6});
  Collector c;
  const Tensor t = x.t();
  t.contiguous();
  x.contiguous();  // already contiguous: no copy, no event (as torch's Tensor::contiguous)
  x.view({6, 4}).reshape({24});
  x.to(kFloat64);
  c.stop();
  const std::map<std::string, int> calls = c.top_level_ops();
  EXPECT_EQ(calls.at("t"), 1);
  EXPECT_EQ(calls.at("contiguous"), 1);
  EXPECT_EQ(calls.at("view"), 1);
  EXPECT_EQ(calls.at("reshape"), 1);
  EXPECT_EQ(calls.at("to"), 1);
  EXPECT_EQ(only(c, record::Kind::Op, "contiguous").shapes.at(0), (std::vector<int64_t>{6, 4}));
}

TEST(OpRecord, OptimizerAndClippingEvents) {
  Tensor p = randn({3, 2}).requires_grad_();
  optim::AdamW opt(optim::NamedParams{{"p", p}});
  (p * p).sum().backward();
  Collector c;
  optim::clip_grad_norm_(optim::NamedParams{{"p", p}}, 1.0);
  opt.step();
  opt.zero_grad();
  c.stop();
  only(c, record::Kind::Optimizer, "Optimizer.step#AdamW.step");
  only(c, record::Kind::Optimizer, "Optimizer.zero_grad#AdamW.zero_grad");
  only(c, record::Kind::Op, "clip_grad_norm_");
}

TEST(OpRecord, NothingIsRecordedWithoutAListener) {
  int calls = 0;
  const int h = record::add_callbacks([](const record::Event&, void* n) { ++*static_cast<int*>(n); }, nullptr, &calls);
  // Registered but not enabled: the ops take the fast path.
  ASSERT_FALSE(record::active());
  const Tensor a = randn({3, 3}).requires_grad_();
  (a.mm(a).relu().sum() + 1).backward();
  record::remove_callbacks(h);
  // Enabled with nobody registered: the same.
  record::set_enabled(true);
  ASSERT_FALSE(record::active());
  (a.mm(a).relu().sum() + 1).backward();
  record::set_enabled(false);
  EXPECT_EQ(calls, 0);
}

namespace {

// A listener that checks each event as a profiler reads it: a name, inputs
// alive and defined at close, nesting consistent with the enclosing scope.
struct Checker {
  int handle = -1;
  std::mutex mu;
  std::vector<std::string> bad;
  std::vector<Seen> events;
  Checker() {
    handle = record::add_callbacks(&on_event, nullptr, this);
    record::set_enabled(true);
  }
  ~Checker() {
    record::set_enabled(false);
    record::remove_callbacks(handle);
  }
  static void on_event(const record::Event& ev, void* user) {
    auto* self = static_cast<Checker*>(user);
    bool ok = !ev.name.empty() && ev.end_ns >= ev.start_ns;
    for (int i = 0; ok && i < ev.num_inputs; ++i) {
      ok = ev.inputs[i] && ev.inputs[i]->defined() && ev.inputs[i]->numel() >= 0 &&
           dtype_name(ev.inputs[i]->dtype())[0] != '\0';
    }
    if (ev.parent_ptr) ok = ok && ev.parent_ptr->id == ev.parent && ev.depth == ev.parent_ptr->depth + 1;
    Seen s;
    s.kind = ev.kind;
    s.name = std::string(ev.name);
    s.seq = ev.seq;
    std::lock_guard<std::mutex> lock(self->mu);
    if (!ok) self->bad.push_back(s.name);
    self->events.push_back(std::move(s));
  }
};

}  // namespace

// Every op of the registry (tests/ops/specs), forward, backward and error
// cases, under a listener: no event with a dead input, and each node run in
// backward leads to exactly one forward op.
TEST(OpRecord, EveryRegistryOpUnderAListener) {
  int samples = 0;
  for (const ops::OpSpec& spec : ops::op_registry()) {
    for (DType dt : spec.dtypes) {
      for (ops::OpSample& smp : spec.samples(dt)) {
        std::vector<Tensor> inputs = smp.inputs;
        const bool grad = spec.differentiable && is_floating_point(dt) && !smp.grad_inputs.empty();
        if (grad)
          for (int i : smp.grad_inputs) inputs[i] = inputs[i].detach().requires_grad_();
        Checker c;
        std::vector<Tensor> outs = smp.run(inputs);
        if (grad) {
          Tensor total;
          for (const Tensor& o : outs) {
            if (!o.defined() || !o.requires_grad()) continue;
            const Tensor s = o.sum();
            total = total.defined() ? total + s : s;
          }
          if (total.defined()) total.backward();
        }
        ++samples;
        EXPECT_TRUE(c.bad.empty()) << spec.name << " [" << smp.label << "]: " << c.bad.front();
        std::map<int64_t, int> makers;
        for (const Seen& e : c.events)
          if (e.kind == record::Kind::Op && e.seq >= 0) ++makers[e.seq];
        for (const Seen& e : c.events) {
          if (e.kind == record::Kind::Backward && e.name != "AccumulateGrad") {
            EXPECT_EQ(makers[e.seq], 1) << spec.name << " [" << smp.label << "]: " << e.name;
          }
        }
      }
    }
    if (spec.errors) {
      Checker c;
      for (const ops::OpErrorCase& ec : spec.errors()) {
        try {
          ec.run();
        } catch (...) {  // the error itself is test_op_registry's business
        }
      }
      EXPECT_TRUE(c.bad.empty()) << spec.name << " (error cases): " << c.bad.front();
    }
  }
  EXPECT_GT(samples, 100);
}
