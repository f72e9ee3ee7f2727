// Whole training steps of the benchmark models under a listener that reads
// every event as a profiler does (include/kiln/core/record.h): each op's
// inputs must still be alive and defined when its scope closes, scopes must
// close in order, and every backward node run must lead back to exactly one
// forward op through its sequence number, with checkpointed blocks recomputed
// in backward, under autocast and in inference too.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kiln/core/record.h"
#include "kiln/kiln.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"

using namespace kiln;

namespace {

struct Seen {
  record::Kind kind;
  std::string name;
  int64_t seq;
  double flops;
};

// Reads what a profiler reads: names, the inputs' shapes, dtypes and element
// counts, and the nesting (a scope's parent is still open when it closes).
class Reader {
 public:
  Reader() {
    handle_ = record::add_callbacks(&on_event, nullptr, this);
    record::set_enabled(true);
  }
  ~Reader() {
    record::set_enabled(false);
    record::remove_callbacks(handle_);
  }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  std::vector<Seen> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  int64_t bad() {
    std::lock_guard<std::mutex> lock(mu_);
    return bad_;
  }
  std::set<std::string> names(record::Kind kind) {
    std::set<std::string> out;
    for (const Seen& e : events())
      if (e.kind == kind) out.insert(e.name);
    return out;
  }

 private:
  static void on_event(const record::Event& ev, void* user) {
    auto* self = static_cast<Reader*>(user);
    int64_t elements = 0;
    bool ok = !ev.name.empty() && ev.end_ns >= ev.start_ns && ev.num_inputs <= record::kMaxInputs;
    for (int i = 0; ok && i < ev.num_inputs; ++i) {
      const Tensor* t = ev.inputs[i];
      ok = t != nullptr && t->defined() && t->dim() == static_cast<int64_t>(t->sizes().size());
      if (ok) elements += t->numel() + static_cast<int64_t>(dtype_name(t->dtype())[0] != '\0');
    }
    if (ev.parent_ptr) ok = ok && ev.parent_ptr->id == ev.parent && ev.depth == ev.parent_ptr->depth + 1;
    std::lock_guard<std::mutex> lock(self->mu_);
    if (!ok) ++self->bad_;
    self->elements_ += elements;
    self->events_.push_back({ev.kind, std::string(ev.name), ev.seq, ev.flops});
  }

  int handle_ = -1;
  std::mutex mu_;
  std::vector<Seen> events_;
  int64_t bad_ = 0, elements_ = 0;
};

// Every node run in backward names exactly one forward op (AccumulateGrad: none).
void expect_linked(const std::vector<Seen>& ev) {
  std::map<int64_t, int> makers;
  for (const Seen& e : ev)
    if (e.kind == record::Kind::Op && e.seq >= 0) ++makers[e.seq];
  int nodes = 0;
  for (const Seen& e : ev) {
    if (e.kind != record::Kind::Backward || e.name == "AccumulateGrad") continue;
    ++nodes;
    EXPECT_EQ(makers[e.seq], 1) << e.name << " (sequence number " << e.seq << ")";
  }
  EXPECT_GT(nodes, 0);
}

// One training step of `model` on (x, target), the way the benchmark runs it.
template <typename M>
void train_step(M& model, const Tensor& x, const Tensor& target) {
  optim::AdamW opt(model.named_parameters());
  opt.zero_grad();
  ops::cross_entropy(model.forward(x), target).backward();
  opt.step();
}

}  // namespace

TEST(RecordModels, MlpCnnResNetTrainingSteps) {
  manual_seed(0);
  models::MLP mlp(models::MLPOptions{.in_features = 12, .hidden = {16, 16}, .out_features = 5});
  models::CNN cnn(models::CNNOptions{.channels1 = 4, .channels2 = 8, .hidden = 16, .input_size = {8, 8}});
  models::ResNetOptions ro;
  ro.stem_channels = 4;
  ro.widths = {4, 8};
  ro.blocks = {1, 1};
  models::ResNet resnet(ro);
  const Tensor y5 = randint(0, 5, {3}), y10 = randint(0, 10, {2});
  Reader r;
  train_step(mlp, randn({3, 12}), y5);
  train_step(cnn, randn({2, 1, 8, 8}), y10);
  train_step(resnet, randn({2, 3, 8, 8}), y10);
  {
    const NoGradGuard no_grad;  // inference: ops without nodes
    resnet.eval();
    resnet.forward(randn({1, 3, 8, 8}));
  }
  EXPECT_EQ(r.bad(), 0) << "events with dead inputs, bad nesting or no name";
  expect_linked(r.events());
  const std::set<std::string> ops = r.names(record::Kind::Op);
  for (const char* want : {"linear", "relu", "conv2d", "max_pool2d", "batch_norm", "cross_entropy", "add_"})
    EXPECT_TRUE(ops.count(want)) << want;
  EXPECT_TRUE(r.names(record::Kind::Optimizer).count("Optimizer.step#AdamW.step"));
  EXPECT_TRUE(r.names(record::Kind::Backward).count("ConvolutionBackward0"));
  double conv_flops = 0;
  for (const Seen& e : r.events())
    if (e.name == "conv2d") conv_flops += e.flops;
  EXPECT_GT(conv_flops, 0);
}

TEST(RecordModels, GptStepsWithCheckpointingAndAutocast) {
  manual_seed(0);
  models::GPTOptions o;
  o.vocab_size = 32;
  o.block_size = 16;
  o.n_layer = 2;
  o.n_head = 2;
  o.n_embd = 16;
  o.activation_checkpointing = nn::CheckpointPolicy::blocks();
  models::GPT gpt(o);
  optim::AdamW opt(gpt.named_parameters());
  const Tensor idx = randint(0, 32, {2, 16}), targets = randint(0, 32, {2, 16});
  Reader r;
  for (int amp = 0; amp < 2; ++amp) {
    opt.zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> guard;
      if (amp) guard.emplace(kBFloat16);
      loss = gpt.loss(idx, targets);
    }
    loss.backward();
    opt.step();
  }
  {
    const NoGradGuard no_grad;
    gpt.forward(idx);
  }
  EXPECT_EQ(r.bad(), 0) << "events with dead inputs, bad nesting or no name";
  expect_linked(r.events());
  const std::set<std::string> ops = r.names(record::Kind::Op);
  for (const char* want : {"index_select", "layer_norm", "linear", "gelu", "scaled_dot_product_attention", "to", "checkpoint"})
    EXPECT_TRUE(ops.count(want)) << want;
}
