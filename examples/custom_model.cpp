// The model docs/guide.md walks through, end to end as a libtorch user would
// write it: custom modules (a learned parameter kept as a Tensor member, a
// ModuleList, BatchNorm, Dropout), a custom autograd Function with its own
// backward, a custom Dataset through the DataLoader, AdamW with split weight
// decay, warm-up + cosine, gradient clipping, evaluation, a full checkpoint
// reloaded into fresh objects, and an export PyTorch reads. Exits non-zero if
// the run does not learn or the reload does not continue identically; CTest
// runs it (example_custom_model). Usage: custom_model [output dir (default .)]
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "kiln/kiln.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/optim/scheduler.h"
#include "kiln/train/checkpoint.h"

using namespace kiln;

namespace {

// ---- a custom autograd Function: y = tanh(x) * k, with a hand-written backward ----
struct ScaledTanh : autograd::Function<ScaledTanh> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x, double k) {
    Tensor y = x.tanh();
    ctx.save_for_backward({y});
    ctx.saved_data["k"] = k;
    return y * k;
  }
  static TensorList backward(autograd::AutogradContext& ctx, TensorList g) {
    Tensor y = ctx.get_saved_variables()[0];
    const double k = ctx.saved_data.get<double>("k");
    return {g[0] * (1.0 - y * y) * k};  // one gradient per tensor input; k gets none
  }
};

// ---- custom modules ----
class Block : public nn::Module {
 public:
  explicit Block(int64_t width) : Module("Block") {
    fc = register_module("fc", std::make_shared<nn::Linear>(nn::LinearOptions{width, width}));
    bn = register_module("bn", std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = width}));
    drop = register_module("drop", std::make_shared<nn::Dropout>(0.1));
    gain = register_parameter("gain", ones({width}));  // a Tensor member, as in libtorch
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*bn)((*fc)(x));
    return x + (*drop)(ScaledTanh::apply(h, 1.5) * gain);
  }
  std::shared_ptr<nn::Linear> fc;
  std::shared_ptr<nn::BatchNorm1d> bn;
  std::shared_ptr<nn::Dropout> drop;
  Tensor gain;
};

