// kiln's side of the benchmark workloads (see workloads.h; the shapes and
// optimizers are WORKLOADS.md's table, and bench/torch/workloads.py mirrors
// every line here).
#include "workloads.h"

#include <cmath>
#include <limits>

#include "kiln/nn/functional.h"
#include "kiln/optim/optimizer.h"

namespace kiln_bench {

using kiln::Tensor;
namespace F = kiln::nn::F;

uint32_t fnv1a(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h;
}

uint32_t mix(uint64_t i, uint32_t salt) {
  uint64_t x = (i * 0x9E3779B1ull + salt) & 0xFFFFFFFFull;
  x ^= x >> 16;
  x = (x * 0x85EBCA6Bull) & 0xFFFFFFFFull;
  x ^= x >> 13;
  x = (x * 0xC2B2AE35ull) & 0xFFFFFFFFull;
  x ^= x >> 16;
  return static_cast<uint32_t>(x);
}

Tensor synthetic_uniform(const std::string& name, kiln::IntArrayRef sizes, double scale) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  const uint32_t salt = fnv1a(name);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] =
        static_cast<float>((2.0 * mix(static_cast<uint64_t>(i), salt) / 4294967296.0 - 1.0) * scale);
  return kiln::tensor(v, sizes);
}

Tensor synthetic_classes(const std::string& name, kiln::IntArrayRef sizes, int64_t n) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const uint32_t salt = fnv1a(name);
  std::vector<int64_t> v(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) v[static_cast<size_t>(i)] = mix(static_cast<uint64_t>(i), salt) % n;
  return kiln::tensor(v, sizes);
}

void synthetic_init(kiln::nn::Module& model) {
  const kiln::NoGradGuard no_grad;
  for (auto& [name, p] : model.named_parameters()) {
    Tensor v;
    if (p.dim() >= 2) {
      v = synthetic_uniform(name, p.sizes(), 1.0 / std::sqrt(static_cast<double>(p.numel() / p.size(0))));
    } else if (name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0) {
      v = synthetic_uniform(name, p.sizes(), 0.1) + 1.0;
    } else {
      v = synthetic_uniform(name, p.sizes(), 0.02);
    }
    p.copy_(v);
  }
}

int64_t parameter_and_state_bytes(kiln::nn::Module& model, const kiln::optim::Optimizer& opt) {
  int64_t bytes = 0;
  for (const auto& [name, p] : model.named_parameters()) bytes += p.numel() * p.element_size();
  for (const auto& [name, st] : opt.state())
    for (const auto& [key, t] : st.tensors) bytes += t.numel() * t.element_size();
  return bytes;
}

double gpt_train_flops(int64_t params, int64_t batch, int64_t seq, int64_t layers, int64_t d_model) {
  return 6.0 * static_cast<double>(params) * static_cast<double>(batch * seq) +
         12.0 * static_cast<double>(layers) * static_cast<double>(seq * seq) * static_cast<double>(d_model) *
             static_cast<double>(batch);
}

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double read_loss(const Tensor& loss, bool want) { return want ? loss.item<float>() : kNaN; }

std::optional<kiln::DType> g_autocast;  // --amp bf16: forward and loss under autocast

}  // namespace

void set_autocast(std::optional<kiln::DType> dtype) { g_autocast = dtype; }

namespace {

/// A classifier trained with cross-entropy on one fixed synthetic batch.
template <typename Model>
class Classifier : public Workload {
 public:
  Classifier(std::shared_ptr<Model> model, kiln::IntArrayRef input_shape, int64_t classes) : model_(std::move(model)) {
    synthetic_init(*model_);
    x_ = synthetic_uniform("input", input_shape, 1.0);
    y_ = synthetic_classes("target", {input_shape[0]}, classes);
  }
  void set_optimizer(std::unique_ptr<kiln::optim::Optimizer> opt) { opt_ = std::move(opt); }

  std::function<Tensor()> step_fn() override {
    return [this] {
      opt_->zero_grad(/*set_to_none=*/true);
      Tensor loss;
      {
        std::optional<kiln::AutocastGuard> amp;
        if (g_autocast) amp.emplace(*g_autocast);
        loss = F::cross_entropy((*model_)(x_), y_);
      }
      loss.backward();
      opt_->step();
      return loss;
    };
  }
  double step(bool want_loss) override { return read_loss(step_fn()(), want_loss); }
  kiln::nn::Module* module() override { return model_.get(); }
  int64_t num_parameters() const override { return model_->num_parameters(); }
  int64_t optimizer_state_bytes() const override { return parameter_and_state_bytes(*model_, *opt_); }

