#pragma once
// What a config describes, built: the model, its data, and for training the
// optimizer and schedule. train, resume, eval and sample all build through
// here, so a run directory's config rebuilds exactly the objects its
// checkpoints were saved from.
#include <cstdint>
#include <memory>
#include <string>

#include "cli/config.h"
#include "kiln/amp/grad_scaler.h"
#include "kiln/amp/mode.h"
#include "kiln/data/loader.h"
#include "kiln/data/sampler.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/fsdp.h"
#include "kiln/dist/process_group.h"
#include "kiln/dist/zero.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/module.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"
#include "kiln/parallel/mesh_gpt.h"

namespace kiln::cli {

struct Distiller;  // cli/distill.h

enum class Purpose { Train, Evaluate };

struct Task {
  std::shared_ptr<nn::Module> model;
  models::GPT* gpt = nullptr;  // the model, when it is the language model
  std::shared_ptr<const data::Dataset<>> train_set, eval_set;
  std::unique_ptr<data::DataLoader<>> train_loader;  // Purpose::Train only
  // The optimizer whose param groups the loop and the scheduler use
  // (Purpose::Train only): the run's optimizer, or with dist.strategy zero1 or
  // zero2 on more than one rank the sharded optimizer's local one (over this
  // rank's pieces, so the scheduler sets the lr its step uses).
  optim::Optimizer* optimizer = nullptr;
  std::unique_ptr<optim::Optimizer> own_optimizer;      // what `optimizer` points to, unless sharded
  std::unique_ptr<dist::ZeroRedundancyOptimizer> zero;  // dist.strategy zero1|zero2 on more than one rank
  std::shared_ptr<optim::LRScheduler> scheduler;        // null for a constant lr without warmup
  int64_t total_steps = 0;                              // the run's length (the schedule's horizon)
  amp::AmpMode amp;                                     // config `amp`: autocast dtype of forward and loss
  std::unique_ptr<amp::GradScaler> scaler;              // Purpose::Train with amp = "fp16" only
  // Data-parallel training (a group of more than one rank): the model wrapped
  // for gradient averaging (not with zero2 or zero3: they reduce-scatter), and this rank's share of the
  // training set. `model` stays the unwrapped module, so checkpoints hold its names.
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::shared_ptr<data::DistributedSampler> sampler;
  // dist.strategy zero3 on more than one rank: `model` wrapped in FSDP (forward
  // goes through it, so that each unit is gathered). Every parameter of
  // `model` is then a 1-D piece of this rank's shard, and `optimizer` steps
  // those pieces (its names are `model`'s, as a ddp run's).
  std::shared_ptr<dist::FullyShardedDataParallel> fsdp;
  // [parallel] tp or pp > 1 (docs/parallel.md): the GPT laid out over a dp x
  // tp x pp mesh. `model` is then this rank's stage (its tp shard; names are
  // the GPT's), `gpt` is null, the loader reads this rank's dp replica's share
  // (ranks of one replica read the same batches), and `zero` (dist.strategy
  // zero1) shards the optimizer over dp. No DDP: mesh_gpt averages over dp.
  std::shared_ptr<dist::DeviceMesh> mesh;
  std::shared_ptr<parallel::MeshGPT> mesh_gpt;
  int64_t num_parameters = 0;  // the model's, counted before any sharding
  std::string finetune_note;   // init_from and LoRA, for the run's first lines (src/cli/finetune.h); "" if neither
  // What the model was built for (make_unsharded_model builds it again).
  std::vector<int64_t> sample_shape;
  int64_t num_classes = 0;
  // [distill] teacher (Purpose::Train): the teacher whose logits batch_loss mixes into the loss; null without one.
  std::shared_ptr<Distiller> distill;
};

/// Seeds the default generator with config.seed, then builds the model (in
/// eval mode for Purpose::Evaluate, and it is never switched back), the
/// datasets and, for training, the loader, optimizer and scheduler. With a
/// `group` of more than one rank (Purpose::Train), the loader reads this rank's
/// DistributedSampler share in batches of data.batch_size (per rank, as in
/// PyTorch) and the model is wrapped in DistributedDataParallel (a collective:
/// every rank builds its task at the same point).
Task build_task(const Config& config, Purpose purpose, dist::ProcessGroupPtr group = nullptr);

/// dist.strategy zero3: the FSDP units of `model`. A model with transformer
/// blocks (gpt, vit) has one unit per nn::TransformerBlock; any other model one
/// per direct child module that holds parameters, containers (Sequential,
/// ModuleList, ModuleDict) opened into their children, recursively: the MLP's
/// and CNN's layers, ResNet's stem convolution and norm, each BasicBlock and
/// the classifier. Parameters outside every unit form FSDP's root unit.
std::vector<std::string> fsdp_units(nn::Module& model);

/// A fresh, unsharded copy of the model `config` describes, for a sharded
/// run's checkpoints (task.fsdp): its parameters have their full shapes. The
/// default generator's state is saved and restored around the build, so the
/// run's random stream does not move.
std::shared_ptr<nn::Module> make_unsharded_model(const Config& config, const Task& task);

/// The unsharded optimizer config `config` describes, over every parameter of
/// `model` (what a single-process or ddp run steps and checkpoints).
std::unique_ptr<optim::Optimizer> make_optimizer(const Config& config, nn::Module& model);

/// A sharded run (task.zero): loads this rank's shard of `full`, the unsharded
/// optimizer state (a checkpoint's, at any world size and strategy), into the
/// sharded optimizer: each piece takes its slice of its parameter's state
/// tensors, each group the hyperparameters of its group in `full`.
void load_optimizer_shard(Task& task, const optim::OptimizerStateDict& full);

/// For a resume whose settings changed the optimizer's hyperparameters or the
/// learning-rate schedule (optim.lr, schedule.*, train.steps, ...): the param
/// groups' hyperparameters and the scheduler's state are those a run started
/// with `config` has after `step` steps. A fresh optimizer and scheduler are
/// stepped that far (the optimizer without gradients: no parameter moves) and
/// copied in, so from the resume step on the rates are bitwise the ones that
/// run would use. Call after loading the checkpoint (its optimizer state stays).
void replay_schedule(Task& task, const Config& config, int64_t step);

/// Whether `config` lays the model out over a mesh ([parallel] tp or pp > 1).
bool uses_mesh(const Config& config);

/// The training loss of one batch (cross-entropy; per token for the language model; with
/// task.distill, the distillation loss against the teacher's logits).
Tensor batch_loss(Task& task, const data::Example& batch);

struct EvalResult {
  double loss = 0;
  double accuracy = 0;       // classification
  double bits_per_char = 0;  // language model
  int64_t samples = 0;
};

/// Mean loss and accuracy (or bits/char) over `split` ("test" = the held-out
/// set, "train"), at most max_batches batches (0: all). The model runs in eval
/// mode under NoGradGuard; its previous mode is restored afterwards. With
/// task.fsdp the forward goes through FSDP, a collective: every rank calls it.
EvalResult evaluate(Task& task, const Config& config, const std::string& split, int64_t max_batches);

}  // namespace kiln::cli