class Net : public nn::Module {
 public:
  Net(int64_t in, int64_t width, int64_t depth, int64_t classes) : Module("Net") {
    stem = register_module("stem", std::make_shared<nn::Linear>(nn::LinearOptions{in, width}));
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(std::make_shared<Block>(width));
    head = register_module("head", std::make_shared<nn::Linear>(nn::LinearOptions{width, classes}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = nn::F::relu((*stem)(x));
    for (const auto& b : *blocks) h = (*b)(h);  // calling the module runs its hooks
    return (*head)(h);
  }
  std::shared_ptr<nn::Linear> stem;
  std::shared_ptr<nn::ModuleList> blocks;
  std::shared_ptr<nn::Linear> head;
};

// ---- a custom dataset: three noisy clusters in 8 dimensions ----
class Clusters : public data::Dataset<data::Example> {
 public:
  Clusters(int64_t n, uint64_t seed) : n_(n), seed_(seed) {}
  int64_t size() const override { return n_; }
  data::Example get(int64_t i) const override {
    const int64_t label = i % 3;
    Generator g(data::sample_seed(seed_, 0, 0, i));  // a pure function of (seed, i)
    Tensor x = randn({8}, TensorOptions(), &g) * 0.5;
    Tensor centre = zeros({8});
    centre.narrow(0, label * 2, 2).fill_(2.0);
    return {x + centre, scalar_tensor(label, TensorOptions(kInt64))};
  }

 private:
  int64_t n_;
  uint64_t seed_;
};

struct Run {
  std::shared_ptr<Net> model = std::make_shared<Net>(8, 32, 2, 3);
  std::unique_ptr<optim::AdamW> opt;
  std::shared_ptr<optim::SequentialLR> sched;
  std::unique_ptr<data::DataLoader<>> loader;
  explicit Run(std::shared_ptr<const data::Dataset<data::Example>> train, int64_t total_steps) {
    opt = std::make_unique<optim::AdamW>(optim::split_decay(model->named_parameters(), 0.05),
                                         optim::AdamWOptions{.lr = 3e-3});
    auto warm = std::make_shared<optim::LinearLR>(*opt, optim::LinearLROptions{.start_factor = 0.1, .total_iters = 10});
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(
        *opt, optim::CosineAnnealingLROptions{.T_max = total_steps - 10, .eta_min = 1e-4});
    sched = std::make_shared<optim::SequentialLR>(*opt, std::vector<std::shared_ptr<optim::LRScheduler>>{warm, cosine},
                                                  std::vector<int64_t>{10});
    loader = std::make_unique<data::DataLoader<>>(
        train, data::DataLoader<>::Options{.batch_size = 32, .shuffle = true, .num_workers = 1, .drop_last = true});
  }
  train::CheckpointRefs refs() { return {.model = model.get(), .optimizer = opt.get(), .scheduler = sched.get()}; }
  // One optimisation step on a batch; returns the loss.
  double step(const data::Example& batch) {
    opt->zero_grad();
    Tensor loss = nn::F::cross_entropy((*model)(batch.data), batch.target);
    loss.backward();
    optim::clip_grad_norm_(model->named_parameters(), 1.0);
    opt->step();
    sched->step();
    return loss.item<double>();
  }
};

double accuracy(nn::Module& model, const std::shared_ptr<const data::Dataset<data::Example>>& set) {
  NoGradGuard no_grad;
  model.eval();
  data::DataLoader<> loader(set, {.batch_size = 100});
  int64_t correct = 0, total = 0;
  for (auto& b : loader) {
    correct += model(b.data).argmax(1).eq(b.target).sum().item<int64_t>();
    total += b.target.numel();
  }
  model.train();
  return static_cast<double>(correct) / static_cast<double>(total);
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path out = argc > 1 ? argv[1] : ".";
  manual_seed(0);  // model init and the loader's shuffle both follow it
  auto train = std::make_shared<Clusters>(960, 1);
  auto test = std::make_shared<Clusters>(300, 2);
  const int64_t steps_per_epoch = 30, epochs = 4;
  Run run(train, steps_per_epoch * epochs);
  std::printf("%s\n", run.model->summary().c_str());

  // Train two epochs, checkpoint, then two more; remember the losses after the checkpoint.
  double last_loss = 0;
  int64_t step = 0;
  for (int epoch = 0; epoch < 2; ++epoch)
    for (auto& batch : *run.loader) last_loss = run.step(batch), ++step;
  const auto ckpt = out / "custom_model.ckpt.safetensors";
  train::save_checkpoint(ckpt.string(), run.refs(), {.step = step, .loader = run.loader->state()});
  std::vector<double> continued;
  for (int epoch = 2; epoch < epochs; ++epoch)
    for (auto& batch : *run.loader) continued.push_back(run.step(batch));
  const double acc = accuracy(*run.model, test);
  std::printf("loss after 2 epochs %.4f, after %lld epochs %.4f, test accuracy %.1f%%\n", last_loss,
              static_cast<long long>(epochs), continued.back(), 100.0 * acc);

  // Reload into fresh objects (as a new process would) and continue: the same losses, bit for bit.
  manual_seed(123);  // whatever the new process did before loading
  Run fresh(train, steps_per_epoch * epochs);
  const auto info = train::load_checkpoint(ckpt.string(), fresh.refs());
  fresh.loader->load_state(*info.loader);
  size_t k = 0;
  bool same = true;
  for (int epoch = 2; epoch < epochs; ++epoch)
    for (auto& batch : *fresh.loader) same = same && fresh.step(batch) == continued.at(k++);
  std::printf("reloaded run continues identically: %s\n", same ? "yes" : "NO");

  // Export for PyTorch: the state_dict keys are PyTorch's ("blocks.0.fc.weight", "blocks.0.gain", ...), so
  // model.load_state_dict(safetensors.torch.load_file(path)) loads it into the twin torch.nn.Module.
  const auto exported = out / "custom_model.safetensors";
  io::save_safetensors(exported.string(), run.model->state_dict());
  std::printf("exported %zu tensors to %s\n", run.model->state_dict().size(), exported.string().c_str());

  const bool learned = acc > 0.9;
  if (!learned) std::fprintf(stderr, "custom_model: expected test accuracy above 90%%, got %.1f%%\n", 100.0 * acc);
  return learned && same ? 0 : 1;
}