 private:
  std::shared_ptr<Model> model_;
  std::unique_ptr<kiln::optim::Optimizer> opt_;
  Tensor x_, y_;
};

template <typename Model>
std::unique_ptr<Workload> classifier(std::shared_ptr<Model> model, kiln::IntArrayRef input_shape, int64_t classes,
                                     auto make_opt) {
  auto w = std::make_unique<Classifier<Model>>(model, input_shape, classes);
  w->set_optimizer(make_opt(model->named_parameters()));
  return w;
}

constexpr int64_t kGptBatch = 16, kGptSeq = 128;

/// The gpt workload: next-token cross-entropy on one fixed synthetic batch, AdamW.
class GptTrain : public Workload {
 public:
  GptTrain() : model_(std::make_shared<kiln::models::GPT>()) {
    synthetic_init(*model_);
    idx_ = synthetic_classes("input", {kGptBatch, kGptSeq}, model_->options.vocab_size);
    targets_ = synthetic_classes("target", {kGptBatch, kGptSeq}, model_->options.vocab_size);
    opt_ = std::make_unique<kiln::optim::AdamW>(model_->named_parameters(),
                                                kiln::optim::AdamWOptions{.lr = 3e-4, .weight_decay = 0.1});
  }
  std::function<Tensor()> step_fn() override {
    return [this] {
      opt_->zero_grad(true);
      Tensor loss;
      {
        std::optional<kiln::AutocastGuard> amp;
        if (g_autocast) amp.emplace(*g_autocast);
        loss = model_->loss(idx_, targets_);
      }
      loss.backward();
      opt_->step();
      return loss;
    };
  }
  double step(bool want_loss) override { return read_loss(step_fn()(), want_loss); }
  kiln::nn::Module* module() override { return model_.get(); }
  int64_t num_parameters() const override { return model_->num_parameters(); }
  int64_t optimizer_state_bytes() const override { return parameter_and_state_bytes(*model_, *opt_); }
  double flops_per_step() const override {
    const auto& o = model_->options;
    return gpt_train_flops(num_parameters(), kGptBatch, kGptSeq, o.n_layer, o.n_embd);
  }

 private:
  std::shared_ptr<kiln::models::GPT> model_;
  std::unique_ptr<kiln::optim::Optimizer> opt_;
  Tensor idx_, targets_;
};

/// gpt_infer: the gpt model in eval mode, forward only without grad, one sequence of 128 tokens.
/// The loss (cross-entropy of the logits) is computed only when asked, outside what is timed.
class GptInfer : public Workload {
 public:
  GptInfer() : model_(std::make_shared<kiln::models::GPT>()) {
    synthetic_init(*model_);
    model_->eval();
    idx_ = synthetic_classes("input", {1, kGptSeq}, model_->options.vocab_size);
    targets_ = synthetic_classes("target", {1, kGptSeq}, model_->options.vocab_size);
  }
  std::function<Tensor()> step_fn() override {
    return [this] {
      const kiln::NoGradGuard no_grad;
      std::optional<kiln::AutocastGuard> amp;
      if (g_autocast) amp.emplace(*g_autocast);
      return (*model_)(idx_);
    };
  }
  double loss_of(const Tensor& logits) const override {
    return F::cross_entropy(logits.view({-1, model_->options.vocab_size}), targets_.view({-1})).item<float>();
  }
  double step(bool want_loss) override {
    Tensor logits = step_fn()();
    return want_loss ? loss_of(logits) : kNaN;
  }
  kiln::nn::Module* module() override { return model_.get(); }
  int64_t num_parameters() const override { return model_->num_parameters(); }

 private:
  std::shared_ptr<kiln::models::GPT> model_;
  Tensor idx_, targets_;
};

}  // namespace

const std::vector<std::string>& workload_names() {
  static const std::vector<std::string> names = {"tiny", "mlp", "cnn", "resnet", "gpt", "gpt_infer"};
  return names;
}

std::unique_ptr<Workload> make_workload(const std::string& name) {
  using namespace kiln;
  using optim::NamedParams;
  if (name == "tiny")
    return classifier(std::make_shared<models::MLP>(models::MLPOptions{.in_features = 32, .hidden = {64, 64}}), {8, 32},
                      10, [](NamedParams p) { return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.01}); });
  if (name == "mlp")
    return classifier(std::make_shared<models::MLP>(), {128, 784}, 10, [](NamedParams p) {
      return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
    });
  if (name == "cnn")
    return classifier(std::make_shared<models::CNN>(), {64, 1, 28, 28}, 10,
                      [](NamedParams p) { return std::make_unique<optim::Adam>(p, optim::AdamOptions{.lr = 1e-3}); });
  if (name == "resnet")
    return classifier(std::make_shared<models::ResNet>(), {32, 3, 32, 32}, 10, [](NamedParams p) {
      return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});
    });
  if (name == "gpt") return std::make_unique<GptTrain>();
  if (name == "gpt_infer") return std::make_unique<GptInfer>();
  std::string known;
  for (const auto& n : workload_names()) known += (known.empty() ? "" : ", ") + n;
  KILN_CHECK(false, ValueError, "kiln_bench: unknown workload '", name, "'; expected one of ", known);
  return nullptr;
}

}  // namespace kiln_bench
