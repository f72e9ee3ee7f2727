// Builds models, datasets, optimizers and schedules from a Config.
#include "cli/task.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <optional>
#include <tuple>

#include "cli/distill.h"
#include "cli/finetune.h"
#include "cli/task_data.h"
#include "kiln/core/autocast.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/data/idx.h"
#include "kiln/data/text.h"
#include "kiln/data/transforms.h"
#include "kiln/models/cnn.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/lora.h"

namespace kiln::cli {
namespace {

/// Samples [begin, begin + count) of another dataset: the first N of a split,
/// or the language model's train/validation cut of one corpus.
class Slice : public data::Dataset<> {
 public:
  Slice(std::shared_ptr<const data::Dataset<>> base, int64_t begin, int64_t count)
      : base_(std::move(base)), begin_(begin), count_(count) {}
  int64_t size() const override { return count_; }
  data::Example get(int64_t i) const override { return base_->get(begin_ + i); }

 private:
  std::shared_ptr<const data::Dataset<>> base_;
  int64_t begin_, count_;
};

std::shared_ptr<const data::Dataset<>> first(std::shared_ptr<const data::Dataset<>> d, int64_t n) {
  if (n <= 0 || n >= d->size()) return d;
  return std::make_shared<Slice>(std::move(d), 0, n);
}

/// What the classifier is built for: one input's shape and the class count.
struct DataShape {
  std::vector<int64_t> sample = {1, 28, 28};
  int64_t classes = 10;
};

DataShape make_datasets(const Config& c, Task& t) {
  const std::string ds = c.string("data.dataset");
  if (is_user_data(c)) {
    UserData u = make_user_data(c);
    t.train_set = first(std::move(u.train), c.integer("data.train_size"));
    t.eval_set = first(std::move(u.eval), c.integer("data.eval_size"));
    return {u.sample_shape, u.num_classes};
  }
  if (ds == "text") {
    const std::string path = c.string("data.path");
    auto corpus = std::make_shared<data::CharCorpus>(data::CharCorpusOptions{
        .path = path.empty() ? std::string(data::kMobyDickPath) : path, .context = c.integer("data.context")});
    const int64_t n = corpus->size();
    const int64_t n_val = std::max<int64_t>(1, static_cast<int64_t>(std::llround(c.number("data.val_fraction") * n)));
    if (n_val >= n)
      throw ConfigError(c.source() + ": the text has " + std::to_string(n) + " windows of data.context = " +
                        std::to_string(c.integer("data.context")) + " bytes, too few to hold out data.val_fraction = " +
                        std::to_string(c.number("data.val_fraction")) + " for evaluation");
    t.train_set = first(std::make_shared<Slice>(corpus, 0, n - n_val), c.integer("data.train_size"));
    t.eval_set = first(std::make_shared<Slice>(corpus, n - n_val, n_val), c.integer("data.eval_size"));
    return {};
  }
  if (ds == "synthetic") {
    const int64_t size = c.integer("data.image_size");
    const DataShape s{{1, size, size}, c.integer("data.num_classes")};
    const auto seed = static_cast<uint64_t>(c.integer("seed"));
    const int64_t n_train = c.integer("data.train_size") > 0 ? c.integer("data.train_size") : 1024;
    const int64_t n_eval = c.integer("data.eval_size") > 0 ? c.integer("data.eval_size") : 256;
    t.train_set = std::make_shared<data::SyntheticDataset>(
        data::SyntheticOptions{.size = n_train, .sample_shape = s.sample, .num_classes = s.classes, .seed = seed});
    t.eval_set = std::make_shared<data::SyntheticDataset>(
        data::SyntheticOptions{.size = n_eval, .sample_shape = s.sample, .num_classes = s.classes, .seed = seed + 1});
    return s;
  }
  std::vector<data::Transform> aug;
  if (c.integer("data.random_crop") > 0)
    aug.push_back(data::transforms::random_crop(28, c.integer("data.random_crop")));
  if (c.boolean("data.hflip")) aug.push_back(data::transforms::random_horizontal_flip());
  data::Transform train_tf = aug.empty() ? nullptr : data::transforms::compose(aug);
  const std::string root = c.string("data.root");
  std::shared_ptr<const data::Dataset<>> train, test;
  try {
    if (ds == "fashion_mnist") {
      const std::string r = root.empty() ? data::kFashionMnistRoot : root;
      train = std::make_shared<data::FashionMNIST>(
          data::FashionMNISTOptions{.root = r, .train = true, .transform = train_tf});
      test = std::make_shared<data::FashionMNIST>(data::FashionMNISTOptions{.root = r, .train = false});
    } else {
      const std::string r = root.empty() ? data::kMnistRoot : root;
      train = std::make_shared<data::MNIST>(data::MNISTOptions{.root = r, .train = true, .transform = train_tf});
      test = std::make_shared<data::MNIST>(data::MNISTOptions{.root = r, .train = false});
    }
  } catch (const IOError& e) {
    if (root.empty()) throw;  // the installed copy is missing: the reader's hint (scripts/setup.sh) is the cure
    // A directory the user chose: scripts/setup.sh installs elsewhere, so its hint would mislead.
    std::string what = e.what();
    if (const auto cut = what.find(" exists ("); cut != std::string::npos) what = what.substr(0, cut + 7);
    throw ConfigError(c.origin("data.root") + ": data.root = \"" + root + "\": " + what +
                      "; data.root names the directory holding the idx files (train-images-idx3-ubyte[.gz] and "
                      "the other three), or leave it out to read the copy scripts/setup.sh installs (" +
                      (ds == "fashion_mnist" ? data::kFashionMnistRoot : data::kMnistRoot) + ")");
  }
  t.train_set = first(train, c.integer("data.train_size"));
  t.eval_set = first(test, c.integer("data.eval_size"));
  return {};
}

// train.activation_checkpointing: "none", "blocks" or k (blocks per checkpointed segment), validated by Config.
nn::CheckpointPolicy checkpoint_policy(const Config& c) {
  const std::string key = "train.activation_checkpointing";
  const std::string choice = c.string(key);  // "" when the value is an integer
  if (choice == "none") return nn::CheckpointPolicy::none();
  if (choice == "blocks") return nn::CheckpointPolicy::blocks();
  return nn::CheckpointPolicy::every_k(c.integer(key));
}

std::shared_ptr<nn::Module> make_model(const Config& c, Task& t, const DataShape& s) {
  const std::string type = c.string("model.type");
  if (type == "gpt") {
    if (!c.is_language_model())
      throw ConfigError(c.source() + ": model.type = \"gpt\" needs data.dataset = \"text\", got \"" +
                        c.string("data.dataset") + "\"");
    auto m = std::make_shared<models::GPT>(models::GPTOptions{.vocab_size = data::CharCorpus::vocab_size(),
                                                              .block_size = c.integer("data.context"),
                                                              .n_layer = c.integer("model.n_layer"),
                                                              .n_head = c.integer("model.n_head"),
                                                              .n_embd = c.integer("model.n_embd"),
                                                              .dropout = c.number("model.dropout"),
                                                              .activation_checkpointing = checkpoint_policy(c)});
    t.gpt = m.get();
    return m;
  }
  if (c.is_language_model())
    throw ConfigError(c.source() + ": data.dataset = \"text\" needs model.type = \"gpt\", got \"" + type + "\"");
  if (type == "mlp") {
    const int64_t in = std::accumulate(s.sample.begin(), s.sample.end(), int64_t{1}, std::multiplies<>());
    return std::make_shared<models::MLP>(
        models::MLPOptions{.in_features = in, .hidden = c.integers("model.hidden"), .out_features = s.classes});
  }
  if (s.sample.size() != 3)
    throw ConfigError(c.source() + ": model.type = \"" + type +
                      "\" needs image samples [C, H, W], and data.path gives " + shape_str(s.sample) +
                      " (use model.type = \"mlp\" for a table, or save images as [N, C, H, W])");
  const int64_t channels = s.sample[0], height = s.sample[1], width = s.sample[2];
  if (type == "cnn")
    return std::make_shared<models::CNN>(models::CNNOptions{.in_channels = channels,
                                                            .channels1 = c.integer("model.channels1"),
                                                            .channels2 = c.integer("model.channels2"),
                                                            .hidden = c.integer("model.fc_hidden"),
                                                            .num_classes = s.classes,
                                                            .input_size = {height, width}});
  if (type == "resnet")
    return std::make_shared<models::ResNet>(models::ResNetOptions{.in_channels = channels,
                                                                  .stem_channels = c.integer("model.stem_channels"),
                                                                  .widths = c.integers("model.widths"),
                                                                  .blocks = c.integers("model.blocks"),
                                                                  .num_classes = s.classes,
                                                                  .activation_checkpointing = checkpoint_policy(c)});
  if (height != width)
    throw ConfigError(c.source() + ": model.type = \"vit\" needs square images, the data's are " +
                      std::to_string(height) + "x" + std::to_string(width) + " (H x W; data.resize makes them square)");
  return std::make_shared<models::ViT>(models::ViTOptions{.image_size = height,
                                                          .patch_size = c.integer("model.patch_size"),
                                                          .in_channels = channels,
                                                          .num_classes = s.classes,
                                                          .dim = c.integer("model.dim"),
                                                          .depth = c.integer("model.depth"),
                                                          .heads = c.integer("model.heads"),
                                                          .mlp_dim = c.integer("model.mlp_dim"),
                                                          .dropout = c.number("model.dropout"),
                                                          .activation_checkpointing = checkpoint_policy(c)});
}

/// The param groups of the run's optimizer: one group, or for adamw decay and no-decay (as nanoGPT).
std::vector<optim::ParamGroup> optimizer_groups(const Config& c, nn::Module& model) {
  // What trains only: a LoRA run's frozen base gets no optimizer state.
  auto params = nn::lora::trainable_parameters(model);
  if (c.string("optim.name") == "adamw") return optim::split_decay(params, c.number("optim.weight_decay"));
  return {optim::ParamGroup{params, {}}};
}

/// Builds config's optimizer over param groups (the run's, or a sharded optimizer's pieces).
dist::OptimizerFactory optimizer_factory(const Config& c) {
  const std::string name = c.string("optim.name");
  const double lr = c.number("optim.lr"), wd = c.number("optim.weight_decay");
  if (name == "sgd")
    return dist::optimizer_factory<optim::SGD>(optim::SGDOptions{
        .lr = lr, .momentum = c.number("optim.momentum"), .weight_decay = wd, .nesterov = c.boolean("optim.nesterov")});
  if (name == "rmsprop")
    return dist::optimizer_factory<optim::RMSprop>(optim::RMSpropOptions{
        .lr = lr, .eps = c.number("optim.eps"), .weight_decay = wd, .momentum = c.number("optim.momentum")});
  if (name == "adamw")
    // Decoupled decay on weight matrices only, as nanoGPT does: biases and norm gains keep their scale.
    return dist::optimizer_factory<optim::AdamW>(optim::AdamWOptions{.lr = lr,
                                                                     .beta1 = c.number("optim.beta1"),
                                                                     .beta2 = c.number("optim.beta2"),
                                                                     .eps = c.number("optim.eps"),
                                                                     .weight_decay = wd});
  return dist::optimizer_factory<optim::Adam>(optim::AdamOptions{.lr = lr,
                                                                 .beta1 = c.number("optim.beta1"),
                                                                 .beta2 = c.number("optim.beta2"),
                                                                 .eps = c.number("optim.eps"),
                                                                 .weight_decay = wd});
}

std::shared_ptr<optim::LRScheduler> make_scheduler(const Config& c, optim::Optimizer& opt, int64_t total) {
  const std::string type = c.string("schedule.type");
  const int64_t warmup = std::min(c.integer("schedule.warmup_steps"), total);
  std::shared_ptr<optim::LRScheduler> main;
  if (type == "cosine")
    main = std::make_shared<optim::CosineAnnealingLR>(
        opt, optim::CosineAnnealingLROptions{.T_max = std::max<int64_t>(1, total - warmup),
                                             .eta_min = c.number("schedule.min_lr")});
  else if (type == "step")
    main = std::make_shared<optim::StepLR>(
        opt, optim::StepLROptions{.step_size = c.integer("schedule.step_size"), .gamma = c.number("schedule.gamma")});
  if (warmup <= 0) return main;
  auto warm = std::make_shared<optim::LinearLR>(
      opt, optim::LinearLROptions{
               .start_factor = 1.0 / static_cast<double>(warmup), .end_factor = 1.0, .total_iters = warmup});
  if (!main) return warm;
  return std::make_shared<optim::SequentialLR>(opt, std::vector<std::shared_ptr<optim::LRScheduler>>{warm, main},
                                               std::vector<int64_t>{warmup});
}

}  // namespace

std::unique_ptr<optim::Optimizer> make_optimizer(const Config& c, nn::Module& model) {
  return optimizer_factory(c)(optimizer_groups(c, model));
}

std::vector<std::string> fsdp_units(nn::Module& model) {
  // nn::TransformerBlock's type name is "Block".
  std::vector<std::string> units = dist::modules_of_type(model, "Block");
  if (!units.empty()) return units;
  std::function<void(nn::Module&, const std::string&)> visit = [&](nn::Module& m, const std::string& prefix) {
    for (auto& [name, child] : m.named_children()) {
      const std::string path = prefix.empty() ? name : prefix + "." + name;
      const std::string type = child->type_name();
      if (type == "Sequential" || type == "ModuleList" || type == "ModuleDict")
        visit(*child, path);
      else if (!child->named_parameters().empty())
        units.push_back(path);
    }
  };
  visit(model, "");
  return units;
}

std::shared_ptr<nn::Module> make_unsharded_model(const Config& c, const Task& t) {
  const GeneratorState saved = default_generator().get_state();
  Task scratch;  // make_model records the GPT here, not in the run's task
  auto model = make_model(c, scratch, DataShape{t.sample_shape, t.num_classes});
  prepare_model(c, *model, /*load_init=*/false);
  default_generator().set_state(saved);
  if (!t.model->is_training()) model->eval();
  return model;
}

bool uses_mesh(const Config& c) {
  return c.string("model.type") == "gpt" && (c.integer("parallel.tp") > 1 || c.integer("parallel.pp") > 1);
}

namespace {

// DDP's bucket caps from [dist] (docs/config.md): each checked here, whatever
// the strategy, so a bad value fails before any rank trains.
struct BucketCaps {
  double cap = 0, first = 0, last = 0;
  // The first key set away from DDP's default, with its value and that
  // default, for the refusals that name it (set_key null: none is).
  const char* set_key = nullptr;
  double set_value = 0, default_value = 0;
};

std::string cap_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

BucketCaps bucket_caps(const Config& c) {
  const dist::DDPOptions d;
  BucketCaps b{c.number("dist.bucket_cap_mb"), c.number("dist.first_bucket_cap_mb"),
               c.number("dist.last_bucket_cap_mb")};
  if (!(b.cap > 0))
    throw ConfigError(c.origin("dist.bucket_cap_mb") +
                      ": dist.bucket_cap_mb must be > 0 (MiB of gradients a bucket holds), got " + cap_text(b.cap));
  if (!(b.first > 0))
    throw ConfigError(c.origin("dist.first_bucket_cap_mb") + ": dist.first_bucket_cap_mb must be > 0 (MiB), got " +
                      cap_text(b.first));
  if (!(b.last >= 0))
    throw ConfigError(c.origin("dist.last_bucket_cap_mb") +
                      ": dist.last_bucket_cap_mb must be >= 0 (MiB; 0: PyTorch's layout, no cap of its own), got " +
                      cap_text(b.last));
  const std::tuple<const char*, double, double> keys[] = {{"dist.bucket_cap_mb", b.cap, d.bucket_cap_mb},
                                                          {"dist.first_bucket_cap_mb", b.first, d.first_bucket_cap_mb},
                                                          {"dist.last_bucket_cap_mb", b.last, d.last_bucket_cap_mb}};
  for (const auto& [key, value, def] : keys) {
    if (value != def) {
      b.set_key = key, b.set_value = value, b.default_value = def;
      break;
    }
  }
  return b;
}

/// [parallel]: dp, the process count left over by tp x pp when parallel.dp is
/// 0; or, when dp x tp x pp is not the process count, 0 and `problem` says so.
int64_t data_parallel_size(const Config& c, int world, std::string* problem) {
  const int64_t tp = c.integer("parallel.tp"), pp = c.integer("parallel.pp");
  int64_t dp = c.integer("parallel.dp");
  if (dp == 0 && world % (tp * pp) == 0) dp = world / (tp * pp);
  if (dp * tp * pp == world) return dp;
  *problem = "[parallel] dp x tp x pp = " + (dp == 0 ? std::string("?") : std::to_string(dp)) + " x " +
             std::to_string(tp) + " x " + std::to_string(pp) + " needs " +
             (dp == 0 ? "a multiple of " + std::to_string(tp * pp) : std::to_string(dp * tp * pp)) +
             " processes, this run has " + std::to_string(world) + " (start it with `kiln launch -n " +
             std::to_string(dp == 0 ? tp * pp : dp * tp * pp) + " -- kiln train ...`)";
  return 0;
}

/// What a mesh run cannot do yet, and what its layout needs of the model and
/// the process count; one message for all, the same on every rank (before any
/// collective). Returns dp.
int64_t check_mesh_config(const Config& c, int world) {
  std::vector<std::string> bad;
  std::string count;
  const int64_t dp = data_parallel_size(c, world, &count);
  if (!count.empty()) bad.push_back(count);
  const int64_t tp = c.integer("parallel.tp"), pp = c.integer("parallel.pp"), m = c.integer("parallel.micro_batches");
  const int64_t heads = c.integer("model.n_head"), embd = c.integer("model.n_embd");
  const int64_t vocab = data::CharCorpus::vocab_size();
  if (heads % tp != 0)
    bad.push_back("model.n_head = " + std::to_string(heads) + " must divide by parallel.tp = " + std::to_string(tp) +
                  " (each tp rank computes whole heads)");
  if (vocab % tp != 0 || (4 * embd) % tp != 0)
    bad.push_back("the vocabulary (" + std::to_string(vocab) + ") and the MLP width (4 x model.n_embd = " +
                  std::to_string(4 * embd) + ") must divide by parallel.tp = " + std::to_string(tp));
  if (c.integer("model.n_layer") < pp)
    bad.push_back("model.n_layer = " + std::to_string(c.integer("model.n_layer")) +
                  " gives fewer layers than parallel.pp = " + std::to_string(pp) + " stages");
  if (c.integer("data.batch_size") % m != 0)
    bad.push_back("data.batch_size = " + std::to_string(c.integer("data.batch_size")) +
                  " (per dp replica) must divide into parallel.micro_batches = " + std::to_string(m));
  if (c.boolean("parallel.sequence_parallel") && c.integer("data.context") % tp != 0)
    bad.push_back("data.context = " + std::to_string(c.integer("data.context")) +
                  " must divide by parallel.tp = " + std::to_string(tp) + " for parallel.sequence_parallel");
  if (c.string("amp") != "off")
    bad.push_back("amp = \"" + c.string("amp") + "\" is not supported with tp or pp yet (use amp = \"off\")");
  if (!c.value_text("train.activation_checkpointing").empty() && c.string("train.activation_checkpointing") != "none")
    bad.push_back(
        "train.activation_checkpointing is not supported with tp or pp yet (a recomputed forward would repeat the tp "
        "collectives)");
  if (c.string("train.keep_best") != "off") bad.push_back("train.keep_best is not supported with tp or pp yet");
  if (c.boolean("train.anomaly")) bad.push_back("train.anomaly is not supported with tp or pp yet");
  if (c.integer("lora.rank") > 0)
    bad.push_back("[lora] is not supported with tp or pp yet (the tensor-parallel layers carry no adapters)");
  if (c.integer("train.grad_accum_steps") > 1)
    bad.push_back(
        "train.grad_accum_steps > 1 is not supported with tp or pp (parallel.micro_batches accumulates "
        "over micro-batches within the pipeline's step)");
  const std::string strategy = c.string("dist.strategy");
  if (strategy == "zero2" || strategy == "zero3")
    bad.push_back("dist.strategy = \"" + strategy +
                  "\" is not supported with tp or pp (the dp dimension takes \"ddp\" or \"zero1\")");
  if (c.string("dist.comm_hook") != "allreduce")
    bad.push_back("dist.comm_hook = \"" + c.string("dist.comm_hook") +
                  "\" is not supported with tp or pp yet (the mesh averages its dp gradients without DDP's buckets)");
  if (const BucketCaps caps = bucket_caps(c); caps.set_key)
    bad.push_back(std::string(caps.set_key) + " = " + cap_text(caps.set_value) +
                  " is not supported with tp or pp (the mesh averages its dp gradients without DDP's buckets); leave "
                  "it at its default, " +
                  cap_text(caps.default_value));
  if (bad.empty()) return dp;
  std::string msg = c.source() + ": [parallel] tp = " + std::to_string(tp) + ", pp = " + std::to_string(pp) + ":";
  for (const auto& b : bad) msg += "\n  " + b;
  throw ConfigError(msg);
}

/// A mesh run's training side (uses_mesh): the mesh, this rank's stage of the
/// GPT `t.model` holds, its dp replica's loader, the optimizer over the stage.
void build_mesh_training(const Config& c, Task& t, const dist::ProcessGroupPtr& group) {
  const int64_t dp = check_mesh_config(c, group ? group->size() : 1);
  t.mesh = std::make_shared<dist::DeviceMesh>(
      std::vector<dist::DeviceMesh::Dim>{{"dp", static_cast<int>(dp)},
                                         {"tp", static_cast<int>(c.integer("parallel.tp"))},
                                         {"pp", static_cast<int>(c.integer("parallel.pp"))}});
  t.mesh_gpt = std::make_shared<parallel::MeshGPT>(
      *t.gpt, *t.mesh,
      parallel::MeshGPTOptions{.micro_batches = c.integer("parallel.micro_batches"),
                               .schedule = c.string("parallel.schedule") == "gpipe" ? parallel::Schedule::GPipe
                                                                                    : parallel::Schedule::OneFOneB,
                               .sequence_parallel = c.boolean("parallel.sequence_parallel")});
  t.gpt = nullptr;
  t.model = t.mesh_gpt->stage_module();  // the whole GPT goes
  // The ranks of one dp replica read the same batches; with one replica, the
  // batches of a single process (so that a tp/pp run reproduces one).
  const int dp_rank = t.mesh->coordinate("dp");
  if (dp > 1)
    t.sampler = std::make_shared<data::DistributedSampler>(
        t.train_set->size(), data::DistributedSamplerOptions{.num_replicas = static_cast<int>(dp),
                                                             .rank = dp_rank,
                                                             .shuffle = true,
                                                             .seed = static_cast<uint64_t>(c.integer("seed"))});
  t.train_loader = std::make_unique<data::DataLoader<>>(
      t.train_set, data::DataLoader<>::Options{.batch_size = c.integer("data.batch_size"),
                                               .shuffle = dp == 1,
                                               .sampler = t.sampler,
                                               .num_workers = c.integer("data.num_workers"),
                                               .drop_last = true,
                                               .seed = static_cast<uint64_t>(c.integer("seed")),
                                               .rank = dp_rank});
  if (t.train_loader->size() == 0)
    throw ConfigError(c.origin("data.batch_size") +
                      ": each dp replica's share of the training set holds fewer than one batch of data.batch_size = " +
                      std::to_string(c.integer("data.batch_size")));
  t.total_steps =
      c.integer("train.steps") > 0 ? c.integer("train.steps") : c.integer("train.epochs") * t.train_loader->size();
  if (c.string("dist.strategy") == "zero1" && dp > 1) {
    t.zero = std::make_unique<dist::ZeroRedundancyOptimizer>(optimizer_groups(c, *t.model), t.mesh_gpt->dp_group(),
                                                             optimizer_factory(c), dist::ZeroOptions{.stage = 1});
    t.optimizer = t.zero->optimizer();
    if (!t.optimizer)
      throw ConfigError(c.origin("dist.strategy") +
                        ": a stage's parameters leave a dp rank an empty shard; use dist.strategy = \"ddp\"");
  } else {
    t.own_optimizer = make_optimizer(c, *t.model);
    t.optimizer = t.own_optimizer.get();
  }
  t.scheduler = make_scheduler(c, *t.optimizer, t.total_steps);
}

}  // namespace

Task build_task(const Config& c, Purpose purpose, dist::ProcessGroupPtr group) {
  if (c.integer("threads") > 0) set_num_threads(static_cast<int>(c.integer("threads")));
  // torch.set_flush_denormal(True) at the top of a script; a CPU without
  // the modes says so and the run goes on with subnormals kept.
  if (c.boolean("flush_denormal") && !set_flush_denormal(true))
    std::fprintf(stderr, "kiln: warning: flush_denormal: this CPU cannot flush subnormals to zero; they are kept\n");
  manual_seed(static_cast<uint64_t>(c.integer("seed")));
  Task t;
  t.amp = amp::parse_amp_mode(c.string("amp"));
  const DataShape shape = make_datasets(c, t);
  t.sample_shape = shape.sample;
  t.num_classes = shape.classes;
  t.model = make_model(c, t, shape);
  t.finetune_note = finetune_note(prepare_model(c, *t.model, /*load_init=*/purpose == Purpose::Train));
  t.num_parameters = t.model->num_parameters();
  if (purpose == Purpose::Evaluate) {
    t.model->eval();
    return t;
  }
  t.distill = make_distiller(c, t);
  if (uses_mesh(c)) {
    build_mesh_training(c, t, group);
    return t;
  }
  if (c.string("model.type") == "gpt" && c.integer("parallel.dp") > 0) {
    std::string problem;  // a stated dp must be the process count
    if (data_parallel_size(c, group ? group->size() : 1, &problem) == 0)
      throw ConfigError(c.origin("parallel.dp") + ": " + problem);
  }
  const bool distributed = group && group->size() > 1;
  check_finetune_config(c, distributed);
  if (distributed)
    t.sampler = std::make_shared<data::DistributedSampler>(
        t.train_set->size(), data::DistributedSamplerOptions{.num_replicas = group->size(),
                                                             .rank = group->rank(),
                                                             .shuffle = true,
                                                             .seed = static_cast<uint64_t>(c.integer("seed"))});
  t.train_loader = std::make_unique<data::DataLoader<>>(
      t.train_set, data::DataLoader<>::Options{.batch_size = c.integer("data.batch_size"),
                                               .shuffle = !distributed,
                                               .sampler = t.sampler,
                                               .num_workers = c.integer("data.num_workers"),
                                               .drop_last = true,
                                               .seed = static_cast<uint64_t>(c.integer("seed")),
                                               .rank = distributed ? group->rank() : 0});
  if (t.train_loader->size() == 0)
    throw ConfigError(
        c.origin("data.batch_size") + ": the training set has " + std::to_string(t.train_set->size()) +
        " samples, fewer than one batch of data.batch_size = " + std::to_string(c.integer("data.batch_size")));
  t.total_steps = c.integer("train.steps") > 0 ? c.integer("train.steps") : steps_for_epochs(c, t.train_loader->size());
  // dist.strategy: ddp keeps every rank's optimizer whole; zero1 shards its
  // state (DDP still averages the gradients), zero2 also the gradients (no DDP:
  // the sharded optimizer reduce-scatters them), zero3 also the parameters
  // (FSDP). One process has nothing to shard.
  const std::string strategy = c.string("dist.strategy");
  const int stage = !distributed ? 0 : strategy == "zero1" ? 1 : strategy == "zero2" ? 2 : strategy == "zero3" ? 3 : 0;
  if (stage > 0 && t.amp.needs_scaler())
    throw ConfigError(c.origin("dist.strategy") + ": dist.strategy = \"" + strategy +
                      "\" does not work with amp = \"fp16\" yet (the GradScaler steps a whole optimizer); use amp = "
                      "\"bf16\" or dist.strategy = \"ddp\"");
  if (stage > 0 && c.string("train.keep_best") != "off")
    throw ConfigError(c.origin("dist.strategy") + ": dist.strategy = \"" + strategy +
                      "\" does not work with train.keep_best yet (rank 0 alone decides to keep a checkpoint, and a "
                      "sharded optimizer's state is gathered by every rank); use train.keep_best = \"off\" or "
                      "dist.strategy = \"ddp\"");
  // (The key applies to gpt, vit and resnet only: elsewhere its value text is empty.)
  const bool checkpointing =
      !c.value_text("train.activation_checkpointing").empty() && c.string("train.activation_checkpointing") != "none";
  if (stage == 3 && checkpointing)
    throw ConfigError(c.origin("train.activation_checkpointing") +
                      ": dist.strategy = \"zero3\" does not work with train.activation_checkpointing yet (a "
                      "checkpointed block runs its forward again in backward, and FSDP gathers a unit once per "
                      "iteration); use train.activation_checkpointing = \"none\" or dist.strategy = \"zero2\"");
  const std::string hook = c.string("dist.comm_hook");
  if (stage >= 2 && hook != "allreduce")
    throw ConfigError(c.origin("dist.comm_hook") + ": dist.comm_hook = \"" + hook +
                      "\" compresses DDP's gradient buckets, and dist.strategy = \"" + strategy +
                      "\" runs without DDP (its gradients are reduce-scattered); use dist.strategy = \"ddp\" or "
                      "\"zero1\", or dist.comm_hook = \"allreduce\"");
  const BucketCaps caps = bucket_caps(c);
  if (stage >= 2 && caps.set_key)
    throw ConfigError(c.origin(caps.set_key) + ": " + caps.set_key + " lays out DDP's gradient buckets (" +
                      cap_text(caps.set_value) + " here, default " + cap_text(caps.default_value) + "), and " +
                      "dist.strategy = \"" + strategy + "\" runs without DDP (its gradients are reduce-scattered); " +
                      "use dist.strategy = \"ddp\" or \"zero1\", or leave the bucket caps at their defaults");
  if (distributed && stage < 2) {
    dist::DDPOptions o;
    o.bucket_cap_mb = caps.cap;
    o.first_bucket_cap_mb = caps.first;
    o.last_bucket_cap_mb = caps.last;
    o.comm_hook = hook == "bf16_compress"   ? dist::CommHook::Bf16Compress
                  : hook == "fp16_compress" ? dist::CommHook::Fp16Compress
                                            : dist::CommHook::Allreduce;
    t.ddp = std::make_shared<dist::DistributedDataParallel>(t.model, group, o);
    if (hook == "powersgd") {
      const int64_t rank = c.integer("dist.powersgd_rank"), start = c.integer("dist.powersgd_start_iter");
      if (rank < 1)
        throw ConfigError(c.origin("dist.powersgd_rank") + ": dist.powersgd_rank must be >= 1, got " +
                          std::to_string(rank));
      if (start < 0)
        throw ConfigError(c.origin("dist.powersgd_start_iter") + ": dist.powersgd_start_iter must be >= 0, got " +
                          std::to_string(start));
      t.ddp->register_comm_hook(dist::PowerSGDOptions{.matrix_approximation_rank = rank, .start_powerSGD_iter = start});
    }
  }
  if (stage == 3) {
    // The param groups are read while the parameters have their full shapes
    // (AdamW's decay split looks at their dims); FSDP then turns each one, in
    // place, into its piece of this rank's shard, and the optimizer is built
    // over those same tensors under the same (module-relative) names.
    auto groups = optimizer_groups(c, *t.model);
    t.fsdp = std::make_shared<dist::FullyShardedDataParallel>(t.model, group,
                                                              dist::FSDPOptions{.units = fsdp_units(*t.model)});
    t.own_optimizer = optimizer_factory(c)(std::move(groups));
    t.optimizer = t.own_optimizer.get();
  } else if (stage > 0) {
    t.zero = std::make_unique<dist::ZeroRedundancyOptimizer>(optimizer_groups(c, *t.model), group, optimizer_factory(c),
                                                             dist::ZeroOptions{.stage = stage});
    t.optimizer = t.zero->optimizer();
    if (!t.optimizer)
      throw ConfigError(c.origin("dist.strategy") + ": the model's " + std::to_string(t.zero->numel()) +
                        " parameter elements leave rank " + std::to_string(group->rank()) +
                        " an empty shard; use fewer ranks or dist.strategy = \"ddp\"");
  } else {
    t.own_optimizer = make_optimizer(c, *t.model);
    t.optimizer = t.own_optimizer.get();
  }
  t.scheduler = make_scheduler(c, *t.optimizer, t.total_steps);
  // float16's narrow range needs loss scaling; bfloat16 has float32's range and does not.
  if (t.amp.needs_scaler()) t.scaler = std::make_unique<amp::GradScaler>(amp::GradScalerOptions{.enabled = true});
  return t;
}

void replay_schedule(Task& t, const Config& c, int64_t step) {
  // Sharded parameters (zero3) are 1-D pieces: the fresh optimizer's decay split needs full shapes.
  auto model = t.fsdp ? make_unsharded_model(c, t) : t.model;
  auto opt = make_optimizer(c, *model);
  auto sched = make_scheduler(c, *opt, t.total_steps);
  for (int64_t i = 0; i < step; ++i) {
    opt->step();  // no parameter has a gradient: only the step count moves, as the scheduler expects
    if (sched) sched->step();
  }
  auto& groups = t.optimizer->param_groups();
  const auto& fresh = opt->param_groups();
  KILN_ASSERT(groups.size() == fresh.size());
  for (size_t g = 0; g < groups.size(); ++g) groups[g].options = fresh[g].options;
  if (t.scheduler) t.scheduler->load_state_dict(sched->state_dict());
}

void load_optimizer_shard(Task& t, const optim::OptimizerStateDict& full) {
  KILN_ASSERT(t.zero && t.optimizer);
  const auto& groups = t.optimizer->param_groups();
  KILN_CHECK(full.param_groups.size() == groups.size(), ValueError, "the checkpoint's optimizer has ",
             full.param_groups.size(), " param groups, the run's ", groups.size());
  optim::OptimizerStateDict sd;
  for (size_t g = 0; g < groups.size(); ++g) {
    optim::OptimizerStateDict::Group group{{}, full.param_groups[g].options};
    for (const auto& [name, p] : groups[g].params) group.param_names.push_back(name);
    sd.param_groups.push_back(std::move(group));
  }
  const auto& names = t.zero->parameter_names();
  for (const dist::ZeroPiece& piece : t.zero->pieces()) {
    auto it = full.state.find(names[piece.param]);
    if (it == full.state.end()) continue;  // no state yet (the parameter has not had a gradient)
    optim::ParamState st;
    st.step = it->second.step;
    for (const auto& [key, value] : it->second.tensors) {
      const Tensor flat = value.contiguous().view({value.numel()});
      // Per-element state (moments, momentum) takes the piece's slice; anything else is copied.
      const bool per_element = value.numel() >= piece.begin + piece.length && value.dim() > 0;
      st.tensors[key] = per_element ? flat.narrow(0, piece.begin, piece.length).clone() : value.clone();
    }
    sd.state[names[piece.param]] = std::move(st);
  }
  t.zero->load_state_dict(sd);
}

namespace {

/// dist.strategy zero3: the model's forward through FSDP (which gathers each
/// unit), and the loss GPT::loss or the classifier's cross-entropy computes;
/// the logits are returned in `logits`.
Tensor fsdp_loss(Task& t, const data::Example& batch, Tensor* logits = nullptr) {
  Tensor out = (*t.fsdp)(batch.data);
  if (logits) *logits = out;
  if (t.gpt)
    return nn::functional::cross_entropy(out.reshape({-1, t.gpt->options.vocab_size}), batch.target.reshape({-1}));
  return nn::functional::cross_entropy(out, batch.target);
}

}  // namespace

Tensor batch_loss(Task& t, const data::Example& batch) {
  std::optional<AutocastGuard> autocast;
  if (t.amp.dtype) autocast.emplace(*t.amp.dtype);
  // GPT::loss would run the GPT itself, past FSDP's gathering.
  if (t.fsdp) return fsdp_loss(t, batch);
  // GPT::loss runs the module itself, past DDP's forward: that only broadcasts
  // buffers, and the GPT has none; its gradients are averaged by DDP's hooks.
  if (t.gpt) return t.gpt->loss(batch.data, batch.target);
  nn::Module& m = t.ddp ? static_cast<nn::Module&>(*t.ddp) : *t.model;
  if (t.distill) return distillation_batch_loss(*t.distill, m(batch.data), batch);
  return nn::functional::cross_entropy(m(batch.data), batch.target);
}

EvalResult evaluate(Task& t, const Config& c, const std::string& split, int64_t max_batches) {
  struct ModeRestore {
    nn::Module& m;
    bool was;
    ~ModeRestore() { m.train(was); }
  } restore{*t.model, t.model->is_training()};
  t.model->eval();
  NoGradGuard no_grad;
  std::optional<AutocastGuard> autocast;
  if (t.amp.dtype) autocast.emplace(*t.amp.dtype);
  auto set = split == "train" ? t.train_set : t.eval_set;
  // An explicit seed: a loader without one draws it from the global generator,
  // which would shift the training RNG stream after every evaluation.
  data::DataLoader<> loader(set, {.batch_size = c.integer("data.eval_batch_size"), .seed = 0});
  EvalResult r;
  double loss_sum = 0;
  int64_t correct = 0, batches = 0;
  for (auto& batch : loader) {
    if (max_batches > 0 && batches++ >= max_batches) break;
    const int64_t n = batch.target.numel();
    if (t.mesh_gpt) {
      loss_sum += t.mesh_gpt->evaluate(batch.data, batch.target) * static_cast<double>(n);
    } else if (t.fsdp) {
      Tensor logits;
      loss_sum += fsdp_loss(t, batch, &logits).item<double>() * static_cast<double>(n);
      if (!t.gpt) correct += logits.argmax(1).eq(batch.target).sum().item<int64_t>();
    } else if (t.gpt) {
      loss_sum += t.gpt->loss(batch.data, batch.target).item<double>() * static_cast<double>(n);
    } else {
      Tensor logits = (*t.model)(batch.data);
      loss_sum += nn::functional::cross_entropy(logits, batch.target).item<double>() * static_cast<double>(n);
      correct += logits.argmax(1).eq(batch.target).sum().item<int64_t>();
    }
    r.samples += n;
  }
  if (r.samples == 0) return r;
  r.loss = loss_sum / static_cast<double>(r.samples);
  if (t.gpt || t.mesh_gpt)
    r.bits_per_char = r.loss / std::log(2.0);
  else
    r.accuracy = static_cast<double>(correct) / static_cast<double>(r.samples);
  return r;
}

}  // namespace kiln::cli
